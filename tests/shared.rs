//! Issue 11: several gateway instances sharing one fleet through a real
//! Redis (`redis-server`, started by each test on a unix socket of its own:
//! no ports, nothing kept between tests). `.ci/run` installs Redis; outside
//! CI a machine without `redis-server` skips these with a message.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use prefixgate::config::Config;
use prefixgate::fleet::AdminState;
use prefixgate::store::{RedisStore, Store};
use serde_json::json;

struct Redis {
    child: Child,
    url: String,
    socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Option<Redis> {
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
        let child = match child {
            Ok(c) => c,
            Err(_) => {
                assert!(std::env::var("CI").is_err(), "CI must install redis-server (see .ci/run)");
                eprintln!("skipped: redis-server is not installed (apt-get install -y redis-server)");
                return None;
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        let url = format!("redis+unix://{}", socket.display());
        Some(Redis { child, url, socket, _dir: dir })
    }

    /// Kills the server; `restart` brings one back on the same socket, empty.
    fn kill(&mut self) {
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
        while !self.socket.exists() {
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
    let mut c = test_config(sims);
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

/// The documented bound: a pin is visible on another instance within the
/// writer's flush interval (50 ms here) plus one pub/sub hop.
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
    let gws = instances(&[&a, &b], &redis, 1).await;
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
    redis.restart();
    wait_until("back", Duration::from_secs(10), || gw.gw.store_up.load(std::sync::atomic::Ordering::Acquire)).await;
    let kinds = [prefixgate::events::EventKind::StoreUnreachable, prefixgate::events::EventKind::StoreReachable];
    assert!(kinds.iter().all(|k| gw.gw.events.count(*k) == 1), "one event per transition");
    // The restarted Redis was empty: every pin written during the outage is there now.
    let reader = RedisStore::open(&redis.url, "reader").unwrap();
    let stored: std::collections::HashSet<u128> = reader.pins().unwrap().into_iter().map(|(k, _)| k).collect();
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
    }
    for gw in gws {
        gw.stop().await;
    }
}

#[test]
fn store_copy_moves_everything_from_sled_to_redis_and_back() {
    let Some(redis) = Redis::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let sled_url = format!("sled:{}", dir.path().join("a").display());
    let back_url = format!("sled:{}", dir.path().join("b").display());
    let src = prefixgate::store::open_url(&sled_url, "t").unwrap();
    src.put_replica(&prefixgate::store::StoredReplica {
        spec: prefixgate::fleet::ReplicaSpec::new("gpu-0", "http://127.0.0.1:1"),
        admin: AdminState::Draining,
    })
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
            };
            (k << 64 | k, Some(pin))
        })
        .collect();
    src.write_pins(&pins).unwrap();
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
        };
        src.append_event(&e, None).unwrap();
    }
    src.put_setting("policy", &json!({"mode": "roundrobin", "identity": {"block_bytes": 64, "block_tokens": 8}}))
        .unwrap();
    drop(src);
    for (from, to) in [(&sled_url, &redis.url), (&redis.url, &back_url)] {
        let out = Command::new(env!("CARGO_BIN_EXE_prefixgate"))
            .args(["store", "copy", "--from", from, "--to", to])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("1 replica(s), 1000 pin(s), 5 event(s), 1 setting(s)"));
    }
    let (a, b) =
        (prefixgate::store::open_url(&sled_url, "t").unwrap(), prefixgate::store::open_url(&back_url, "t").unwrap());
    let sorted = |s: &Arc<dyn Store>| {
        let mut p = s.pins().unwrap();
        p.sort_by_key(|(k, _)| *k);
        p
    };
    assert_eq!(sorted(&a), sorted(&b));
    assert_eq!(a.replicas().unwrap(), b.replicas().unwrap());
    assert_eq!(a.events().unwrap(), b.events().unwrap());
    assert_eq!(a.setting("policy").unwrap(), b.setting("policy").unwrap());
}
