//! The application state: a bag of `Arc` handles, one per component, built
//! once at startup. Components take only the handles they use (a running
//! ticket holds the running-request registry, the health prober holds the
//! fleet and the tracker), so dependencies point one way:
//! HTTP (admin, proxy) -> domain (operator, fleet, pins, capacity, ...) -> store.

use std::sync::Arc;

use crate::access::Access;
use crate::announce::Announcer;
use crate::capacity::Capacity;
use crate::config::Config;
use crate::events::EventLog;
use crate::fleet::health::HealthTracker;
use crate::fleet::{AdminState, Fleet, Replica, ReplicaSource};
use crate::metrics::Metrics;
use crate::operator::Operator;
use crate::pins::{Pin, PinSource, PinTable};
use crate::policy::{CurrentPolicy, PolicySettings, PrefixKey, SpreadCounter};
use crate::store::{EventWriter, MemoryStore, SledStore, Store, StoreError, StoredReplica};

pub struct AppState {
    pub config: Arc<Config>,
    pub fleet: Arc<Fleet>,
    pub pins: Arc<PinTable>,
    pub events: Arc<EventLog>,
    pub event_writer: Arc<EventWriter>,
    pub store: Arc<dyn Store>,
    pub metrics: Arc<Metrics>,
    /// Tells the other instances (a shared store) about new pins at once.
    pub announcer: Arc<Announcer>,
    pub access: Arc<Access>,
    pub capacity: Arc<Capacity>,
    pub health: Arc<HealthTracker>,
    pub policy: Arc<CurrentPolicy>,
    pub spread: Arc<SpreadCounter>,
    /// Client ids and cache salts, computed once per API key.
    pub client_ids: crate::client_ids::ClientIds,
    /// Continued streams' next legs starting now (`failover.max_resuming`).
    pub resuming: Arc<tokio::sync::Semaphore>,
    pub operator: Arc<Operator>,
    /// Fleet-wide large-context leases this instance holds (a shared store).
    pub leases: Arc<crate::leases::Leases>,
    /// The discovery sources and their last status.
    pub discovery: Arc<crate::discovery::Discovery>,
    /// OpenTelemetry traces (off without an endpoint).
    pub telemetry: crate::telemetry::Telemetry,
    /// Sessions resident on each replica, and the new ones held for room.
    pub sessions: Arc<crate::sessions::Sessions>,
    /// The fleet over time, sampled in the background.
    pub timeline: crate::timeline::Timeline,
    /// Stored response ids no replica held, not looked for again for a while.
    pub unknown_responses: crate::unknown_ids::UnknownIds,
    /// False while the last write to the store failed (a shared store that is
    /// unreachable): routing goes on from memory, writes are retried.
    pub store_up: std::sync::atomic::AtomicBool,
}

/// This instance's name in a shared store: configured, else host and process id.
fn instance_name(config: &Config) -> String {
    config.store.instance.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "gateway".into());
        format!("{}-{}", host.trim(), std::process::id())
    })
}

impl AppState {
    /// Opens the store (sled under `data_dir`, else memory), restores what
    /// it holds, and seeds replicas from the config when the database is new.
    ///
    /// The rule: the config's replica list seeds an empty database only;
    /// afterwards the database (changed through the admin API) is the source
    /// of truth, and replicas in the config file are ignored with a warning.
    pub async fn open(config: Config) -> Result<Arc<AppState>, StoreError> {
        let store: Arc<dyn Store> = match (&config.store.url, &config.data_dir) {
            (Some(url), _) => crate::store::open_url(url, &instance_name(&config)).await?,
            (None, Some(dir)) => Arc::new(SledStore::open(dir)?),
            (None, None) => Arc::new(MemoryStore::history_elsewhere()),
        };
        AppState::with_store(config, store).await
    }

    pub async fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Arc<AppState>, StoreError> {
        let fleet = Arc::new(Fleet::default());
        let stored = store.replicas().await?;
        if store.is_new() {
            for spec in &config.replicas {
                let r = StoredReplica { spec: spec.clone(), admin: AdminState::Active, source: ReplicaSource::Static };
                store.put_replica(&r).await?;
                fleet.add(Replica::new(r.spec, r.admin));
            }
        } else {
            if !config.replicas.is_empty() {
                tracing::warn!(
                    "the database already lists replicas; the {} replica(s) in the config are ignored \
                     (manage replicas through the admin API)",
                    config.replicas.len()
                );
            }
            for r in stored {
                fleet.add(Replica::from_source(r.spec, r.admin, r.source));
            }
        }
        let policy = match store.setting("policy").await? {
            Some(v) => serde_json::from_value(v)
                .map_err(|e| StoreError::Corrupt { tree: "settings", detail: e.to_string() })?,
            None => PolicySettings { mode: config.policy, identity: config.identity.blocks() },
        };
        let capacity = Arc::new(Capacity::new(config.capacity.working_set_window_secs));
        let pins = restore_pins(store.as_ref(), &fleet, capacity.window_secs()).await?;
        let (events, recorded) = EventLog::new(
            config.history.max_events,
            config.history.max_unwritten,
            store.instance(),
            store.events().await?,
        );
        let event_writer = EventWriter::new(recorded, store.clone());
        let events = Arc::new(events);
        let policy = Arc::new(CurrentPolicy::new(policy));
        let metrics = Arc::new(Metrics::new());
        let sessions = crate::sessions::Sessions::new(config.sessions.clone());
        let operator = Arc::new(Operator {
            fleet: fleet.clone(),
            pins: pins.clone(),
            events: events.clone(),
            store: store.clone(),
            policy: policy.clone(),
            sessions: sessions.clone(),
            discovered_admin: std::sync::Mutex::new(crate::operator::read_discovered_admin(store.as_ref()).await?),
            serial: Default::default(),
        });
        let follower = Arc::new(crate::shared::Follower {
            operator: Arc::downgrade(&operator),
            metrics: Arc::downgrade(&metrics),
            // Re-read once the listener runs: another instance may have
            // changed something between our reads above and the subscription.
            resync: std::sync::atomic::AtomicBool::new(store.instance().is_some()),
        });
        crate::shared::follow(follower, store.as_ref());
        let announcer = Announcer::start(&store, metrics.clone());
        Ok(Arc::new(AppState {
            announcer: Arc::new(announcer),
            metrics,
            access: Arc::new(Access::new(&config)),
            health: Arc::new(HealthTracker::new(config.health.rise, config.health.fall, events.clone())),
            resuming: Arc::new(tokio::sync::Semaphore::new(config.failover.max_resuming)),
            client_ids: Default::default(),
            spread: Arc::new(SpreadCounter::starting_at(
                store.instance().map_or(0, |name| xxhash_rust::xxh3::xxh3_64(name.as_bytes())),
            )),
            discovery: Arc::new(crate::discovery::Discovery::new(&config.discovery)),
            unknown_responses: crate::unknown_ids::UnknownIds::new(config.timeouts.unknown_response_ms),
            sessions,
            timeline: crate::timeline::Timeline::new(config.timeline.clone()),
            telemetry: crate::telemetry::Telemetry::from_config(&config.tracing).map_err(StoreError::Backend)?,
            config: Arc::new(config),
            fleet,
            pins,
            events,
            event_writer: Arc::new(event_writer),
            store,
            capacity,
            policy,
            operator,
            leases: Arc::default(),

            store_up: std::sync::atomic::AtomicBool::new(true),
        }))
    }

    /// Writes dirty pins and recorded events in one batch each and makes them
    /// durable; called by the flusher and at shutdown. The explicit flush
    /// matters: sled otherwise keeps writes in memory for up to 500 ms, and a
    /// `kill -9` would lose pins older than our own flush interval.
    ///
    /// A failed write leaves its pins dirty and its events queued, so the
    /// next flush retries them: pins written while a shared store was down
    /// reach it once it is back.
    pub async fn flush_pins(&self) -> Result<usize, StoreError> {
        let changes = self.pins.take_dirty();
        let written = self.write_changes(&changes).await;
        match &written {
            Ok(n) => {
                self.metrics.pins_persisted.inc_by(*n as u64);
            }
            Err(_) => self.pins.mark_dirty(changes.iter().map(|(k, _)| *k)),
        }
        written
    }

    /// The flusher's tick: the heartbeat (shared stores), then the batch of
    /// pins and events; the store counts as reachable again only once both
    /// went through, so "reachable" means the queued writes are in.
    pub async fn sync_with_store(&self, admin_url: Option<String>) -> Result<usize, StoreError> {
        let result = match self.heartbeat(admin_url).await {
            Ok(()) => self.flush_pins().await,
            Err(e) => Err(e),
        };
        self.note_store(result.as_ref().err());
        result
    }

    async fn write_changes(&self, changes: &[crate::pins::PinChange]) -> Result<usize, StoreError> {
        let events = self.event_writer.flush().await?;
        if !changes.is_empty() {
            self.store.write_pins(changes).await?;
        }
        if !changes.is_empty() || events > 0 {
            self.store.flush().await?;
        }
        Ok(changes.len())
    }

    /// True when the request path may ask the shared store: there is one,
    /// and the flusher's last round trip to it went through. A store that
    /// stopped answering costs requests nothing: they go on from this
    /// instance's own view until the flusher gets through again (within a
    /// flush interval of the store's return).
    pub fn shared_store_answers(&self) -> bool {
        self.store.instance().is_some() && self.store_up.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records the store's reachability: one event and one log line per transition.
    pub fn note_store(&self, error: Option<&StoreError>) {
        use std::sync::atomic::Ordering;
        let up = error.is_none();
        if self.store_up.swap(up, Ordering::AcqRel) != up {
            match error {
                Some(e) => {
                    tracing::error!("the store is unreachable ({e}); routing goes on from memory, writes are retried");
                    self.events.record(crate::events::EventKind::StoreUnreachable, None, None, e.to_string());
                }
                None => {
                    tracing::info!("the store is reachable again; queued writes went through");
                    self.events.record(crate::events::EventKind::StoreReachable, None, None, "queued writes flushed");
                }
            }
        }
    }

    /// This instance's heartbeat in a shared store (no-op otherwise).
    async fn heartbeat(&self, admin_url: Option<String>) -> Result<(), StoreError> {
        let Some(instance) = self.store.instance() else { return Ok(()) };
        let fleet = self.fleet.snapshot();
        let inflight = fleet.iter().map(|r| (r.id.to_string(), r.inflight())).collect();
        let walls = fleet.iter().filter_map(|r| Some((r.id.to_string(), r.residents.evidence.shared()?))).collect();
        let now = crate::clock::now_ms();
        let beat = crate::store::InstanceBeat {
            instance: instance.to_string(),
            at_ms: now,
            inflight,
            admin_url,
            running: self.capacity.running.totals(),
            walls,
        };
        let result = async {
            self.store.heartbeat(&beat).await?;
            self.store.renew_leases(&self.leases.held(), crate::leases::LEASE_TTL_MS).await?;
            self.store.instances().await
        }
        .await;
        // The other live instances: what they run counts in the capacity
        // verdict, and the walls they hold are this one's too.
        if let Ok(beats) = &result {
            let others: Vec<_> = beats
                .iter()
                .filter(|b| {
                    b.instance != instance && now.saturating_sub(b.at_ms) <= crate::operator::INSTANCE_TIMEOUT_MS
                })
                .collect();
            let mut elsewhere: std::collections::HashMap<&str, (u64, u64)> = Default::default();
            for b in &others {
                for (replica, (count, tokens)) in &b.running {
                    let e = elsewhere.entry(replica.as_str()).or_default();
                    e.0 += count;
                    e.1 += tokens;
                }
            }
            for r in fleet.iter() {
                r.capacity.set_running_elsewhere(elsewhere.get(&*r.id).copied().unwrap_or_default());
            }
            self.merge_walls(&others, now);
        }
        result.map(|_| ())
    }

    /// Merges the walls the other live instances hold (`others`, their
    /// beats) into this one's (`fleet::wall::shared`): a wall is the
    /// replica's, whichever instance saw it. Said in history as a wall
    /// seen here would be.
    fn merge_walls(&self, others: &[&crate::store::InstanceBeat], now: u64) {
        for b in others {
            for (id, wall) in &b.walls {
                let Some(r) = self.fleet.get(id) else { continue };
                let Some(at) = r.residents.evidence.merge(*wall, now) else { continue };
                let detail = format!(
                    "instance {} saw the wall at ~{at} tokens resident: no new session above that load",
                    b.instance
                );
                tracing::info!(replica = %r.id, "{detail}");
                self.events.record(crate::events::EventKind::KvWallSeen, Some(&r.id), None, detail);
            }
        }
    }

    /// Graceful shutdown's last step: everything to disk.
    pub async fn flush_all(&self) -> Result<(), StoreError> {
        self.flush_pins().await?;
        self.store.flush().await
    }
}

/// The pins the store holds, and the working set they leave (the
/// conversations that came back within the window, on their replicas).
/// Read whole; or, from a store that keeps pages (sled), page by page while
/// the gateway serves (`pins::pages`): a key's page on its first touch, the
/// rest by a background thread.
async fn restore_pins(store: &dyn Store, fleet: &Arc<Fleet>, window_secs: u64) -> Result<Arc<PinTable>, StoreError> {
    let since = crate::clock::now_ms().saturating_sub(window_secs * 1000);
    let fleet = fleet.clone();
    let remember = move |pins: &[(PrefixKey, Pin)]| {
        let returned = pins.iter().map(|(_, p)| p).filter(|p| p.turns >= 2 && p.last_used_ms >= since);
        for p in returned.filter(|p| p.origin.source != PinSource::Passed) {
            if let Some(r) = fleet.get(&p.replica) {
                r.residents.remember(p.family, p.est_tokens, p.last_used_ms);
            }
        }
    };
    let Some(read) = store.pin_pages() else {
        let (pins, all) = (PinTable::default(), store.pins().await?);
        remember(&all);
        pins.restore(all);
        return Ok(Arc::new(pins));
    };
    let pins = Arc::new(PinTable::paged(read, Some(Box::new(remember))));
    let loader = pins.clone();
    std::thread::Builder::new()
        .name("pin-pages".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            loader.load_all();
            let secs = started.elapsed().as_secs_f64();
            tracing::info!(pins = loader.len(), "pins read from disk in the background in {secs:.2} s");
        })
        .map_err(|e| StoreError::Backend(format!("cannot start the pin loader: {e}")))?;
    Ok(pins)
}
