//! The simulated engine's KV cache: one pool of fixed-size blocks shared by
//! running sequences and cached prefixes, as in vLLM. A running sequence pins
//! its blocks; finished sequences leave their prompt blocks cached until
//! evicted (least recently used first, and deepest first within a prompt so
//! that a chain is cut from its tail, never its head).
//!
//! Pure: no clock (a logical tick), no I/O.

use std::collections::HashMap;

/// Pseudo-tokens per KV block (vLLM's default block size).
pub const BLOCK_TOKENS: u64 = 16;

#[derive(Debug, Clone, Copy)]
struct Block {
    refs: u32,
    last_used: u64,
    depth: u32,
}

#[derive(Debug)]
pub struct KvPool {
    capacity: usize,
    cached: HashMap<u128, Block>,
    /// Blocks owned by running sequences that are not shareable (the
    /// partial last prompt block, generated tokens).
    private: usize,
    tick: u64,
}

/// Why a sequence cannot start now.
#[derive(Debug, PartialEq, Eq)]
pub enum AdmitError {
    /// Wait for running sequences to finish.
    Full,
    /// Could never fit, even in an empty pool.
    TooLarge { needed: usize, capacity: usize },
}

impl KvPool {
    pub fn new(capacity_tokens: u64) -> KvPool {
        KvPool { capacity: (capacity_tokens / BLOCK_TOKENS) as usize, cached: HashMap::new(), private: 0, tick: 0 }
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity
    }

    pub fn used_blocks(&self) -> usize {
        self.cached.len() + self.private
    }

    /// Blocks running sequences hold (shared prefixes once): what vLLM's
    /// `kv_cache_usage_perc` counts. Cached prefixes nobody runs are free
    /// to evict, so they do not count.
    pub fn running_blocks(&self) -> usize {
        self.cached.values().filter(|b| b.refs > 0).count() + self.private
    }

    /// Leading blocks of `chain` already cached.
    pub fn matched(&self, chain: &[u128]) -> usize {
        chain.iter().take_while(|k| self.cached.contains_key(k)).count()
    }

    /// Starts a sequence: shares its cached prefix, allocates the rest
    /// (evicting unreferenced cached blocks as needed). Returns the number of
    /// prompt blocks that were already cached.
    pub fn admit(&mut self, chain: &[u128], private: usize) -> Result<usize, AdmitError> {
        let needed_total = chain.len() + private;
        if needed_total > self.capacity {
            return Err(AdmitError::TooLarge { needed: needed_total, capacity: self.capacity });
        }
        let matched = self.matched(chain);
        let new_blocks = chain.len() - matched + private;
        let free = self.capacity - self.used_blocks();
        if new_blocks > free {
            let evictable_count = self.cached.values().filter(|b| b.refs == 0).count()
                - chain[..matched].iter().filter(|k| self.cached[*k].refs == 0).count();
            if new_blocks > free + evictable_count {
                return Err(AdmitError::Full);
            }
        }
        self.tick += 1;
        // Reference the shared prefix first, so eviction cannot take it
        // (and needs no per-block lookup into the prefix: O(n), not O(n^2)).
        for k in &chain[..matched] {
            let b = self.cached.get_mut(k).expect("matched blocks are cached");
            b.refs += 1;
            b.last_used = self.tick;
        }
        if new_blocks > free {
            let mut evictable: Vec<(u64, std::cmp::Reverse<u32>, u128)> = self
                .cached
                .iter()
                .filter(|(_, b)| b.refs == 0)
                .map(|(k, b)| (b.last_used, std::cmp::Reverse(b.depth), *k))
                .collect();
            let shortfall = new_blocks - free;
            evictable.select_nth_unstable(shortfall - 1);
            for (_, _, k) in &evictable[..shortfall] {
                self.cached.remove(k);
            }
        }
        for (depth, k) in chain.iter().enumerate().skip(matched) {
            let b = self.cached.entry(*k).or_insert(Block { refs: 0, last_used: self.tick, depth: depth as u32 });
            b.refs += 1;
            b.last_used = self.tick;
        }
        self.private += private;
        Ok(matched)
    }

    /// Ends a sequence: its prompt blocks stay cached, unreferenced.
    pub fn release(&mut self, chain: &[u128], private: usize) {
        self.tick += 1;
        for k in chain {
            if let Some(b) = self.cached.get_mut(k) {
                b.refs = b.refs.saturating_sub(1);
                b.last_used = self.tick;
            }
        }
        self.private -= private.min(self.private);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(family: u128, n: usize) -> Vec<u128> {
        (0..n as u128).map(|i| family << 64 | i).collect()
    }

    #[test]
    fn a_repeated_prefix_is_served_from_cache() {
        let mut kv = KvPool::new(160); // 10 blocks
        let c = chain(1, 4);
        assert_eq!(kv.admit(&c, 1), Ok(0));
        kv.release(&c, 1);
        assert_eq!(kv.admit(&c, 1), Ok(4));
        kv.release(&c, 1);
        assert_eq!(kv.used_blocks(), 4);
    }

    #[test]
    fn two_families_larger_than_the_pool_evict_each_other() {
        let mut kv = KvPool::new(16 * 10);
        let (a, b) = (chain(1, 8), chain(2, 8));
        kv.admit(&a, 0).unwrap();
        kv.release(&a, 0);
        assert_eq!(kv.admit(&a, 0), Ok(8), "alone, a stays cached");
        kv.release(&a, 0);
        assert_eq!(kv.admit(&b, 0), Ok(0));
        kv.release(&b, 0);
        for _ in 0..3 {
            assert_eq!(kv.admit(&a, 0), Ok(2), "a was mostly evicted by b");
            kv.release(&a, 0);
            // Each keeps only the 2 leading blocks the other left it.
            assert_eq!(kv.admit(&b, 0), Ok(2), "b was mostly evicted by a");
            kv.release(&b, 0);
        }
    }

    #[test]
    fn running_sequences_are_never_evicted_and_overflow_waits() {
        let mut kv = KvPool::new(16 * 10);
        let a = chain(1, 6);
        kv.admit(&a, 0).unwrap();
        assert_eq!(kv.admit(&chain(2, 6), 0), Err(AdmitError::Full));
        assert!(matches!(kv.admit(&chain(3, 11), 0), Err(AdmitError::TooLarge { .. })));
        kv.release(&a, 0);
        assert_eq!(kv.admit(&chain(2, 6), 0), Ok(0));
    }

    #[test]
    fn eviction_cuts_a_prefix_from_its_tail() {
        let mut kv = KvPool::new(16 * 8);
        let a = chain(1, 6);
        kv.admit(&a, 0).unwrap();
        kv.release(&a, 0);
        let b = chain(2, 4);
        kv.admit(&b, 0).unwrap(); // needs 2 of a's blocks
        assert_eq!(kv.matched(&a), 4);
    }
}
