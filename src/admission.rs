//! Admission for large contexts (opt-in, per replica `max_large_inflight`).
//!
//! A large request bound for a replica at its limit waits in that replica's
//! queue, bounded in time (`admission.wait_ms`) and length
//! (`admission.max_queue`); past either it is rejected with 503 and
//! Retry-After. Slots are handed straight to the next waiter on release, in
//! the queue's order: by priority class, then turns between clients, then
//! arrival (`priority::FairQueue`). Every path releases: the permit is an RAII guard, and a
//! waiter that goes away (client disconnect, timeout) either leaves the queue
//! or, if it was granted a slot in the same instant, gives the slot back.
//!
//! The seed measured that one large request per card did *not* help on its
//! workload; this is a lever to measure, off unless configured.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::domain_error::DomainError;
use crate::priority::{FairQueue, Who};

#[derive(Default)]
struct Slots {
    in_use: u32,
    waiters: FairQueue<oneshot::Sender<()>>,
}

/// One replica's large-context slots and their queue. Kept on the
/// replica's record (`fleet::Replica::large_slots`): it leaves with the
/// replica, and a permit still held keeps it only until it is dropped.
#[derive(Default)]
pub struct LargeSlots {
    slots: Mutex<Slots>,
}

/// The replica's limit, read again at every release so a limit changed at
/// runtime applies at once (`None`: unlimited).
pub type Limit = Arc<dyn Fn() -> Option<u32> + Send + Sync>;

/// Holds one large slot until dropped.
pub struct Permit {
    slots: Arc<LargeSlots>,
    limit: Limit,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.slots.release((self.limit)());
    }
}

/// Why a request waited or not (for metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    AtOnce,
    AfterWaiting,
}

impl LargeSlots {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn queued(&self) -> usize {
        self.lock().waiters.len()
    }

    pub fn in_use(&self) -> u32 {
        self.lock().in_use
    }

    /// True when a large request could start without waiting.
    pub fn has_free_slot(&self, limit: Option<u32>) -> bool {
        let Some(limit) = limit else { return true };
        let s = self.lock();
        s.in_use < limit && s.waiters.is_empty()
    }

    /// Takes a slot for `who`, waiting in line if needed; `replica` names
    /// it in a refusal.
    pub async fn acquire(
        self: &Arc<Self>,
        replica: &str,
        who: &Who,
        limit: Limit,
        wait: Duration,
        max_queue: usize,
    ) -> Result<(Permit, Admitted), DomainError> {
        let permit = || Permit { slots: self.clone(), limit: limit.clone() };
        let waiter = {
            let mut slots = self.lock();
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
                    let id = slots.waiters.push(who.class, who.client.clone(), tx);
                    Waiter { slots: self.clone(), id, rx: Some(rx), limit: limit.clone() }
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

    fn release(&self, limit: Option<u32>) {
        let mut slots = self.lock();
        slots.in_use = slots.in_use.saturating_sub(1);
        LargeSlots::grant(&mut slots, limit);
    }

    /// Hands free slots to waiters in order, skipping those that left.
    fn grant(slots: &mut Slots, limit: Option<u32>) {
        while limit.is_none_or(|l| slots.in_use < l) {
            let Some(waiter) = slots.waiters.pop() else {
                break;
            };
            if waiter.value.send(()).is_ok() {
                slots.in_use += 1;
            }
        }
    }

    /// After a limit change: wakes waiters that now fit.
    pub fn rebalance(&self, limit: Option<u32>) {
        LargeSlots::grant(&mut self.lock(), limit);
    }
}

impl std::fmt::Debug for LargeSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("LargeSlots").field("in_use", &s.in_use).field("queued", &s.waiters.len()).finish()
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
    slots: Arc<LargeSlots>,
    id: u64,
    rx: Option<oneshot::Receiver<()>>,
    limit: Limit,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else { return };
        rx.close();
        let granted = rx.try_recv().is_ok();
        if granted {
            self.slots.release((self.limit)());
        } else {
            self.slots.lock().waiters.remove(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(n: u32) -> Limit {
        Arc::new(move || Some(n))
    }

    #[tokio::test]
    async fn waiters_are_served_in_order_and_slots_never_leak() {
        let a = Arc::new(LargeSlots::default());
        let r = "r";
        let (first, how) = a.acquire(r, &Who::default(), limit(1), Duration::from_secs(5), 8).await.unwrap();
        assert_eq!(how, Admitted::AtOnce);
        let a2 = a.clone();
        let r2 = r;
        let second = tokio::spawn(async move {
            a2.acquire(r2, &Who::default(), limit(1), Duration::from_secs(5), 8).await.map(|(p, h)| (h, p))
        });
        while a.queued() == 0 {
            tokio::task::yield_now().await;
        }
        drop(first);
        let (how, p) = second.await.unwrap().unwrap();
        assert_eq!(how, Admitted::AfterWaiting);
        assert_eq!(a.in_use(), 1);
        drop(p);
        assert_eq!((a.in_use(), a.queued()), (0, 0));
    }

    #[tokio::test]
    async fn a_full_queue_and_a_timeout_are_rejections_that_leave_nothing_behind() {
        let a = Arc::new(LargeSlots::default());
        let r = "r";
        let (held, _) = a.acquire(r, &Who::default(), limit(1), Duration::from_secs(1), 0).await.unwrap();
        assert!(matches!(
            a.acquire(r, &Who::default(), limit(1), Duration::from_secs(1), 0).await,
            Err(DomainError::Overloaded { .. })
        ));
        assert!(matches!(
            a.acquire(r, &Who::default(), limit(1), Duration::from_millis(20), 4).await,
            Err(DomainError::Overloaded { .. })
        ));
        assert_eq!((a.in_use(), a.queued()), (1, 0));
        drop(held);
        assert_eq!(a.in_use(), 0);
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_highest_class_waiting_then_by_clients_turns() {
        use crate::priority::Class;
        let a = Arc::new(LargeSlots::default());
        let who = |class, client: &str| Who { class, stated: true, client: Arc::from(client) };
        let (held, _) = a.acquire("r", &who(Class::Default, "x"), limit(1), Duration::from_secs(5), 8).await.unwrap();
        let (order_tx, mut order) = tokio::sync::mpsc::unbounded_channel();
        // Queued in this order: two background ones of client a, one default
        // of a, one default of b, one interactive.
        let queued = [
            (Class::Background, "a"),
            (Class::Background, "a"),
            (Class::Default, "a"),
            (Class::Default, "a"),
            (Class::Default, "b"),
            (Class::Interactive, "c"),
        ];
        for (i, (class, client)) in queued.into_iter().enumerate() {
            let (slots, tx, w) = (a.clone(), order_tx.clone(), who(class, client));
            tokio::spawn(async move {
                let (p, _) = slots.acquire("r", &w, limit(1), Duration::from_secs(5), 8).await.unwrap();
                tx.send(i).unwrap();
                drop(p);
            });
            while a.queued() < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        let mut got = Vec::new();
        for _ in 0..queued.len() {
            got.push(order.recv().await.unwrap());
        }
        // Interactive first; then default, where b's one goes before a's second; background last.
        assert_eq!(got, [5, 2, 4, 3, 0, 1]);
        assert_eq!((a.in_use(), a.queued()), (0, 0));
    }

    #[tokio::test]
    async fn a_cancelled_waiter_leaves_the_queue() {
        let a = Arc::new(LargeSlots::default());
        let r = "r";
        let (held, _) = a.acquire(r, &Who::default(), limit(1), Duration::from_secs(1), 4).await.unwrap();
        let who = Who::default();
        let wait = a.acquire(r, &who, limit(1), Duration::from_secs(10), 4);
        // Poll once so it queues, then drop it (a client that went away).
        let mut wait = Box::pin(wait);
        assert!(futures_util::poll!(wait.as_mut()).is_pending());
        assert_eq!(a.queued(), 1);
        drop(wait);
        assert_eq!(a.queued(), 0);
        drop(held);
        assert_eq!(a.in_use(), 0);
    }
}
