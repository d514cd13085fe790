//! Requests running now, with the context they occupy: one part of a
//! replica's working set.

use std::sync::{Arc, Mutex, Weak};

use crate::policy::PrefixKey;

#[derive(Debug, Clone, Copy)]
pub struct RunningRequest {
    pub family: Option<PrefixKey>,
    pub tokens: u64,
}

/// Requests running now, with the context they occupy. Each worker
/// registers its requests in a shard of its own (`worker`, taken once when
/// the worker starts): a request's begin and end touch only memory its
/// worker owns (one shared map moved its lock and table between the cores on
/// every request). Readers (once a second, and heartbeats) walk every shard;
/// a shard whose worker and tickets are gone drops out.
#[derive(Default)]
pub struct RunningRequests {
    shards: Mutex<Vec<Weak<RunningShard>>>,
}

/// One worker's shard of the running requests.
pub struct RunningWorker(Arc<RunningShard>);

#[derive(Default)]
struct RunningShard {
    map: Mutex<ShardMap>,
}

#[derive(Default)]
struct ShardMap {
    running: foldhash::HashMap<u64, (Arc<str>, RunningRequest)>,
    next_ticket: u64,
}

/// Registered while a request runs; unregisters on drop, however the request ends.
pub struct RunningTicket {
    shard: Arc<RunningShard>,
    id: u64,
}

impl Drop for RunningTicket {
    fn drop(&mut self) {
        self.shard.map.lock().expect("lock").running.remove(&self.id);
    }
}

impl RunningTicket {
    /// The request runs on `replica` from now (a stream that went on
    /// elsewhere, `proxy::resume`).
    pub fn move_to(&self, replica: &Arc<str>) {
        if let Some((on, _)) = self.shard.map.lock().expect("lock").running.get_mut(&self.id) {
            *on = replica.clone();
        }
    }
}

impl RunningWorker {
    pub fn begin(&self, replica: &Arc<str>, family: Option<PrefixKey>, tokens: u64) -> RunningTicket {
        let id = {
            let mut map = self.0.map.lock().expect("lock");
            map.next_ticket += 1;
            let id = map.next_ticket;
            map.running.insert(id, (replica.clone(), RunningRequest { family, tokens }));
            id
        };
        RunningTicket { shard: self.0.clone(), id }
    }
}

impl RunningRequests {
    /// A shard for one worker, taken once; a ticket keeps its shard counted
    /// until the ticket drops, whoever began it.
    pub fn worker(&self) -> RunningWorker {
        let shard = Arc::new(RunningShard::default());
        let mut shards = self.shards.lock().expect("lock");
        shards.retain(|s| s.strong_count() > 0);
        shards.push(Arc::downgrade(&shard));
        RunningWorker(shard)
    }

    pub(super) fn snapshot(&self) -> Vec<(Arc<str>, RunningRequest)> {
        let shards: Vec<Arc<RunningShard>> =
            self.shards.lock().expect("lock").iter().filter_map(Weak::upgrade).collect();
        shards.iter().flat_map(|s| s.map.lock().expect("lock").running.values().cloned().collect::<Vec<_>>()).collect()
    }

    /// Requests running now per replica: (count, estimated tokens), for this
    /// instance's heartbeat.
    pub fn totals(&self) -> std::collections::BTreeMap<String, (u64, u64)> {
        let mut out = std::collections::BTreeMap::new();
        for (replica, q) in self.snapshot() {
            let e: &mut (u64, u64) = out.entry(replica.to_string()).or_default();
            e.0 += 1;
            e.1 += q.tokens;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_requests_count_across_worker_shards_and_a_gone_workers_shard_drops_out() {
        let running = RunningRequests::default();
        let a: Arc<str> = Arc::from("a");
        let (w1, w2) = (running.worker(), running.worker());
        let t1 = w1.begin(&a, None, 100);
        let t2 = w2.begin(&a, Some(7), 50);
        let t3 = w2.begin(&a, None, 25);
        assert_eq!(running.totals().get("a"), Some(&(3, 175)));
        drop(t2);
        assert_eq!(running.totals().get("a"), Some(&(2, 125)));
        // A worker that ends keeps its shard while its tickets run...
        drop(w2);
        assert_eq!(running.totals().get("a"), Some(&(2, 125)));
        drop(t3);
        assert_eq!(running.totals().get("a"), Some(&(1, 100)));
        // ...and then the shard is gone from the list.
        let _w3 = running.worker();
        assert_eq!(running.shards.lock().unwrap().len(), 2, "w1's shard and w3's");
        drop((t1, w1));
        assert!(running.totals().is_empty());
    }

    #[test]
    fn a_ticket_moved_counts_on_its_new_replica_and_ends_there() {
        let running = RunningRequests::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let worker = running.worker();
        let ticket = worker.begin(&a, None, 100);
        ticket.move_to(&b);
        assert_eq!((running.totals().get("a"), running.totals().get("b")), (None, Some(&(1, 100))));
        drop(ticket);
        assert!(running.totals().is_empty());
    }
}
