//! Token estimates without a tokenizer, their per-replica calibration, and
//! whether a replica's engine counts prompts itself (`proxy::count`: a
//! session turn bound for a pool of tokens is counted by the engine where
//! it can be; everything else is estimated).
//!
//! The documented starting point is 4 bytes of prompt text per token (close
//! for English BPE vocabularies; code and CJK text run denser). The
//! simulated replica uses the same rule, so its `usage` agrees with it.
//! Each replica's ratio then moves toward what its own `usage.prompt_tokens`
//! (and its engine's counts) say (an exponential average), because
//! tokenizers differ per model.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of prompt text per token, before any per-replica calibration.
pub const BYTES_PER_TOKEN: usize = 4;

/// Calibration keeps this much of each new sample (an exponential average).
const CALIBRATION_WEIGHT: f64 = 0.2;

/// Estimated tokens for `bytes` of prompt text at the default ratio.
pub fn estimate_tokens(bytes: usize) -> u64 {
    bytes.div_ceil(BYTES_PER_TOKEN) as u64
}

/// One replica's calibration: its bytes per token, an `f64`'s bits, 0 until
/// the first sample (a ratio is clamped to at least 0.5 bytes per token, so
/// never 0). Kept on the replica's record (`fleet::Replica`): it leaves
/// with the replica.
#[derive(Debug, Default)]
pub struct Calibration {
    ratio: AtomicU64,
    /// The engine is not asked to count a prompt (`proxy::count`) before
    /// this moment, ms: a count failed or took too long (`engine_failed`),
    /// or never again (`NEVER`: it has no way to count, `engine_refused`).
    counts_resume_ms: AtomicU64,
    /// Whether its streams carry token ids when asked (`return_token_ids`,
    /// `proxy::resume`): 0 not known yet, 1 yes, 2 no.
    token_ids: std::sync::atomic::AtomicU8,
}

/// `counts_resume_ms` of an engine that refused to count.
const NEVER: u64 = u64::MAX;

impl Calibration {
    /// The replica's bytes per token (the default until it reported usage).
    pub fn bytes_per_token(&self) -> f64 {
        match self.ratio.load(Ordering::Relaxed) {
            0 => BYTES_PER_TOKEN as f64,
            bits => f64::from_bits(bits),
        }
    }

    /// Estimated tokens for `bytes` of prompt text on this replica.
    pub fn estimate(&self, bytes: usize) -> u64 {
        (bytes as f64 / self.bytes_per_token()).ceil() as u64
    }

    /// True once the replica reported usage.
    pub fn is_calibrated(&self) -> bool {
        self.ratio.load(Ordering::Relaxed) != 0
    }

    /// True while the engine may be asked to count a prompt: it never
    /// refused (`engine_refused`), and no count failed in the last while
    /// (`engine_failed`).
    pub fn engine_counts(&self, now_ms: u64) -> bool {
        let resume = self.counts_resume_ms.load(Ordering::Relaxed);
        resume != NEVER && now_ms >= resume
    }

    /// A count failed or timed out (an engine too busy, or a prompt too
    /// large to count in time): not asked again until `resume_ms`, so a
    /// slow tokenizer costs a turn its wait at most once in that while.
    pub fn engine_failed(&self, resume_ms: u64) {
        self.counts_resume_ms.fetch_max(resume_ms.min(NEVER - 1), Ordering::Relaxed);
    }

    /// The engine has no way to count a prompt: estimates only, from now
    /// (until the replica is registered again).
    pub fn engine_refused(&self) {
        self.counts_resume_ms.store(NEVER, Ordering::Relaxed);
    }

    /// Whether the engine is asked for token ids: yes until a stream it
    /// was asked for them came without (then never, until the replica is
    /// registered again).
    pub fn asks_token_ids(&self) -> bool {
        self.token_ids.load(Ordering::Relaxed) != 2
    }

    /// A stream asked for token ids came with them (`true`) or without.
    pub fn heard_token_ids(&self, given: bool) {
        self.token_ids.store(if given { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Feeds one measured (bytes, prompt_tokens) pair into the ratio.
    pub fn calibrate(&self, prompt_bytes: usize, prompt_tokens: u64) {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let sample = (prompt_bytes as f64 / prompt_tokens as f64).clamp(0.5, 16.0);
        let _ = self.ratio.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            let next = match bits {
                0 => sample,
                _ => f64::from_bits(bits) * (1.0 - CALIBRATION_WEIGHT) + sample * CALIBRATION_WEIGHT,
            };
            (next.to_bits() != bits).then_some(next.to_bits())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_moves_toward_measured_ratio() {
        let t = Calibration::default();
        assert_eq!(t.bytes_per_token(), 4.0);
        assert!(!t.is_calibrated());
        t.calibrate(3_000, 1_000);
        assert_eq!(t.bytes_per_token(), 3.0);
        t.calibrate(5_000, 1_000);
        assert!((t.bytes_per_token() - 3.4).abs() < 1e-9);
        assert_eq!(t.estimate(340), 100);
    }

    #[test]
    fn an_engine_is_asked_for_counts_until_it_refuses_and_not_for_a_while_after_one_failed() {
        let t = Calibration::default();
        assert!(t.engine_counts(0));
        t.engine_failed(10_000);
        assert!(!t.engine_counts(9_999), "a count that failed: not asked for a while");
        t.engine_failed(5_000);
        assert!(!t.engine_counts(9_999), "an earlier resumption does not shorten the wait");
        assert!(t.engine_counts(10_000));
        t.engine_refused();
        assert!(!t.engine_counts(u64::MAX), "no such endpoint: never again");
    }
}
