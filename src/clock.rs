//! Wall-clock helpers. Logic takes `now` as an argument; only the edges
//! (handlers, background tasks) read the clock.

use std::time::{SystemTime, UNIX_EPOCH};

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}
