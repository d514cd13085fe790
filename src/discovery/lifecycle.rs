//! What a discovery source's answer means for the replicas it found: the
//! lifecycle of a discovered replica, as a pure function of the answers and
//! the time (issue 21; the sources and the wiring to the operator come next).
//!
//! The rules, and why:
//! - A replica that appears is added; it is probed like any replica and
//!   takes traffic once healthy.
//! - A replica that disappears from its source (a pod starting to
//!   terminate) is drained at once: no new traffic, while its in-flight
//!   streams and the follow-ups naming responses it stored are still served.
//!   It is removed when idle, or after the grace period.
//! - A replica that reappears under the same name goes back to rotation
//!   (the caller keeps an operator's own disable or drain, which is keyed by
//!   name and outlives the disappearance).
//! - A replica is known to its source only once the operator accepted it
//!   (`accepted`): a name another replica holds (static, added through the
//!   API, another source's) is refused, and the addition is proposed again
//!   at every answer, so the replica appears as soon as the name is free.
//! - A failing source (DNS down, NXDOMAIN, an unreadable or malformed file)
//!   changes nothing: the last good answer stands and the source is stale.
//! - An answer that would take away more than a set fraction of the
//!   source's replicas at once (a half-empty answer from a resolver that is
//!   restarting, a file caught mid-write) is held, and applied only when the
//!   next answer says the same: fleets emptied by a discovery hiccup are the
//!   failure peer routers' users report most.

use std::collections::{BTreeMap, BTreeSet};

use crate::fleet::{ReplicaSpec, SourceAction};

/// The lifecycle's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// A drained replica that still has requests is removed after this anyway.
    pub grace_ms: u64,
    /// An answer removing more than this fraction of the source's replicas
    /// is applied only when seen twice in a row.
    pub max_removal_fraction: f64,
}

/// How an answer was taken.
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    Applied,
    /// The source failed; nothing changed.
    Failed(String),
    /// It would remove `would_remove` of `of` replicas at once: held until
    /// the next answer says the same (additions and changes were applied).
    Held {
        would_remove: usize,
        of: usize,
    },
}

/// One source's view of its replicas, kept between answers.
#[derive(Debug, Default, Clone)]
pub struct SourceState {
    /// By replica id: its spec, and since when it is gone from the source.
    known: BTreeMap<String, (ReplicaSpec, Option<u64>)>,
    /// The replicas of an answer that was held (seen once).
    held: Option<BTreeSet<String>>,
    /// Listed replicas whose addition was refused (their name is taken).
    refused: BTreeSet<String>,
    /// The last answer that was not a failure, and the last failure since.
    pub last_ok_ms: Option<u64>,
    pub failing_since_ms: Option<u64>,
}

impl SourceState {
    /// Replicas the source lists now (not gone).
    pub fn present(&self) -> usize {
        self.known.values().filter(|(_, gone)| gone.is_none()).count()
    }

    /// True while the last answer was a failure: the fleet is the last good answer's.
    pub fn stale(&self) -> bool {
        self.failing_since_ms.is_some()
    }

    /// Takes one answer of the source at `now_ms`.
    pub fn answer(
        &mut self,
        answer: Result<Vec<ReplicaSpec>, String>,
        now_ms: u64,
        settings: Settings,
    ) -> (Taken, Vec<SourceAction>) {
        let found = match answer {
            Ok(found) => found,
            Err(why) => {
                self.failing_since_ms.get_or_insert(now_ms);
                return (Taken::Failed(why), Vec::new());
            }
        };
        self.failing_since_ms = None;
        self.last_ok_ms = Some(now_ms);
        let mut actions = Vec::new();
        let found_ids: BTreeSet<String> = found.iter().map(|s| s.id.clone()).collect();
        self.refused.retain(|id| found_ids.contains(id));
        for spec in found {
            match self.known.get_mut(&spec.id) {
                // Known once accepted: refused (its name is taken), it is
                // proposed again with every answer.
                None => actions.push(SourceAction::Add(spec)),
                Some((known, gone)) => {
                    if gone.take().is_some() {
                        actions.push(SourceAction::Return(spec.id.clone()));
                    }
                    if *known != spec {
                        actions.push(SourceAction::Update(spec.clone()));
                        *known = spec;
                    }
                }
            }
        }
        let leaving: Vec<String> = self
            .known
            .iter()
            .filter(|(id, (_, gone))| gone.is_none() && !found_ids.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        let present = self.present();
        let too_many = !leaving.is_empty() && leaving.len() as f64 > settings.max_removal_fraction * present as f64;
        if too_many && self.held.as_ref() != Some(&found_ids) {
            self.held = Some(found_ids);
            return (Taken::Held { would_remove: leaving.len(), of: present }, actions);
        }
        self.held = None;
        for id in leaving {
            if let Some((_, gone)) = self.known.get_mut(&id) {
                *gone = Some(now_ms);
            }
            actions.push(SourceAction::Drain(id));
        }
        (Taken::Applied, actions)
    }

    /// The operator added `spec` (an `Add` this state proposed): from now
    /// on it is this source's replica.
    /// Returns true when it had been refused before (its name came free).
    pub fn accepted(&mut self, spec: ReplicaSpec) -> bool {
        let was_refused = self.refused.remove(&spec.id);
        self.known.insert(spec.id.clone(), (spec, None));
        was_refused
    }

    /// The operator refused to add `id` (its name is taken); true the first
    /// time in a row, so the caller says it once.
    pub fn refused(&mut self, id: &str) -> bool {
        self.refused.insert(id.to_string())
    }

    /// The removals due at `now_ms`: replicas gone from the source that are
    /// idle (`idle(id)`), or gone for longer than the grace period.
    pub fn due(&mut self, now_ms: u64, idle: impl Fn(&str) -> bool, settings: Settings) -> Vec<SourceAction> {
        let done: Vec<String> = self
            .known
            .iter()
            .filter_map(|(id, (_, gone))| {
                let since = (*gone)?;
                (idle(id) || now_ms.saturating_sub(since) >= settings.grace_ms).then(|| id.clone())
            })
            .collect();
        for id in &done {
            self.known.remove(id);
        }
        done.into_iter().map(SourceAction::Remove).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: Settings = Settings { grace_ms: 60_000, max_removal_fraction: 0.5 };

    fn specs(ids: &[&str]) -> Vec<ReplicaSpec> {
        ids.iter().map(|id| ReplicaSpec::new(id, &format!("http://{id}.engines.local:8000"))).collect()
    }

    /// One answer, every addition accepted (no name conflict).
    fn ok(s: &mut SourceState, ids: &[&str], now: u64) -> (Taken, Vec<SourceAction>) {
        let (verdict, actions) = s.answer(Ok(specs(ids)), now, SETTINGS);
        for a in &actions {
            if let SourceAction::Add(spec) = a {
                s.accepted(spec.clone());
            }
        }
        (verdict, actions)
    }

    #[test]
    fn a_refused_addition_is_proposed_again_until_accepted() {
        let mut s = SourceState::default();
        let add = |ids: &[&str]| specs(ids).into_iter().map(SourceAction::Add).collect::<Vec<_>>();
        // The name is taken: the operator refuses, the state does not know it.
        assert_eq!(s.answer(Ok(specs(&["e-1"])), 0, SETTINGS).1, add(&["e-1"]));
        assert!(s.refused("e-1"));
        assert_eq!(s.present(), 0);
        assert_eq!(s.answer(Ok(specs(&["e-1"])), 1_000, SETTINGS).1, add(&["e-1"]), "proposed again");
        assert!(!s.refused("e-1"), "said once");
        // The name came free and the operator added it: known from now on.
        assert!(s.accepted(specs(&["e-1"]).remove(0)), "it had been refused");
        assert_eq!(s.answer(Ok(specs(&["e-1"])), 2_000, SETTINGS).1, vec![]);
        assert_eq!(s.present(), 1);
    }

    #[test]
    fn appearances_are_added_and_a_departure_drains_then_removes_when_idle() {
        let mut s = SourceState::default();
        let (v, a) = ok(&mut s, &["e-1", "e-2", "e-3"], 0);
        assert_eq!(v, Taken::Applied);
        assert_eq!(a.len(), 3, "{a:?}");
        assert!(a.iter().all(|a| matches!(a, SourceAction::Add(_))));
        let (v, a) = ok(&mut s, &["e-1", "e-2"], 1_000);
        assert_eq!((v, a), (Taken::Applied, vec![SourceAction::Drain("e-3".into())]));
        // Still busy: stays until idle...
        assert!(s.due(2_000, |_| false, SETTINGS).is_empty());
        assert_eq!(s.due(3_000, |id| id == "e-3", SETTINGS), vec![SourceAction::Remove("e-3".into())]);
        assert_eq!(s.present(), 2);
        // ...or until the grace period is over.
        ok(&mut s, &["e-1"], 10_000);
        assert!(s.due(10_000 + 59_999, |_| false, SETTINGS).is_empty());
        assert_eq!(s.due(10_000 + 60_000, |_| false, SETTINGS), vec![SourceAction::Remove("e-2".into())]);
    }

    #[test]
    fn a_replica_that_comes_back_returns_to_rotation_and_a_changed_one_is_updated() {
        let mut s = SourceState::default();
        ok(&mut s, &["e-1", "e-2", "e-3"], 0);
        ok(&mut s, &["e-1", "e-2"], 1_000);
        let (_, a) = ok(&mut s, &["e-1", "e-2", "e-3"], 2_000);
        assert_eq!(a, vec![SourceAction::Return("e-3".into())]);
        assert!(s.due(3_000, |_| true, SETTINGS).is_empty(), "it is not gone any more");
        let mut moved = specs(&["e-1", "e-2", "e-3"]);
        moved[0].url = "http://e-1.engines.local:9000".into();
        let (_, a) = s.answer(Ok(moved.clone()), 4_000, SETTINGS);
        assert_eq!(a, vec![SourceAction::Update(moved[0].clone())]);
    }

    #[test]
    fn a_failing_source_changes_nothing_and_is_stale_until_it_answers() {
        let mut s = SourceState::default();
        ok(&mut s, &["e-1", "e-2"], 0);
        let (v, a) = s.answer(Err("SERVFAIL".into()), 1_000, SETTINGS);
        assert_eq!((v, a), (Taken::Failed("SERVFAIL".into()), vec![]));
        assert!(s.stale());
        s.answer(Err("timeout".into()), 2_000, SETTINGS);
        assert_eq!(s.failing_since_ms, Some(1_000), "stale since the first failure");
        assert_eq!(s.present(), 2, "the last good answer stands");
        let (v, a) = ok(&mut s, &["e-1", "e-2"], 3_000);
        assert_eq!((v, a), (Taken::Applied, vec![]));
        assert!(!s.stale());
    }

    #[test]
    fn an_answer_that_empties_half_the_fleet_is_applied_only_when_seen_twice() {
        let mut s = SourceState::default();
        ok(&mut s, &["e-1", "e-2", "e-3", "e-4"], 0);
        // A resolver restarting answers with one record, then with all four.
        let (v, a) = ok(&mut s, &["e-1"], 1_000);
        assert_eq!((v, a), (Taken::Held { would_remove: 3, of: 4 }, vec![]));
        let (v, a) = ok(&mut s, &["e-1", "e-2", "e-3", "e-4"], 2_000);
        assert_eq!((v, a), (Taken::Applied, vec![]), "nothing was lost");
        // Held once, then the same answer again: a real scale-down.
        assert!(matches!(ok(&mut s, &["e-1"], 3_000).0, Taken::Held { .. }));
        let (v, a) = ok(&mut s, &["e-1"], 4_000);
        assert_eq!(v, Taken::Applied);
        assert_eq!(a.len(), 3);
        // An empty answer (NXDOMAIN as "no records") is a removal of everything: held too.
        let (v, _) = ok(&mut s, &[], 5_000);
        assert_eq!(v, Taken::Held { would_remove: 1, of: 1 });
        // A removal within the fraction is applied at once, and an addition
        // in a held answer still happens.
        let mut t = SourceState::default();
        ok(&mut t, &["e-1", "e-2", "e-3", "e-4"], 0);
        assert_eq!(ok(&mut t, &["e-1", "e-2", "e-3"], 1_000).0, Taken::Applied);
        let (v, a) = ok(&mut t, &["e-5"], 2_000);
        assert!(matches!(v, Taken::Held { .. }));
        assert!(matches!(&a[..], [SourceAction::Add(spec)] if spec.id == "e-5"), "{a:?}");
    }
}
