//! The seed's test shapes, driven through the pure policy with no server.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

/// A decision with its spread pick made from `counter`, as the request path makes it.
#[derive(Debug)]
struct Picked {
    replica: usize,
    reason: RouteReason,
}

fn decide(
    mode: Mode,
    shape: &RequestShape,
    candidates: &[Candidate],
    pinned: Option<(Boundary, &str)>,
    named: Option<&str>,
    counter: &SpreadCounter,
) -> Option<Picked> {
    let d = super::decide(mode, Spread::Load, shape, candidates, pinned, named)?;
    Some(Picked { replica: d.candidate(candidates, Spread::Load, || counter.next()), reason: d.reason })
}

/// A tiny in-memory router: decide, then record the pin like the gateway does.
struct Router {
    mode: Mode,
    ids: Vec<&'static str>,
    down: Vec<bool>,
    pins: HashMap<PrefixKey, String>,
    counter: SpreadCounter,
}

impl Router {
    fn new(mode: Mode) -> Router {
        Router {
            mode,
            ids: vec!["a", "b"],
            down: vec![false, false],
            pins: HashMap::new(),
            counter: SpreadCounter::default(),
        }
    }

    fn route(&mut self, body: &str) -> Option<(&'static str, RouteReason)> {
        let shape = identity::extract(Endpoint::Chat, body.as_bytes(), IdentityBlocks::default()).unwrap();
        let candidates: Vec<Candidate> = self
            .ids
            .iter()
            .zip(&self.down)
            .map(|(id, down)| Candidate { routable: !down, ..Candidate::idle(id) })
            .collect();
        let pinned = longest(&shape, |k| self.pins.get(&k).cloned());
        let d = decide(
            self.mode,
            &shape,
            &candidates,
            pinned.as_ref().map(|(m, r)| (*m, r.as_str())),
            None,
            &self.counter,
        )?;
        let id = self.ids[d.replica];
        if let Some(key) = shape.pin_at {
            self.pins.insert(key, id.to_string());
        }
        Some((id, d.reason))
    }
}

/// The longest pinned boundary, as `PinTable::lookup_longest` finds it.
fn longest<R: AsRef<str>>(shape: &RequestShape, pin_of: impl Fn(PrefixKey) -> Option<R>) -> Option<(Boundary, R)> {
    shape.boundaries.iter().rev().find_map(|b| pin_of(b.key).map(|r| (*b, r)))
}

fn single(i: usize) -> String {
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":"question {i}"}}]}}"#)
}

/// Turn `n` of a conversation: the same leading messages, a longer history.
fn conversation(first: &str, turns: usize) -> String {
    let mut msgs = vec![format!(r#"{{"role":"user","content":"{first}"}}"#)];
    for t in 1..turns {
        msgs.push(format!(r#"{{"role":"assistant","content":"answer {t}"}}"#));
        msgs.push(format!(r#"{{"role":"user","content":"follow-up {t}"}}"#));
    }
    format!(r#"{{"model":"m","messages":[{}]}}"#, msgs.join(","))
}

#[test]
fn a_batch_of_single_turn_requests_alternates_across_replicas() {
    let mut r = Router::new(Mode::Shape);
    let picks: Vec<_> = (0..8).map(|i| r.route(&single(i)).unwrap()).collect();
    for pair in picks.windows(2) {
        assert_ne!(pair[0].0, pair[1].0, "consecutive spread picks must alternate");
    }
    assert!(picks.iter().all(|(_, reason)| *reason == RouteReason::Spread));
}

#[test]
fn a_growing_conversation_stays_with_its_first_turn_even_when_it_is_tiny() {
    for first in ["x", "a much longer opening message about the codebase"] {
        let mut r = Router::new(Mode::Shape);
        let (home, _) = r.route(&conversation(first, 1)).unwrap();
        for turn in 2..12 {
            // Unrelated single-turn traffic in between advances the counter.
            r.route(&single(turn)).unwrap();
            let (id, reason) = r.route(&conversation(first, turn)).unwrap();
            assert_eq!((id, reason), (home, RouteReason::Pinned), "turn {turn} of {first:?}");
        }
    }
}

#[test]
fn multi_message_requests_sharing_a_few_shot_prefix_are_spread() {
    let few_shot = (0..20)
        .map(|i| format!(r#"{{"role":"user","content":"example {i}"}},{{"role":"assistant","content":"label {i}"}}"#))
        .collect::<Vec<_>>()
        .join(",");
    let mut r = Router::new(Mode::Shape);
    let picks: Vec<_> = (0..6)
        .map(|i| {
            r.route(&format!(r#"{{"model":"m","messages":[{few_shot},{{"role":"user","content":"item {i}"}}]}}"#))
                .unwrap()
        })
        .collect();
    assert!(picks.iter().any(|p| p.0 == "a") && picks.iter().any(|p| p.0 == "b"));
    assert!(picks.iter().all(|p| p.1 == RouteReason::Spread));
}

#[test]
fn a_pin_on_a_down_replica_moves_and_sticks_to_its_new_home() {
    let mut r = Router::new(Mode::Shape);
    let (home, _) = r.route(&conversation("x", 1)).unwrap();
    let home_index = r.ids.iter().position(|i| *i == home).unwrap();
    r.down[home_index] = true;
    let (moved_to, reason) = r.route(&conversation("x", 2)).unwrap();
    assert_eq!(reason, RouteReason::Repinned);
    assert_ne!(moved_to, home);
    r.down[home_index] = false;
    assert_eq!(r.route(&conversation("x", 3)).unwrap(), (moved_to, RouteReason::Pinned));
}

#[test]
fn every_mode_picks_the_live_replica_and_none_when_all_are_down() {
    for mode in [Mode::Shape, Mode::RoundRobin, Mode::Affinity] {
        let mut r = Router::new(mode);
        r.down = vec![true, false];
        for i in 0..4 {
            assert_eq!(r.route(&single(i)).unwrap().0, "b", "{mode:?}");
            assert_eq!(r.route(&conversation("y", i + 1)).unwrap().0, "b", "{mode:?}");
        }
        r.down = vec![true, true];
        assert_eq!(r.route(&single(9)), None, "{mode:?}");
    }
}

#[test]
fn spread_prefers_a_replica_with_a_free_slot_but_pins_do_not_move() {
    let ids = ["a", "b"];
    let candidates = [Candidate { spare: false, ..Candidate::idle(ids[0]) }, Candidate::idle(ids[1])];
    let counter = SpreadCounter::default();
    for i in 0..4 {
        let shape = identity::extract(Endpoint::Chat, single(i).as_bytes(), IdentityBlocks::default()).unwrap();
        assert_eq!(decide(Mode::Shape, &shape, &candidates, None, None, &counter).unwrap().replica, 1);
    }
    let shape = identity::extract(Endpoint::Chat, conversation("q", 2).as_bytes(), IdentityBlocks::default()).unwrap();
    let d = decide(Mode::Shape, &shape, &candidates, longest(&shape, |_| Some("a")), None, &counter).unwrap();
    assert_eq!((d.replica, d.reason), (0, RouteReason::Pinned));
}

#[test]
fn roundrobin_alternates_even_within_a_conversation() {
    let mut r = Router::new(Mode::RoundRobin);
    let ids: Vec<_> = (1..5).map(|t| r.route(&conversation("z", t)).unwrap().0).collect();
    assert_eq!(ids, ["a", "b", "a", "b"]);
}

#[test]
fn affinity_sends_everything_sharing_a_first_message_to_one_replica() {
    let mut r = Router::new(Mode::Affinity);
    let sys = r#"{"role":"system","content":"big shared system prompt"}"#;
    let ids: Vec<_> = (0..6)
        .map(|i| {
            r.route(&format!(r#"{{"model":"m","messages":[{sys},{{"role":"user","content":"q{i}"}}]}}"#)).unwrap().0
        })
        .collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
}

#[test]
fn modes_are_selected_by_the_environment_variable() {
    // One test owns this variable, so parallel tests do not race on it.
    for (value, mode) in [("shape", Mode::Shape), ("roundrobin", Mode::RoundRobin), ("affinity", Mode::Affinity)] {
        std::env::set_var("PREFIXGATE_POLICY", value);
        assert_eq!(Mode::from_env(), Ok(Some(mode)));
    }
    std::env::set_var("PREFIXGATE_POLICY", "bogus");
    assert!(Mode::from_env().is_err());
    std::env::remove_var("PREFIXGATE_POLICY");
    assert_eq!(Mode::from_env(), Ok(None));
}

proptest! {
    #[test]
    fn spread_never_picks_an_unroutable_replica(routable in prop::collection::vec(any::<bool>(), 1..8), start in 0u64..1000, n in 1usize..20) {
        let ids: Vec<String> = (0..routable.len()).map(|i| format!("r{i}")).collect();
        let candidates: Vec<Candidate> = ids.iter().zip(&routable).map(|(id, r)| Candidate { routable: *r, ..Candidate::idle(id) }).collect();
        let counter = SpreadCounter(AtomicU64::new(start));
        let shape = RequestShape::default();
        let live = routable.iter().filter(|r| **r).count();
        let mut last = None;
        for _ in 0..n {
            match decide(Mode::Shape, &shape, &candidates, None, None, &counter) {
                None => prop_assert_eq!(live, 0),
                Some(d) => {
                    prop_assert!(routable[d.replica]);
                    if live > 1 { prop_assert_ne!(Some(d.replica), last, "the counter must alternate"); }
                    last = Some(d.replica);
                }
            }
        }
    }

    #[test]
    fn a_continuation_follows_its_pin_whenever_that_replica_is_routable(
        routable in prop::collection::vec(any::<bool>(), 1..6), pinned in 0usize..6, turns in 2usize..10,
    ) {
        let ids: Vec<String> = (0..routable.len()).map(|i| format!("r{i}")).collect();
        let pinned = pinned % ids.len();
        let candidates: Vec<Candidate> = ids.iter().zip(&routable).map(|(id, r)| Candidate { routable: *r, ..Candidate::idle(id) }).collect();
        let first = identity::extract(Endpoint::Chat, conversation("p", 1).as_bytes(), IdentityBlocks::default()).unwrap();
        let later = identity::extract(Endpoint::Chat, conversation("p", turns).as_bytes(), IdentityBlocks::default()).unwrap();
        let pin_key = first.pin_at.unwrap();
        let lookup = |k: PrefixKey| (k == pin_key).then(|| ids[pinned].clone());
        let pinned_match = longest(&later, lookup);
        let d = decide(Mode::Shape, &later, &candidates, pinned_match.as_ref().map(|(m, r)| (*m, r.as_str())), None, &SpreadCounter::default());
        match d {
            None => prop_assert!(routable.iter().all(|r| !r)),
            Some(d) if routable[pinned] => prop_assert_eq!((d.replica, d.reason), (pinned, RouteReason::Pinned)),
            Some(d) => {
                prop_assert_eq!(d.reason, RouteReason::Repinned);
                prop_assert!(routable[d.replica]);
            }
        }
    }
}

#[test]
fn a_session_key_decides_only_without_prefix_evidence() {
    let ids = ["a", "b"];
    let candidates: Vec<Candidate> = ids.iter().map(|id| Candidate::idle(id)).collect();
    let counter = SpreadCounter::default();
    // A compacted history (no pinned prefix) follows its session.
    let shape = identity::extract(Endpoint::Chat, single(1).as_bytes(), IdentityBlocks::default()).unwrap();
    for _ in 0..3 {
        let d = decide(Mode::Shape, &shape, &candidates, None, Some("b"), &counter).unwrap();
        assert_eq!((d.replica, d.reason), (1, RouteReason::Session));
    }
    // A prefix match wins over the session key.
    let shape = identity::extract(Endpoint::Chat, conversation("q", 2).as_bytes(), IdentityBlocks::default()).unwrap();
    let d = decide(Mode::Shape, &shape, &candidates, longest(&shape, |_| Some("a")), Some("b"), &counter).unwrap();
    assert_eq!((d.replica, d.reason), (0, RouteReason::Pinned));
    // The session's replica gone: spread, and the session moves.
    let gone = [Candidate::idle("a"), Candidate { routable: false, ..Candidate::idle("b") }];
    let d = decide(Mode::Shape, &shape, &gone, None, Some("b"), &counter).unwrap();
    assert_eq!((d.replica, d.reason), (0, RouteReason::Repinned));
    // The baselines ignore keys.
    let d = decide(Mode::RoundRobin, &shape, &candidates, None, Some("b"), &counter).unwrap();
    assert_eq!(d.reason, RouteReason::RoundRobin);
}

#[test]
fn spread_picks_follow_the_weights_and_weight_zero_is_a_last_resort() {
    let c = |id, routable, weight| Candidate { routable, weight, ..Candidate::idle(id) };
    let picks =
        |candidates: &[Candidate]| (0..8).map(|at| spread_pick(candidates, Spread::Counter, at)).collect::<Vec<_>>();
    let share = |picks: &[usize], i| picks.iter().filter(|p| **p == i).count();
    let weighted = [c("a", true, 3), c("b", true, 1)];
    let p = picks(&weighted);
    assert_eq!((share(&p, 0), share(&p, 1)), (6, 2), "{p:?}");
    let standby = [c("a", true, 1), c("b", true, 0)];
    assert!(picks(&standby).iter().all(|i| *i == 0));
    let only_standby = [c("a", false, 1), c("b", true, 0)];
    assert!(picks(&only_standby).iter().all(|i| *i == 1));
}

#[test]
fn a_load_spread_goes_to_the_least_work_per_weight_then_the_shared_prompts_holder_then_the_counter() {
    let c = |id, load, weight, holds_shared| Candidate { load, weight, holds_shared, ..Candidate::idle(id) };
    let picks =
        |candidates: &[Candidate], spread| (0..4).map(|at| spread_pick(candidates, spread, at)).collect::<Vec<_>>();
    // The least outstanding work, whatever the counter says.
    let busy = [c("a", 15_000, 1, false), c("b", 256, 1, false), c("c", 4_000, 1, false)];
    assert_eq!(picks(&busy, Spread::Load), vec![1, 1, 1, 1]);
    // The seed's counter reads no load.
    assert_eq!(picks(&busy, Spread::Counter), vec![0, 1, 2, 0]);
    // Per unit of weight: twice the weight carries twice the work.
    assert_eq!(picks(&[c("a", 1_000, 2, false), c("b", 600, 1, false)], Spread::Load), vec![0; 4]);
    // Equal work: the holder of the shared prompt; none holds it: the counter.
    let idle = [c("a", 0, 1, false), c("b", 0, 1, true), c("c", 0, 1, false)];
    assert_eq!(picks(&idle, Spread::Load), vec![1, 1, 1, 1]);
    let idle = [c("a", 0, 1, false), c("b", 0, 1, false)];
    assert_eq!(picks(&idle, Spread::Load), vec![0, 1, 0, 1]);
    // A holder with more work than another is not preferred.
    assert_eq!(picks(&[c("a", 0, 1, false), c("b", 300, 1, true)], Spread::Load), vec![0; 4]);
    // Weight 0 stays a last resort.
    assert_eq!(picks(&[c("a", 9_000, 1, false), c("b", 0, 0, false)], Spread::Load), vec![0; 4]);
}

#[test]
fn a_request_continues_from_where_a_served_one_ended_or_from_a_boundary_it_passed_only_going_further() {
    // Its own pin (went on 0): always.
    assert!(continues(3, 3, 0));
    assert!(continues(5, 3, 0));
    // A status line replaced: turn 1 went one boundary past, turn 2 three.
    assert!(continues(4, 1, 1));
    // A first turn after the same system prompt: no further than the other went.
    assert!(!continues(1, 0, 1));
    assert!(!continues(2, 0, 2));
}

#[test]
fn a_pinned_turn_moves_only_when_its_replicas_queue_outweighs_a_whole_prefill_elsewhere() {
    let c = |id, load, prefill_tps| Candidate { load, prefill_tps, ..Candidate::idle(id) };
    // 20,000 tokens queued at home, nothing elsewhere: a 5,000-token turn
    // (4,000 cached) waits longer than it would prefill whole on b.
    assert_eq!(moves(&[c("a", 20_000, None), c("b", 0, None)], 0, 5_000, 4_000), Some(1));
    // A long, warm context outweighs a short queue: it stays.
    assert_eq!(moves(&[c("a", 2_000, None), c("b", 0, None)], 0, 50_000, 49_000), None);
    // Measured rates decide: b prefills ten times slower, so the same queue is worth waiting for.
    assert_eq!(moves(&[c("a", 20_000, Some(1_000.0)), c("b", 0, Some(100.0))], 0, 5_000, 4_000), None);
    // Nowhere else to go: it stays; at the wall, never where it does not fit.
    assert_eq!(moves(&[c("a", 20_000, None), Candidate { routable: false, ..c("b", 0, None) }], 0, 5_000, 4_000), None);
    assert_eq!(moves(&[c("a", 20_000, None), Candidate { has_room: false, ..c("b", 0, None) }], 0, 5_000, 4_000), None);
    let three = [c("a", 20_000, None), Candidate { has_room: false, ..c("b", 0, None) }, c("c", 1_000, None)];
    assert_eq!(moves(&three, 0, 5_000, 4_000), Some(2), "the least loaded with room");

    // Through `decide`: moved with load placement, never with the counter.
    let mut shape = RequestShape { multi_unit: true, prompt_bytes: 20_000, ..Default::default() };
    shape.boundaries = vec![Boundary { key: 1, bytes: 16_000 }, Boundary { key: 2, bytes: 20_000 }];
    let m = Boundary { key: 1, bytes: 16_000 };
    let busy = [c("a", 20_000, None), c("b", 0, None)];
    let d = super::decide(Mode::Shape, Spread::Load, &shape, &busy, Some((m, "a")), None).unwrap();
    assert_eq!((d.target, d.reason), (Target::Candidate(1), RouteReason::Moved));
    let d = super::decide(Mode::Shape, Spread::Counter, &shape, &busy, Some((m, "a")), None).unwrap();
    assert_eq!((d.target, d.reason), (Target::Candidate(0), RouteReason::Pinned));
}
