//! Active health checks. The transition rule is a pure function (`next`);
//! the loop around it only does I/O. A replica flips only after `rise`
//! consecutive good or `fall` consecutive bad probes (an unknown replica
//! takes the first verdict), so one slow probe does not flap it.
//!
//! Engine facts this respects: llama-cpp-python has no `/health` (404: we
//! fall back to `/v1/models`), and a busy single-slot engine may answer a
//! probe only after its running prefill: a probe *timeout* while requests
//! are in flight is not a verdict. Models are refreshed from `/v1/models`
//! only while the replica is idle, because some engines end a running stream
//! when any other request arrives.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Fleet, Health, Replica};
use crate::events::{EventKind, EventLog};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeResult {
    Ok,
    Failed,
    /// No verdict (timed out while busy).
    Inconclusive,
}

/// The health after a probe, given the streaks *including* this probe.
pub fn next(current: Health, result: ProbeResult, ok_streak: u32, fail_streak: u32, rise: u32, fall: u32) -> Health {
    match (current, result) {
        (_, ProbeResult::Inconclusive) => current,
        (Health::Unknown, ProbeResult::Ok) => Health::Up,
        (Health::Unknown, ProbeResult::Failed) => Health::Down,
        (Health::Down, ProbeResult::Ok) if ok_streak >= rise => Health::Up,
        (Health::Up, ProbeResult::Failed) if fail_streak >= fall => Health::Down,
        (h, _) => h,
    }
}

/// What was seen of a replica's health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// A health probe's verdict; `epoch` is `HealthTracker::epoch` read when
    /// the probe started.
    Probe { result: ProbeResult, error: Option<String>, epoch: u64 },
    /// A request could not connect: the replica is down now, whatever the
    /// streaks say (the failover path needs it out of rotation at once).
    ConnectionFailed { error: String },
}

/// The one writer of replica health. Probes and failed connections both
/// report here; each observation is applied under the replica's probe lock,
/// so a probe that was in flight when a connection failed cannot flip the
/// replica back up with its stale verdict (its epoch is older).
pub struct HealthTracker {
    rise: u32,
    fall: u32,
    events: Arc<EventLog>,
}

impl HealthTracker {
    pub fn new(rise: u32, fall: u32, events: Arc<EventLog>) -> HealthTracker {
        HealthTracker { rise, fall, events }
    }

    /// The engine said it is over its pool (vLLM's own word: `why`) at
    /// `load` tokens of resident sessions: the replica is over its wall in
    /// practice and takes no new session above that load
    /// (`Residents::engine_preemptions`, `Residents::engine_full`).
    pub fn engine_over_wall(&self, r: &Replica, load: u64, why: &str) {
        let detail = format!("{why} at ~{load} tokens resident: no new session above that load");
        tracing::warn!(replica = %r.id, "{detail}");
        self.events.record(EventKind::KvWallSeen, Some(&r.id), None, detail);
    }

    /// A wall no loss confirmed for `wall::WALL_MEMORY_MS` was forgotten.
    pub fn wall_forgotten(&self, r: &Replica, wall: u64) {
        let minutes = crate::fleet::wall::WALL_MEMORY_MS / 60_000;
        let detail = format!(
            "no lost prefix confirmed the wall at ~{wall} tokens for {minutes} minutes: forgotten, new sessions \
             are admitted up to the replica's capacity again"
        );
        tracing::info!(replica = %r.id, "{detail}");
        self.events.record(EventKind::KvWallForgotten, Some(&r.id), None, detail);
    }

    /// Read before a probe starts; passed back with its result.
    pub fn epoch(&self, r: &Replica) -> u64 {
        r.probe.lock().expect("probe lock").epoch
    }

    /// Applies one observation; returns true when it took the replica down.
    pub fn observe(&self, r: &Replica, obs: Observation, now_ms: u64) -> bool {
        let (prev, now, error) = {
            let mut p = r.probe.lock().expect("probe lock");
            let prev = r.health();
            match obs {
                Observation::ConnectionFailed { error } => {
                    p.epoch += 1;
                    p.ok_streak = 0;
                    p.last_error = Some(error);
                    r.set_health(Health::Down);
                    // Recorded by the failover path, which knows where the request went.
                    return prev != Health::Down;
                }
                Observation::Probe { epoch, .. } if epoch != p.epoch => return false,
                Observation::Probe { result, error, .. } => {
                    match result {
                        ProbeResult::Ok => {
                            p.ok_streak += 1;
                            p.fail_streak = 0;
                            p.last_error = None;
                        }
                        ProbeResult::Failed => {
                            p.fail_streak += 1;
                            p.ok_streak = 0;
                            p.last_error = error.clone();
                        }
                        ProbeResult::Inconclusive => {}
                    }
                    p.last_check_ms = Some(now_ms);
                    let now = next(prev, result, p.ok_streak, p.fail_streak, self.rise, self.fall);
                    r.set_health(now);
                    (prev, now, error)
                }
            }
        };
        match (prev, now) {
            (Health::Up | Health::Unknown, Health::Down) => {
                self.events.record(EventKind::ReplicaDown, Some(&r.id), None, error.unwrap_or_default());
                true
            }
            (Health::Down, Health::Up) => {
                self.events.record(EventKind::ReplicaUp, Some(&r.id), None, "health checks pass again");
                false
            }
            _ => false,
        }
    }
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// How often every replica is probed.
    pub interval_ms: u64,
    /// A probe with no answer within this is a failure (unless the replica is busy).
    pub timeout_ms: u64,
    /// Consecutive successes before a down replica is up again.
    pub rise: u32,
    /// Consecutive failures before an up replica is down.
    pub fall: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig { interval_ms: 5_000, timeout_ms: 3_000, rise: 2, fall: 2 }
    }
}

/// The prober: runs forever on the current actix runtime. It only does I/O
/// and reports; the tracker decides.
pub async fn run(cfg: HealthConfig, connect_timeout: Duration, fleet: Arc<Fleet>, tracker: Arc<HealthTracker>) {
    let client = awc::Client::builder()
        .connector(crate::connector::connector(connect_timeout))
        .timeout(Duration::from_millis(cfg.timeout_ms))
        .finish();
    let interval = Duration::from_millis(cfg.interval_ms);
    probe_every(interval, &fleet, |r| check(&tracker, &client, r)).await
}

/// The prober's schedule, apart from its I/O so that it runs on paused time
/// in tests: every replica checked at once, then every `interval`, and
/// again when asked (`Fleet::probe_now`: a replica was discovered).
pub async fn probe_every<F, Fut>(interval: Duration, fleet: &Fleet, check: F)
where
    F: Fn(Arc<Replica>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        let snapshot = fleet.snapshot_owned();
        futures_util::future::join_all(snapshot.iter().map(|r| check(r.clone()))).await;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = fleet.probe_now.notified() => {}
        }
    }
}

/// One probe of one replica, reported to the tracker.
pub async fn check(tracker: &HealthTracker, client: &awc::Client, r: Arc<Replica>) {
    let epoch = tracker.epoch(&r);
    let spec = r.spec_owned();
    let busy = r.inflight() > 0;
    // A keyed engine refuses unkeyed calls, /v1/models and /metrics too:
    // every probe carries the replica's key, as its requests do.
    let get = |path: &str| {
        let req = client.get(format!("{}{path}", spec.url));
        match spec.own_credentials() {
            Some(credentials) => req.insert_header((awc::http::header::AUTHORIZATION, credentials)),
            None => req,
        }
    };
    let (mut result, mut error) = probe(get(spec.health_path()), busy).await;
    if result == ProbeResult::Failed && spec.health_path.is_none() && error.as_deref() == Some("404") {
        (result, error) = probe(get("/v1/models"), busy).await;
    }
    if result == ProbeResult::Ok && (!busy || r.models().is_empty()) {
        if let Some(models) = fetch_models(get("/v1/models")).await {
            r.set_models(models);
        }
    }
    // vLLM's metrics, busy or not: its preemptions happen while it is busy.
    let metrics = match result {
        ProbeResult::Ok => fetch_text(get("/metrics")).await,
        _ => None,
    };
    let now = crate::clock::now_ms();
    if let Some(total) = metrics.as_deref().and_then(preemptions_from_vllm_metrics) {
        if let Some(load) = r.residents.engine_preemptions(total, now) {
            tracker.engine_over_wall(&r, load, "the engine preempted requests (vllm:num_preemptions_total rose)");
        }
    }
    if metrics.as_deref().is_some_and(pool_full_in_vllm_metrics) {
        if let Some(load) = r.residents.engine_full(now) {
            tracker.engine_over_wall(
                &r,
                load,
                "the engine's pool is full with requests waiting (vllm:kv_cache_usage_perc)",
            );
        }
    }
    if let Some(wall) = r.residents.evidence.forget_stale_wall(now) {
        tracker.wall_forgotten(&r, wall);
    }
    if result == ProbeResult::Ok && !busy {
        // vLLM reports its KV capacity; other engines 404 here, which is fine.
        // An observation of the replica, as its models are: the capacity
        // verdict reads it from there.
        let kv = metrics.as_deref().and_then(kv_tokens_from_vllm_metrics);
        // llama.cpp's server says its slots and their context instead.
        let slots = match kv {
            Some(_) => None,
            None => fetch_text(get("/props")).await.and_then(|t| slots_from_llama_props(&t)),
        };
        r.set_observed_kv(kv.or(slots.map(|(n, ctx)| n * ctx)));
        r.set_slot_tokens(slots.map(|(_, ctx)| ctx));
    }
    tracker.observe(&r, Observation::Probe { result, error, epoch }, crate::clock::now_ms());
}

async fn probe(req: awc::ClientRequest, busy: bool) -> (ProbeResult, Option<String>) {
    match req.send().await {
        Ok(resp) if resp.status().is_success() => (ProbeResult::Ok, None),
        Ok(resp) => (ProbeResult::Failed, Some(resp.status().as_u16().to_string())),
        Err(awc::error::SendRequestError::Timeout) if busy => (ProbeResult::Inconclusive, None),
        Err(e) => (ProbeResult::Failed, Some(e.to_string())),
    }
}

async fn fetch_text(req: awc::ClientRequest) -> Option<String> {
    let mut resp = req.send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.body().limit(8 * 1024 * 1024).await.ok()?;
    String::from_utf8(body.to_vec()).ok()
}

async fn fetch_models(req: awc::ClientRequest) -> Option<Vec<String>> {
    let text = fetch_text(req).await?;
    let list: ModelList = serde_json::from_str(&text).ok()?;
    Some(list.data.into_iter().map(|m| m.id).collect())
}

/// llama.cpp's `/props`: `total_slots` and one slot's context
/// (`default_generation_settings.n_ctx`), as (slots, tokens per slot). Each
/// slot keeps one conversation's prefix; with `--cache-ram 0` that is all
/// the prompt cache there is (with a RAM cache, declare `kv_tokens`).
pub fn slots_from_llama_props(text: &str) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let slots = v.get("total_slots")?.as_u64().filter(|n| *n > 0)?;
    let ctx = v.get("default_generation_settings")?.get("n_ctx")?.as_u64().filter(|n| *n > 0)?;
    Some((slots, ctx))
}

/// vLLM's `vllm:num_preemptions_total` (summed over its label sets) from a
/// metrics page; None when the engine reports none.
pub fn preemptions_from_vllm_metrics(text: &str) -> Option<u64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("vllm:num_preemptions_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() as u64)
}

/// `vllm:kv_cache_usage_perc` at or above this (a fraction: vLLM's gauge
/// runs from 0 to 1) with requests waiting: the pool is full now.
pub const POOL_FULL_USAGE: f64 = 0.95;

/// Whether vLLM's pool is full now: the blocks of its running requests
/// (`vllm:kv_cache_usage_perc`; cached prefixes not counted) fill at least
/// `POOL_FULL_USAGE` of it while requests wait (`vllm:num_requests_waiting`).
/// Either alone says little: an idle engine reads 0 however much it caches,
/// and requests also wait for the engine's batch limits.
pub fn pool_full_in_vllm_metrics(text: &str) -> bool {
    let values = |name: &str| -> Vec<f64> {
        text.lines()
            .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect()
    };
    let usage = values("vllm:kv_cache_usage_perc").into_iter().fold(0.0, f64::max);
    let waiting: f64 = values("vllm:num_requests_waiting").iter().sum();
    usage >= POOL_FULL_USAGE && waiting > 0.0
}

/// Parses `vllm:cache_config_info{...num_gpu_blocks="N",block_size="B"...}` from a metrics page.
pub fn kv_tokens_from_vllm_metrics(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let label = |name: &str| -> Option<u64> {
        let start = line.find(&format!("{name}=\""))? + name.len() + 2;
        line[start..].split('"').next()?.parse().ok()
    };
    Some(label("num_gpu_blocks")? * label("block_size")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama_cpp_slots() {
        let props = r#"{"total_slots":1,"default_generation_settings":{"n_ctx":8192,"id":0},"model_path":"m.gguf"}"#;
        assert_eq!(slots_from_llama_props(props), Some((1, 8_192)));
        assert_eq!(slots_from_llama_props(r#"{"total_slots":0}"#), None);
        assert_eq!(slots_from_llama_props("not json"), None);
    }

    #[test]
    fn parses_vllm_preemptions() {
        let page =
            "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_preemptions_total{engine=\"1\",model_name=\"m\"} 2.0\nvllm:num_requests_running 1\n";
        assert_eq!(preemptions_from_vllm_metrics(page), Some(5));
        assert_eq!(preemptions_from_vllm_metrics("vllm:num_requests_running 1\n"), None);
    }

    #[test]
    fn a_vllm_pool_is_full_when_running_blocks_fill_it_and_requests_wait() {
        let page = |usage: &str, waiting: &str| {
            format!(
                "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n\
                 vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n\
                 vllm:num_requests_waiting_by_reason{{reason=\"capacity\"}} 9.0\n"
            )
        };
        assert!(pool_full_in_vllm_metrics(&page("0.97", "2.0")));
        assert!(!pool_full_in_vllm_metrics(&page("0.97", "0.0")), "full but nothing waits: not over");
        assert!(!pool_full_in_vllm_metrics(&page("0.5", "3.0")), "waiting for batch limits, room left");
        assert!(!pool_full_in_vllm_metrics("vllm:num_requests_running 1\n"), "not vLLM");
    }

    #[test]
    fn parses_vllm_cache_config_info() {
        let text =
            "# HELP x\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",num_gpu_blocks=\"7664\"} 1.0\n";
        assert_eq!(kv_tokens_from_vllm_metrics(text), Some(122_624));
        assert_eq!(kv_tokens_from_vllm_metrics("vllm:num_requests_running 1"), None);
    }
    use ProbeResult::*;

    #[test]
    fn flips_only_after_rise_or_fall_consecutive_results() {
        assert_eq!(next(Health::Unknown, Ok, 1, 0, 2, 3), Health::Up);
        assert_eq!(next(Health::Unknown, Failed, 0, 1, 2, 3), Health::Down);
        assert_eq!(next(Health::Up, Failed, 0, 2, 2, 3), Health::Up);
        assert_eq!(next(Health::Up, Failed, 0, 3, 2, 3), Health::Down);
        assert_eq!(next(Health::Down, Ok, 1, 0, 2, 3), Health::Down);
        assert_eq!(next(Health::Down, Ok, 2, 0, 2, 3), Health::Up);
        assert_eq!(next(Health::Up, Inconclusive, 0, 9, 2, 3), Health::Up);
    }

    fn tracker() -> HealthTracker {
        HealthTracker::new(1, 1, Arc::new(EventLog::new(100, 100, None, Vec::new()).0))
    }

    #[test]
    fn a_probe_that_started_before_a_connection_failure_cannot_bring_the_replica_back() {
        let t = tracker();
        let r = Replica::new(super::super::ReplicaSpec::new("a", "http://x"), super::super::AdminState::Active);
        t.observe(&r, Observation::Probe { result: Ok, error: None, epoch: t.epoch(&r) }, 1);
        assert_eq!(r.health(), Health::Up);
        // A probe starts, then a request's connection fails, then the probe answers 200.
        let stale = t.epoch(&r);
        assert!(t.observe(&r, Observation::ConnectionFailed { error: "refused".into() }, 2));
        assert!(!t.observe(&r, Observation::ConnectionFailed { error: "refused".into() }, 2), "one transition");
        t.observe(&r, Observation::Probe { result: Ok, error: None, epoch: stale }, 3);
        assert_eq!(r.health(), Health::Down, "the stale verdict was ignored");
        // A probe that started after the failure counts (rise = 1 here).
        t.observe(&r, Observation::Probe { result: Ok, error: None, epoch: t.epoch(&r) }, 4);
        assert_eq!(r.health(), Health::Up);
        assert_eq!(r.probe_state().last_check_ms, Some(4));
    }
}
