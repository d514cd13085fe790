//! Issue 12's defects, each with the test that would have caught it:
//! operator actions that changed memory before a failed store write, pin
//! deletes without history, a GET that recorded events, a raised admission
//! limit that woke nobody, and a shutdown that cut streams after 30 s.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use actix_web::test as atest;
use futures_util::StreamExt;
use prefixgate::events::{Event, EventKind};
use prefixgate::pins::{Pin, PinChange};
use prefixgate::policy::PrefixKey;
use prefixgate::store::{MemoryStore, Store, StoreError, StoredReplica};
use serde_json::{json, Value};

/// A memory store whose writes fail while `broken` is set, and take a
/// second while `slow` is set (a Redis across a congested link).
#[derive(Default)]
struct FlakyStore {
    inner: MemoryStore,
    broken: AtomicBool,
    slow: AtomicBool,
}

impl FlakyStore {
    async fn check(&self) -> Result<(), StoreError> {
        if self.slow.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if self.broken.load(Ordering::SeqCst) {
            return Err(StoreError::Backend("disk on fire".into()));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Store for FlakyStore {
    fn is_new(&self) -> bool {
        self.inner.is_new()
    }
    async fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError> {
        self.inner.replicas().await
    }
    async fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError> {
        self.check().await?;
        self.inner.put_replica(r).await
    }
    async fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        self.check().await?;
        self.inner.delete_replica(id).await
    }
    async fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError> {
        self.inner.pins().await
    }
    async fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        self.inner.write_pins(changes).await
    }
    async fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError> {
        self.inner.append_event(e, dropped_up_to).await
    }
    async fn events(&self) -> Result<Vec<Event>, StoreError> {
        self.inner.events().await
    }
    async fn setting(&self, key: &str) -> Result<Option<Value>, StoreError> {
        self.inner.setting(key).await
    }
    async fn put_setting(&self, key: &str, value: &Value) -> Result<(), StoreError> {
        self.check().await?;
        self.inner.put_setting(key, value).await
    }
    async fn settings(&self, prefix: &str) -> Result<Vec<(String, Value)>, StoreError> {
        self.inner.settings(prefix).await
    }
    async fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush().await
    }
}

#[actix_web::test]
async fn an_operator_action_whose_write_fails_changes_nothing_in_memory() {
    let a = start_sim("a", fast_sim()).await;
    let store = Arc::new(FlakyStore::default());
    let gw = start_gateway_with_store(test_config(&[&a]), store.clone()).await;
    let base = format!("{}/admin/v1", gw.admin);
    store.broken.store(true, Ordering::SeqCst);
    let events_before = gw.gw.events.query(&prefixgate::events::EventFilter { limit: 1000, ..Default::default() });
    for (method, url, body) in [
        ("POST", format!("{base}/replicas/a/drain"), None),
        ("POST", format!("{base}/replicas/a/disable"), None),
        ("PATCH", format!("{base}/replicas/a"), Some(json!({"max_large_inflight": 3}))),
        ("POST", format!("{base}/replicas"), Some(json!({"id": "b", "url": "http://127.0.0.1:9"}))),
        ("DELETE", format!("{base}/replicas/a"), None),
        (
            "PUT",
            format!("{base}/policy"),
            Some(json!({"mode": "roundrobin", "identity": {"block_bytes": 8, "block_tokens": 8}})),
        ),
    ] {
        let (s, v) = admin(method, &url, None, body).await;
        assert_eq!(s, 500, "{method} {url}: {v}");
        assert_eq!(v["error"]["code"], "internal_error");
    }
    let r = gw.gw.fleet.get("a").expect("still there");
    assert_eq!(r.admin(), prefixgate::fleet::AdminState::Active);
    assert_eq!(r.spec().max_large_inflight, None);
    assert!(gw.gw.fleet.get("b").is_none());
    assert_eq!(gw.gw.policy.get().mode, prefixgate::policy::Mode::Shape);
    let events_after = gw.gw.events.query(&prefixgate::events::EventFilter { limit: 1000, ..Default::default() });
    assert_eq!(events_before, events_after, "no event for an action that did not happen");
    // The store is back: the same action now works.
    store.broken.store(false, Ordering::SeqCst);
    let (s, v) = admin("POST", &format!("{base}/replicas/a/drain"), None, None).await;
    assert_eq!((s, v["admin_state"].as_str()), (200, Some("draining")));
    assert_eq!(store.replicas().await.unwrap()[0].admin, prefixgate::fleet::AdminState::Draining);
    gw.stop().await;
}

#[actix_web::test]
async fn deleting_pins_through_the_api_is_recorded_in_history() {
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&a])).await;
    chat(&gw, &[("user", "one")]).await;
    chat(&gw, &[("user", "two")]).await;
    let (_, page) = admin("GET", &format!("{}/admin/v1/pins", gw.admin), None, None).await;
    let key = page["items"][0]["key"].as_str().unwrap().to_string();
    let (s, _) = admin("DELETE", &format!("{}/admin/v1/pins/{key}", gw.admin), None, None).await;
    assert_eq!(s, 204);
    // Two pins and their messages' leads, one of the four deleted.
    let (s, v) = admin("DELETE", &format!("{}/admin/v1/replicas/a/pins", gw.admin), None, None).await;
    assert_eq!((s, v["removed"].as_u64()), (200, Some(3)));
    let (_, events) = admin("GET", &format!("{}/admin/v1/events?kind=pins_deleted", gw.admin), None, None).await;
    let details: Vec<&str> =
        events["items"].as_array().unwrap().iter().map(|e| e["detail"].as_str().unwrap()).collect();
    assert_eq!(details, [String::from("3 pin(s) deleted"), format!("pin {key} deleted")]);
    gw.stop().await;
}

#[actix_web::test]
async fn get_capacity_reports_without_recording_anything() {
    // No background tasks: the app alone, so only the GET could record events.
    let mut config = test_config(&[]);
    config.replicas = vec![prefixgate::fleet::ReplicaSpec {
        kv_tokens: Some(100),
        ..prefixgate::fleet::ReplicaSpec::new("a", "http://127.0.0.1:9")
    }];
    let state = prefixgate::state::AppState::open(config).await.unwrap();
    let replica: Arc<str> = Arc::from("a");
    let _running = state.capacity.running.worker().begin(&replica, None, 1_000);
    let app = atest::init_service(prefixgate::create_admin_app(actix_web::web::Data::from(state.clone()))).await;
    for _ in 0..3 {
        let req = atest::TestRequest::get().uri("/admin/v1/capacity").to_request();
        let report: Value = atest::call_and_read_body_json(&app, req).await;
        assert_eq!(report["verdict"], "over_capacity", "{report}");
    }
    assert_eq!(state.events.count(EventKind::CapacityWarning), 0, "a GET must not change state");
    // The background evaluation is what records the transition, once.
    for _ in 0..2 {
        let since = state.capacity.since_ms(prefixgate::clock::now_ms());
        state.capacity.evaluate(&state.fleet.capacity_inputs(since), &state.events);
    }
    assert_eq!(state.events.count(EventKind::CapacityWarning), 2, "one for the replica, one for the fleet");
}

#[actix_web::test]
async fn raising_max_large_inflight_wakes_a_waiting_request_at_once() {
    let a = start_sim("a", slow_decoder(20.0)).await;
    let mut config = test_config(&[&a]);
    config.replicas[0].max_large_inflight = Some(1);
    config.admission.wait_ms = 60_000;
    let gw = start_gateway(config).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let mut holder = client().post(&url).send_json(&large_stream("holder", 200)).await.unwrap();
    assert_eq!(holder.status(), 200);
    let _ = holder.next().await;
    let waiting = actix_web::rt::spawn({
        let url = url.clone();
        async move { client().post(&url).send_json(&large_stream("waiter", 200)).await.map(|r| r.status().as_u16()) }
    });
    wait_until("queued", Duration::from_secs(5), || gw.gw.fleet.get("a").unwrap().large_slots.queued() == 1).await;
    let (s, _) =
        admin("PATCH", &format!("{}/admin/v1/replicas/a", gw.admin), None, Some(json!({"max_large_inflight": 2})))
            .await;
    assert_eq!(s, 200);
    // The holder streams for ~10 s more; the waiter must not wait for it.
    let status = tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("woken by the PATCH");
    assert_eq!(status.unwrap().unwrap(), 200);
    // The waiter hung up after its head: its slot came back, the holder's is still taken.
    wait_until("waiter's slot released", Duration::from_secs(5), || {
        gw.gw.fleet.get("a").unwrap().large_slots.in_use() == 1
    })
    .await;
    drop(holder);
    gw.stop().await;
}

/// Streams one slow answer and reports (ended with [DONE], seconds it took).
async fn one_slow_stream(url: String) -> (bool, f64) {
    let started = Instant::now();
    let body = chat_body(&[("user", "a long answer")], json!({"stream": true, "max_tokens": 30}));
    let mut resp = client().post(&url).send_json(&body).await.unwrap();
    let mut text = Vec::new();
    while let Some(Ok(chunk)) = resp.next().await {
        text.extend_from_slice(&chunk);
    }
    (String::from_utf8_lossy(&text).trim_end().ends_with("data: [DONE]"), started.elapsed().as_secs_f64())
}

#[actix_web::test]
async fn shutdown_waits_for_streams_as_long_as_configured_and_no_longer() {
    // 30 tokens at 10 tokens/s: a 3 s stream. The old hard-coded limit (30 s)
    // is scaled down to a 1 s grace here, against a 10 s one.
    for (grace, finishes) in [(1, false), (10, true)] {
        let a = start_sim("a", slow_decoder(10.0)).await;
        let mut config = test_config(&[&a]);
        config.timeouts.shutdown_grace_secs = grace;
        let gw = start_gateway(config).await;
        let stream = actix_web::rt::spawn(one_slow_stream(format!("{}/v1/chat/completions", gw.base)));
        let replica = gw.gw.fleet.get("a").unwrap();
        wait_until("in flight", Duration::from_secs(5), || replica.inflight() == 1).await;
        let stopping = Instant::now();
        gw.stop().await;
        let stopped_after = stopping.elapsed().as_secs_f64();
        let (complete, _) = stream.await.unwrap();
        assert_eq!(complete, finishes, "grace {grace} s");
        if finishes {
            assert!(stopped_after >= 2.0, "the stop waited for the stream ({stopped_after:.1} s)");
        } else {
            assert!(stopped_after < 2.9, "the stop did not wait past its grace ({stopped_after:.1} s)");
        }
    }
}

/// Issue 25: an admin action waits on the store off the admin listener's
/// one worker: a slow store write does not stall the other admin requests.
#[actix_web::test]
async fn a_slow_store_write_does_not_hold_the_admin_worker() {
    let a = start_sim("a", fast_sim()).await;
    let store = Arc::new(FlakyStore::default());
    let gw = start_gateway_with_store(test_config(&[&a]), store.clone()).await;
    store.slow.store(true, Ordering::SeqCst);
    let drain_url = format!("{}/admin/v1/replicas/a/drain", gw.admin);
    let drain = admin("POST", &drain_url, None, None);
    let list = async {
        // Sent once the drain is waiting on the store.
        actix_web::rt::time::sleep(Duration::from_millis(200)).await;
        let listed = admin("GET", &format!("{}/admin/v1/replicas", gw.admin), None, None).await;
        (listed, Instant::now())
    };
    let ((drained, drained_at), (listed, listed_at)) =
        futures_util::join!(async { (drain.await, Instant::now()) }, list);
    assert_eq!((drained.0, listed.0), (200, 200));
    assert!(listed_at < drained_at, "the list waited for the drain's store write");
    store.slow.store(false, Ordering::SeqCst);
    gw.stop().await;
}
