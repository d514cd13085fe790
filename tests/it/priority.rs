//! Issue 33: who waits at the wall. One simulated card of 20,000 tokens;
//! sessions of ~12,000: one fits at a time, the rest wait, and the order
//! they go in is by class, then turns between clients.

use std::time::{Duration, Instant};

use crate::common::*;
use prefixgate::config::{Config, SessionConfig};
use prefixgate::events::EventKind;
use prefixgate::sessions::WallAt;
use serde_json::json;

fn card() -> prefixgate::sim::SimConfig {
    prefixgate::sim::SimConfig { kv_tokens: 20_000, ..fast_sim() }
}

fn config(sims: &[&Sim], idle_ms: u64, max_held: usize, preempt: bool) -> Config {
    let sessions = SessionConfig {
        idle_ms,
        max_wait_ms: 20_000,
        max_held,
        hold_min_tokens: Some(1_000),
        wall: WallAt::Declared,
        ..Default::default()
    };
    let mut c = Config { sessions, ..test_config(sims) };
    c.priority.preempt = preempt;
    c.priority.client_header = true;
    c
}

/// Turn `n` (1: the first) of a family with a ~12,000-token context.
fn turn(family: &str, n: usize) -> serde_json::Value {
    let system = text(family, 12_000);
    let mut m = vec![("system", system.as_str()), ("user", "task")];
    for _ in 1..n {
        m.extend([("assistant", "step"), ("user", "go on")]);
    }
    chat_body(&m, json!({}))
}

/// A family's turn `n` with `headers`, on its own task; with when it ended.
fn spawn_turn(
    gw: &Gw,
    family: &'static str,
    n: usize,
    headers: &'static [(&'static str, &'static str)],
) -> actix_web::rt::task::JoinHandle<(Reply, Instant)> {
    let url = format!("{}/v1/chat/completions", gw.base);
    actix_web::rt::spawn(async move {
        let r = post_with(&url, &turn(family, n), headers).await;
        (r, Instant::now())
    })
}

async fn capacity_read(gw: &Gw) {
    wait_until("capacity read", Duration::from_secs(5), || {
        gw.gw.fleet.snapshot().iter().all(|r| r.kv_capacity() == Some(20_000))
    })
    .await;
}

fn held_ms(r: &Reply) -> u64 {
    r.headers.get("x-prefixgate-held-ms").map_or(0, |v| v.to_str().unwrap().parse().unwrap())
}

const BACKGROUND: &[(&str, &str)] = &[("x-prefixgate-priority", "background")];
const INTERACTIVE: &[(&str, &str)] = &[("x-prefixgate-priority", "interactive")];

/// One card behind a gateway (`config`'s settings), its capacity read, and
/// one session resident on it: the next new session does not fit.
async fn one_full_card(idle_ms: u64, max_held: usize, preempt: bool) -> (Sim, Gw) {
    let a = start_sim("a", card()).await;
    let gw = start_gateway(config(&[&a], idle_ms, max_held, preempt)).await;
    capacity_read(&gw).await;
    assert_eq!(spawn_turn(&gw, "resident", 1, &[]).await.unwrap().0.status, 200);
    (a, gw)
}

/// Queues each (family, headers) in turn, waiting until it is held.
async fn queue(
    gw: &Gw,
    waiting: &[(&'static str, &'static [(&'static str, &'static str)])],
) -> Vec<actix_web::rt::task::JoinHandle<(Reply, Instant)>> {
    let mut out = Vec::new();
    for (i, (family, headers)) in waiting.iter().enumerate() {
        out.push(spawn_turn(gw, family, 1, headers));
        wait_until("queued", Duration::from_secs(5), || gw.gw.sessions.held() == i + 1).await;
    }
    out
}

/// Waits for every queued turn: each answered 200; when each ended.
async fn all_answered(waiting: Vec<actix_web::rt::task::JoinHandle<(Reply, Instant)>>) -> Vec<Instant> {
    let mut ended = Vec::new();
    for w in waiting {
        let (r, at) = w.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        ended.push(at);
    }
    ended
}

#[actix_web::test]
async fn an_unknown_class_is_a_400_naming_the_header_and_nothing_is_queued() {
    let (_a, gw) = one_full_card(300, 8, true).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    for (header, value) in [("x-prefixgate-priority", "urgent"), ("X-SMG-Priority", "high")] {
        let r = post_with(&url, &turn("two", 1), &[(header, value)]).await;
        assert_eq!(r.status, 400, "{}", r.body);
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(&header.to_lowercase()) && message.contains(value), "{message}");
        assert_eq!(r.body["error"]["type"], "invalid_request_error");
        assert_eq!(gw.gw.sessions.held(), 0, "nothing queued");
    }
    // SGLang's classes are understood: bulk is background.
    let r = post_with(&url, &chat_body(&[("user", "hi")], json!({})), &[("x-smg-priority", "bulk")]).await;
    assert_eq!(r.status, 200);
    gw.stop().await;
}

#[actix_web::test]
async fn an_interactive_session_goes_before_background_ones_that_queued_first() {
    let (_a, gw) = one_full_card(300, 8, false).await;
    let waiting = queue(&gw, &[("bg1", BACKGROUND), ("bg2", BACKGROUND), ("int", INTERACTIVE)]).await;
    // The capacity view lists the queue in the order it goes, with classes.
    let (_, cap) = admin("GET", &format!("{}/admin/v1/capacity", gw.admin), None, None).await;
    let classes: Vec<&str> =
        cap["sessions"]["queue"].as_array().unwrap().iter().map(|q| q["class"].as_str().unwrap()).collect();
    assert_eq!(classes, ["interactive", "background", "background"], "{cap}");
    assert_eq!(cap["sessions"]["held_by_class"], json!({"interactive": 1, "default": 0, "background": 2}));
    let ended = all_answered(waiting).await;
    // Each goes when the one before idled out: the interactive one first.
    assert!(ended[2] < ended[0] && ended[0] < ended[1], "interactive, then the background ones in order");
    let metrics = scrape(&gw).await;
    assert!(metrics.contains(r#"prefixgate_session_hold_seconds_count{class="background"} 2"#), "{metrics}");
    assert!(metrics.contains(r#"prefixgate_session_hold_seconds_count{class="interactive"} 1"#));
    gw.stop().await;
}

#[actix_web::test]
async fn within_a_class_clients_take_turns() {
    let (_a, gw) = one_full_card(200, 8, false).await;
    const A: &[(&str, &str)] = &[("x-prefixgate-client", "team-a")];
    const B: &[(&str, &str)] = &[("x-prefixgate-client", "team-b")];
    // Client A opens three at once, then B one: B's goes second, not fourth.
    let waiting = queue(&gw, &[("a1", A), ("a2", A), ("a3", A), ("b1", B)]).await;
    let ended = all_answered(waiting).await;
    let mut order: Vec<usize> = (0..4).collect();
    order.sort_by_key(|i| ended[*i]);
    eprintln!(
        "DEBUG {:?}",
        ended
            .iter()
            .map(|e| e.duration_since(ended[0]).as_millis() as i64 - ended[0].duration_since(*e).as_millis() as i64)
            .collect::<Vec<_>>()
    );
    assert_eq!(order, [0, 3, 1, 2], "a1, b1, a2, a3");
    gw.stop().await;
}

#[actix_web::test]
async fn a_full_queue_refuses_the_lowest_class_first() {
    let (_a, gw) = one_full_card(60_000, 2, false).await;
    let mut waiting = queue(&gw, &[("bg1", BACKGROUND), ("bg2", BACKGROUND)]).await;
    // Full: an interactive session takes the place of the last background one.
    let int = spawn_turn(&gw, "int", 1, INTERACTIVE);
    let (bg2, _) = waiting.pop().unwrap().await.unwrap();
    assert_eq!(bg2.status, 503, "{}", bg2.body);
    assert!(bg2.headers.contains_key("retry-after"));
    // Full of [interactive, background]: a background newcomer is refused itself.
    let url = format!("{}/v1/chat/completions", gw.base);
    let refused = post_with(&url, &turn("bg3", 1), BACKGROUND).await;
    assert_eq!(refused.status, 503);
    assert_eq!(gw.gw.sessions.held_by_class(), [1, 0, 1], "the interactive and bg1 wait");
    int.abort();
    waiting.pop().unwrap().abort();
    gw.stop().await;
}

#[actix_web::test]
async fn a_waiting_interactive_session_takes_a_background_ones_room_at_its_turn_boundary_never_mid_turn() {
    // Slow enough that a turn is still running when the interactive one comes.
    let slow = prefixgate::sim::SimConfig { kv_tokens: 20_000, ..slow_decoder(20.0) };
    let a = start_sim("a", slow).await;
    // Sessions idle out after 10 s: the interactive one must not wait for that.
    let gw = start_gateway(config(&[&a], 10_000, 8, true)).await;
    capacity_read(&gw).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let short = |family, n| {
        let mut body = turn(family, n);
        body["max_tokens"] = json!(4);
        body
    };
    assert_eq!(post_with(&url, &short("bg", 1), BACKGROUND).await.status, 200);
    // The background session's second turn runs (~1 s of decoding), without
    // a header: it stays background.
    let mut long = turn("bg", 2);
    long["max_tokens"] = json!(20);
    let running = actix_web::rt::spawn({
        let url = url.clone();
        async move {
            let r = post_with(&url, &long, &[]).await;
            (r, Instant::now())
        }
    });
    // Until that turn runs on the replica (it decodes for ~1 s).
    let replica = gw.gw.fleet.get("a").unwrap();
    wait_until("the background turn runs", Duration::from_secs(5), || replica.inflight() == 1).await;
    let int = spawn_turn(&gw, "int", 1, INTERACTIVE);
    let (bg_turn, bg_ended) = running.await.unwrap();
    // The turn that had started was never cut.
    assert_eq!(bg_turn.status, 200, "{}", bg_turn.body);
    assert_eq!(gw.gw.events.count(EventKind::SessionPreempted), 0, "not while its turn ran");
    let (int, int_ended) = int.await.unwrap();
    assert_eq!(int.status, 200);
    // It went right after the background turn ended, not 10 s later.
    assert!(int_ended > bg_ended && held_ms(&int) < 5_000, "held {} ms", held_ms(&int));
    assert_eq!(gw.gw.events.count(EventKind::SessionPreempted), 1);
    // The background session's next turn waits for room (the interactive
    // one is resident now, until it idles out): paused, not failed.
    let next = actix_web::rt::spawn({
        let url = url.clone();
        async move { post_with(&url, &short("bg", 3), &[]).await }
    });
    wait_until("the background turn paused", Duration::from_secs(5), || gw.gw.sessions.paused() == 1).await;
    let metrics = scrape(&gw).await;
    assert!(metrics.contains(r#"prefixgate_sessions_preempted_total{class="background"} 1"#), "{metrics}");
    next.abort();
    gw.stop().await;
}

/// One streamed turn `n` of `family`, read as agents and the SDKs read it:
/// up to the stream's last event (`data: [DONE]`), then the next turn goes,
/// whether or not the gateway has seen the stream close. Its held time.
async fn streamed_turn(url: &str, family: &str, n: usize, headers: &[(&str, &str)]) -> u64 {
    use futures_util::StreamExt;
    let mut body = turn(family, n);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(10);
    let mut req = client().post(url);
    for (k, v) in headers {
        req = req.insert_header((*k, *v));
    }
    let mut resp = req.send_json(&body).await.unwrap();
    assert_eq!(resp.status(), 200);
    let held = resp.headers().get("x-prefixgate-held-ms").map_or(0, |v| v.to_str().unwrap().parse().unwrap());
    let mut seen = Vec::new();
    while let Some(chunk) = resp.next().await {
        seen.extend_from_slice(&chunk.unwrap());
        if seen.windows(12).any(|w| w == b"data: [DONE]") {
            break;
        }
    }
    held
}

/// Issue 40: a streamed turn's end is a turn boundary. A background agent
/// streams six turns back to back, each sent on the last event of the one
/// before, so the gateway never sees it between turns. An interactive
/// session that arrives meanwhile takes its room at its next turn, not when
/// it ends: it waits about one turn, and the background agent's next turn
/// pauses (a turn that started is never cut).
#[actix_web::test]
async fn a_streaming_background_agent_gives_its_room_at_its_next_turn_not_at_its_end() {
    // Ten tokens a turn at 20 tokens/s: each turn streams for ~0.5 s.
    let slow = prefixgate::sim::SimConfig { kv_tokens: 20_000, ..slow_decoder(20.0) };
    let a = start_sim("a", slow).await;
    // Sessions idle out after 2 s: longer than a turn boundary, shorter than the test.
    let gw = start_gateway(config(&[&a], 2_000, 8, true)).await;
    capacity_read(&gw).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let background = actix_web::rt::spawn({
        let url = url.clone();
        async move {
            let mut held = Vec::new();
            for n in 1..=6 {
                held.push(streamed_turn(&url, "bg", n, BACKGROUND).await);
            }
            held
        }
    });
    // The background agent is in its second turn when the interactive one comes.
    wait_until("the background agent's second turn", Duration::from_secs(10), || {
        a.state.received() >= 2 && gw.gw.sessions.held() == 0
    })
    .await;
    let interactive = streamed_turn(&url, "int", 1, INTERACTIVE).await;
    assert!(interactive < 1_500, "the interactive session waited {interactive} ms: past a turn boundary");
    assert_eq!(gw.gw.events.count(EventKind::SessionPreempted), 1);
    let background = background.await.unwrap();
    assert!(background.iter().any(|held| *held > 0), "a background turn paused: {background:?}");
    gw.stop().await;
}
