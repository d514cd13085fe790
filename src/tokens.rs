//! Token estimates without a tokenizer, and their per-replica calibration.
//!
//! The documented starting point is 4 bytes of prompt text per token (close
//! for English BPE vocabularies; code and CJK text run denser). The
//! simulated replica uses the same rule, so its `usage` agrees with it.
//! Each replica's ratio then moves toward what its own `usage.prompt_tokens`
//! says (an exponential average), because tokenizers differ per model.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bytes of prompt text per token, before any per-replica calibration.
pub const BYTES_PER_TOKEN: usize = 4;

/// Calibration keeps this much of each new sample (an exponential average).
const CALIBRATION_WEIGHT: f64 = 0.2;

/// Estimated tokens for `bytes` of prompt text at the default ratio.
pub fn estimate_tokens(bytes: usize) -> u64 {
    bytes.div_ceil(BYTES_PER_TOKEN) as u64
}

#[derive(Debug, Clone, Copy)]
struct Ratio {
    bytes_per_token: f64,
    samples: u64,
}

/// Per-replica bytes-per-token ratios, learned from reported usage.
#[derive(Debug, Default)]
pub struct Calibration {
    ratios: Mutex<HashMap<Arc<str>, Ratio>>,
}

impl Calibration {
    pub fn bytes_per_token(&self, replica: &str) -> f64 {
        self.ratios.lock().expect("lock").get(replica).map_or(BYTES_PER_TOKEN as f64, |r| r.bytes_per_token)
    }

    /// Estimated tokens of `bytes` of prompt on `replica`.
    pub fn estimate(&self, replica: &str, bytes: usize) -> u64 {
        (bytes as f64 / self.bytes_per_token(replica)).ceil() as u64
    }

    /// Feeds one measured (bytes, prompt_tokens) pair into the replica's ratio.
    pub fn calibrate(&self, replica: &Arc<str>, prompt_bytes: usize, prompt_tokens: u64) {
        if prompt_bytes == 0 || prompt_tokens == 0 {
            return;
        }
        let sample = (prompt_bytes as f64 / prompt_tokens as f64).clamp(0.5, 16.0);
        let mut ratios = self.ratios.lock().expect("lock");
        let r = ratios.entry(replica.clone()).or_insert(Ratio { bytes_per_token: sample, samples: 0 });
        if r.samples > 0 {
            r.bytes_per_token = r.bytes_per_token * (1.0 - CALIBRATION_WEIGHT) + sample * CALIBRATION_WEIGHT;
        }
        r.samples += 1;
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
