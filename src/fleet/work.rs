//! The work a replica has outstanding, as the gateway counts it: the
//! uncached prompt tokens of the requests it was sent that have not had a
//! first token yet (queued or prefilling), and the streams it is decoding.
//! New sessions and one-shots go where the least is (`policy::spread_pick`,
//! `routing.spread = "load"`); a pinned turn leaves a replica whose queue
//! costs more than prefilling its context elsewhere (`policy::moves`).
//!
//! A prefill counts until the request's first event passes the gateway
//! (`InflightGuard::prefilled`): a streaming client that does not read
//! keeps its prefill counted, which only makes its replica look busier.
//!
//! Why not in-flight requests: a 50,000-token cold prefill and a one-token
//! warm turn are one request each, and it is the prefill that delays
//! whoever comes next.

use std::sync::atomic::{AtomicU64, Ordering};

/// A stream decoding counts as this many tokens of work: each one takes
/// its share of every engine step, about what prefilling a few hundred
/// tokens in a chunked-prefill step takes (vLLM's steps mix both). Small
/// against a cold prefill, so prefills decide; decides between replicas
/// with none queued.
pub const DECODING_STREAM_TOKENS: u64 = 256;

#[derive(Debug, Default)]
pub struct Work {
    prefill_tokens: AtomicU64,
    decoding: AtomicU64,
}

impl Work {
    /// Outstanding work, tokens: prefills waiting or running, plus
    /// `DECODING_STREAM_TOKENS` per stream decoding.
    pub fn outstanding(&self) -> u64 {
        let decoding = self.decoding.load(Ordering::Relaxed).saturating_mul(DECODING_STREAM_TOKENS);
        self.prefill_tokens.load(Ordering::Relaxed).saturating_add(decoding)
    }

    /// Uncached prompt tokens queued or prefilling now.
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed)
    }

    pub(super) fn add_prefill(&self, tokens: u64) {
        self.prefill_tokens.fetch_add(tokens, Ordering::Relaxed);
    }

    /// A request's prefill ended (its first token came, or it ended):
    /// `tokens` leave the queue; `decoding`: it goes on as a stream.
    pub(super) fn prefilled(&self, tokens: u64, decoding: bool) {
        sub(&self.prefill_tokens, tokens);
        if decoding {
            self.decoding.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn stopped_decoding(&self) {
        sub(&self.decoding, 1);
    }
}

fn sub(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(n)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_counts_until_its_first_token_and_a_stream_until_it_ends() {
        let w = Work::default();
        w.add_prefill(10_000);
        w.add_prefill(500);
        assert_eq!(w.outstanding(), 10_500);
        w.prefilled(10_000, true);
        assert_eq!(w.outstanding(), 500 + DECODING_STREAM_TOKENS);
        w.stopped_decoding();
        w.prefilled(500, false);
        assert_eq!(w.outstanding(), 0);
        // Never below zero, whatever the order.
        w.stopped_decoding();
        assert_eq!(w.outstanding(), 0);
    }
}
