//! Wall-clock helpers. Logic takes `now` as an argument; only the edges
//! (handlers, background tasks) read the clock.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// Milliseconds since the epoch as an RFC 3339 timestamp.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + std::time::Duration::from_millis(ms)).to_string()
}
