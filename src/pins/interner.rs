//! Replica names, each held once: a pin refers to its replica by a
//! `ReplicaRef` (an index and a generation), not by its name, so a pin in
//! memory stays 64 bytes.

use std::sync::Arc;

use crate::read_mostly::ReadMostly;

/// A replica name in the interner: its index, and the generation the index
/// had when the name was interned. An index is reused once its name is
/// released; a pin that still carries the old generation names nobody (it
/// reads as absent), so a stale pin never reaches the index's next replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ReplicaRef {
    pub(super) index: u32,
    pub(super) generation: u16,
}

/// Replica names, each stored once; pins refer to them by `ReplicaRef`. A
/// name is released when its replica leaves with no pin left on it (or, for
/// names only other instances' pins carried, when its last pin went), and
/// its index is reused under the next generation: the table holds the names
/// in use, not every name the process ever saw.
#[derive(Default)]
pub(super) struct Interner {
    /// Read by every pin write (from both workers); written when a name
    /// comes or goes.
    table: ReadMostly<InternTable>,
}

#[derive(Default, Clone)]
pub(super) struct InternTable {
    /// By index: the name it holds now (None: free), and its generation.
    entries: Vec<(Option<Arc<str>>, u16)>,
    index: foldhash::HashMap<Arc<str>, ReplicaRef>,
    free: Vec<u32>,
}

impl Interner {
    pub(super) fn intern(&self, name: &Arc<str>) -> ReplicaRef {
        if let Some(r) = self.find(name) {
            return r;
        }
        let added = self.table.update(|table| {
            if table.index.contains_key(name) {
                return None; // interned while we waited for the writer lock
            }
            let index = match table.free.pop() {
                Some(i) => i,
                None => {
                    table.entries.push((None, 0));
                    // More names at once than a u32 counts would be billions of pins.
                    u32::try_from(table.entries.len() - 1).expect("fewer than 2^32 names in use")
                }
            };
            let entry = &mut table.entries[index as usize];
            entry.0 = Some(name.clone());
            let r = ReplicaRef { index, generation: entry.1 };
            table.index.insert(name.clone(), r);
            Some(r)
        });
        added.or_else(|| self.find(name)).expect("interned")
    }

    pub(super) fn find(&self, name: &str) -> Option<ReplicaRef> {
        self.table.load().index.get(name).copied()
    }

    /// The name `r` refers to; None once it was released (a stale pin).
    pub(super) fn name(&self, r: ReplicaRef) -> Option<Arc<str>> {
        match self.table.load().entries.get(r.index as usize) {
            Some((Some(name), generation)) if *generation == r.generation => Some(name.clone()),
            _ => None,
        }
    }

    /// Frees the names `release` picks among those interned; their indexes
    /// are reused under the next generation.
    pub(super) fn release(&self, mut release: impl FnMut(&str, ReplicaRef) -> bool) -> usize {
        self.table
            .update(|table| {
                let gone: Vec<(Arc<str>, ReplicaRef)> =
                    table.index.iter().filter(|(n, r)| release(n, **r)).map(|(n, r)| (n.clone(), *r)).collect();
                if gone.is_empty() {
                    return None;
                }
                for (name, r) in &gone {
                    table.index.remove(name);
                    let entry = &mut table.entries[r.index as usize];
                    *entry = (None, entry.1.wrapping_add(1));
                    table.free.push(r.index);
                }
                Some(gone.len())
            })
            .unwrap_or(0)
    }

    pub(super) fn len(&self) -> usize {
        self.table.load().index.len()
    }

    /// Indexes ever handed out, free ones included (a churn test's bound).
    #[cfg(test)]
    pub(super) fn indexes(&self) -> usize {
        self.table.load().entries.len()
    }
}
