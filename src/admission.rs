//! Admission for large contexts (opt-in, per replica `max_large_inflight`).
//!
//! A large request bound for a replica at its limit waits in that replica's
//! FIFO queue, bounded in time (`admission.wait_ms`) and length
//! (`admission.max_queue`); past either it is rejected with 503 and
//! Retry-After. Slots are handed straight to the next waiter on release, so
//! the queue is fair. Every path releases: the permit is an RAII guard, and a
//! waiter that goes away (client disconnect, timeout) either leaves the queue
//! or, if it was granted a slot in the same instant, gives the slot back.
//!
//! The seed measured that one large request per card did *not* help on its
//! workload; this is a lever to measure, off unless configured.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::domain_error::DomainError;

#[derive(Default)]
struct Slots {
    in_use: u32,
    waiters: VecDeque<(u64, oneshot::Sender<()>)>,
}

#[derive(Default)]
pub struct Admission {
    replicas: Mutex<HashMap<Arc<str>, Slots>>,
    next_waiter: std::sync::atomic::AtomicU64,
}

/// Holds one large slot until dropped.
pub struct Permit {
    admission: Arc<Admission>,
    replica: Arc<str>,
    limit: Arc<dyn Fn() -> Option<u32> + Send + Sync>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.admission.release(&self.replica, (self.limit)());
    }
}

/// Why a request waited or not (for metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    AtOnce,
    AfterWaiting,
}

impl Admission {
    pub fn queued(&self, replica: &str) -> usize {
        self.replicas.lock().expect("lock").get(replica).map_or(0, |s| s.waiters.len())
    }

    pub fn in_use(&self, replica: &str) -> u32 {
        self.replicas.lock().expect("lock").get(replica).map_or(0, |s| s.in_use)
    }

    /// True when a large request could start on `replica` without waiting.
    pub fn has_free_slot(&self, replica: &str, limit: Option<u32>) -> bool {
        let Some(limit) = limit else { return true };
        let map = self.replicas.lock().expect("lock");
        map.get(replica).is_none_or(|s| s.in_use < limit && s.waiters.is_empty())
    }

    /// Takes a slot on `replica`, waiting in line if needed. `limit` is read
    /// again on every release, so a limit changed at runtime applies at once.
    pub async fn acquire(
        self: &Arc<Self>,
        replica: &Arc<str>,
        limit: Arc<dyn Fn() -> Option<u32> + Send + Sync>,
        wait: Duration,
        max_queue: usize,
    ) -> Result<(Permit, Admitted), DomainError> {
        let permit = || Permit { admission: self.clone(), replica: replica.clone(), limit: limit.clone() };
        let waiter = {
            let mut map = self.replicas.lock().expect("lock");
            let slots = map.entry(replica.clone()).or_default();
            match limit() {
                None => {
                    slots.in_use += 1;
                    return Ok((permit(), Admitted::AtOnce));
                }
                Some(l) if slots.in_use < l && slots.waiters.is_empty() => {
                    slots.in_use += 1;
                    return Ok((permit(), Admitted::AtOnce));
                }
                Some(_) if slots.waiters.len() >= max_queue => {
                    return Err(rejected(replica, wait, "its admission queue is full"));
                }
                Some(_) => {
                    let (tx, rx) = oneshot::channel();
                    let id = self.next_waiter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    slots.waiters.push_back((id, tx));
                    Waiter { admission: self.clone(), replica: replica.clone(), id, rx: Some(rx), limit: limit.clone() }
                }
            }
        };
        let mut waiter = waiter;
        match tokio::time::timeout(wait, waiter.rx.as_mut().expect("set")).await {
            Ok(Ok(())) => {
                waiter.rx = None; // the slot is ours now: the permit releases it
                Ok((permit(), Admitted::AfterWaiting))
            }
            // The waiter's drop settles the place in line (or a racing grant).
            _ => Err(rejected(replica, wait, "no large-context slot freed up in time")),
        }
    }

    fn release(&self, replica: &Arc<str>, limit: Option<u32>) {
        let mut map = self.replicas.lock().expect("lock");
        let Some(slots) = map.get_mut(replica) else {
            return;
        };
        slots.in_use = slots.in_use.saturating_sub(1);
        Admission::grant(slots, limit);
        // An idle replica keeps no entry: entries leave with their last
        // permit or waiter, so a replica that left the fleet leaves none.
        if slots.in_use == 0 && slots.waiters.is_empty() {
            map.remove(replica);
        }
    }

    /// Replicas with a permit or a waiter now (for the churn test).
    pub fn replicas_tracked(&self) -> usize {
        self.replicas.lock().expect("lock").len()
    }

    /// Hands free slots to waiters in order, skipping those that left.
    fn grant(slots: &mut Slots, limit: Option<u32>) {
        while limit.is_none_or(|l| slots.in_use < l) {
            let Some((_, tx)) = slots.waiters.pop_front() else {
                break;
            };
            if tx.send(()).is_ok() {
                slots.in_use += 1;
            }
        }
    }

    /// After a limit change: wakes waiters that now fit.
    pub fn rebalance(&self, replica: &str, limit: Option<u32>) {
        let mut map = self.replicas.lock().expect("lock");
        if let Some(slots) = map.get_mut(replica) {
            Admission::grant(slots, limit);
        }
    }
}

fn rejected(replica: &str, wait: Duration, why: &str) -> DomainError {
    DomainError::Overloaded {
        message: format!("replica '{replica}' is at its large-context limit and {why}; retry later"),
        retry_after: (wait / 2).max(Duration::from_secs(1)),
    }
}

/// A place in line. Dropped without being granted: leaves the line. Dropped
/// after a grant it never used (timeout and grant raced): returns the slot.
struct Waiter {
    admission: Arc<Admission>,
    replica: Arc<str>,
    id: u64,
    rx: Option<oneshot::Receiver<()>>,
    limit: Arc<dyn Fn() -> Option<u32> + Send + Sync>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        rx.close();
        let granted = rx.try_recv().is_ok();
        if granted {
            self.admission.release(&self.replica, (self.limit)());
        } else {
            let mut map = self.admission.replicas.lock().expect("lock");
            if let Some(slots) = map.get_mut(&self.replica) {
                slots.waiters.retain(|(id, _)| *id != self.id);
                if slots.in_use == 0 && slots.waiters.is_empty() {
                    map.remove(&self.replica);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(n: u32) -> Arc<dyn Fn() -> Option<u32> + Send + Sync> {
        Arc::new(move || Some(n))
    }

    #[tokio::test]
    async fn waiters_are_served_in_order_and_slots_never_leak() {
        let a = Arc::new(Admission::default());
        let r: Arc<str> = Arc::from("r");
        let (first, how) = a.acquire(&r, limit(1), Duration::from_secs(5), 8).await.unwrap();
        assert_eq!(how, Admitted::AtOnce);
        let a2 = a.clone();
        let r2 = r.clone();
        let second =
            tokio::spawn(
                async move { a2.acquire(&r2, limit(1), Duration::from_secs(5), 8).await.map(|(p, h)| (h, p)) },
            );
        while a.queued("r") == 0 {
            tokio::task::yield_now().await;
        }
        drop(first);
        let (how, p) = second.await.unwrap().unwrap();
        assert_eq!(how, Admitted::AfterWaiting);
        assert_eq!(a.in_use("r"), 1);
        drop(p);
        assert_eq!((a.in_use("r"), a.queued("r")), (0, 0));
        assert_eq!(a.replicas_tracked(), 0, "an idle replica keeps no entry");
    }

    #[tokio::test]
    async fn a_full_queue_and_a_timeout_are_rejections_that_leave_nothing_behind() {
        let a = Arc::new(Admission::default());
        let r: Arc<str> = Arc::from("r");
        let (held, _) = a.acquire(&r, limit(1), Duration::from_secs(1), 0).await.unwrap();
        assert!(matches!(
            a.acquire(&r, limit(1), Duration::from_secs(1), 0).await,
            Err(DomainError::Overloaded { .. })
        ));
        assert!(matches!(
            a.acquire(&r, limit(1), Duration::from_millis(20), 4).await,
            Err(DomainError::Overloaded { .. })
        ));
        assert_eq!((a.in_use("r"), a.queued("r")), (1, 0));
        drop(held);
        assert_eq!(a.in_use("r"), 0);
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_the_queue() {
        let a = Arc::new(Admission::default());
        let r: Arc<str> = Arc::from("r");
        let (held, _) = a.acquire(&r, limit(1), Duration::from_secs(1), 4).await.unwrap();
        let wait = a.acquire(&r, limit(1), Duration::from_secs(10), 4);
        // Poll once so it queues, then drop it (a client that went away).
        let mut wait = Box::pin(wait);
        assert!(futures_util::poll!(wait.as_mut()).is_pending());
        assert_eq!(a.queued("r"), 1);
        drop(wait);
        assert_eq!(a.queued("r"), 0);
        drop(held);
        assert_eq!(a.in_use("r"), 0);
    }
}
