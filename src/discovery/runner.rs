//! One task per discovery source: read it (DNS on its interval or sooner
//! when the records' TTL says so; a file when it changed), take the answer
//! through the lifecycle (`lifecycle.rs`), apply the actions through the
//! operator, and report: an event and a log line per failure, recovery and
//! held answer, metrics per read, and a status the admin API and `/healthz`
//! show.
//!
//! Each gateway instance runs its own tasks against the same sources, so
//! they find the same replicas under the same names; nothing here is written
//! to the store (see `operator/discovered.rs`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use utoipa::ToSchema;

use super::dns;
use super::lifecycle::{SourceState, Taken};
use super::source::{read_file, Source};
use super::SourceConfig;
use crate::clock::now_ms;
use crate::events::EventKind;
use crate::fleet::{ReplicaSpec, SourceAction};
use crate::metrics::Metrics;
use crate::operator::Operator;

/// How often a task wakes: to notice a changed file, and to remove a
/// departed replica soon after its last request ended.
const TICK: Duration = Duration::from_millis(250);
/// A DNS answer is not read again sooner than this, whatever its TTL.
const MIN_REREAD: Duration = Duration::from_secs(1);

/// A source as the admin API shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct SourceStatus {
    /// `dns:NAME:PORT`, `dns+srv:NAME` or `file:PATH`: the `source` of its replicas.
    pub source: String,
    pub url: String,
    pub interval_ms: u64,
    /// When it was last read (RFC 3339), whatever the result.
    pub last_resolution: Option<String>,
    /// `pending` (not read yet), `ok`, `failed` or `held` (an answer that
    /// would remove too many replicas at once, waiting to be seen twice).
    pub result: String,
    /// Why the last read failed, or what was held.
    pub error: Option<String>,
    /// Replicas the source lists now (the last good answer's, while stale).
    pub replicas: usize,
    /// True while reads fail: the fleet is the last good answer's.
    pub stale: bool,
    /// Since when reads fail (RFC 3339).
    pub stale_since: Option<String>,
}

/// One configured source, and what its task knows of it.
struct Entry {
    config: SourceConfig,
    source: Source,
    label: String,
    read: Mutex<LastRead>,
}

/// The source's lifecycle state and its last read, kept by the task and
/// shown by the views (which derive the replica count and staleness from
/// the lifecycle state itself).
struct LastRead {
    state: SourceState,
    at_ms: Option<u64>,
    result: &'static str,
    error: Option<String>,
}

impl Entry {
    fn read(&self) -> std::sync::MutexGuard<'_, LastRead> {
        self.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn status(&self) -> SourceStatus {
        let read = self.read();
        SourceStatus {
            source: self.label.clone(),
            url: self.config.url.clone(),
            interval_ms: self.config.interval_ms,
            last_resolution: read.at_ms.map(crate::clock::rfc3339),
            result: read.result.into(),
            error: read.error.clone(),
            replicas: read.state.present(),
            stale: read.state.stale(),
            stale_since: read.state.failing_since_ms.map(crate::clock::rfc3339),
        }
    }
}

/// Every configured source, with its last status.
#[derive(Default)]
pub struct Discovery {
    sources: Vec<Arc<Entry>>,
}

impl Discovery {
    /// The sources of a validated config.
    pub fn new(configs: &[SourceConfig]) -> Discovery {
        let sources = configs
            .iter()
            .filter_map(|c| {
                // A loaded config has validated its sources; one built by hand may not have.
                let source = Source::parse(&c.url).inspect_err(|e| tracing::error!("{e}; not read")).ok()?;
                let read = LastRead { state: SourceState::default(), at_ms: None, result: "pending", error: None };
                let label = source.label();
                Some(Arc::new(Entry { config: c.clone(), source, label, read: Mutex::new(read) }))
            })
            .collect();
        Discovery { sources }
    }

    pub fn statuses(&self) -> Vec<SourceStatus> {
        self.sources.iter().map(|e| e.status()).collect()
    }

    /// Starts one task per source (aborted with the other background tasks
    /// when the gateway stops).
    /// `tracer`: with tracing on, each change a source makes is a span.
    pub fn spawn(
        &self,
        operator: &Arc<Operator>,
        metrics: &Arc<Metrics>,
        tracer: Option<opentelemetry_sdk::trace::Tracer>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        self.sources
            .iter()
            .map(|entry| {
                let (operator, metrics, tracer) = (operator.clone(), metrics.clone(), tracer.clone());
                let run = Run { entry: entry.clone(), operator, metrics, tracer };
                tokio::spawn(run.forever())
            })
            .collect()
    }
}

/// One source's task.
struct Run {
    entry: Arc<Entry>,
    operator: Arc<Operator>,
    metrics: Arc<Metrics>,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
}

/// A file's identity between two looks: a change in any part is a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    modified: SystemTime,
    len: u64,
    inode: u64,
}

/// None: the file is not there (or unreadable).
fn stamp(path: &std::path::Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(FileStamp { modified: m.modified().ok()?, len: m.len(), inode: m.ino() })
}

impl Run {
    async fn forever(self) {
        let interval = Duration::from_millis(self.entry.config.interval_ms);
        self.metrics.discovery_source(&self.entry.label);
        let mut next_read = tokio::time::Instant::now();
        let mut seen: Option<FileStamp> = None;
        loop {
            let changed = match &self.entry.source {
                Source::File { path } => {
                    let current = stamp(path);
                    std::mem::replace(&mut seen, current) != current
                }
                _ => false,
            };
            if changed || tokio::time::Instant::now() >= next_read {
                let (answer, valid_for) = self.read(interval).await;
                // Records that expire sooner than the interval are read again when they do.
                let wait = match valid_for {
                    Some(ttl) if !ttl.is_zero() => interval.min(ttl.max(MIN_REREAD)),
                    _ => interval,
                };
                next_read = tokio::time::Instant::now() + wait;
                self.take(answer).await;
            }
            let fleet = &self.operator.fleet;
            let idle = |id: &str| fleet.get(id).is_none_or(|r| r.inflight() == 0);
            let due = self.entry.read().state.due(now_ms(), idle, self.entry.config.lifecycle());
            for action in due {
                self.apply(action).await;
            }
            tokio::time::sleep(TICK.min(interval)).await;
        }
    }

    /// Reads the source once: its replicas (with the source's settings), or
    /// why not; and for DNS, how long the answer is valid. The resolver is
    /// made for each read, so a changed `/etc/resolv.conf` is followed.
    async fn read(&self, interval: Duration) -> (Result<Vec<ReplicaSpec>, String>, Option<Duration>) {
        let timeout = interval.clamp(Duration::from_millis(500), Duration::from_secs(5));
        let (found, valid_for) = match &self.entry.source {
            Source::File { path } => {
                let path = path.clone();
                let read = tokio::task::spawn_blocking(move || read_file(&path)).await;
                (read.unwrap_or_else(|e| Err(format!("reading the file failed: {e}"))), None)
            }
            Source::Dns { name, port, resolver } => match dns::resolver(*resolver, timeout) {
                Ok(r) => split(dns::resolve_addresses(&r, name, *port).await),
                Err(e) => (Err(e), None),
            },
            Source::Srv { name, resolver } => match dns::resolver(*resolver, timeout) {
                Ok(r) => split(dns::resolve_srv(&r, name).await),
                Err(e) => (Err(e), None),
            },
        };
        let config = &self.entry.config;
        (found.map(|found| found.into_iter().map(|spec| config.dress(spec)).collect()), valid_for)
    }

    /// Takes one answer through the lifecycle, applies its actions and reports.
    async fn take(&self, answer: Result<Vec<ReplicaSpec>, String>) {
        let label = self.entry.label.as_str();
        let now = now_ms();
        // The lock is let go before the actions are applied (they await the operator).
        let (was_stale, verdict, actions, result, error, present, stale) = {
            let mut read = self.entry.read();
            let was_stale = read.state.stale();
            let (verdict, actions) = read.state.answer(answer, now, self.entry.config.lifecycle());
            let (result, error) = match &verdict {
                Taken::Applied => ("ok", None),
                Taken::Failed(why) => ("failed", Some(why.clone())),
                Taken::Held { would_remove, of } => (
                    "held",
                    Some(format!(
                        "would remove {would_remove} of {of} replicas at once; applied if the next answer says the same"
                    )),
                ),
            };
            (read.at_ms, read.result, read.error) = (Some(now), result, error.clone());
            let (present, stale) = (read.state.present(), read.state.stale());
            (was_stale, verdict, actions, result, error, present, stale)
        };
        for action in actions {
            self.apply(action).await;
        }
        self.metrics.discovery_read(label, result, present, stale);
        // One event and one log line per outage, recovery and held answer;
        // every failed read is counted.
        let events = &self.operator.events;
        let error = error.unwrap_or_default();
        match verdict {
            Taken::Applied if was_stale => {
                tracing::info!(source = label, "discovery source answers again");
                events.record(EventKind::DiscoveryRecovered, None, None, format!("{label} answers again"));
            }
            Taken::Applied => {}
            Taken::Failed(_) if was_stale => {
                tracing::debug!(source = label, "discovery source still failing: {error}")
            }
            Taken::Failed(_) => {
                tracing::warn!(source = label, "discovery source failed, keeping its last answer: {error}");
                events.record(EventKind::DiscoveryFailed, None, None, format!("{label}: {error}; last answer kept"));
            }
            Taken::Held { .. } => {
                tracing::warn!(source = label, "discovery answer held: {error}");
                events.record(EventKind::DiscoveryHeld, None, None, format!("{label}: {error}"));
            }
        }
    }

    async fn apply(&self, action: SourceAction) {
        let label = self.entry.label.as_str();
        let adding = match &action {
            SourceAction::Add(spec) => Some(spec.clone()),
            _ => None,
        };
        let change = match &action {
            SourceAction::Add(_) => "added",
            SourceAction::Update(_) => "updated",
            SourceAction::Drain(_) => "drained",
            SourceAction::Return(_) => "returned",
            SourceAction::Remove(_) => "removed",
        };
        // A span, current while the change applies: its event carries the trace id.
        let span = crate::telemetry::operation_span(self.tracer.as_ref(), || {
            let source = opentelemetry::KeyValue::new("prefixgate.source", label.to_string());
            (format!("prefixgate.discovery.{change}"), vec![source])
        });
        let applying = self.operator.apply_discovered(label, action, now_ms());
        let applied = match span {
            Some(cx) => opentelemetry::context::FutureExt::with_context(applying, cx).await,
            None => applying.await,
        };
        match applied {
            Ok(()) => {
                if let Some(spec) = adding {
                    // Known to the source only now: a refused one is proposed again.
                    let id = spec.id.clone();
                    if self.entry.read().state.accepted(spec) {
                        tracing::info!(source = label, replica = %id, "the name is free again: discovered replica added");
                        self.operator.events.record(
                            EventKind::ReplicaDiscovered,
                            Some(&id),
                            None,
                            format!("its name was taken when {label} listed it; added now that the name is free"),
                        );
                    }
                }
                self.metrics.discovery_change(label, change);
            }
            Err(refused) => {
                // Counted at every read while the name is taken; said once.
                let first = match &refused {
                    crate::operator::NotApplied::NameTaken { id, .. } => self.entry.read().state.refused(id),
                };
                if first {
                    tracing::warn!(source = label, "discovered replica not {change}: {refused}; retried at every read");
                }
                self.metrics.discovery_change(label, "conflict");
            }
        }
    }
}

fn split(r: Result<dns::Answer, String>) -> (Result<Vec<ReplicaSpec>, String>, Option<Duration>) {
    match r {
        Ok(a) => (Ok(a.replicas), Some(a.valid_for)),
        Err(e) => (Err(e), None),
    }
}
