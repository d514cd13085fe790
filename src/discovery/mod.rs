//! Finding replicas where fleets run (issue 21): sources (DNS A/AAAA and SRV
//! records, a file of `[[replicas]]` tables) re-read on an interval, and the
//! lifecycle their answers drive. So far: the lifecycle, pure and tested
//! (`lifecycle.rs`); the sources' URLs, replica names and the file
//! source's reader (`source.rs`); DNS A/AAAA and SRV resolution through
//! the system's resolver or a named one (`dns.rs`, tested against dnsmasq).
//! The runner that feeds the lifecycle and applies its actions through the
//! operator (`Operator::apply_replica`) is the next step.

pub mod dns;
pub mod lifecycle;
pub mod source;
