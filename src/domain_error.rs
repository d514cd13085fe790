//! The domain's one error type: what an operator action, an admission or a
//! fleet-wide lease can refuse, in the domain's own words. The HTTP layer
//! maps it to `ApiError` (status, OpenAI error JSON) in `error.rs`; nothing
//! here knows of HTTP, so the domain is usable (and tested) without it.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum DomainError {
    /// Nothing by that name (a replica, a pin).
    #[error("{0}")]
    NotFound(String),
    /// The action contradicts the current state (a name taken, a replica
    /// owned by its source, a drain that was undone).
    #[error("{0}")]
    Conflict(String),
    /// A value that does not pass validation.
    #[error("{0}")]
    Invalid(String),
    /// A wait that ran out (a drain still busy).
    #[error("{0}")]
    Timeout(String),
    /// No capacity now: retry after `retry_after`.
    #[error("{message}")]
    Overloaded { message: String, retry_after: Duration },
    /// The store refused a write the action needs first: nothing changed.
    /// The store's own error, in words: the domain knows no store type, so
    /// the mapping happens where the store is called.
    #[error("{0}")]
    Store(String),
}
