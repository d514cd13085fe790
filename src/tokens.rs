//! Token estimates without a tokenizer.
//!
//! The documented starting point is 4 bytes of prompt text per token (close
//! for English BPE vocabularies; code and CJK text run denser). The
//! simulated replica uses the same rule, so its `usage` agrees with it.

/// Bytes of prompt text per token, before any per-replica calibration.
pub const BYTES_PER_TOKEN: usize = 4;

/// Estimated tokens for `bytes` of prompt text at the default ratio.
pub fn estimate_tokens(bytes: usize) -> u64 {
    bytes.div_ceil(BYTES_PER_TOKEN) as u64
}
