//! Token estimates without a tokenizer, and their per-replica calibration.
//!
//! The documented starting point is 4 bytes of prompt text per token (close
//! for English BPE vocabularies; code and CJK text run denser). The
//! simulated replica uses the same rule, so its `usage` agrees with it.
//! Each replica's ratio then moves toward what its own `usage.prompt_tokens`
//! says (an exponential average), because tokenizers differ per model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::read_mostly::ReadMostly;

/// Bytes of prompt text per token, before any per-replica calibration.
pub const BYTES_PER_TOKEN: usize = 4;

/// Calibration keeps this much of each new sample (an exponential average).
const CALIBRATION_WEIGHT: f64 = 0.2;

/// Estimated tokens for `bytes` of prompt text at the default ratio.
pub fn estimate_tokens(bytes: usize) -> u64 {
    bytes.div_ceil(BYTES_PER_TOKEN) as u64
}

/// One replica's ratio: an `f64`'s bits, 0 until the first sample (a
/// ratio is clamped to at least 0.5 bytes per token, so never 0).
#[derive(Debug, Default)]
struct Ratio(AtomicU64);

impl Ratio {
    /// Moves the ratio toward `sample`. An unchanged ratio is not written:
    /// a converged replica's cache line stays shared between the cores.
    fn feed(&self, sample: f64) {
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            let next = match bits {
                0 => sample,
                _ => f64::from_bits(bits) * (1.0 - CALIBRATION_WEIGHT) + sample * CALIBRATION_WEIGHT,
            };
            (next.to_bits() != bits).then_some(next.to_bits())
        });
    }
}

/// Per-replica bytes-per-token ratios, learned from reported usage. Every
/// request reads its replica's ratio and every measured response feeds it,
/// from both workers: so the map is read without a lock (`ReadMostly`, a
/// new replica's entry is the only write to it) and a ratio is an atomic,
/// written only when a sample moves it.
#[derive(Debug, Default)]
pub struct Calibration {
    ratios: ReadMostly<foldhash::HashMap<Arc<str>, Arc<Ratio>>>,
}

impl Calibration {
    pub fn bytes_per_token(&self, replica: &str) -> f64 {
        match self.ratios.load().get(replica).map(|r| r.0.load(Ordering::Relaxed)) {
            Some(bits) if bits != 0 => f64::from_bits(bits),
            _ => BYTES_PER_TOKEN as f64,
        }
    }

    /// Estimated tokens of `bytes` of prompt on `replica`.
    pub fn estimate(&self, replica: &str, bytes: usize) -> u64 {
        (bytes as f64 / self.bytes_per_token(replica)).ceil() as u64
    }

    /// Forgets a replica's ratio (it left the fleet).
    pub fn forget_replica(&self, replica: &str) {
        self.ratios.update(|m| m.remove(replica).map(|_| ()));
    }

    /// Replicas with a ratio (for the churn test).
    pub fn len(&self) -> usize {
        self.ratios.load().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Feeds one measured (bytes, prompt_tokens) pair into the replica's ratio.
    pub fn calibrate(&self, replica: &Arc<str>, prompt_bytes: usize, prompt_tokens: u64) {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let sample = (prompt_bytes as f64 / prompt_tokens as f64).clamp(0.5, 16.0);
        if let Some(ratio) = self.ratios.load().get(replica) {
            return ratio.feed(sample);
        }
        let ratio =
            self.ratios.update(|m| Some(m.entry(replica.clone()).or_default().clone())).expect("always updates");
        ratio.feed(sample);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_moves_toward_measured_ratio() {
        let t = Calibration::default();
        let id: Arc<str> = Arc::from("a");
        assert_eq!(t.bytes_per_token("a"), 4.0);
        t.calibrate(&id, 3_000, 1_000);
        assert_eq!(t.bytes_per_token("a"), 3.0);
        t.calibrate(&id, 5_000, 1_000);
        assert!((t.bytes_per_token("a") - 3.4).abs() < 1e-9);
        assert_eq!(t.estimate("a", 340), 100);
    }
}
