//! Issues 11 and 19: several gateway instances sharing one fleet through a real
//! Redis (`redis-server`, started by each test on a unix socket of its own:
//! no ports, nothing kept between tests). `.ci/run` installs Redis; outside
//! CI a machine without `redis-server` skips these with a message.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use futures_util::StreamExt;
use prefixgate::config::Config;
use prefixgate::fleet::AdminState;
use prefixgate::store::{RedisStore, Store};
use serde_json::json;

pub struct Redis {
    child: Child,
    pub url: String,
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// True once the server at `socket` answers PING (the socket file appears
/// at bind(), a moment before the server listens on it).
fn answers(socket: &std::path::Path) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) else { return false };
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl Redis {
    pub fn start() -> Option<Redis> {
        let dir = tempfile::tempdir().unwrap();
        Redis::start_in(dir)
    }

    fn start_in(dir: tempfile::TempDir) -> Option<Redis> {
        let socket = dir.path().join("redis.sock");
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(&socket)
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        if !require("redis-server", child.is_ok(), "apt-get install -y redis-server") {
            return None;
        }
        let child = child.expect("checked");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !answers(&socket) {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        let url = format!("redis+unix://{}", socket.display());
        Some(Redis { child, url, socket, _dir: dir })
    }

    /// Kills the server; `restart` brings one back on the same socket, empty.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.socket);
    }

    fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(&self.socket)
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = child;
        let deadline = Instant::now() + Duration::from_secs(10);
        while !answers(&self.socket) {
            assert!(Instant::now() < deadline, "redis-server did not restart");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn shared_config(sims: &[&Sim], redis: &Redis, name: &str) -> Config {
    on_redis(test_config(sims), redis, name)
}

/// `c` as instance `name` sharing `redis`, its flusher every 50 ms.
pub fn on_redis(mut c: Config, redis: &Redis, name: &str) -> Config {
    c.store.url = Some(redis.url.clone());
    c.store.instance = Some(name.to_string());
    c.pins.flush_interval_ms = 50;
    c
}

async fn instances(sims: &[&Sim], redis: &Redis, n: usize) -> Vec<Gw> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push(start_gateway(shared_config(sims, redis, &format!("gw{i}"))).await);
    }
    out
}

/// `n` instances on `redis` whose flusher waits 10 s: only announcements
/// (and what they write) carry a pin to another instance in time.
async fn announcing_only(sims: &[&Sim], redis: &Redis, n: usize) -> Vec<Gw> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut c = shared_config(sims, redis, &format!("gw{i}"));
        c.pins.flush_interval_ms = 10_000;
        out.push(start_gateway(c).await);
    }
    out
}

/// A generous bound for what takes one pub/sub hop (a pin is announced at
/// once, an operator action once persisted): a loaded CI machine is slow.
const PROPAGATION: Duration = Duration::from_millis(1_000);

#[actix_web::test]
async fn agent_loops_stay_pinned_and_warm_when_every_turn_reaches_another_instance() {
    let Some(redis) = Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gws = instances(&[&a, &b], &redis, 3).await;
    for family in 0..3 {
        let ctx = text(&format!("shared family {family}"), 2_000);
        let mut msgs = vec![("user".to_string(), ctx)];
        let mut home = String::new();
        for turn in 0..4usize {
            let gw = &gws[(family + turn) % 3];
            let view: Vec<(&str, &str)> = msgs.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
            let r = chat(gw, &view).await;
            assert_eq!(r.status, 200);
            if turn == 0 {
                home = r.replica.clone();
            } else {
                assert_eq!(
                    (r.replica.as_str(), r.route.as_str()),
                    (home.as_str(), "pinned"),
                    "family {family} turn {turn}"
                );
                assert!(cached_tokens(&r) > 1_000, "warm on its replica");
            }
            // The bound under test: this turn's pin reaches every other instance.
            let pin_at = prefixgate::policy::identity::extract(
                prefixgate::policy::Endpoint::Chat,
                &serde_json::to_vec(&chat_body(&view, json!({}))).unwrap(),
                Default::default(),
            )
            .unwrap()
            .pin_at
            .unwrap();
            let started = Instant::now();
            wait_until("the pin reached every instance", PROPAGATION, || {
                gws.iter().all(|g| g.gw.pins.replica_of(pin_at).as_deref() == Some(home.as_str()))
            })
            .await;
            assert!(started.elapsed() < PROPAGATION);
            msgs.push(("assistant".into(), "ok".into()));
            msgs.push(("user".into(), format!("next {turn}")));
        }
    }
    // One-shots are spread over every replica, whichever instance they reach.
    let mut used = std::collections::HashSet::new();
    for i in 0..6 {
        used.insert(chat(&gws[i % 3], &[("user", &format!("one-shot {i}"))]).await.replica);
    }
    assert_eq!(used.len(), 2);
    // Every instance lists the others as alive.
    let (_, list) = admin("GET", &format!("{}/admin/v1/instances", gws[2].admin), None, None).await;
    let alive: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["alive"] == true)
        .map(|i| i["instance"].as_str().unwrap())
        .collect();
    assert_eq!(alive, ["gw0", "gw1", "gw2"]);
    for gw in gws {
        gw.stop().await;
    }
}

#[actix_web::test]
async fn a_drain_on_one_instance_reaches_the_others_and_waits_for_all_of_their_requests() {
    let Some(redis) = Redis::start() else { return };
    let slow = slow_decoder(10.0);
    let (a, b) = (start_sim("a", slow.clone()).await, start_sim("b", slow).await);
    let gws = instances(&[&a, &b], &redis, 3).await;
    // A 10 s stream through instance 2, on replica a.
    let url = format!("{}/v1/chat/completions", gws[2].base);
    let mut stream = loop {
        let body = chat_body(&[("user", "a long answer")], json!({"stream": true, "max_tokens": 100}));
        let resp = client().post(&url).send_json(&body).await.unwrap();
        if resp.headers().get("x-prefixgate-replica").unwrap() == "a" {
            break resp;
        }
    };
    let _ = stream.next().await;
    // Drained on instance 0: instances 1 and 2 hear of it.
    let drain = actix_web::rt::spawn({
        let url = format!("{}/admin/v1/replicas/a/drain?wait=true&timeout=30", gws[0].admin);
        async move {
            let (s, _) = admin("POST", &url, None, None).await;
            (s, Instant::now())
        }
    });
    wait_until("every instance sees the drain", PROPAGATION, || {
        gws.iter().all(|g| g.gw.fleet.get("a").unwrap().admin() == AdminState::Draining)
    })
    .await;
    for gw in &gws[1..] {
        for i in 0..2 {
            let r = chat(gw, &[("user", &format!("after the drain {i}"))]).await;
            assert_eq!(r.replica, "b", "no new traffic to a draining replica from any instance");
        }
    }
    // wait=true returns only once instance 2's stream is done (here: its client leaves).
    if drain.is_finished() {
        let (s, _) = drain.await.unwrap();
        panic!("the drain returned {s} while a request on another instance was in flight");
    }
    assert_eq!(gws[2].gw.fleet.get("a").unwrap().inflight(), 1);
    drop(stream);
    let stream_done = Instant::now();
    let (status, drained_at) = drain.await.unwrap();
    assert_eq!(status, 200);
    assert!(drained_at >= stream_done);
    for gw in gws {
        gw.stop().await;
    }
}

#[actix_web::test]
async fn redis_going_away_costs_no_request_and_pins_written_meanwhile_reach_it_after() {
    let Some(mut redis) = Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gws = instances(&[&a, &b], &redis, 2).await;
    let gw = &gws[0];
    assert_eq!(chat(gw, &[("user", "before")]).await.status, 200);
    redis.kill();
    let mut during = Vec::new();
    for i in 0..20 {
        let text = format!("during the outage {i}");
        let r = chat(gw, &[("user", &text)]).await;
        assert_eq!(r.status, 200, "no client-visible error");
        during.push(text);
    }
    wait_until("the outage is visible", Duration::from_secs(5), || {
        !gw.gw.store_up.load(std::sync::atomic::Ordering::Acquire)
    })
    .await;
    let (_, health) = admin("GET", &format!("{}/healthz", gw.base), None, None).await;
    assert_eq!((health["status"].as_str(), health["store"].as_str()), (Some("ok"), Some("unreachable")));
    let mut scrape = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
    let metrics = String::from_utf8(scrape.body().limit(1 << 22).await.unwrap().to_vec()).unwrap();
    assert!(metrics.lines().any(|l| l == "prefixgate_store_up 0"), "{metrics}");
    redis.restart();
    wait_until("back", Duration::from_secs(10), || gw.gw.store_up.load(std::sync::atomic::Ordering::Acquire)).await;
    let kinds = [prefixgate::events::EventKind::StoreUnreachable, prefixgate::events::EventKind::StoreReachable];
    // This instance's own events: the other instance's reach this history
    // too (shared through the store), whenever its flusher writes them.
    let own = |kind| {
        let filter = prefixgate::events::EventFilter { kind: Some(kind), limit: 1_000, ..Default::default() };
        gw.gw.events.query(&filter).iter().filter(|e| e.instance.as_deref() == Some("gw0")).count()
    };
    // The flag flips a moment before its event is recorded.
    wait_until("the transition recorded", Duration::from_secs(5), || own(kinds[1]) > 0).await;
    assert!(kinds.iter().all(|k| own(*k) == 1), "one event per transition");
    // The restarted Redis was empty: every pin written during the outage is there now.
    let reader = RedisStore::open(&redis.url, "reader").await.unwrap();
    let stored: std::collections::HashSet<u128> = reader.pins().await.unwrap().into_iter().map(|(k, _)| k).collect();
    for text in &during {
        let key = prefixgate::policy::identity::extract(
            prefixgate::policy::Endpoint::Chat,
            &serde_json::to_vec(&chat_body(&[("user", text)], json!({}))).unwrap(),
            Default::default(),
        )
        .unwrap()
        .pin_at
        .unwrap();
        assert!(stored.contains(&key), "the pin of '{text}' reached Redis");
        // The other instance, whose listener lost its connection too, catches up.
        wait_until("the other instance caught up", Duration::from_secs(10), || {
            gws[1].gw.pins.replica_of(key).is_some()
        })
        .await;
    }
    // The restarted Redis lost the fleet too: an instance put it back, nobody lost a replica.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !reader.replicas().await.is_ok_and(|r| r.len() == 2) {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for the fleet restored in Redis");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gws.iter().all(|g| g.gw.fleet.snapshot().len() == 2));
    for gw in gws {
        gw.stop().await;
    }
}

#[actix_web::test]
async fn store_copy_moves_everything_from_sled_to_redis_and_back() {
    let Some(redis) = Redis::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let sled_url = format!("sled:{}", dir.path().join("a").display());
    let back_url = format!("sled:{}", dir.path().join("b").display());
    let src = prefixgate::store::open_url(&sled_url, "t").await.unwrap();
    src.put_replica(&prefixgate::store::StoredReplica {
        spec: prefixgate::fleet::ReplicaSpec::new("gpu-0", "http://127.0.0.1:1"),
        admin: AdminState::Draining,
        source: Default::default(),
    })
    .await
    .unwrap();
    let pins: Vec<prefixgate::pins::PinChange> = (0..1_000u128)
        .map(|k| {
            let pin = prefixgate::pins::Pin {
                replica: Arc::from("gpu-0"),
                created_ms: 1,
                last_used_ms: 2,
                turns: 3,
                est_tokens: 4,
                family: k,
                origin: Default::default(),
                went_on: 0,
            };
            (k << 64 | k, Some(pin))
        })
        .collect();
    src.write_pins(&pins).await.unwrap();
    for id in 1..=5u64 {
        let e = prefixgate::events::Event {
            id,
            at: "2026-11-30T00:00:00Z".into(),
            at_ms: id,
            kind: prefixgate::events::EventKind::DrainStarted,
            replica: Some("gpu-0".into()),
            to_replica: None,
            detail: format!("event {id}"),
            instance: None,
            trace_id: None,
        };
        src.append_event(&e, None).await.unwrap();
    }
    src.put_setting("policy", &json!({"mode": "roundrobin", "identity": {"block_bytes": 64, "block_tokens": 8}}))
        .await
        .unwrap();
    // An operator's disable of a discovered replica, kept by name.
    let kept = format!("{}engine-0-8000", prefixgate::store::DISCOVERED_ADMIN_PREFIX);
    src.put_setting(&kept, &json!("disabled")).await.unwrap();
    drop(src);
    for (from, to) in [(&sled_url, &redis.url), (&redis.url, &back_url)] {
        let out = Command::new(env!("CARGO_BIN_EXE_prefixgate"))
            .args(["store", "copy", "--from", from, "--to", to])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 replica(s), 1000 pin(s), 5 event(s), 2 setting(s)"));
    }
    let (a, b) = (
        prefixgate::store::open_url(&sled_url, "t").await.unwrap(),
        prefixgate::store::open_url(&back_url, "t").await.unwrap(),
    );
    async fn sorted(s: &Arc<dyn Store>) -> Vec<(u128, prefixgate::pins::Pin)> {
        let mut p = s.pins().await.unwrap();
        p.sort_by_key(|(k, _)| *k);
        p
    }
    assert_eq!(sorted(&a).await, sorted(&b).await);
    assert_eq!(a.replicas().await.unwrap(), b.replicas().await.unwrap());
    assert_eq!(a.events().await.unwrap(), b.events().await.unwrap());
    assert_eq!(a.setting("policy").await.unwrap(), b.setting("policy").await.unwrap());
    assert_eq!(b.setting(&kept).await.unwrap(), Some(json!("disabled")));
}

#[actix_web::test]
async fn max_large_inflight_holds_for_the_whole_fleet_of_gateways() {
    let Some(redis) = Redis::start() else { return };
    let a = start_sim("a", slow_decoder(20.0)).await;
    let mut gws = Vec::new();
    for i in 0..3 {
        let mut c = shared_config(&[&a], &redis, &format!("gw{i}"));
        c.replicas[0].max_large_inflight = Some(1);
        c.admission.wait_ms = 30_000;
        gws.push(start_gateway(c).await);
    }
    let requests: Vec<_> = (0..6)
        .map(|i| {
            let url = format!("{}/v1/chat/completions", gws[i % 3].base);
            actix_web::rt::spawn(async move {
                let mut resp = client().post(&url).send_json(&large_stream(&format!("large {i}"), 10)).await.unwrap();
                let status = resp.status().as_u16();
                while resp.next().await.is_some() {}
                status
            })
        })
        .collect();
    // The card's own count of running sequences, sampled while they run.
    let mut most = 0;
    while !requests.iter().all(|r| r.is_finished()) {
        most = most.max(a.state.running());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for r in requests {
        assert_eq!(r.await.unwrap(), 200);
    }
    assert_eq!(most, 1, "never more than one large request on the card, whatever instance sent it");
    for gw in gws {
        gw.stop().await;
    }
}

fn spawn_shared_gateway(redis: &Redis, name: &str, sim: &Sim) -> GatewayProcess {
    let replica = format!("{}={}", sim.id, sim.url);
    let env = [
        ("PREFIXGATE_STORE_INSTANCE", name),
        ("PREFIXGATE_PINS_FLUSH_INTERVAL_MS", "100"),
        ("PREFIXGATE_HEALTH_INTERVAL_MS", "200"),
        ("PREFIXGATE_ADMISSION_WAIT_MS", "30000"),
    ];
    GatewayProcess::spawn(&["--store", &redis.url, "--replica", &replica], &env, Stdio::null())
}

#[actix_web::test]
async fn the_slot_of_a_killed_gateway_comes_back_when_its_lease_expires() {
    let Some(redis) = Redis::start() else { return };
    let a = start_sim("a", slow_decoder(10.0)).await;
    let mut p1 = spawn_shared_gateway(&redis, "p1", &a);
    let p2 = spawn_shared_gateway(&redis, "p2", &a);
    // Set the limit on one instance; the other hears of it.
    let (s, _) =
        admin("PATCH", &format!("{}/admin/v1/replicas/a", p1.admin), None, Some(json!({"max_large_inflight": 1})))
            .await;
    assert_eq!(s, 200);
    let deadline = Instant::now() + PROPAGATION;
    loop {
        let (_, r) = admin("GET", &format!("{}/admin/v1/replicas/a", p2.admin), None, None).await;
        if r["max_large_inflight"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the limit did not reach p2");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // p1 holds the card's only large slot with a long stream, then dies.
    let body = chat_body(&[("user", &text("holder", 40_000))], json!({"stream": true, "max_tokens": 200}));
    let mut holder = client().post(format!("{}/v1/chat/completions", p1.base)).send_json(&body).await.unwrap();
    assert_eq!(holder.status(), 200);
    let _ = holder.next().await;
    p1.kill(); // SIGKILL: no release, no flush
    let killed = Instant::now();
    // p2's large request waits for the lease to expire, then runs.
    let mut resp =
        client().post(format!("{}/v1/chat/completions", p2.base)).send_json(&large_stream("after", 10)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let _ = resp.next().await;
    let waited = killed.elapsed();
    assert!(waited >= Duration::from_millis(2_000), "the dead instance's lease held the slot for a while ({waited:?})");
    assert!(
        waited <= Duration::from_millis(prefixgate::leases::LEASE_TTL_MS + 2_000),
        "and gave it back within the lease time ({waited:?})"
    );
}

#[actix_web::test]
async fn the_capacity_verdict_on_any_instance_covers_the_whole_fleet() {
    let Some(redis) = Redis::start() else { return };
    let a = start_sim("a", prefixgate::sim::SimConfig { kv_tokens: 20_000, ..slow_decoder(10.0) }).await;
    let gws = instances(&[&a], &redis, 2).await;
    // A returning conversation and a long-running request, both on instance 1.
    let ctx = text("fleet verdict", 6_000);
    chat(&gws[1], &[("user", &ctx)]).await;
    chat(&gws[1], &[("user", &ctx), ("assistant", "ok"), ("user", "more")]).await;
    let body = chat_body(&[("user", &text("running elsewhere", 16_000))], json!({"stream": true, "max_tokens": 100}));
    let mut running = client().post(format!("{}/v1/chat/completions", gws[1].base)).send_json(&body).await.unwrap();
    let _ = running.next().await;
    // Instance 0 has served nothing, yet its verdict sees both.
    let url = format!("{}/admin/v1/capacity", gws[0].admin);
    let deadline = Instant::now() + PROPAGATION * 2;
    loop {
        let (_, report) = admin("GET", &url, None, None).await;
        let r = &report["replicas"][0];
        if r["running_requests"] == 1 && r["families_active"] == 1 && report["verdict"] == "over_capacity" {
            assert!(r["working_set_tokens"].as_u64().unwrap() > 20_000, "{report}");
            break;
        }
        assert!(Instant::now() < deadline, "instance 0 never saw instance 1's load: {report}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(running);
    for gw in gws {
        gw.stop().await;
    }
}

/// A chat agent loop of `turns` turns, turn t sent to instance `first + t`
/// at once; returns (replica, route, cached tokens) per turn.
async fn chat_loop(gws: &[String], first: usize, tag: String, turns: usize) -> Vec<(String, String, u64)> {
    let mut msgs = vec![json!({"role": "user", "content": text(&tag, 2_000)})];
    let mut out = Vec::new();
    for turn in 0..turns {
        let url = format!("{}/v1/chat/completions", gws[(first + turn) % gws.len()]);
        let r = post_with(&url, &json!({"model": "sim-model", "messages": msgs, "max_tokens": 4}), &[]).await;
        assert_eq!(r.status, 200, "{tag} turn {turn}: {}", r.body);
        out.push((r.replica, r.route, r.body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()));
        msgs.push(r.body["choices"][0]["message"].clone());
        msgs.push(json!({"role": "user", "content": format!("tool result {turn}")}));
    }
    out
}

/// The same with the Anthropic Messages API (Claude Code's shape).
async fn messages_loop(gws: &[String], first: usize, tag: String, turns: usize) -> Vec<(String, String, u64)> {
    let mut msgs = vec![json!({"role": "user", "content": [{"type": "text", "text": text(&tag, 2_000)}]})];
    let mut out = Vec::new();
    for turn in 0..turns {
        let url = format!("{}/v1/messages", gws[(first + turn) % gws.len()]);
        let body = json!({"model": "sim-model", "max_tokens": 4, "system": "You are Claude Code.", "messages": msgs});
        let r = post_with(&url, &body, &[("anthropic-version", "2023-06-01")]).await;
        assert_eq!(r.status, 200, "{tag} turn {turn}: {}", r.body);
        out.push((r.replica, r.route, r.body["usage"]["cache_read_input_tokens"].as_u64().unwrap()));
        msgs.push(json!({"role": "assistant", "content": r.body["content"].clone()}));
        msgs.push(json!({"role": "user", "content": [{"type": "text", "text": format!("tool result {turn}")}]}));
    }
    out
}

/// A Responses chain: each turn names the previous response; returns
/// (status, replica) per turn.
async fn responses_chain(gws: &[String], first: usize, tag: String, turns: usize) -> Vec<(u16, String)> {
    let mut prev: Option<String> = None;
    let mut out = Vec::new();
    for turn in 0..turns {
        let url = format!("{}/v1/responses", gws[(first + turn) % gws.len()]);
        let mut body = json!({"model": "sim-model", "input": format!("{tag} turn {turn}"), "max_output_tokens": 4});
        if let Some(p) = &prev {
            body["previous_response_id"] = json!(p);
        }
        let r = post_with(&url, &body, &[]).await;
        out.push((r.status, r.replica.clone()));
        prev = r.body["id"].as_str().map(str::to_string);
        if r.status != 200 {
            break;
        }
    }
    out
}

/// Issue 19: three instances on one Redis, every turn on the next instance
/// with no pause at all. The flusher is slowed to 10 s, so only the
/// announcements (and, for a stored response, asking) can carry a pin to
/// the next instance in time.
#[actix_web::test]
async fn with_no_pause_between_turns_every_instance_knows_the_last_turns_pin() {
    let Some(redis) = Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gws = announcing_only(&[&a, &b], &redis, 3).await;
    let bases: Vec<String> = gws.iter().map(|g| g.base.clone()).collect();
    let bases = &bases;
    let chats = futures_util::future::join_all((0..4).map(|f| chat_loop(bases, f, format!("chat {f}"), 6)));
    let messages = futures_util::future::join_all((0..4).map(|f| messages_loop(bases, f, format!("claude {f}"), 6)));
    let chains = futures_util::future::join_all((0..4).map(|f| responses_chain(bases, f, format!("codex {f}"), 5)));
    let (chats, messages, chains) = futures_util::future::join3(chats, messages, chains).await;
    for (kind, loops) in [("chat", &chats), ("messages", &messages)] {
        for (f, turns) in loops.iter().enumerate() {
            let home = &turns[0].0;
            for (t, (replica, route, cached)) in turns.iter().enumerate().skip(1) {
                assert_eq!((replica, route.as_str()), (home, "pinned"), "{kind} loop {f} turn {t}");
                assert!(*cached > 1_000, "{kind} loop {f} turn {t} is warm ({cached} cached)");
            }
        }
    }
    for (f, chain) in chains.iter().enumerate() {
        assert_eq!(chain.len(), 5, "chain {f} broke: {chain:?}");
        assert!(chain.iter().all(|(s, _)| *s == 200), "chain {f}: {chain:?}");
        assert!(chain.windows(2).all(|w| w[0].1 == w[1].1), "each follow-up on its predecessor's replica: {chain:?}");
    }
    // The announcements did it: every instance measured their propagation.
    for gw in &gws {
        let text = gw.gw.metrics.encode();
        let count = text
            .lines()
            .find_map(|l| l.strip_prefix("prefixgate_shared_propagation_seconds_count "))
            .map(|v| v.parse::<f64>().unwrap())
            .unwrap();
        assert!(count > 0.0, "{text}");
    }
    for gw in gws {
        gw.stop().await;
    }
}

/// A turn that outruns its previous turn's announcement (a loaded instance
/// had not applied the message yet) finds the pin in the shared store:
/// announcing writes it there first. Simulated by forgetting, on the second
/// instance only, what it heard; the flusher is slowed to 10 s, so only the
/// announcement can have written it.
#[actix_web::test]
async fn a_turn_that_outruns_the_announcement_reads_its_pin_from_the_store() {
    let Some(redis) = Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gws = announcing_only(&[&a, &b], &redis, 2).await;
    let mut msgs = vec![
        json!({"role": "system", "content": "You are an agent."}),
        json!({"role": "user", "content": text("outrun", 2_000)}),
    ];
    let turn = |base: &str, msgs: &Vec<serde_json::Value>| {
        let url = format!("{base}/v1/chat/completions");
        let body = json!({"model": "sim-model", "messages": msgs, "max_tokens": 4});
        async move { post_with(&url, &body, &[]).await }
    };
    let first = turn(&gws[0].base, &msgs).await;
    assert_eq!(first.status, 200);
    let keys = gws[0].gw.pins.keys_of(&first.replica);
    assert!(!keys.is_empty());
    wait_until("the announcement heard", PROPAGATION, || keys.iter().all(|k| gws[1].gw.pins.get(*k).is_some())).await;
    gws[1].gw.pins.apply(keys.iter().map(|k| (*k, None)));
    msgs.push(first.body["choices"][0]["message"].clone());
    msgs.push(json!({"role": "user", "content": "tool result"}));
    let second = turn(&gws[1].base, &msgs).await;
    assert_eq!((second.replica.as_str(), second.route.as_str()), (first.replica.as_str(), "pinned"));
    let read = |result: &str| {
        let text = gws[1].gw.metrics.encode();
        let line = format!("prefixgate_pin_read_through_total{{result=\"{result}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(line.as_str())).map(|v| v.parse::<f64>().unwrap()).unwrap()
    };
    assert_eq!(read("found"), 1.0);
    for gw in gws {
        gw.stop().await;
    }
}

/// Issue 19: with Redis down, nothing is announced; a follow-up that names a
/// response this instance never heard of still reaches the replica holding
/// it (found by asking the replicas), and the answer is recorded.
#[actix_web::test]
async fn with_redis_down_a_follow_up_unknown_here_is_found_by_asking_the_replicas() {
    let Some(mut redis) = Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gws = instances(&[&a, &b], &redis, 2).await;
    redis.kill();
    let url = |g: &Gw| format!("{}/v1/responses", g.base);
    // Several first turns, so some land on each replica (spread).
    for i in 0..4 {
        let first = post_with(&url(&gws[0]), &json!({"model": "sim-model", "input": format!("first {i}")}), &[]).await;
        assert_eq!(first.status, 200);
        let id = first.body["id"].as_str().unwrap().to_string();
        let key = prefixgate::policy::conversation::response_key(&id);
        assert_eq!(gws[1].gw.pins.replica_of(key), None, "instance 1 cannot have heard of it");
        let follow = json!({"model": "sim-model", "input": "again", "previous_response_id": id});
        let r = post_with(&url(&gws[1]), &follow, &[]).await;
        assert_eq!((r.status, r.replica.as_str(), r.route.as_str()), (200, first.replica.as_str(), "response"));
        assert_eq!(gws[1].gw.pins.replica_of(key).as_deref(), Some(first.replica.as_str()), "recorded");
    }
    let text = gws[1].gw.metrics.encode();
    assert!(text.lines().any(|l| l == r#"prefixgate_stored_response_lookups_total{result="replica"} 4"#), "{text}");
    // An id nobody holds is forwarded, and the engine's own 404 comes back.
    let r = post_with(
        &url(&gws[1]),
        &json!({"model": "sim-model", "input": "x", "previous_response_id": "resp_nobody"}),
        &[],
    )
    .await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (404, Some("response_not_found")));
    for gw in gws {
        gw.stop().await;
    }
}

/// A TCP front for the test's Redis that, while `slow` is set, holds every
/// answer for `delay` before passing it on: a Redis across a congested link.
struct SlowLink {
    addr: std::net::SocketAddr,
    slow: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowLink {
    async fn start(redis: &Redis, delay: Duration) -> SlowLink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let slow = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (socket, flag) = (redis.socket.clone(), slow.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::UnixStream::connect(&socket).await else { continue };
                let flag = flag.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let (mut client_rx, mut client_tx) = client.into_split();
                    let (mut server_rx, mut server_tx) = server.into_split();
                    let asks = async move { tokio::io::copy(&mut client_rx, &mut server_tx).await };
                    let answers = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = server_rx.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<_, std::io::Error>(());
                            }
                            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                                tokio::time::sleep(delay).await;
                            }
                            client_tx.write_all(&buf[..n]).await?;
                        }
                    };
                    let _ = futures_util::future::join(asks, answers).await;
                });
            }
        });
        SlowLink { addr, slow, task }
    }

    fn set_slow(&self, slow: bool) {
        self.slow.store(slow, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Issue 32: the store is reached asynchronously. A Redis that answers after
/// 2 s holds the admin action that writes to it (and only that action: the
/// admin API's reads go on), while `/v1` requests, new sessions and
/// continuations alike, never wait for it.
#[actix_web::test]
async fn a_redis_that_answers_after_two_seconds_holds_admin_actions_and_never_a_request() {
    let Some(redis) = Redis::start() else { return };
    let link = SlowLink::start(&redis, Duration::from_secs(2)).await;
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let mut c = shared_config(&[&a, &b], &redis, "gw0");
    c.store.url = Some(format!("redis://{}", link.addr));
    // The hold on: a new session's placement reads the fleet's loads and
    // admits itself in the store, when the store answers.
    c.sessions.max_wait_ms = 10_000;
    c.sessions.hold_min_tokens = Some(1);
    let gw = start_gateway(c).await;
    let system = text("slow store system prompt", 600);
    assert_eq!(chat(&gw, &[("system", &system), ("user", "before")]).await.status, 200);

    link.set_slow(true);
    wait_until("the flusher noticed the slow store", Duration::from_secs(10), || {
        !gw.gw.store_up.load(std::sync::atomic::Ordering::Acquire)
    })
    .await;
    // An admin action waits on the store, in a task of its own.
    let drain = {
        let url = format!("{}/admin/v1/replicas/b/drain", gw.admin);
        actix_web::rt::spawn(async move {
            let started = Instant::now();
            let (status, _) = admin("POST", &url, None, None).await;
            (status, started.elapsed())
        })
    };
    // Meanwhile: requests, new sessions (placed with the hold on) and
    // continuations, each far quicker than one store answer.
    for i in 0..20 {
        let started = Instant::now();
        let turn = if i % 2 == 0 {
            chat(&gw, &[("system", &text(&format!("new session {i}"), 600)), ("user", "hi")]).await
        } else {
            chat(&gw, &[("system", &system), ("user", "before"), ("assistant", "ok"), ("user", &format!("more {i}"))])
                .await
        };
        assert_eq!(turn.status, 200, "{}", turn.body);
        let took = started.elapsed();
        // A request that waited would have waited a placement's store budget (250 ms).
        assert!(took < Duration::from_millis(150), "request {i} waited on the store: {took:?}");
    }
    // The admin API's reads answer while the action waits.
    let started = Instant::now();
    let (status, _) = admin("GET", &format!("{}/admin/v1/replicas", gw.admin), None, None).await;
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_millis(400), "a read waited behind the action");
    // The action itself waited for the store and, refused by its timeout, changed nothing.
    let (status, took) = drain.await.unwrap();
    assert_eq!(status, 500, "the store write timed out");
    assert!(took >= prefixgate::store::redis_store_timeout(), "it waited for the store ({took:?})");
    assert_eq!(gw.gw.fleet.get("b").unwrap().admin(), AdminState::Active);

    // The store answers again: the instance is back in step, and the action goes through.
    link.set_slow(false);
    wait_until("the store answers again", Duration::from_secs(10), || {
        gw.gw.store_up.load(std::sync::atomic::Ordering::Acquire)
    })
    .await;
    let (status, _) = admin("POST", &format!("{}/admin/v1/replicas/b/drain", gw.admin), None, None).await;
    assert_eq!(status, 200);
    gw.stop().await;
}

/// Issue 49: an agent that replaces a status line every turn, each turn on
/// the next of three instances with no pause, the flusher slowed to 10 s:
/// the boundaries a turn passed reach the next instance in its
/// announcement, so the next turn finds the same match there.
#[actix_web::test]
async fn a_turn_whose_tail_was_rewritten_finds_its_conversation_on_the_next_instance() {
    let Some(redis) = Redis::start() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gws = announcing_only(&[&a, &b], &redis, 3).await;
    let task = text("a task whose status line is rewritten", 2_000);
    let mut history = vec![("system".to_string(), "You are an agent.".to_string()), ("user".to_string(), task)];
    let mut home = String::new();
    for turn in 0..6usize {
        let mut sent = history.clone();
        sent.push(("user".into(), format!("Tool-call turn {turn} of 100.")));
        let view: Vec<(&str, &str)> = sent.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        let r = chat(&gws[turn % 3], &view).await;
        assert_eq!(r.status, 200);
        if turn == 0 {
            home = r.replica.clone();
        } else {
            assert_eq!((r.replica.as_str(), r.route.as_str()), (home.as_str(), "pinned"), "turn {turn}");
            assert!(cached_tokens(&r) > 1_000, "turn {turn} is warm");
        }
        history.push(("assistant".into(), format!("calling tool {turn}")));
        history.push(("user".into(), format!("tool result {turn}")));
    }
    for gw in gws {
        gw.stop().await;
    }
}
