//! Finding replicas where fleets run (issue 21): sources (DNS A/AAAA and SRV
//! records, a file of `[[replicas]]` tables) re-read on an interval, and the
//! lifecycle their answers drive. So far: the lifecycle, pure and tested
//! (`lifecycle.rs`), and the sources' URLs, replica names and the file
//! source's reader (`source.rs`). DNS resolution and the wiring to the
//! operator's apply path (`Operator::apply_replica`) are the next step.

pub mod lifecycle;
pub mod source;
