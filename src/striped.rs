//! Counters and histograms that the request path writes without sharing a
//! cache line between cores. prometheus-client's own types keep one atomic
//! (a counter) or one lock (a histogram) per series, which every worker
//! writes on every request: each write pulls the line from the core that
//! wrote it last, and a histogram's lock serializes the workers. Here each
//! thread writes its own stripe (a cache-padded slot picked once per
//! thread); a scrape sums the stripes. The exposition is unchanged.
//! (On the 2-core bench machine the difference is inside the noise,
//! `docs/benchmarks-log.md`; the traffic it removes grows with the workers.)

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Enough for one stripe per worker on common machines; more workers share
/// stripes (still correct, only contended again).
const STRIPES: usize = 16;

/// This thread's stripe, assigned round robin on first use.
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    MINE.with(|s| *s)
}

/// A monotonic counter (`prometheus_client`'s `Counter`, striped).
#[derive(Debug, Clone)]
pub struct StripedCounter(Arc<[CachePadded<AtomicU64>; STRIPES]>);

impl Default for StripedCounter {
    fn default() -> Self {
        StripedCounter(Arc::new(std::array::from_fn(|_| CachePadded::new(AtomicU64::new(0)))))
    }
}

impl StripedCounter {
    pub fn inc(&self) {
        self.inc_by(1);
    }

    pub fn inc_by(&self, v: u64) {
        self.0[stripe()].fetch_add(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }
}

impl TypedMetric for StripedCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for StripedCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A histogram (`prometheus_client`'s `Histogram`, striped). Buckets hold
/// the observations up to their bound that no lower bucket took, as
/// prometheus-client stores them; the last bound is `f64::MAX` (`+Inf`).
///
/// All stripes live in one allocation, each as `[sum bits, bucket counts...]`
/// followed by at least a cache line of padding: stripes whose buckets were
/// separate allocations could sit next to each other in memory and share a
/// line, which is the traffic striping exists to avoid.
#[derive(Debug, Clone)]
pub struct StripedHistogram {
    bounds: Arc<[f64]>,
    cells: Arc<[AtomicU64]>,
    /// Cells from one stripe's start to the next's.
    stride: usize,
}

/// A cache line, in cells.
const LINE: usize = 64 / std::mem::size_of::<AtomicU64>();

impl StripedHistogram {
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> StripedHistogram {
        let bounds: Arc<[f64]> = bounds.into_iter().chain(std::iter::once(f64::MAX)).collect();
        let stride = (1 + bounds.len()).next_multiple_of(LINE) + LINE;
        // 0u64 is also 0.0's bits: every sum starts at zero.
        let cells = (0..STRIPES * stride).map(|_| AtomicU64::new(0)).collect();
        StripedHistogram { bounds, cells, stride }
    }

    /// This stripe's cells: the sum, then the buckets.
    fn stripe(&self, s: usize) -> &[AtomicU64] {
        &self.cells[s * self.stride..][..1 + self.bounds.len()]
    }

    pub fn observe(&self, v: f64) {
        let s = self.stripe(stripe());
        // Threads share a stripe only past STRIPES threads: the loop almost
        // never retries.
        let _ =
            s[0].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) + v).to_bits()));
        if let Some(i) = self.bounds.iter().position(|b| *b >= v) {
            s[1 + i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (sum, count, buckets), the count taken from the buckets so that a
    /// scrape during an observation still adds up.
    pub fn get(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut buckets: Vec<(f64, u64)> = self.bounds.iter().map(|b| (*b, 0)).collect();
        let mut sum = 0.0;
        for s in (0..STRIPES).map(|s| self.stripe(s)) {
            sum += f64::from_bits(s[0].load(Ordering::Relaxed));
            for (out, b) in buckets.iter_mut().zip(&s[1..]) {
                out.1 += b.load(Ordering::Relaxed);
            }
        }
        let count = buckets.iter().map(|b| b.1).sum();
        (sum, count, buckets)
    }
}

impl TypedMetric for StripedHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for StripedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.get();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::registry::Registry;

    fn encoded(register: impl FnOnce(&mut Registry)) -> String {
        let mut r = Registry::default();
        register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        out
    }

    #[test]
    fn striped_metrics_expose_what_prometheus_clients_own_types_expose_from_many_threads() {
        let (sc, pc) = (StripedCounter::default(), Counter::<u64>::default());
        let bounds = [0.001, 0.01, 0.1, 1.0];
        let (sh, ph) = (StripedHistogram::new(bounds), Histogram::new(bounds));
        // Dyadic values: their sums are exact in any order, so the two
        // expositions can be compared byte for byte.
        let values = [0.000_488_281_25, 0.000_976_562_5, 0.0625, 0.5, 3.0, 0.015_625];
        std::thread::scope(|scope| {
            for t in 0..20 {
                let (sc, pc, sh, ph) = (&sc, &pc, &sh, &ph);
                scope.spawn(move || {
                    for (i, v) in values.iter().enumerate() {
                        sc.inc_by((t + i) as u64);
                        pc.inc_by((t + i) as u64);
                        sh.observe(*v);
                        ph.observe(*v);
                    }
                });
            }
        });
        assert_eq!(sc.get(), pc.get());
        let striped = encoded(|r| {
            r.register("c", "h", sc.clone());
            r.register("d", "h", sh.clone());
        });
        let own = encoded(|r| {
            r.register("c", "h", pc.clone());
            r.register("d", "h", ph.clone());
        });
        assert_eq!(striped, own);
        assert!(striped.contains("d_count 120"), "{striped}");
    }
}
