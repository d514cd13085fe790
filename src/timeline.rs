//! The fleet over time, kept by the gateway itself (`GET
//! /admin/v1/timeline`, the UI's "Fleet over time"): every
//! `timeline.interval_ms` a sample of each replica (resident session tokens
//! against capacity and the learned wall, the warm share of prompt tokens,
//! time to first token p50 and p90, in flight, paused turns by class,
//! failovers) and of the fleet (held sessions by class).
//!
//! Why here and not only in Prometheus: an operator without a Prometheus
//! (a gateway where the internet is not, a first deployment) still sees
//! how the fleet got where it is. Each instance keeps its own timeline of
//! what it served; with several instances, each serves its own.
//!
//! Rates and quantiles are of the interval between two samples: the
//! running totals a replica's series keep (`ReplicaSeries::totals`) are
//! read at each sample and the differences kept, so the request path does
//! nothing for the timeline. TTFT quantiles are interpolated within the
//! `prefixgate_time_to_first_token_seconds` histogram's buckets (powers of
//! two from 1 ms), as Prometheus's `histogram_quantile` does.
//!
//! Bounded: at most `window_secs / interval_ms` samples (720 by default: an
//! hour at 5 s), each with at most `MAX_REPLICAS` replicas' points of
//! `POINT_BYTES` each (`Timeline::bytes`): ~1.2 MB for 16 replicas over an
//! hour, at most ~48 MB for 512. The previous totals are kept per replica
//! present at the last sample only: a replica that left is gone at the next.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::metrics::SeriesTotals;

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TimelineConfig {
    /// How often the fleet is sampled for `GET /admin/v1/timeline` (ms; 0: no timeline).
    pub interval_ms: u64,
    /// How far back the timeline reaches, seconds (the samples kept: this over the interval).
    pub window_secs: u64,
}

impl Default for TimelineConfig {
    fn default() -> Self {
        TimelineConfig { interval_ms: 5_000, window_secs: 3_600 }
    }
}

/// Replicas sampled at most per sample (the first by id).
pub const MAX_REPLICAS: usize = 512;

/// What one replica's point costs in memory, bytes (its `Arc<str>` name is
/// shared with the fleet's record).
pub const POINT_BYTES: usize = std::mem::size_of::<ReplicaPoint>();

/// One replica as read at a sample: gauges as they are, totals as they stand.
#[derive(Debug, Clone)]
pub struct Reading {
    pub id: Arc<str>,
    pub resident_tokens: u64,
    pub capacity_tokens: Option<u64>,
    pub wall_tokens: Option<u64>,
    pub inflight: i64,
    pub paused_by_class: [usize; 3],
    pub totals: SeriesTotals,
}

/// One replica at one sample.
#[derive(Debug, Clone, PartialEq)]
struct ReplicaPoint {
    id: Arc<str>,
    resident_tokens: u64,
    capacity_tokens: Option<u64>,
    wall_tokens: Option<u64>,
    warm_share: Option<f32>,
    ttft_p50_ms: Option<f32>,
    ttft_p90_ms: Option<f32>,
    inflight: u32,
    paused_by_class: [u16; 3],
    failovers: u32,
}

#[derive(Debug, Clone)]
struct Sample {
    at_ms: u64,
    held_by_class: [u32; 3],
    replicas: Vec<ReplicaPoint>,
}

pub struct Timeline {
    config: TimelineConfig,
    samples: Mutex<VecDeque<Sample>>,
    /// Each replica's totals at the last sample (the differences' base).
    last: Mutex<Vec<(Arc<str>, SeriesTotals)>>,
}

/// Per class, in `Class::ALL`'s order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ByClass {
    pub interactive: u32,
    pub default: u32,
    pub background: u32,
}

impl ByClass {
    fn of(counts: [u32; 3]) -> ByClass {
        let [interactive, default, background] = counts;
        ByClass { interactive, default, background }
    }
}

/// One replica's series over the window, a value per sample (aligned with `at`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReplicaSeriesView {
    pub replica: String,
    /// Tokens the resident sessions count for.
    pub resident_tokens: Vec<Option<u64>>,
    /// KV capacity, tokens (null: unknown, or not in the fleet at that sample).
    pub capacity_tokens: Vec<Option<u64>>,
    /// The wall its receipts found, tokens (null: none seen).
    pub wall_tokens: Vec<Option<u64>>,
    /// Cached over prompt tokens the replica reported in the interval (null: none reported).
    pub warm_share: Vec<Option<f32>>,
    /// Time to first token of the interval's streamed responses, ms (null: none).
    pub ttft_p50_ms: Vec<Option<f32>>,
    pub ttft_p90_ms: Vec<Option<f32>>,
    pub inflight: Vec<Option<u32>>,
    /// Turns paused now, by class.
    pub paused: Vec<Option<ByClass>>,
    /// Failovers away from it in the interval.
    pub failovers: Vec<Option<u32>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TimelineView {
    /// The instance this timeline is of: each instance keeps its own.
    pub instance: String,
    pub interval_ms: u64,
    /// The window asked for, seconds (at most `timeline.window_secs`).
    pub window_s: u64,
    /// Sample times, ms since the epoch, oldest first.
    pub at: Vec<u64>,
    /// New sessions held for room at each sample, by class (fleet-wide).
    pub held: Vec<ByClass>,
    pub replicas: Vec<ReplicaSeriesView>,
}

impl Timeline {
    pub fn new(config: TimelineConfig) -> Timeline {
        Timeline { config, samples: Mutex::default(), last: Mutex::default() }
    }

    pub fn config(&self) -> &TimelineConfig {
        &self.config
    }

    /// Samples kept at most.
    pub fn max_samples(&self) -> usize {
        match self.config.interval_ms {
            0 => 0,
            every => (self.config.window_secs.saturating_mul(1000) / every).max(1) as usize,
        }
    }

    fn samples(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps one sample at `at_ms`: `readings` of the replicas now, and the
    /// held sessions by class.
    pub fn record(&self, at_ms: u64, mut readings: Vec<Reading>, held_by_class: [usize; 3]) {
        let max = self.max_samples();
        if max == 0 {
            return;
        }
        readings.sort_by(|a, b| a.id.cmp(&b.id));
        readings.truncate(MAX_REPLICAS);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let replicas = readings
            .iter()
            .map(|r| {
                let before = last.iter().find(|(id, _)| *id == r.id).map(|(_, t)| t);
                point(r, before)
            })
            .collect();
        *last = readings.into_iter().map(|r| (r.id, r.totals)).collect();
        drop(last);
        let sample = Sample { at_ms, held_by_class: held_by_class.map(clamp_u32), replicas };
        let mut samples = self.samples();
        while samples.len() >= max {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// The samples of the last `window_s` seconds before `now_ms`, as series per replica.
    pub fn view(&self, instance: &str, now_ms: u64, window_s: u64) -> TimelineView {
        let window_s = window_s.min(self.config.window_secs);
        let since = now_ms.saturating_sub(window_s.saturating_mul(1000));
        let samples = self.samples();
        let kept: Vec<&Sample> = samples.iter().filter(|s| s.at_ms >= since).collect();
        let mut ids: Vec<Arc<str>> = kept.iter().flat_map(|s| s.replicas.iter().map(|p| p.id.clone())).collect();
        ids.sort();
        ids.dedup();
        let replicas = ids
            .iter()
            .map(|id| {
                let points: Vec<Option<&ReplicaPoint>> =
                    kept.iter().map(|s| s.replicas.iter().find(|p| p.id == *id)).collect();
                let series = |f: &dyn Fn(&ReplicaPoint) -> Option<f32>| points.iter().map(|p| p.and_then(f)).collect();
                ReplicaSeriesView {
                    replica: id.to_string(),
                    resident_tokens: points.iter().map(|p| p.map(|p| p.resident_tokens)).collect(),
                    capacity_tokens: points.iter().map(|p| p.and_then(|p| p.capacity_tokens)).collect(),
                    wall_tokens: points.iter().map(|p| p.and_then(|p| p.wall_tokens)).collect(),
                    warm_share: series(&|p| p.warm_share),
                    ttft_p50_ms: series(&|p| p.ttft_p50_ms),
                    ttft_p90_ms: series(&|p| p.ttft_p90_ms),
                    inflight: points.iter().map(|p| p.map(|p| p.inflight)).collect(),
                    paused: points.iter().map(|p| p.map(|p| ByClass::of(p.paused_by_class.map(u32::from)))).collect(),
                    failovers: points.iter().map(|p| p.map(|p| p.failovers)).collect(),
                }
            })
            .collect();
        TimelineView {
            instance: instance.to_string(),
            interval_ms: self.config.interval_ms,
            window_s,
            at: kept.iter().map(|s| s.at_ms).collect(),
            held: kept.iter().map(|s| ByClass::of(s.held_by_class)).collect(),
            replicas,
        }
    }

    /// The memory the samples take now, bytes (points and the samples'
    /// own records; names are shared with the fleet).
    pub fn bytes(&self) -> usize {
        let samples = self.samples();
        samples.iter().map(|s| std::mem::size_of::<Sample>() + s.replicas.capacity() * POINT_BYTES).sum()
    }

    /// The most the samples can take, bytes, with `replicas` in the fleet.
    pub fn bound_bytes(&self, replicas: usize) -> usize {
        self.max_samples() * (std::mem::size_of::<Sample>() + replicas.min(MAX_REPLICAS) * POINT_BYTES)
    }

    /// Samples kept now.
    pub fn len(&self) -> usize {
        self.samples().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn clamp_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A replica's point: its gauges, and what its totals did since `before`
/// (None: first seen at this sample, so nothing to difference yet).
fn point(r: &Reading, before: Option<&SeriesTotals>) -> ReplicaPoint {
    let (warm_share, ttft, failovers) = match before {
        Some(b) => {
            let prompt = r.totals.prompt_tokens.saturating_sub(b.prompt_tokens);
            let cached = r.totals.cached_tokens.saturating_sub(b.cached_tokens);
            let warm = (prompt > 0).then(|| (cached as f64 / prompt as f64).min(1.0) as f32);
            let buckets: Vec<(f64, u64)> = match b.first_token.len() == r.totals.first_token.len() {
                true => r
                    .totals
                    .first_token
                    .iter()
                    .zip(&b.first_token)
                    .map(|(n, o)| (n.0, n.1.saturating_sub(o.1)))
                    .collect(),
                false => r.totals.first_token.clone(),
            };
            (warm, buckets, r.totals.failovers.saturating_sub(b.failovers))
        }
        None => (None, Vec::new(), 0),
    };
    let ms = |q| quantile(&ttft, q).map(|s| (s * 1000.0) as f32);
    ReplicaPoint {
        id: r.id.clone(),
        resident_tokens: r.resident_tokens,
        capacity_tokens: r.capacity_tokens,
        wall_tokens: r.wall_tokens,
        warm_share,
        ttft_p50_ms: ms(0.5),
        ttft_p90_ms: ms(0.9),
        inflight: u32::try_from(r.inflight.max(0)).unwrap_or(u32::MAX),
        paused_by_class: r.paused_by_class.map(|n| u16::try_from(n).unwrap_or(u16::MAX)),
        failovers: u32::try_from(failovers).unwrap_or(u32::MAX),
    }
}

/// The `q` quantile of observations counted in `buckets` ((upper bound,
/// count), not cumulative, ascending), interpolated linearly within its
/// bucket; in the last (unbounded) bucket, that bucket's lower bound.
/// None: no observation.
pub fn quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    let total: u64 = buckets.iter().map(|b| b.1).sum();
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let (mut below, mut lower) = (0u64, 0.0);
    for (upper, count) in buckets {
        if *count > 0 && (below + count) as f64 >= rank {
            if !upper.is_finite() || *upper == f64::MAX {
                return Some(lower);
            }
            let within = (rank - below as f64) / *count as f64;
            return Some(lower + (upper - lower) * within);
        }
        below += count;
        lower = *upper;
    }
    Some(lower)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(id: &str, prompt: u64, cached: u64, ttft: Vec<(f64, u64)>, failovers: u64) -> Reading {
        Reading {
            id: Arc::from(id),
            resident_tokens: 1_000,
            capacity_tokens: Some(12_000),
            wall_tokens: None,
            inflight: 2,
            paused_by_class: [0, 1, 0],
            totals: SeriesTotals { prompt_tokens: prompt, cached_tokens: cached, first_token: ttft, failovers },
        }
    }

    #[test]
    fn quantiles_interpolate_within_buckets_as_prometheus_does() {
        let buckets = [(0.1, 0), (0.2, 10), (0.4, 10), (f64::MAX, 0)];
        assert_eq!(quantile(&buckets, 0.5), Some(0.2));
        assert!((quantile(&buckets, 0.25).unwrap() - 0.15).abs() < 1e-9);
        assert!((quantile(&buckets, 0.9).unwrap() - 0.36).abs() < 1e-9);
        assert_eq!(quantile(&[(0.1, 0), (f64::MAX, 3)], 0.5), Some(0.1), "the unbounded bucket says its lower bound");
        assert_eq!(quantile(&[(0.1, 0)], 0.5), None);
    }

    #[test]
    fn a_sample_keeps_the_intervals_differences_not_the_running_totals() {
        let t = Timeline::new(TimelineConfig { interval_ms: 1_000, window_secs: 60 });
        let buckets = |fast: u64, slow: u64| vec![(0.064, 0), (0.128, fast), (0.256, slow), (f64::MAX, 0)];
        t.record(1_000, vec![reading("a", 100, 0, buckets(0, 0), 0)], [0, 0, 0]);
        t.record(2_000, vec![reading("a", 1_100, 900, buckets(10, 0), 1)], [1, 0, 2]);
        // Only slow first tokens in the next interval: its quantiles say so.
        t.record(3_000, vec![reading("a", 2_100, 1_000, buckets(10, 10), 1)], [0, 0, 0]);
        let v = t.view("this", 3_000, 60);
        assert_eq!(v.at, vec![1_000, 2_000, 3_000]);
        let a = &v.replicas[0];
        assert_eq!(a.warm_share, vec![None, Some(0.9), Some(0.1)]);
        assert_eq!(a.failovers, vec![Some(0), Some(1), Some(0)]);
        assert_eq!(a.ttft_p50_ms[0], None, "nothing to difference at the first sample");
        assert!((a.ttft_p50_ms[1].unwrap() - 96.0).abs() < 0.01, "{:?}", a.ttft_p50_ms);
        assert!(a.ttft_p50_ms[2].unwrap() > 128.0);
        assert_eq!(v.held[1], ByClass { interactive: 1, default: 0, background: 2 });
        assert_eq!(a.paused[1], Some(ByClass { interactive: 0, default: 1, background: 0 }));
        assert_eq!(a.capacity_tokens[2], Some(12_000));
    }

    #[test]
    fn a_replica_that_leaves_has_gaps_and_its_base_goes_with_it() {
        let t = Timeline::new(TimelineConfig { interval_ms: 1_000, window_secs: 60 });
        t.record(1_000, vec![reading("a", 0, 0, vec![], 0), reading("b", 0, 0, vec![], 0)], [0; 3]);
        t.record(2_000, vec![reading("a", 0, 0, vec![], 0)], [0; 3]);
        assert_eq!(t.last.lock().unwrap().len(), 1, "b's totals left with it");
        let v = t.view("this", 2_000, 60);
        let b = v.replicas.iter().find(|r| r.replica == "b").unwrap();
        assert_eq!(b.inflight, vec![Some(2), None]);
    }

    #[test]
    fn the_window_asked_for_is_what_comes_back() {
        let t = Timeline::new(TimelineConfig { interval_ms: 1_000, window_secs: 60 });
        for s in 1..=30 {
            t.record(s * 1_000, vec![reading("a", 0, 0, vec![], 0)], [0; 3]);
        }
        assert_eq!(t.view("this", 30_000, 10).at.len(), 11);
        assert_eq!(t.view("this", 30_000, 3_600).window_s, 60, "at most the window kept");
    }

    #[test]
    fn an_hour_of_samples_stays_within_the_stated_bound() {
        // The default: a sample every 5 s, an hour kept; 16 replicas, and
        // twice an hour's samples recorded (with churn in the names).
        let t = Timeline::new(TimelineConfig::default());
        assert_eq!(t.max_samples(), 720);
        for s in 0..1_440u64 {
            let readings = (0..16).map(|i| reading(&format!("r{}", (s / 100) * 16 + i), s, s / 2, vec![], 0)).collect();
            t.record(s * 5_000, readings, [1, 2, 3]);
        }
        assert_eq!(t.len(), 720, "the oldest go first");
        assert!(t.bytes() <= t.bound_bytes(16), "{} > {}", t.bytes(), t.bound_bytes(16));
        // As the module's doc and docs/observability.md state it.
        const { assert!(POINT_BYTES <= 120, "a point is at most 120 bytes") };
        assert!(t.bound_bytes(16) <= 1_300_000, "an hour of 16 replicas: {} bytes", t.bound_bytes(16));
        assert!(t.bound_bytes(MAX_REPLICAS) <= 48_000_000, "an hour of 512: {} bytes", t.bound_bytes(MAX_REPLICAS));
        assert!(t.last.lock().unwrap().len() <= 16, "bases only for the replicas now");
        // More replicas than a sample keeps: the points stop at MAX_REPLICAS.
        let many = (0..MAX_REPLICAS + 10).map(|i| reading(&format!("m{i}"), 0, 0, vec![], 0)).collect();
        t.record(1, many, [0; 3]);
        assert!(t.bytes() <= t.bound_bytes(MAX_REPLICAS + 10));
    }

    #[test]
    fn an_interval_of_zero_keeps_nothing() {
        let t = Timeline::new(TimelineConfig { interval_ms: 0, window_secs: 3_600 });
        t.record(1, vec![reading("a", 0, 0, vec![], 0)], [0; 3]);
        assert!(t.is_empty());
    }
}
