//! The integration tests: one binary (each module used to be a binary of
//! its own, and each linked the whole crate). Whole-system behaviour, on real
//! servers bound to ephemeral loopback ports, simulated replicas as the
//! backend; the shared harness is `common`.

// Each module uses part of the harness.
#[allow(dead_code)]
mod common;

mod admin;
mod agents;
mod browser;
mod capacity;
mod churn;
mod continuation;
mod contract;
mod deploy;
mod discovery;
mod layers;
mod paused;
mod persistence;
mod priority;
mod qualitative;
mod regressions;
mod reliability;
mod retry;
mod rewrites;
mod routing;
mod sdk;
mod sessions;
mod shared;
mod tenants;
mod timeline;
mod traces;
