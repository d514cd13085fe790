//! Issue 26: sessions at the KV wall. Two simulated cards of 20,000 tokens,
//! sessions of ~12,000: one fits on each, a third does not. New sessions
//! wait in a fair queue until a resident session idles out, and go where
//! the room opened; resident turns and one-shots never wait.

use std::time::Duration;

use crate::common::*;
use crate::shared::on_redis;
use prefixgate::config::{Config, SessionConfig};
use prefixgate::sessions::WallAt;
use serde_json::json;

fn card() -> prefixgate::sim::SimConfig {
    prefixgate::sim::SimConfig { kv_tokens: 20_000, ..fast_sim() }
}

fn holding(sims: &[&Sim], max_wait_ms: u64, max_held: usize) -> Config {
    let sessions = SessionConfig {
        idle_ms: 300,
        max_wait_ms,
        max_held,
        hold_min_tokens: Some(1_000),
        wall: WallAt::Declared,
        ..Default::default()
    };
    Config { sessions, ..test_config(sims) }
}

/// A family's turn `n` (1: its first): a ~12,000-token context of its own.
fn turn(family: &str, n: usize) -> Vec<(String, String)> {
    let mut m = vec![("system".to_string(), text(family, 12_000)), ("user".to_string(), format!("{family} task"))];
    for i in 1..n {
        m.push(("assistant".into(), format!("step {i}")));
        m.push(("user".into(), format!("go on {i}")));
    }
    m
}

async fn send(gw: &Gw, family: &str, n: usize) -> Reply {
    let m = turn(family, n);
    let refs: Vec<(&str, &str)> = m.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
    chat(gw, &refs).await
}

/// Two cards behind a gateway configured by `config` (over `holding`'s
/// settings), each holding one of the sessions "one" and "two", returned
/// with the replies of their first turns: the next new session does not fit.
async fn full_cards(config: impl FnOnce(&mut Config)) -> (Sim, Sim, Gw, Reply, Reply) {
    let (a, b) = (start_sim("a", card()).await, start_sim("b", card()).await);
    let mut c = holding(&[&a, &b], 10_000, 8);
    config(&mut c);
    let gw = start_gateway(c).await;
    capacity_read(&gw).await;
    let one = send(&gw, "one", 1).await;
    let two = send(&gw, "two", 1).await;
    (a, b, gw, one, two)
}

/// A family's first turn, sent on its own task (it may be held).
fn spawn_turn(gw: &Gw, family: &'static str) -> actix_web::rt::task::JoinHandle<Reply> {
    spawn_chat(gw, turn(family, 1))
}

/// One chat turn of `messages`, sent on its own task (it may wait).
fn spawn_chat(gw: &Gw, messages: Vec<(String, String)>) -> actix_web::rt::task::JoinHandle<Reply> {
    let base = gw.base.clone();
    actix_web::rt::spawn(async move {
        let refs: Vec<(&str, &str)> = messages.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        post(&format!("{base}/v1/chat/completions"), &chat_body(&refs, json!({}))).await
    })
}

/// Until the prober read every replica's 20,000-token capacity.
async fn capacity_read(gw: &Gw) {
    pool_read(gw, 20_000).await;
}

/// Until the prober read every replica's capacity as `tokens`.
async fn pool_read(gw: &Gw, tokens: u64) {
    wait_until("capacity read", Duration::from_secs(5), || {
        gw.gw.fleet.snapshot().iter().all(|r| r.kv_capacity() == Some(tokens))
    })
    .await;
}

fn held_ms(r: &Reply) -> Option<u64> {
    r.headers.get("x-prefixgate-held-ms").map(|v| v.to_str().unwrap().parse().unwrap())
}

fn events_of(gw: &Gw, kind: prefixgate::events::EventKind) -> usize {
    gw.gw.events.count(kind)
}

#[actix_web::test]
async fn a_new_session_waits_for_room_and_goes_where_it_opened_while_resident_turns_and_one_shots_never_wait() {
    let (_a, _b, gw, one, two) = full_cards(|_| {}).await;
    assert_eq!((one.status, two.status), (200, 200));
    assert_ne!(one.replica, two.replica, "the second session goes where the room is");
    assert_eq!((held_ms(&one), held_ms(&two)), (None, None));
    // A third does not fit: it waits, while the first keeps working.
    let third = spawn_turn(&gw, "three");
    wait_until("the third held", Duration::from_secs(5), || gw.gw.sessions.held() == 1).await;
    // The capacity view shows who is resident where, the room, the queue.
    let (s, report) = admin("GET", &format!("{}/admin/v1/capacity", gw.admin), None, None).await;
    assert_eq!(s, 200);
    assert_eq!(report["sessions"]["held"], 1, "{report}");
    for r in report["replicas"].as_array().unwrap() {
        assert_eq!(r["resident_sessions"], 1, "{report}");
        let room = r["room_tokens"].as_i64().unwrap();
        assert!((5_000..10_000).contains(&room), "{report}");
    }
    for n in 2..5 {
        let r = send(&gw, "one", n).await;
        assert_eq!((r.status, r.route.as_str(), held_ms(&r)), (200, "pinned", None), "turn {n} of a resident session");
        // The second session stays too: only the first will go quiet.
        send(&gw, "two", n).await;
    }
    let quick = chat(&gw, &[("user", "a one-shot question")]).await;
    assert_eq!((quick.status, held_ms(&quick)), (200, None), "a one-shot is not a session");
    assert_eq!(gw.gw.sessions.held(), 1, "still waiting: both sessions are busy");
    // The first goes quiet; the second keeps working: the room opens on
    // the first's replica, and the third goes there.
    let mut n = 5;
    while !third.is_finished() {
        assert_eq!(send(&gw, "two", n).await.status, 200);
        n += 1;
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    let third = third.await.unwrap();
    assert_eq!(third.status, 200, "{}", third.body);
    assert_eq!(third.replica, one.replica, "placed where the room opened");
    assert!(held_ms(&third).unwrap() >= 250, "held for {:?} ms", held_ms(&third));
    assert_eq!(events_of(&gw, prefixgate::events::EventKind::SessionHeld), 1);
    gw.stop().await;
}

#[actix_web::test]
async fn past_the_wait_a_session_is_admitted_over_capacity_and_past_the_bound_refused() {
    let (_a, _b, gw, _, _) = full_cards(|c| {
        (c.sessions.max_wait_ms, c.sessions.max_held) = (1_500, 1);
        c.sessions.idle_ms = 60_000; // nobody leaves
    })
    .await;
    let third = spawn_turn(&gw, "three");
    wait_until("the third held", Duration::from_secs(5), || gw.gw.sessions.held() == 1).await;
    // The queue holds one: a fourth is refused at once, clearly.
    let fourth = send(&gw, "four", 1).await;
    assert_eq!(fourth.status, 503, "{}", fourth.body);
    assert!(fourth.headers.contains_key("retry-after"));
    assert!(fourth.body["error"]["message"].as_str().unwrap().contains("wait for room"), "{}", fourth.body);
    // No room opens: the third goes over capacity after the wait, and says so.
    let third = third.await.unwrap();
    assert_eq!(third.status, 200);
    assert!(held_ms(&third).unwrap() >= 1_400);
    assert_eq!(events_of(&gw, prefixgate::events::EventKind::SessionOverCapacity), 1);
    let mut resp = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
    let text = String::from_utf8(resp.body().await.unwrap().to_vec()).unwrap();
    assert!(text.contains("prefixgate_sessions_over_capacity_total 1"), "{text}");
    assert!(text.contains(r#"prefixgate_session_hold_seconds_count{class="default"} 1"#), "{text}");
    assert!(text.contains(r#"prefixgate_held_sessions{class="default"} 0"#));
    gw.stop().await;
}

#[actix_web::test]
async fn a_held_client_that_goes_away_leaves_the_queue_at_once() {
    let (_a, _b, gw, _, _) = full_cards(|c| {
        c.sessions.max_wait_ms = 30_000;
        c.sessions.idle_ms = 60_000;
    })
    .await;
    let m = turn("three", 1);
    let refs: Vec<(&str, &str)> = m.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
    let impatient = awc::Client::builder().timeout(Duration::from_millis(500)).finish();
    let gave_up =
        impatient.post(format!("{}/v1/chat/completions", gw.base)).send_json(&chat_body(&refs, json!({}))).await;
    assert!(gave_up.is_err(), "the client timed out while held");
    wait_until("the queue emptied", Duration::from_secs(5), || gw.gw.sessions.held() == 0).await;
    gw.stop().await;
}

/// Several instances on one Redis place like one, and never admit two new
/// sessions into the same last room.
#[actix_web::test]
async fn two_instances_share_the_room_and_never_admit_into_the_same_last_room() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let (a, b) = (start_sim("a", card()).await, start_sim("b", card()).await);
    let config = |name: &str| {
        let mut c = holding(&[&a, &b], 10_000, 8);
        c.sessions.idle_ms = 60_000; // nobody leaves during the test
        on_redis(c, &redis, name)
    };
    let (g1, g2) = (start_gateway(config("gw1")).await, start_gateway(config("gw2")).await);
    for g in [&g1, &g2] {
        capacity_read(g).await;
    }
    // One session through each instance: the second instance sees the
    // first's and places its own on the other replica.
    let one = send(&g1, "one", 1).await;
    let two = send(&g2, "two", 1).await;
    assert_eq!((one.status, two.status), (200, 200));
    assert_ne!(one.replica, two.replica, "the fleet's room, not each instance's own");
    // Now both replicas are full: a new session on either instance waits.
    let third = spawn_turn(&g2, "three");
    wait_until("held on the second instance", Duration::from_secs(5), || g2.gw.sessions.held() == 1).await;
    third.abort();
    g1.stop().await;
    g2.stop().await;
}

/// The store refuses a second session into a replica's last room, atomically;
/// and of replicas that tie, it takes the one with the fewest sessions.
#[actix_web::test]
async fn the_store_admits_one_session_into_the_last_room_and_spreads_ties() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let store = prefixgate::store::open_url(&redis.url, "gw1").await.unwrap();
    let other = prefixgate::store::open_url(&redis.url, "gw2").await.unwrap();
    let on = |replica: &str, capacity: u64| vec![(replica.to_string(), Some(capacity))];
    assert_eq!(store.place_session(&on("a", 20_000), "s1", 12_000, 60_000, true).await.unwrap(), Some(0));
    assert_eq!(other.place_session(&on("a", 20_000), "s2", 12_000, 60_000, true).await.unwrap(), None, "no room");
    assert_eq!(other.place_session(&on("a", 20_000), "s3", 8_000, 60_000, true).await.unwrap(), Some(0), "it fits");
    assert_eq!(store.session_loads(&["a".into(), "b".into()]).await.unwrap(), vec![20_000, 0]);
    // Past the hold (capacity not enforced) it is placed anyway.
    assert_eq!(other.place_session(&on("a", 20_000), "s6", 8_000, 60_000, false).await.unwrap(), Some(0));
    // An entry that is not renewed expires, and its room opens.
    assert_eq!(store.place_session(&on("b", 20_000), "s4", 20_000, 1, true).await.unwrap(), Some(0));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(other.place_session(&on("b", 20_000), "s5", 20_000, 60_000, true).await.unwrap(), Some(0));
    // Ties: "c" and "d" (capacity unknown), each instance naming "c" first.
    let tie = vec![("c".to_string(), None), ("d".to_string(), None)];
    assert_eq!(store.place_session(&tie, "t1", 1_000, 60_000, false).await.unwrap(), Some(0));
    assert_eq!(other.place_session(&tie, "t2", 1_000, 60_000, false).await.unwrap(), Some(1), "the fewest sessions");
    assert_eq!(other.place_session(&tie, "t3", 1_000, 60_000, false).await.unwrap(), Some(0), "then the first");
}

/// A held session whose room opens on a replica that is draining is not
/// sent there: it is placed where room opens next, on a replica that takes
/// traffic.
#[actix_web::test]
async fn a_held_session_is_placed_again_when_the_replica_with_room_drains() {
    let (_a, _b, gw, one, two) = full_cards(|_| {}).await;
    assert_ne!(one.replica, two.replica);
    let third = spawn_turn(&gw, "three");
    wait_until("the third held", Duration::from_secs(5), || gw.gw.sessions.held() == 1).await;
    // The first's replica drains: its room opens when "one" idles out, but
    // it takes no new traffic. The second keeps working a while, then stops.
    gw.gw.operator.drain(&one.replica).await.unwrap();
    for n in 2..8 {
        send(&gw, "two", n).await;
        actix_web::rt::time::sleep(Duration::from_millis(100)).await;
        assert!(!third.is_finished(), "placed while no replica that takes traffic had room (turn {n})");
    }
    let third = third.await.unwrap();
    assert_eq!((third.status, third.replica.as_str()), (200, two.replica.as_str()), "{}", third.body);
    gw.stop().await;
}

/// Below the wall, three instances on one Redis place new sessions like one
/// gateway: four families whose turns each reach the next instance end two
/// on each replica (each instance's own counter used to pile them up).
#[actix_web::test]
async fn three_instances_place_new_sessions_like_one() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let mut gws = Vec::new();
    for i in 0..3 {
        let mut c = holding(&[&a, &b], 10_000, 8);
        c.sessions.idle_ms = 60_000;
        gws.push(start_gateway(on_redis(c, &redis, &format!("gw{i}"))).await);
    }
    for g in &gws {
        wait_until("capacity read", Duration::from_secs(5), || {
            g.gw.fleet.snapshot().iter().all(|r| r.kv_capacity().is_some())
        })
        .await;
    }
    let mut placed = Vec::new();
    for f in 0..4 {
        let m = [("system", text("shared", 700)), ("user", text(&format!("family {f}"), 500))];
        let refs: Vec<(&str, &str)> = m.iter().map(|(r, c)| (*r, c.as_str())).collect();
        let r = chat(&gws[f % 3], &refs).await;
        assert_eq!(r.status, 200);
        placed.push(r.replica);
    }
    let on_a = placed.iter().filter(|r| *r == "a").count();
    assert_eq!(on_a, 2, "{placed:?}");
    for g in gws {
        g.stop().await;
    }
}

/// With the shared store down, an instance places and holds from its own
/// view: new sessions are answered, none blocks on the store.
#[actix_web::test]
async fn with_the_store_down_new_sessions_go_on_from_the_instances_own_view() {
    let Some(mut redis) = crate::shared::Redis::start() else { return };
    let (a, b) = (start_sim("a", card()).await, start_sim("b", card()).await);
    let mut c = holding(&[&a, &b], 10_000, 8);
    c.store.url = Some(redis.url.clone());
    c.store.instance = Some("gw1".into());
    let gw = start_gateway(c).await;
    capacity_read(&gw).await;
    redis.kill();
    let started = std::time::Instant::now();
    let one = send(&gw, "one", 1).await;
    let two = send(&gw, "two", 1).await;
    assert_eq!((one.status, two.status), (200, 200));
    assert_ne!(one.replica, two.replica, "placed by this instance's own room");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    // Its own view still holds the third.
    let third = spawn_turn(&gw, "three");
    wait_until("the third held", Duration::from_secs(5), || gw.gw.sessions.held() == 1).await;
    third.abort();
    gw.stop().await;
}

/// Issue 31: a session's footprint is what it will hold. Agents sharing one
/// system prompt start at ~3,000 tokens and grow to ~15,000. Once one such
/// session ended, the gateway knows: two new ones fill the two 20,000-token
/// cards, and a third waits, though its first turn alone would fit.
#[actix_web::test]
async fn new_sessions_are_admitted_at_what_their_kind_grew_to() {
    let (a, b) = (start_sim("a", card()).await, start_sim("b", card()).await);
    let gw = start_gateway(holding(&[&a, &b], 10_000, 8)).await;
    capacity_read(&gw).await;
    let system = text("the shared agent system prompt", 1_000);
    let turn = |family: &str, n: usize| {
        let mut m = vec![("system".to_string(), system.clone()), ("user".to_string(), text(family, 2_000))];
        for i in 1..n {
            m.push(("assistant".into(), format!("{family} step {i}")));
            m.push(("user".into(), text(&format!("{family} tool output {i}"), 4_000)));
        }
        m
    };
    let send = |family: &str, n: usize| spawn_chat(&gw, turn(family, n));
    // The first agent grows to ~15,000 tokens over four turns, then ends.
    for n in 1..=4 {
        assert_eq!(send("first", n).await.unwrap().status, 200);
    }
    wait_until("the first session ended and was learned", Duration::from_secs(10), || {
        gw.gw.sessions.projection_figures().sessions_learned == 1
    })
    .await;
    let learned = gw.gw.sessions.projection_figures().fleet_tokens.unwrap();
    assert!((14_000..17_000).contains(&learned), "projected {learned}");
    // Two new agents: one per card, each counted at its projection.
    let (one, two) = (send("second", 1).await.unwrap(), send("third", 1).await.unwrap());
    assert_eq!((one.status, two.status), (200, 200));
    assert_ne!(one.replica, two.replica, "each to the card with the most room");
    assert_eq!((held_ms(&one), held_ms(&two)), (None, None));
    let (_, capacity) = admin("GET", &format!("{}/admin/v1/capacity", gw.admin), None, None).await;
    for r in capacity["replicas"].as_array().unwrap() {
        assert_eq!(r["resident_tokens"].as_u64(), Some(learned), "{r}");
    }
    assert_eq!(capacity["sessions"]["projected_tokens"].as_u64(), Some(learned));
    // A third: ~3,000 tokens would fit beside either, ~15,000 does not.
    // Where holding it whole costs less than admitting it to pause at the
    // crossing (issue 40: each card measured a slow prefill, so re-prefilling
    // its context after a pause would cost more than the turns it could
    // overlap; `room::admit_and_pause`), it waits.
    for id in ["a", "b"] {
        gw.gw.fleet.get(id).unwrap().residents.observe_prefill(1_000, Duration::from_secs(10));
    }
    let fourth = send("fourth", 1);
    wait_until("the fourth held", Duration::from_secs(5), || gw.gw.sessions.held() == 1).await;
    // Room opens when one of the two idles out; then it goes.
    let fourth = fourth.await.unwrap();
    assert_eq!(fourth.status, 200);
    assert!(held_ms(&fourth).is_some_and(|ms| ms > 0), "it says it waited");
    gw.stop().await;
}

/// Issue 31: when a replica's sessions outgrow its KV anyway (nothing
/// learned yet), the youngest one's next turn pauses at its boundary until
/// room opens, and says so; the older one's turns go on, never paused.
#[actix_web::test]
async fn the_youngest_sessions_turn_pauses_when_its_replica_is_over_its_pool_and_resumes_when_room_opens() {
    let a = start_sim("a", card()).await;
    let gw = start_gateway(holding(&[&a], 10_000, 8)).await;
    capacity_read(&gw).await;
    // Turn n of a family: its own ~6,000-token prompt, then 3,000 new tokens a turn.
    let turn = |family: &str, n: usize| {
        let mut m = vec![("system".to_string(), text(family, 6_000)), ("user".to_string(), "go".to_string())];
        for i in 1..n {
            m.push(("assistant".into(), format!("step {i}")));
            m.push(("user".into(), text(&format!("{family} output {i}"), 3_000)));
        }
        m
    };
    let send = |family: &str, n: usize| spawn_chat(&gw, turn(family, n));
    // Both fit at first: ~6,000 + ~6,000 of 20,000.
    for r in [send("older", 1).await.unwrap(), send("younger", 1).await.unwrap()] {
        assert_eq!((r.status, held_ms(&r)), (200, None));
    }
    // The older grows to ~9,000: still within the pool, nobody pauses.
    let r = send("older", 2).await.unwrap();
    assert_eq!((r.status, held_ms(&r)), (200, None));
    // The younger's next turn (~12,000) would cross it: it pauses.
    let younger = send("younger", 3);
    wait_until("the younger paused", Duration::from_secs(5), || gw.gw.sessions.paused() == 1).await;
    // The older goes on meanwhile: it is not the youngest, it never pauses.
    let r = send("older", 3).await.unwrap();
    assert_eq!((r.status, held_ms(&r)), (200, None), "an older session's turn never pauses");
    assert!(!younger.is_finished(), "still paused while the older one is resident");
    // The older stops; once it idles out, room opens and the younger goes, warm.
    let younger = younger.await.unwrap();
    assert_eq!(younger.status, 200);
    assert!(held_ms(&younger).is_some_and(|ms| ms >= 300), "it says it paused: {:?}", held_ms(&younger));
    assert_eq!(gw.gw.events.count(prefixgate::events::EventKind::SessionPaused), 1);
    assert!(cached_tokens(&younger) > 0, "it resumed where its prefix was");
    let metrics = gw.gw.metrics.encode();
    assert!(
        metrics.contains(r#"prefixgate_session_turns_paused_total{class="default"} 1"#),
        "the pause is counted, by its session's class"
    );
    gw.stop().await;
}

/// Issue 31: the engine's own word, before the turn runs. A session's turn
/// bound for a pool of tokens is counted by the engine (`POST /tokenize`):
/// the gateway's figure for it is the engine's count (what its usage then
/// reports), not an estimate from bytes, which here falls short (the
/// engine's template adds a line break a message that the bytes do not).
#[actix_web::test]
async fn a_session_turn_bound_for_a_pool_is_counted_by_the_engine_before_it_runs() {
    // A pool the session nearly fills: near the wall, where a count matters.
    let a = start_sim("a", prefixgate::sim::SimConfig { kv_tokens: 7_008, ..card() }).await;
    let mut config = holding(&[&a], 10_000, 8);
    config.sessions.idle_ms = 60_000; // resident still when it is looked at, however loaded the machine
    let gw = start_gateway(config).await;
    pool_read(&gw, 7_008).await;
    let mut messages = vec![("system".to_string(), text("counted", 6_000))];
    for i in 0..40 {
        messages.push(("user".into(), format!("question {i}")));
        messages.push(("assistant".into(), format!("answer {i}")));
    }
    messages.push(("user".into(), "go".into()));
    let bytes: usize = messages.iter().map(|(role, content)| role.len() + content.len()).sum();
    let r = spawn_chat(&gw, messages).await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(a.state.tokenize_requests.load(std::sync::atomic::Ordering::Relaxed), 1);
    let engine = r.body["usage"]["prompt_tokens"].as_u64().unwrap();
    let replica = gw.gw.fleet.get("a").unwrap();
    let resident = replica.residents.snapshot().iter().map(|(_, s)| s.tokens).collect::<Vec<_>>();
    assert_eq!(resident, vec![engine], "the session counts at the engine's figure");
    let (_, replicas) = admin("GET", &format!("{}/admin/v1/replicas", gw.admin), None, None).await;
    assert_eq!(replicas[0]["engine_counts"], json!(true));
    // An estimate at the default ratio falls short by a token in four messages.
    assert!(engine >= prefixgate::tokens::estimate_tokens(bytes) + 15, "{engine} tokens");
    gw.stop().await;
}

/// Issue 40: below the wall, nothing is asked. A session whose turns keep
/// its replica's load well under the pool (with an eighth more for an
/// estimate's shortfall) goes on with estimates: no count could change a
/// decision there, and each would cost its turn a round trip. Once its
/// turns bring the load near the pool, they are counted.
#[actix_web::test]
async fn below_the_wall_no_count_is_asked_and_near_it_every_turn_is_counted() {
    let a = start_sim("a", card()).await;
    let gw = start_gateway(holding(&[&a], 10_000, 8)).await;
    capacity_read(&gw).await;
    let asked = || a.state.tokenize_requests.load(std::sync::atomic::Ordering::Relaxed);
    let mut messages = vec![("system".to_string(), text("below", 2_000)), ("user".to_string(), "go".to_string())];
    for turn in 0..3 {
        assert_eq!(spawn_chat(&gw, messages.clone()).await.unwrap().status, 200);
        messages.push(("assistant".into(), format!("step {turn}")));
        messages.push(("user".into(), text(&format!("more {turn}"), 500)));
    }
    assert_eq!(asked(), 0, "a session at ~3,500 of 20,000 tokens is never counted");
    // Its context grows to ~19,000 tokens: near the pool, each turn is counted.
    messages.push(("user".into(), text("a large tool result", 15_500)));
    for turn in 0..2 {
        assert_eq!(spawn_chat(&gw, messages.clone()).await.unwrap().status, 200);
        assert_eq!(asked(), turn + 1);
        messages.push(("assistant".into(), "ok".into()));
        messages.push(("user".into(), "again".into()));
    }
    gw.stop().await;
}

/// An engine without `POST /tokenize` is asked once: its turns go on with
/// estimates, and it is not asked again.
#[actix_web::test]
async fn an_engine_that_counts_no_prompts_is_asked_once() {
    // Sessions of ~12,000 tokens on a 12,800-token pool: near the wall, where counts are asked.
    let a = start_sim("a", prefixgate::sim::SimConfig { no_tokenize: true, kv_tokens: 12_800, ..card() }).await;
    let gw = start_gateway(holding(&[&a], 10_000, 8)).await;
    pool_read(&gw, 12_800).await;
    for n in 1..=3 {
        let r = send(&gw, "uncounted", n).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(a.state.tokenize_requests.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(!gw.gw.fleet.get("a").unwrap().calibration.engine_counts(u64::MAX));
    let (status, replicas) = admin("GET", &format!("{}/admin/v1/replicas", gw.admin), None, None).await;
    assert_eq!((status, &replicas[0]["engine_counts"]), (200, &json!(false)), "the operator sees estimates only");
    gw.stop().await;
}

/// Issue 31: the engine's own word. A pinned turn that finds almost none of
/// the prefix it should have (a one-shot evicted it) shows the replica did
/// not keep the session: it takes no new session above that load, though
/// its capacity says there is room, until room opens below it.
#[actix_web::test]
async fn a_receipt_that_shows_a_lost_prefix_closes_the_replica_to_new_sessions() {
    let a = start_sim("a", card()).await;
    let gw = start_gateway(holding(&[&a], 10_000, 8)).await;
    capacity_read(&gw).await;
    let first = send(&gw, "kept", 1).await;
    assert_eq!(first.status, 200);
    // A one-shot of ~19,000 tokens: the 20,000-token pool evicts the session's prefix.
    let one_shot = chat(&gw, &[("user", &text("a large one-shot", 19_000))]).await;
    assert_eq!(one_shot.status, 200);
    let second = send(&gw, "kept", 2).await;
    assert_eq!((second.status, second.route.as_str()), (200, "pinned"));
    assert!(cached_tokens(&second) < 1_000, "the prefix was lost: {} cached", cached_tokens(&second));
    assert_eq!(events_of(&gw, prefixgate::events::EventKind::KvWallSeen), 1);
    let wall = gw.gw.fleet.get("a").unwrap().residents.evidence.wall().expect("a wall seen");
    assert!((12_000..13_000).contains(&wall), "the load it was lost at: {wall}");
    // A new ~6,000-token session would fit the capacity (20,000), not the wall.
    let newcomer = spawn_turn_of(&gw, "newcomer", 6_000);
    wait_until("the newcomer held", Duration::from_secs(5), || gw.gw.sessions.held() == 1).await;
    // The session idles out below the wall: room opens, the newcomer goes.
    let newcomer = newcomer.await.unwrap();
    assert_eq!(newcomer.status, 200);
    assert!(held_ms(&newcomer).is_some());
    gw.stop().await;
}

/// Two instances, gw1 and gw2, on `redis`, holding sessions on `a` (`holding`'s settings).
async fn two_holding_instances(redis: &crate::shared::Redis, a: &Sim) -> (Gw, Gw) {
    let config = |name: &str| on_redis(holding(&[a], 10_000, 8), redis, name);
    (start_gateway(config("gw1")).await, start_gateway(config("gw2")).await)
}

/// Several instances behave as one at the wall: a wall one instance read
/// from a receipt is every instance's within a heartbeat, with a
/// `kv_wall_seen` event that names where it was seen; a new session sent
/// to the other instance waits below it as it would on the first.
#[actix_web::test]
async fn a_wall_one_instance_saw_holds_new_sessions_on_every_instance() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let a = start_sim("a", card()).await;
    let (g1, g2) = two_holding_instances(&redis, &a).await;
    for g in [&g1, &g2] {
        capacity_read(g).await;
    }
    assert_eq!(send(&g1, "kept", 1).await.status, 200);
    // A one-shot evicts the session's prefix; its next turn on gw1 finds it lost.
    assert_eq!(chat(&g1, &[("user", &text("a large one-shot", 19_000))]).await.status, 200);
    let second = send(&g1, "kept", 2).await;
    assert!(cached_tokens(&second) < 1_000, "the prefix was lost: {} cached", cached_tokens(&second));
    let seen = g1.gw.fleet.get("a").unwrap().residents.evidence.wall().expect("gw1 saw the wall");
    let other = g2.gw.fleet.get("a").unwrap();
    wait_until("gw2 holds gw1's wall", Duration::from_secs(5), || other.residents.evidence.wall() == Some(seen)).await;
    let kind = Some(prefixgate::events::EventKind::KvWallSeen);
    let all = g2.gw.events.query(&prefixgate::events::EventFilter { kind, limit: 10, ..Default::default() });
    let said: Vec<_> = all.iter().filter(|e| e.instance.as_deref() == Some("gw2")).collect();
    assert_eq!(said.len(), 1, "said once by gw2: {all:?}");
    assert!(said[0].detail.contains("instance gw1"), "{}", said[0].detail);
    // A new ~6,000-token session fits the capacity, not the wall: held on gw2 too.
    let newcomer = spawn_turn_of(&g2, "newcomer", 6_000);
    wait_until("the newcomer held on gw2", Duration::from_secs(5), || g2.gw.sessions.held() == 1).await;
    let newcomer = newcomer.await.unwrap();
    assert_eq!(newcomer.status, 200);
    assert!(held_ms(&newcomer).is_some(), "it waited for room below the wall");
    g1.stop().await;
    g2.stop().await;
}

/// A family's first turn of about `tokens`, sent on its own task (it may be held).
fn spawn_turn_of(gw: &Gw, family: &str, tokens: usize) -> actix_web::rt::task::JoinHandle<Reply> {
    spawn_chat(gw, vec![("system".into(), text(family, tokens)), ("user".into(), format!("{family} task"))])
}

/// Issue 31: a session that idles out on the instance that served it is
/// given back to the fleet at once: its entry leaves the shared store and
/// the other instance forgets it within milliseconds, not when the entry
/// would have expired (a flush interval and `STORE_SLACK_MS` later).
#[actix_web::test]
async fn a_released_session_reaches_another_instance_in_milliseconds() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let a = start_sim("a", card()).await;
    let (g1, g2) = two_holding_instances(&redis, &a).await;
    let store = prefixgate::store::open_url(&redis.url, "reader").await.unwrap();
    let load = || async { store.session_loads(&["a".to_string()]).await.unwrap()[0] };
    // A session on gw1; gw1 keeps it in the store, and gw2 knows it from its pins.
    for n in 1..=2 {
        assert_eq!(send(&g1, "one", n).await.status, 200);
    }
    let session = g1.gw.sessions.kept(prefixgate::clock::now_ms())[0].clone();
    let key = u128::from_str_radix(&session.session, 16).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while load().await == 0 || !g2.gw.sessions.is_resident(key) {
        assert!(std::time::Instant::now() < deadline, "the session never reached the store and gw2");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // It idles out on gw1 (300 ms after its turn, at most a sweep later).
    wait_until("idled out on gw1", Duration::from_secs(5), || !g1.gw.sessions.is_resident(key)).await;
    let released = std::time::Instant::now();
    assert!(session.until_ms > prefixgate::clock::now_ms() + 500, "its entry would have lived on");
    // Gone from the store and from gw2 at once, not at its expiry.
    while load().await != 0 || g2.gw.sessions.is_resident(key) {
        assert!(released.elapsed() < Duration::from_millis(300), "the release did not propagate at once");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    g1.stop().await;
    g2.stop().await;
}

/// Issue 31: ties are broken fleet-wide. Two instances, each with its own
/// spread counter, whose first picks are the same replica: the hold off, a
/// new session through each still lands one on each replica, because the
/// store places a new session by its own count (the most room, then the
/// fewest sessions), not by either instance's view.
#[actix_web::test]
async fn new_sessions_at_two_instances_spread_over_replicas_that_tie() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let (a, b) = (start_sim("a", card()).await, start_sim("b", card()).await);
    let config = |name: &str| on_redis(test_config(&[&a, &b]), &redis, name); // the hold off
    let (g1, g2) = (start_gateway(config(TIED.0)).await, start_gateway(config(TIED.1)).await);
    for g in [&g1, &g2] {
        capacity_read(g).await;
    }
    for round in 0..3 {
        let one = send(&g1, &format!("one {round}"), 1).await;
        let two = send(&g2, &format!("two {round}"), 1).await;
        assert_eq!((one.status, two.status), (200, 200));
        assert_ne!(one.replica, two.replica, "round {round}: one new session on each replica");
    }
    g1.stop().await;
    g2.stop().await;
}

/// Issue 31: with the hold off, placement by room still counts a new
/// session from its admission. Two arriving together at one instance, on
/// replicas of unequal room (20,000 and 16,000 tokens), do not both go
/// where the most room was: the second sees the first's reservation there.
#[actix_web::test]
async fn with_the_hold_off_two_new_sessions_arriving_together_take_one_replica_each() {
    let a = start_sim("a", card()).await;
    let b = start_sim("b", prefixgate::sim::SimConfig { kv_tokens: 16_000, ..fast_sim() }).await;
    let gw = start_gateway(test_config(&[&a, &b])).await; // the hold off
    wait_until("capacity read", Duration::from_secs(5), || {
        gw.gw.fleet.snapshot().iter().all(|r| r.kv_capacity().is_some())
    })
    .await;
    let (one, two) = (spawn_turn(&gw, "one"), spawn_turn(&gw, "two"));
    let (one, two) = (one.await.unwrap(), two.await.unwrap());
    assert_eq!((one.status, two.status), (200, 200));
    let mut went = [one.replica, two.replica];
    went.sort();
    assert_eq!(went, ["a".to_string(), "b".to_string()], "one new session on each replica");
    gw.stop().await;
}

/// Issue 31: the engine's own word, when all it says is a full pool. A
/// vLLM-like replica that reports no preemption counter: one session of
/// ~19,500 tokens decoding on a 20,000-token pool, and another request
/// waiting for room in the engine. The prober reads
/// `vllm:kv_cache_usage_perc` (the running request's blocks) at 0.95 or
/// more with a request waiting, and the wall is set at the load resident
/// then, with a `kv_wall_seen` event that names the gauge.
#[actix_web::test]
async fn a_full_pool_with_requests_waiting_sets_the_wall() {
    let quiet = prefixgate::sim::SimConfig { kv_tokens: 20_000, no_preemption_counter: true, ..slow_decoder(20.0) };
    let a = start_sim("a", quiet).await;
    let gw = start_gateway(test_config(&[&a])).await; // the hold off: both go at once
    capacity_read(&gw).await;
    let replica = gw.gw.fleet.get("a").unwrap();
    let url = format!("{}/v1/chat/completions", gw.base);
    let body = |family: &str, tokens: usize| {
        let m = [("system", text(family, tokens)), ("user", format!("{family} task"))];
        let refs: Vec<(&str, &str)> = m.iter().map(|(r, c)| (*r, c.as_str())).collect();
        chat_body(&refs, json!({"max_tokens": 20}))
    };
    let (big, small) = (body("big", 19_500), body("small", 2_000));
    let (u1, u2) = (url.clone(), url.clone());
    let first = actix_web::rt::spawn(async move { post(&u1, &big).await });
    wait_until("the big one runs", Duration::from_secs(5), || !replica.residents.is_empty()).await;
    // Until the engine holds its blocks (its pool full), so the second waits in it.
    let pool_full = || async {
        let metrics = client().get(format!("{}/metrics", a.url)).send().await.unwrap().body().await.unwrap();
        let text = String::from_utf8(metrics.to_vec()).unwrap();
        let usage = text.lines().find(|l| l.starts_with("vllm:kv_cache_usage_perc")).unwrap();
        usage.rsplit(' ').next().unwrap().parse::<f64>().unwrap() >= 0.95
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !pool_full().await {
        assert!(std::time::Instant::now() < deadline, "the big one never filled the pool");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = actix_web::rt::spawn(async move { post(&u2, &small).await });
    wait_until("the wall seen", Duration::from_secs(10), || replica.residents.evidence.wall().is_some()).await;
    let load: u64 = replica.residents.snapshot().iter().map(|(_, r)| r.tokens).sum();
    assert!(load >= 21_000, "both resident when it was read: {load}");
    assert_eq!(replica.residents.evidence.wall(), Some(load));
    let kind = Some(prefixgate::events::EventKind::KvWallSeen);
    let said = gw.gw.events.query(&prefixgate::events::EventFilter { kind, limit: 100, ..Default::default() });
    assert_eq!(said.len(), 1, "once: the same full pool read again says nothing new");
    assert!(said[0].detail.contains("vllm:kv_cache_usage_perc"), "{}", said[0].detail);
    assert_eq!((first.await.unwrap().status, second.await.unwrap().status), (200, 200));
    gw.stop().await;
}

/// Two instance names whose spread counters start on the same replica.
const TIED: (&str, &str) = ("gw-a", "gw-b");

/// Issue 31: the engine's own word. A vLLM-like replica that ran out of
/// KV with the sessions resident now says so in `vllm:num_preemptions_total`
/// (the simulator counts a sequence that found its pool full); the prober
/// reads it while the replica is busy, and the replica's wall is set at the
/// load it happened at, with a `kv_wall_seen` event.
#[actix_web::test]
async fn engine_preemptions_set_the_wall_at_the_load_they_happened_at() {
    let slow = prefixgate::sim::SimConfig { kv_tokens: 20_000, ..slow_decoder(20.0) };
    let a = start_sim("a", slow).await;
    let gw = start_gateway(test_config(&[&a])).await; // the hold off: both go at once
    capacity_read(&gw).await;
    let replica = gw.gw.fleet.get("a").unwrap();
    // Two sessions of ~12,000 tokens on a 20,000-token pool: the second
    // waits inside the engine for the first's blocks.
    let url = format!("{}/v1/chat/completions", gw.base);
    let body = |family: &str| {
        let m = turn(family, 1);
        let refs: Vec<(&str, &str)> = m.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        chat_body(&refs, json!({"max_tokens": 10}))
    };
    let (one, two) = (body("one"), body("two"));
    let (u1, u2) = (url.clone(), url.clone());
    let first = actix_web::rt::spawn(async move { post(&u1, &one).await });
    let second = actix_web::rt::spawn(async move { post(&u2, &two).await });
    wait_until("the wall seen", Duration::from_secs(10), || replica.residents.evidence.wall().is_some()).await;
    let load: u64 = replica.residents.snapshot().iter().map(|(_, r)| r.tokens).sum();
    assert!(load >= 20_000, "both sessions resident: {load}");
    assert_eq!(replica.residents.evidence.wall(), Some(load));
    assert_eq!(events_of(&gw, prefixgate::events::EventKind::KvWallSeen), 1);
    assert_eq!((first.await.unwrap().status, second.await.unwrap().status), (200, 200));
    gw.stop().await;
}

/// Issue 40: with the hold off, new sessions that arrive together still see
/// each other, when every replica already holds an idle session (no room
/// anywhere, the replicas tie): the first one's reservation tips the
/// second to the other replica. Round after round, with all of them
/// staying resident, on `sim`'s kind of KV.
async fn with_the_hold_off_pairs_arriving_together_spread_over_full_replicas(sim: prefixgate::sim::SimConfig) {
    let (a, b) = (start_sim("a", sim.clone()).await, start_sim("b", sim).await);
    let mut config = test_config(&[&a, &b]); // the hold off
    config.sessions.idle_ms = 600_000;
    let gw = start_gateway(config).await;
    capacity_read(&gw).await;
    let first = [send(&gw, "first-a", 1).await.replica, send(&gw, "first-b", 1).await.replica];
    assert_ne!(first[0], first[1], "one idle session on each replica");
    for round in 0..10 {
        let names: [&'static str; 2] =
            [Box::leak(format!("r{round}-x").into_boxed_str()), Box::leak(format!("r{round}-y").into_boxed_str())];
        let (x, y) = (spawn_turn(&gw, names[0]), spawn_turn(&gw, names[1]));
        let (x, y) = (x.await.unwrap(), y.await.unwrap());
        assert_eq!((x.status, y.status), (200, 200));
        assert_ne!(x.replica, y.replica, "round {round}: the pair went to one replica");
    }
    gw.stop().await;
}

#[actix_web::test]
async fn with_the_hold_off_pairs_arriving_together_spread_on_a_token_pool() {
    with_the_hold_off_pairs_arriving_together_spread_over_full_replicas(card()).await;
}

#[actix_web::test]
async fn with_the_hold_off_pairs_arriving_together_spread_on_a_slot_engine() {
    // llama.cpp's shape: one slot of 20,000 tokens, said by /props.
    with_the_hold_off_pairs_arriving_together_spread_over_full_replicas(prefixgate::sim::SimConfig {
        slots: Some(1),
        ..card()
    })
    .await;
}

/// Issue 40: no phantom rooms. An instance that stops gives back at once
/// the room of the sessions it served last: they leave the shared store
/// and the other instance forgets them now, not when their entries expire
/// (`idle_ms` after their last turn: a minute here).
#[actix_web::test]
async fn an_instance_that_stops_releases_its_ended_sessions_at_once() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let a = start_sim("a", card()).await;
    let config = |name: &str| {
        let mut c = on_redis(holding(&[&a], 10_000, 8), &redis, name);
        c.sessions.idle_ms = 60_000;
        c
    };
    let (g1, g2) = (start_gateway(config("gw1")).await, start_gateway(config("gw2")).await);
    let store = prefixgate::store::open_url(&redis.url, "reader").await.unwrap();
    let load = || async { store.session_loads(&["a".to_string()]).await.unwrap()[0] };
    for n in 1..=2 {
        assert_eq!(send(&g1, "one", n).await.status, 200);
    }
    let key = u128::from_str_radix(&g1.gw.sessions.kept(prefixgate::clock::now_ms())[0].session, 16).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while load().await == 0 || !g2.gw.sessions.is_resident(key) {
        assert!(std::time::Instant::now() < deadline, "the session never reached the store and gw2");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    g1.stop().await;
    let stopped = std::time::Instant::now();
    while load().await != 0 || g2.gw.sessions.is_resident(key) {
        assert!(
            stopped.elapsed() < Duration::from_millis(500),
            "the stopped instance's session held its room: load {}, resident on gw2 {}",
            load().await,
            g2.gw.sessions.is_resident(key)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A session with a turn running elsewhere keeps its room: gw2 serves it now.
    let running = spawn_chat(&g2, turn("two", 1));
    assert_eq!(running.await.unwrap().status, 200);
    wait_until("two kept by gw2", Duration::from_secs(5), || {
        !g2.gw.sessions.kept(prefixgate::clock::now_ms()).is_empty()
    })
    .await;
    g2.stop().await;
}

/// Issue 40: no phantom rooms after a restart. A new instance reads back
/// the pins of sessions that ended on an instance that stopped: it does not
/// take them for resident (they would hold their room here for
/// `ELSEWHERE_FACTOR` x `idle_ms`), and a new session goes at once.
#[actix_web::test]
async fn a_new_instance_does_not_take_the_ended_sessions_of_a_stopped_one_for_resident() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let a = start_sim("a", card()).await;
    let config = |name: &str| on_redis(holding(&[&a], 10_000, 8), &redis, name); // idle_ms 300
    let g1 = start_gateway(config("gw1")).await;
    for n in 1..=2 {
        assert_eq!(send(&g1, "one", n).await.status, 200);
    }
    let ended = prefixgate::clock::now_ms();
    g1.stop().await;
    // Its idle time passes: had g1 lived, the session would have idled out.
    wait_until("past its idle time", Duration::from_secs(5), || prefixgate::clock::now_ms() > ended + 400).await;
    let (g2, g3) = (start_gateway(config("gw2")).await, start_gateway(config("gw3")).await);
    assert!(g2.gw.pins.count_by_replica().values().sum::<usize>() > 0, "gw2 read the pins back");
    // gw2 re-reads the store when it subscribes, before it applies any
    // announcement: once gw3's marker reached it, that re-read is done.
    let marker = chat_body(&[("user", "a marker")], json!({}));
    assert_eq!(post(&format!("{}/v1/chat/completions", g3.base), &marker).await.status, 200);
    let key = prefixgate::policy::identity::extract(
        prefixgate::policy::Endpoint::Chat,
        &serde_json::to_vec(&marker).unwrap(),
        Default::default(),
    )
    .unwrap()
    .pin_at
    .unwrap();
    wait_until("gw3's marker reached gw2", Duration::from_secs(5), || g2.gw.pins.get(key).is_some()).await;
    assert!(g2.gw.sessions.is_empty(), "the stopped instance's ended session is not resident on gw2");
    let r = spawn_turn(&g2, "two").await.unwrap();
    assert_eq!((r.status, held_ms(&r)), (200, None), "a new session goes at once: no phantom room");
    assert_eq!(g2.gw.sessions.len(), 1, "only the new session is resident");
    g2.stop().await;
    g3.stop().await;
}

#[actix_web::test]
async fn with_the_wall_learned_nothing_waits_until_a_returning_session_loses_its_prefix_and_the_view_shows_why() {
    let (_a, _b, gw, one, _two) = full_cards(|c| c.sessions.wall = WallAt::Learned).await;
    // Both cards declare 20,000 tokens and hold a 12,000-token session: a
    // third does not fit by what they declare, but no wall was seen.
    let three = text("three", 16_000);
    let three = chat(&gw, &[("system", &three), ("user", "three task")]).await;
    assert_eq!((three.status, held_ms(&three)), (200, None), "declared capacity is not a wall");
    let view = |gw: &Gw| {
        let url = format!("{}/admin/v1/capacity", gw.admin);
        async move { admin("GET", &url, None, None).await.1 }
    };
    let before = view(&gw).await;
    for r in before["replicas"].as_array().unwrap() {
        assert_eq!(r["learned_tokens"], 20_000, "learning starts from the declared: {r}");
        assert!(r["evidence"]["wall_tokens"].is_null(), "{r}");
    }
    // The session that shared its card with "three" comes back: the card
    // evicted most of it (28,000 tokens of contexts in 20,000), and its receipt
    // says so: the wall is where it was lost.
    let home = if three.replica == one.replica { "one" } else { "two" };
    let back = send(&gw, home, 2).await;
    assert_eq!(back.route, "pinned", "{}", back.body["usage"]);
    let after = view(&gw).await;
    let card = after["replicas"].as_array().unwrap().iter().find(|r| r["replica"] == three.replica.as_str()).unwrap();
    assert_eq!(card["evidence"]["receipts_lost"], 1, "{card} {}", back.body["usage"]);
    let wall = card["evidence"]["wall_tokens"].as_u64().expect("a wall seen");
    // What it holds as learned: no more than its wall, nor than it was seen to keep.
    assert_eq!(card["learned_tokens"].as_u64(), Some(wall.min(20_000)), "{card}");
    assert!((20_000..=30_000).contains(&wall), "lost with both sessions resident: {wall}");
    assert_eq!(card["evidence"]["wall_sessions"], 1, "two resident at the loss, so one held: {card}");
    gw.stop().await;
}
