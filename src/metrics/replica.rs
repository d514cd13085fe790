//! A replica's own series, kept on its fleet record (`fleet::Replica::series`).
//!
//! Every series labelled with a replica is created through its record and
//! listed there, and leaves its family when the replica leaves the fleet
//! (`Fleet::remove` calls `remove`). A request still in flight on a removed
//! replica goes on counting into handles no family holds: nothing it does
//! brings the replica back into the exposition, and a replica added again
//! under the same name starts its series afresh. Without this, a fleet whose
//! pods come back under new names grew every scrape by ~49 series per name.
//!
//! The request path reads its handles from the record it already holds
//! (`OnceLock`s: a read is a load, no lock and no shared write), so two
//! workers never bounce a family's lock between cores.

use std::borrow::Cow;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::{latency_histogram, push_once, replica_label, FailoverLabels, Metrics, Name, RequestLabels, RouteLabels};
use crate::policy::RouteReason;
use crate::striped::{StripedCounter, StripedHistogram};

/// Statuses counted without a lock: the usual ones. Any other is found in a
/// short list under a lock (HTTP statuses: bounded).
const STATUSES: [&str; 13] = [
    "200",
    "400",
    "404",
    "429",
    "500",
    "502",
    "503",
    "504",
    "connect_failed",
    "closed_after_write",
    "upstream_failed",
    "idle_timeout",
    "client_gone",
];

/// The request-path metrics of one (replica, route).
pub struct RouteMetrics {
    pub upstream_ttfb: StripedHistogram,
    /// Streamed responses' first body event (`prefixgate_time_to_first_token_seconds`).
    pub first_token: StripedHistogram,
    pub request_duration: StripedHistogram,
    pub prompt_tokens: StripedCounter,
    pub cached_tokens: StripedCounter,
    /// `prefixgate_requests_total` by status, created on first use.
    requests: [OnceLock<StripedCounter>; STATUSES.len()],
    other_requests: Mutex<Vec<(Cow<'static, str>, StripedCounter)>>,
}

/// Running totals of one replica's series (`ReplicaSeries::totals`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeriesTotals {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Streamed responses' time to first token: (upper bound s, count) per
    /// bucket, not cumulative (empty: none yet).
    pub first_token: Vec<(f64, u64)>,
    /// Failovers away from this replica.
    pub failovers: u64,
}

/// The series labelled with one replica, and its handles on them.
pub struct ReplicaSeries {
    name: Name,
    routes: [OnceLock<RouteMetrics>; RouteReason::ALL.len()],
    listed: Mutex<Listed>,
}

/// What was created in the families, to take it out again.
#[derive(Default)]
struct Listed {
    /// The families the series are in (known from the first one).
    metrics: Option<Arc<Metrics>>,
    requests: Vec<RequestLabels>,
    routes: Vec<RouteLabels>,
    failovers: Vec<FailoverLabels>,
    admission: bool,
    /// The replica left the fleet: nothing more goes into the families.
    removed: bool,
}

impl std::fmt::Debug for ReplicaSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSeries").field("replica", &self.name.0).finish_non_exhaustive()
    }
}

impl ReplicaSeries {
    pub fn new(name: &Arc<str>) -> ReplicaSeries {
        ReplicaSeries { name: name.into(), routes: Default::default(), listed: Mutex::default() }
    }

    fn lock(&self) -> MutexGuard<'_, Listed> {
        self.listed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `create` (which lists what it creates in the families) unless
    /// the replica left; under the lock `remove` takes, so a series is
    /// never created in a family after its replica's were taken out.
    fn create<T>(&self, metrics: &Arc<Metrics>, create: impl FnOnce(&mut Listed, &Metrics) -> T) -> Option<T> {
        let mut listed = self.lock();
        if listed.removed {
            return None;
        }
        listed.metrics.get_or_insert_with(|| metrics.clone());
        Some(create(&mut listed, metrics))
    }

    /// This replica's handles for requests routed by `reason`.
    pub fn route(&self, metrics: &Arc<Metrics>, reason: RouteReason) -> &RouteMetrics {
        self.routes[reason as usize].get_or_init(|| {
            let labels = RouteLabels { replica: self.name.clone(), route: reason.as_str() };
            let created = self.create(metrics, |listed, m| {
                push_once(&mut listed.routes, &labels);
                (
                    m.upstream_ttfb.get_or_create(&labels).clone(),
                    m.first_token.get_or_create(&labels).clone(),
                    m.request_duration.get_or_create(&labels).clone(),
                    m.prompt_tokens.get_or_create(&labels).clone(),
                    m.cached_tokens.get_or_create(&labels).clone(),
                )
            });
            let (upstream_ttfb, first_token, request_duration, prompt_tokens, cached_tokens) =
                created.unwrap_or_else(|| {
                    (
                        latency_histogram(),
                        latency_histogram(),
                        latency_histogram(),
                        Default::default(),
                        Default::default(),
                    )
                });
            RouteMetrics {
                upstream_ttfb,
                first_token,
                request_duration,
                prompt_tokens,
                cached_tokens,
                requests: Default::default(),
                other_requests: Mutex::default(),
            }
        })
    }

    /// Counts one request routed by `reason` in `prefixgate_requests_total`.
    pub fn count_request(&self, metrics: &Arc<Metrics>, reason: RouteReason, status: Cow<'static, str>) {
        let route = self.route(metrics, reason);
        if let Some(i) = STATUSES.iter().position(|s| *s == status) {
            route.requests[i].get_or_init(|| self.request_counter(metrics, reason, status)).inc();
            return;
        }
        let mut others = route.other_requests.lock().unwrap_or_else(|e| e.into_inner());
        match others.iter().find(|(s, _)| *s == status) {
            Some((_, c)) => c.inc(),
            None => {
                let c = self.request_counter(metrics, reason, status.clone());
                c.inc();
                others.push((status, c));
            }
        }
    }

    fn request_counter(
        &self,
        metrics: &Arc<Metrics>,
        reason: RouteReason,
        status: Cow<'static, str>,
    ) -> StripedCounter {
        let labels = RequestLabels { replica: self.name.clone(), route: reason.as_str(), status };
        self.create(metrics, |listed, m| {
            push_once(&mut listed.requests, &labels);
            m.requests.get_or_create(&labels).clone()
        })
        .unwrap_or_default()
    }

    /// Counts large requests that `waited` for an admission slot here and
    /// that were `rejected`; zeros start both counters, so a rate over a
    /// quiet replica is 0, not absent.
    pub fn admission(&self, metrics: &Arc<Metrics>, waited: u64, rejected: u64) {
        self.create(metrics, |listed, m| {
            listed.admission = true;
            let l = replica_label(&self.name.0);
            m.admission_waits.get_or_create(&l).inc_by(waited);
            m.admission_rejections.get_or_create(&l).inc_by(rejected);
        });
    }

    /// The counters a dashboard or an alert divides by or rates, at zero
    /// from the replica's first scrape: a rate over a quiet replica is 0,
    /// not absent (a failover to nowhere, admission waits and rejections).
    /// The shape rule's two routes (pinned, spread) have their request,
    /// token and first-token series from the start; rarer routes appear
    /// with their first request (a series each per replica would multiply
    /// the histograms for nothing).
    pub fn from_zero(&self, metrics: &Arc<Metrics>) {
        self.admission(metrics, 0, 0);
        for reason in [RouteReason::Pinned, RouteReason::Spread] {
            let route = self.route(metrics, reason);
            route.requests[0].get_or_init(|| self.request_counter(metrics, reason, Cow::Borrowed(STATUSES[0])));
        }
        let labels = FailoverLabels { from: self.name.clone(), to: "none".into() };
        self.create(metrics, |listed, m| {
            push_once(&mut listed.failovers, &labels);
            m.failovers.get_or_create(&labels).inc_by(0);
        });
    }

    /// Counts a failover from this replica to `to` (None: nowhere left).
    /// Listed on both, so either one's leaving takes it out.
    pub fn failover(&self, metrics: &Arc<Metrics>, to: Option<&ReplicaSeries>) {
        let labels =
            FailoverLabels { from: self.name.clone(), to: to.map_or_else(|| "none".into(), |t| t.name.clone()) };
        let listed_there = to.is_none_or(|t| t.create(metrics, |l, _| push_once(&mut l.failovers, &labels)).is_some());
        if listed_there {
            self.create(metrics, |listed, m| {
                push_once(&mut listed.failovers, &labels);
                m.failovers.get_or_create(&labels).inc();
            });
        }
    }

    /// What this replica's series count so far, over every route: for the
    /// timeline, which takes differences between two readings. Reads only
    /// the handles that exist (nothing is created).
    pub fn totals(&self) -> SeriesTotals {
        let mut t = SeriesTotals::default();
        for route in self.routes.iter().filter_map(OnceLock::get) {
            t.prompt_tokens += route.prompt_tokens.get();
            t.cached_tokens += route.cached_tokens.get();
            let (_, _, buckets) = route.first_token.get();
            if t.first_token.is_empty() {
                t.first_token = buckets;
            } else {
                t.first_token.iter_mut().zip(buckets).for_each(|(sum, b)| sum.1 += b.1);
            }
        }
        let listed = self.lock();
        if let Some(m) = &listed.metrics {
            let from_here = listed.failovers.iter().filter(|l| l.from == self.name);
            t.failovers = from_here.map(|l| m.failovers.get_or_create(l).get()).sum();
        }
        t
    }

    /// The replica left the fleet: its series leave their families, and
    /// none is created again through this record.
    pub fn remove(&self) {
        let mut listed = self.lock();
        listed.removed = true;
        let Some(m) = listed.metrics.take() else { return };
        for l in &listed.requests {
            m.requests.remove(l);
        }
        for l in &listed.routes {
            m.upstream_ttfb.remove(l);
            m.first_token.remove(l);
            m.request_duration.remove(l);
            m.prompt_tokens.remove(l);
            m.cached_tokens.remove(l);
        }
        for l in &listed.failovers {
            m.failovers.remove(l);
        }
        if listed.admission {
            let l = replica_label(&self.name.0);
            m.admission_waits.remove(&l);
            m.admission_rejections.remove(&l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::status_label;

    fn line(text: &str, prefix: &str) -> Option<String> {
        text.lines().find(|l| l.starts_with(prefix)).map(str::to_string)
    }

    #[test]
    fn two_records_of_one_name_count_into_the_same_series() {
        let metrics = Arc::new(Metrics::new());
        // The same name in two records' allocations counts into one series.
        let (a, a_again) = (ReplicaSeries::new(&Arc::from("gpu-a")), ReplicaSeries::new(&Arc::from("gpu-a")));
        a.count_request(&metrics, RouteReason::Spread, status_label(200));
        a.count_request(&metrics, RouteReason::Spread, status_label(200));
        a_again.count_request(&metrics, RouteReason::Spread, status_label(200));
        a_again.count_request(&metrics, RouteReason::Spread, status_label(599));
        a.route(&metrics, RouteReason::Spread).prompt_tokens.inc_by(5);
        a_again.route(&metrics, RouteReason::Spread).prompt_tokens.inc_by(7);
        let text = metrics.encode();
        assert_eq!(
            line(&text, r#"prefixgate_requests_total{replica="gpu-a",route="spread",status="200"}"#).as_deref(),
            Some(r#"prefixgate_requests_total{replica="gpu-a",route="spread",status="200"} 3"#)
        );
        assert!(line(&text, r#"prefixgate_requests_total{replica="gpu-a",route="spread",status="599"} 1"#).is_some());
        assert!(
            line(&text, r#"prefixgate_prompt_tokens_total{replica="gpu-a",route="spread"} 12"#).is_some(),
            "{text}"
        );
    }

    #[test]
    fn a_removed_replicas_series_leave_the_exposition_and_never_come_back() {
        let metrics = Arc::new(Metrics::new());
        let (a, b) = (ReplicaSeries::new(&Arc::from("gpu-a")), ReplicaSeries::new(&Arc::from("gpu-b")));
        for r in [&a, &b] {
            r.count_request(&metrics, RouteReason::Spread, status_label(200));
            r.route(&metrics, RouteReason::Spread).upstream_ttfb.observe(0.1);
        }
        a.failover(&metrics, Some(&b));
        b.failover(&metrics, None);
        a.admission(&metrics, 1, 0);
        assert!(metrics.encode().contains(r#"prefixgate_failovers_total{from="gpu-a",to="gpu-b"} 1"#));
        a.remove();
        let text = metrics.encode();
        assert!(!text.contains("gpu-a"), "{text}");
        assert!(text.contains(r#"prefixgate_requests_total{replica="gpu-b",route="spread",status="200"} 1"#));
        assert!(text.contains(r#"prefixgate_failovers_total{from="gpu-b",to="none"} 1"#));
        // A request still in flight on gpu-a ends after the removal, with a
        // route and a status not seen before: nothing enters a family.
        a.count_request(&metrics, RouteReason::Pinned, status_label(502));
        a.admission(&metrics, 0, 1);
        b.failover(&metrics, Some(&a));
        assert!(!metrics.encode().contains("gpu-a"));
        // A replica added again under the name starts afresh.
        let a_again = ReplicaSeries::new(&Arc::from("gpu-a"));
        a_again.count_request(&metrics, RouteReason::Spread, status_label(200));
        assert!(metrics
            .encode()
            .contains(r#"prefixgate_requests_total{replica="gpu-a",route="spread",status="200"} 1"#));
        // gpu-b's own series stayed.
        b.count_request(&metrics, RouteReason::Spread, status_label(200));
        assert!(metrics
            .encode()
            .contains(r#"prefixgate_requests_total{replica="gpu-b",route="spread",status="200"} 2"#));
    }
}
