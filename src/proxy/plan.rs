//! Where a request may go: the candidates (from a fleet snapshot) and the
//! policy's decision. Pure: no I/O, no clock, nothing written; the caller
//! records what came of it.

use std::sync::Arc;

use crate::fleet::Replica;
use crate::pins::Pin;
use crate::policy::{self, Candidate, Decision, Mode, PrefixMatch, RequestShape, SpreadCounter};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanError {
    /// No replica serves the requested model (with a non-empty fleet).
    ModelNotFound(String),
    /// Nothing routable is left (all down, draining, or already tried).
    NoReplica,
}

/// What a plan needs to know about the request besides its shape.
pub struct PlanInput<'a> {
    pub mode: Mode,
    pub shape: &'a RequestShape,
    /// The longest pinned prefix of the request, looked up once per request.
    pub pinned: Option<&'a (PrefixMatch, Pin)>,
    /// Replicas this request already failed on.
    pub tried: &'a [Arc<str>],
    /// True when the request counts against `max_large_inflight`; then
    /// `has_free_slot` says which replicas could start it at once.
    pub large: bool,
}

pub fn plan(
    input: &PlanInput,
    fleet: &[Arc<Replica>],
    has_free_slot: impl Fn(&Replica) -> bool,
    counter: &SpreadCounter,
) -> Result<Decision, PlanError> {
    let model = input.shape.model.as_deref();
    if let Some(m) = model {
        if !fleet.is_empty() && !fleet.iter().any(|r| r.serves(m)) {
            return Err(PlanError::ModelNotFound(m.to_string()));
        }
    }
    let candidates: Vec<Candidate> = fleet
        .iter()
        .map(|r| Candidate {
            id: &r.id,
            routable: r.routable() && model.is_none_or(|m| r.serves(m)) && !input.tried.contains(&r.id),
            spare: !input.large || has_free_slot(r),
        })
        .collect();
    let pinned = input.pinned.map(|(m, pin)| (*m, &*pin.replica));
    policy::decide(input.mode, input.shape, &candidates, pinned, counter).ok_or(PlanError::NoReplica)
}
