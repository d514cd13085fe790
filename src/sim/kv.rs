//! The simulated engine's KV cache: one pool of fixed-size blocks shared by
//! running sequences and cached prefixes, as in vLLM. A running sequence pins
//! its blocks; finished sequences leave their prompt blocks cached until
//! evicted (least recently used first, and deepest first within a prompt so
//! that a chain is cut from its tail, never its head).
//!
//! An optional host tier (`HostTier`) keeps what the pool evicts, as
//! llama-server's `--cache-ram` and vLLM's CPU offload do: a prompt that
//! returns finds its evicted blocks there and is restored, not prefilled.
//!
//! Pure: no clock (a logical tick), no I/O.

use std::collections::{BTreeSet, HashMap};

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
    host: HostTier,
}

/// Blocks evicted from the pool, kept in host memory up to `capacity`
/// blocks, the least recently evicted or restored out first.
#[derive(Debug, Default)]
struct HostTier {
    capacity: usize,
    blocks: HashMap<u128, u64>,
    /// (tick, block): the eviction order.
    order: BTreeSet<(u64, u128)>,
}

impl HostTier {
    fn keep(&mut self, block: u128, tick: u64) {
        if self.capacity == 0 {
            return;
        }
        if let Some(old) = self.blocks.insert(block, tick) {
            self.order.remove(&(old, block));
        }
        self.order.insert((tick, block));
        while self.blocks.len() > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            self.blocks.remove(&oldest);
        }
    }

    fn take(&mut self, block: u128) -> bool {
        match self.blocks.remove(&block) {
            Some(tick) => self.order.remove(&(tick, block)),
            None => false,
        }
    }
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
        KvPool::with_host_tier(capacity_tokens, 0)
    }

    /// A pool whose evicted blocks are kept in a host tier of `host_tokens`.
    pub fn with_host_tier(capacity_tokens: u64, host_tokens: u64) -> KvPool {
        let host = HostTier { capacity: (host_tokens / BLOCK_TOKENS) as usize, ..Default::default() };
        KvPool {
            capacity: (capacity_tokens / BLOCK_TOKENS) as usize,
            cached: HashMap::new(),
            private: 0,
            tick: 0,
            host,
        }
    }

    /// After `admit` (which gave the chain's first `matched` blocks from the
    /// pool and allocated the rest): how many of the blocks after those the
    /// host tier held, in a row: restored, not prefilled (they leave the
    /// tier: they are in the pool again).
    pub fn restored(&mut self, chain: &[u128], matched: usize) -> usize {
        chain[matched..].iter().take_while(|k| self.host.take(**k)).count()
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
                self.host.keep(*k, self.tick);
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

    #[test]
    fn with_a_host_tier_what_the_pool_evicts_is_restored_and_the_tier_is_bounded() {
        let mut kv = KvPool::with_host_tier(16 * 10, 16 * 12);
        let (a, b) = (chain(1, 8), chain(2, 8));
        kv.admit(&a, 0).unwrap();
        kv.release(&a, 0);
        kv.admit(&b, 0).unwrap(); // evicts 6 of a's blocks to the host tier
        assert_eq!(kv.restored(&b, 0), 0, "b was never evicted");
        kv.release(&b, 0);
        let matched = kv.admit(&a, 0).unwrap();
        assert_eq!((matched, kv.restored(&a, matched)), (2, 6), "a: 2 in the pool, 6 restored from the host");
        kv.release(&a, 0);
        // Past its bound the tier drops the oldest: 30 families' tails pass through 12 blocks.
        for f in 3..33 {
            kv.admit(&chain(f, 8), 0).unwrap();
            kv.release(&chain(f, 8), 0);
        }
        assert!(kv.host.blocks.len() <= 12 && kv.host.order.len() == kv.host.blocks.len());
        let matched = kv.admit(&a, 0).unwrap();
        assert_eq!(kv.restored(&a, matched), 0, "a's blocks left the tier long ago");
    }
}
