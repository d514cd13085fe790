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

use serde::Deserialize;

use super::{Health, Replica};
use crate::events::EventKind;
use crate::gateway::Gateway;

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

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// Runs forever on the current actix runtime.
pub async fn run(gw: Arc<Gateway>) {
    let cfg = gw.config.health.clone();
    let client = awc::Client::builder()
        .connector(crate::proxy::connector(Duration::from_millis(gw.config.timeouts.connect_ms)))
        .timeout(Duration::from_millis(cfg.timeout_ms))
        .finish();
    loop {
        let fleet = gw.fleet.snapshot();
        let probes = fleet.iter().map(|r| check(&gw, &client, r.clone()));
        futures_util::future::join_all(probes).await;
        tokio::time::sleep(Duration::from_millis(cfg.interval_ms)).await;
    }
}

/// One probe of one replica, applied to its state.
pub async fn check(gw: &Gateway, client: &awc::Client, r: Arc<Replica>) {
    let spec = r.spec();
    let busy = r.inflight() > 0;
    let (mut result, mut error) = probe(client, &spec.url, spec.health_path(), busy).await;
    if result == ProbeResult::Failed && spec.health_path.is_none() && error.as_deref() == Some("404") {
        (result, error) = probe(client, &spec.url, "/v1/models", busy).await;
    }
    if result == ProbeResult::Ok && (!busy || r.models().is_empty()) {
        if let Some(models) = fetch_models(client, &spec.url).await {
            r.set_models(models);
        }
    }
    if result == ProbeResult::Ok && !busy {
        // vLLM reports its KV capacity; other engines 404 here, which is fine.
        let kv = fetch_text(client, &format!("{}/metrics", spec.url))
            .await
            .and_then(|t| crate::capacity::kv_tokens_from_vllm_metrics(&t));
        gw.capacity.set_metrics_kv(&r.id, kv);
    }
    let (prev, now) = {
        let mut p = r.probe.lock().expect("probe lock");
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
        p.last_check_ms = Some(crate::clock::now_ms());
        let prev = r.health();
        let now = next(prev, result, p.ok_streak, p.fail_streak, gw.config.health.rise, gw.config.health.fall);
        r.set_health(now);
        (prev, now)
    };
    match (prev, now) {
        (Health::Up | Health::Unknown, Health::Down) => {
            gw.events.record(EventKind::ReplicaDown, Some(&r.id), None, error.unwrap_or_default());
        }
        (Health::Down, Health::Up) => {
            gw.events.record(EventKind::ReplicaUp, Some(&r.id), None, "health checks pass again");
        }
        _ => {}
    }
}

async fn probe(client: &awc::Client, base: &str, path: &str, busy: bool) -> (ProbeResult, Option<String>) {
    match client.get(format!("{base}{path}")).send().await {
        Ok(resp) if resp.status().is_success() => (ProbeResult::Ok, None),
        Ok(resp) => (ProbeResult::Failed, Some(resp.status().as_u16().to_string())),
        Err(awc::error::SendRequestError::Timeout) if busy => (ProbeResult::Inconclusive, None),
        Err(e) => (ProbeResult::Failed, Some(e.to_string())),
    }
}

async fn fetch_text(client: &awc::Client, url: &str) -> Option<String> {
    let mut resp = client.get(url).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.body().limit(8 * 1024 * 1024).await.ok()?;
    String::from_utf8(body.to_vec()).ok()
}

async fn fetch_models(client: &awc::Client, base: &str) -> Option<Vec<String>> {
    let text = fetch_text(client, &format!("{base}/v1/models")).await?;
    let list: ModelList = serde_json::from_str(&text).ok()?;
    Some(list.data.into_iter().map(|m| m.id).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
