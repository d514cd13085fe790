//! The hold: whole new sessions wait for room in a queue ordered by
//! priority class, then turns between clients; the head goes as soon as
//! room opens, reserving it until its first turn is resident. A higher
//! class may take a lower one's room between its turns (`preempt_for`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::room::{self, Room};
use super::{Footprint, HeldWaiter, Reservation, Sessions, WaitStats};
use crate::capacity::QueuedSession;
use crate::domain_error::DomainError;
use crate::fleet::residents::Resident;
use crate::fleet::Replica;
use crate::policy::PrefixKey;
use crate::priority::{Class, Who};

/// A place in the held queue; leaving it (admitted, timed out, or the
/// client gone) is dropping it.
pub struct Ticket {
    sessions: Arc<Sessions>,
    id: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.sessions.lock();
        state.held.remove(self.id);
        state.evicted.retain(|t| *t != self.id);
        drop(state);
        // The next in line may go now.
        self.sessions.changed.notify_waiters();
    }
}

/// How a held session's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnded {
    /// Room opened after this long.
    Placed(Duration),
    /// `max_wait_ms` passed without room: admitted over capacity.
    OverCapacity(Duration),
}

impl WaitEnded {
    pub fn waited(self) -> Duration {
        match self {
            WaitEnded::Placed(d) | WaitEnded::OverCapacity(d) => d,
        }
    }
}

impl Sessions {
    /// A waiting session of `class` and `tokens` at the head of the hold
    /// gives it room (`priority.preempt`): on the candidate where the fewest
    /// of this instance's lower-class residents between turns free enough
    /// (`room::preemptible`), those are preempted: they count for nothing
    /// from now, and their next turns wait for room again. Returns the
    /// replica and the classes of the sessions preempted (empty: none).
    ///
    /// `boundary`: a session whose next turn is arriving now counts as
    /// between turns, whether or not its last turn's stream end was seen:
    /// its client has the answer (agents send the next turn on the last
    /// chunk, before the gateway sees the stream close), so this is its
    /// turn boundary. Its new turn has not started: nothing is cut.
    pub fn preempt_for(
        &self,
        candidates: &[Arc<Replica>],
        class: Class,
        tokens: u64,
        boundary: Option<PrefixKey>,
    ) -> Vec<(Arc<str>, Class)> {
        let between_turns = |id: &PrefixKey, s: &Resident| s.running == 0 || boundary == Some(*id);
        let rooms: Vec<(Room, Vec<(room::Occupant, bool)>)> = candidates
            .iter()
            .map(|r| {
                let room = self.room_of(r);
                let residents = r
                    .residents
                    .snapshot()
                    .into_iter()
                    .filter(|(_, s)| s.ours && !s.preempted)
                    .map(|(id, s)| {
                        let o = room::Occupant {
                            arrived_ms: s.arrived_ms,
                            continued_ms: s.continued_ms,
                            id,
                            tokens: s.counted_tokens(),
                            class: s.class,
                            client_sessions: 1,
                        };
                        (o, !between_turns(&id, &s))
                    })
                    .collect();
                (room, residents)
            })
            .collect();
        let footprint = |room: &Room| room.footprint(tokens);
        let Some(need) = rooms.first().map(|(room, _)| footprint(room)) else { return Vec::new() };
        let Some((i, victims)) = room::preemptible(&rooms, class, need) else { return Vec::new() };
        let replica = &candidates[i];
        // Still between turns (a turn may have begun since): else left alone.
        let out: Vec<(Arc<str>, Class)> = replica
            .residents
            .preempt(&victims, class, between_turns)
            .into_iter()
            .map(|c| (replica.id.clone(), c))
            .collect();
        if !out.is_empty() {
            // The held look again: the room is theirs now.
            self.changed.notify_waiters();
        }
        out
    }

    /// The class and tokens of the held session that goes next, if any.
    pub fn next_held(&self) -> Option<(Class, u64)> {
        self.lock().held.head().map(|w| (w.class, w.value.tokens))
    }

    /// Counts one finished wait.
    pub fn record_wait(&self, held: WaitEnded) {
        let mut w = self.waits.lock().unwrap_or_else(|e| e.into_inner());
        let ms = held.waited().as_millis() as u64;
        w.waited += 1;
        w.over_capacity += u64::from(matches!(held, WaitEnded::OverCapacity(_)));
        w.total_ms += ms;
        w.max_ms = w.max_ms.max(ms);
    }

    pub fn wait_stats(&self) -> WaitStats {
        *self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sessions waiting now.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// Waits until `admit` (the room now, judged by the caller) says yes
    /// while this session is first in line, or `max_wait_ms` passed. The
    /// line is ordered by class, then turns between clients (`priority.rs`):
    /// a later session passes only by a higher class or a client's turn.
    /// Past `max_held` waiting, the lowest class is refused first: the
    /// newcomer, unless the last in line is of a lower class (that one is
    /// refused instead). Dropping the future leaves the queue (a client
    /// that went away).
    pub async fn hold(
        self: &Arc<Self>,
        who: &Who,
        tokens: Footprint,
        admit: impl Fn(&[Footprint]) -> bool,
    ) -> Result<(WaitEnded, Reservation), DomainError> {
        let full = |waiting: usize| DomainError::Overloaded {
            message: format!("the replicas' KV is full and {waiting} new sessions already wait for room; retry later"),
            retry_after: Duration::from_millis(self.settings.max_wait_ms / 2).max(Duration::from_secs(1)),
        };
        let ticket = {
            let mut state = self.lock();
            if state.held.len() >= self.settings.max_held {
                match state.held.last().filter(|last| last.class < who.class).map(|last| last.id) {
                    Some(lower) => {
                        state.held.remove(lower);
                        state.evicted.push(lower);
                    }
                    None => return Err(full(state.held.len())),
                }
            }
            let waiter = HeldWaiter { tokens: tokens.whole, since_ms: crate::clock::now_ms() };
            let id = state.held.push(who.class, who.client.clone(), waiter);
            Ticket { sessions: self.clone(), id }
        };
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_millis(self.settings.max_wait_ms);
        // Judged and reserved under the lock: the next in line sees this
        // one's room taken, whichever worker it runs on.
        let reserved = Mutex::new(None);
        let first_with_room = || {
            let state = self.lock();
            if !state.held.contains(ticket.id) {
                return true; // turned away
            }
            let first = state.held.head().is_some_and(|h| h.id == ticket.id);
            if first && admit(&self.unplaced()) {
                *reserved.lock().unwrap_or_else(|e| e.into_inner()) = Some(self.reserve(&state, tokens));
                return true;
            }
            false
        };
        let placed = self.wait_for(deadline, first_with_room).await;
        if self.lock().evicted.contains(&ticket.id) {
            return Err(full(self.settings.max_held));
        }
        let held = match placed {
            true => WaitEnded::Placed(started.elapsed()),
            false => WaitEnded::OverCapacity(started.elapsed()),
        };
        let reservation = reserved
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or_else(|| self.reserve(&self.lock(), tokens));
        Ok((held, reservation))
    }

    /// Admits a new session at once when `admit` (given the tokens of the
    /// sessions admitted but not resident yet) says there is room; judged
    /// and reserved under one lock, so two arriving together do not both
    /// take the last room. None: it must wait (`hold`).
    /// The client's turn counts: its next waiter queues behind clients that
    /// had none (`FairQueue::served_at_once`).
    pub fn admit_at_once(
        self: &Arc<Self>,
        who: &Who,
        tokens: Footprint,
        admit: impl Fn(&[Footprint]) -> bool,
    ) -> Option<Reservation> {
        let mut state = self.lock();
        if !admit(&self.unplaced()) {
            return None;
        }
        state.held.served_at_once(who.class, &who.client);
        Some(self.reserve(&state, tokens))
    }

    /// One new session at a time chooses its replica and places its
    /// reservation there, holding this: two arriving together on two
    /// workers would otherwise both read the rooms before either was
    /// placed, and both go where the most room was. Never held across an
    /// await (a shared store's placement ranks in its own script instead).
    pub fn placing(&self) -> std::sync::MutexGuard<'_, ()> {
        self.placing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves room for a new session placed without the hold (it is
    /// off): nothing waits, but the next new session's placement counts
    /// this one where it goes until its first turn is resident, so two
    /// arriving together do not both go to the replica that had the most room.
    pub fn reserve_unheld(self: &Arc<Self>, tokens: Footprint) -> Reservation {
        let state = self.lock();
        self.reserve(&state, tokens)
    }

    /// Sessions waiting now, by class (`Class::ALL` order).
    pub fn held_by_class(&self) -> [usize; 3] {
        self.lock().held.by_class()
    }

    /// The held sessions in the order they go.
    pub fn queue(&self, now_ms: u64) -> Vec<QueuedSession> {
        let state = self.lock();
        state
            .held
            .in_order()
            .into_iter()
            .map(|w| QueuedSession {
                class: w.class,
                client: w.client.to_string(),
                tokens: w.value.tokens,
                waited_ms: now_ms.saturating_sub(w.value.since_ms),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::settings;
    use super::super::*;
    use crate::domain_error::DomainError;

    #[tokio::test(start_paused = true)]
    async fn the_held_wait_in_order_until_room_opens_or_the_wait_ends() {
        let s = Sessions::new(settings());
        let room = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let has_room = {
            let room = room.clone();
            move |_: &[Footprint]| room.load(std::sync::atomic::Ordering::SeqCst)
        };
        let first = tokio::spawn({
            let (s, has_room) = (s.clone(), has_room.clone());
            async move { s.hold(&Who::default(), Footprint::same(1), has_room).await }
        });
        tokio::task::yield_now().await;
        let second = tokio::spawn({
            let s = s.clone();
            async move { s.hold(&Who::default(), Footprint::same(1), |_: &[Footprint]| true).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(s.held(), 2, "the second waits behind the first, though it would fit");
        assert!(
            matches!(
                s.hold(&Who::default(), Footprint::same(1), |_: &[Footprint]| true).await,
                Err(DomainError::Overloaded { .. })
            ),
            "the queue is full"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        room.store(true, std::sync::atomic::Ordering::SeqCst);
        s.recheck();
        assert!(matches!(first.await.unwrap().unwrap().0, WaitEnded::Placed(_)));
        assert!(matches!(second.await.unwrap().unwrap().0, WaitEnded::Placed(_)));
        assert_eq!(s.held(), 0);
        // No room ever: over capacity at max_wait_ms.
        let (over, _) = s.hold(&Who::default(), Footprint::same(1), |_: &[Footprint]| false).await.unwrap();
        assert_eq!(over, WaitEnded::OverCapacity(Duration::from_millis(10_000)));
        // A waiter dropped mid-wait leaves the queue.
        let who = Who::default();
        let mut gone = Box::pin(s.hold(&who, Footprint::same(1), |_: &[Footprint]| false));
        assert!(futures_util::poll!(gone.as_mut()).is_pending());
        assert_eq!(s.held(), 1);
        drop(gone);
        assert_eq!(s.held(), 0);
    }
}
