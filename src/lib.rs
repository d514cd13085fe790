//! prefixgate: a gateway in front of OpenAI-compatible LLM replicas that
//! routes by request shape: continuations go back to the replica holding
//! their prefix in KV cache, everything else is spread by a counter.
//!
//! `create_traffic_app` and `create_admin_app` are the one place where the
//! HTTP surface is wired; `main` and the integration tests both use them.

#![forbid(unsafe_code)]

pub mod access;
pub mod admin;
pub mod admission;
pub mod announce;
pub mod bench;
pub mod by_arc;
pub mod capacity;
pub mod client_ids;
pub mod clock;
pub mod config;
pub mod config_flags;
pub mod connector;
pub mod discovery;
pub mod domain_error;
pub mod error;
pub mod events;
pub mod fleet;
pub mod json_int;
pub mod leases;
pub mod metrics;
pub mod operator;
pub mod pins;
pub mod policy;
pub mod priority;
pub mod proxy;
pub mod read_mostly;
pub mod sessions;
pub mod shared;
pub mod sim;
pub mod state;
pub mod store;
pub mod striped;
pub mod telemetry;
pub mod timeline;
pub mod tokens;
pub mod unknown_ids;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};

use error::ApiError;
use state::AppState;

/// A running gateway: its two listeners and the handles to stop it.
pub struct Running {
    pub state: Arc<AppState>,
    pub traffic_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    traffic: ServerHandle,
    admin: ServerHandle,
    servers: Vec<actix_web::rt::task::JoinHandle<std::io::Result<()>>>,
    background: Background,
}

/// The background tasks. The flusher is asked to stop and finishes the
/// round it is in: aborted mid-write, a store call it made would run on
/// without it (a sled write on the blocking pool keeps the database open).
struct Background {
    flusher: actix_web::rt::task::JoinHandle<()>,
    stop_flusher: Arc<tokio::sync::Notify>,
    others: Vec<actix_web::rt::task::JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, lets in-flight requests finish (bounded by the
    /// servers' shutdown timeout), flushes pins and the store, then gives
    /// back the room of the sessions it served last (a shared store).
    pub async fn stop(self) {
        futures_util::future::join(self.traffic.stop(true), self.admin.stop(true)).await;
        futures_util::future::join_all(self.servers).await;
        // The background tasks hold the gateway (and so the database): end them.
        let Background { flusher, stop_flusher, others } = self.background;
        for task in &others {
            task.abort();
        }
        stop_flusher.notify_one();
        let _ = flusher.await;
        futures_util::future::join_all(others).await;
        if let Err(e) = self.state.flush_all().await {
            tracing::error!("final flush failed: {e}");
        }
        // After the flusher (which would keep them again) and the last pins
        // (which would make them resident again on the others).
        match sessions::sync::release_ours(&self.state.sessions, self.state.store.as_ref()).await {
            Ok(0) => {}
            Ok(n) => tracing::info!("released {n} session(s) this instance served last"),
            Err(e) => tracing::warn!("could not release this instance's sessions (their entries expire): {e}"),
        }
        self.state.telemetry.shutdown();
    }
}

/// Starts both listeners and the background tasks (health checks, pin
/// flusher and pruner). Must run inside an actix system.
pub fn start(state: Arc<AppState>, traffic: TcpListener, admin: TcpListener) -> std::io::Result<Running> {
    let traffic_addr = traffic.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let data = web::Data::from(state.clone());
    let config = state.config.clone();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let traffic_server = HttpServer::new({
        let data = data.clone();
        move || create_traffic_app(data.clone())
    })
    .workers(workers)
    .backlog(4096)
    .tcp_nodelay(true)
    .max_connections(100_000)
    .client_request_timeout(Duration::from_millis(config.limits.header_timeout_ms))
    // A client that closes its side has gone (OpenAI clients never half-close):
    // drop its handler at once, so a request queued for admission or waiting
    // for a slow first byte is cancelled instead of running for nobody.
    .h1_allow_half_closed(false)
    // In-flight streams may run this long after a stop: long decodes finish.
    .shutdown_timeout(config.timeouts.shutdown_grace_secs)
    .disable_signals()
    .listen(traffic)?
    .run();
    let admin_server = HttpServer::new({
        let data = data.clone();
        move || create_admin_app(data.clone())
    })
    .workers(1)
    .tcp_nodelay(true)
    .shutdown_timeout(5)
    .disable_signals()
    .listen(admin)?
    .run();
    let background = spawn_background(&state, admin_addr);
    let (traffic, admin) = (traffic_server.handle(), admin_server.handle());
    // Servers run only while polled: spawn them on this system.
    let servers = vec![actix_web::rt::spawn(traffic_server), actix_web::rt::spawn(admin_server)];
    Ok(Running { state, traffic_addr, admin_addr, traffic, admin, servers, background })
}

/// Health checks; the pin and event flusher; capacity evaluation, pin
/// pruning and rate-limiter pruning. Each task holds only the handles it uses.
fn spawn_background(state: &Arc<AppState>, admin_addr: SocketAddr) -> Background {
    let health = actix_web::rt::spawn(fleet::health::run(
        state.config.health.clone(),
        Duration::from_millis(state.config.timeouts.connect_ms),
        state.fleet.clone(),
        state.health.clone(),
    ));
    let stop_flusher = Arc::new(tokio::sync::Notify::new());
    let flusher =
        actix_web::rt::spawn(flusher(state.clone(), Some(format!("http://{admin_addr}")), stop_flusher.clone()));
    let housekeeping = actix_web::rt::spawn({
        let (fleet, pins, capacity, events, access) = (
            state.fleet.clone(),
            state.pins.clone(),
            state.capacity.clone(),
            state.events.clone(),
            state.access.clone(),
        );
        let (ttl_ms, max_pins) = (state.config.pins.ttl_secs * 1000, state.config.pins.max_pins);
        async move {
            let mut tick = 0u64;
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                tick += 1;
                capacity.evaluate(&fleet.capacity_inputs(capacity.since_ms(clock::now_ms())), &events);
                if tick.is_multiple_of(10) {
                    let pruned = pins.prune(clock::now_ms(), ttl_ms, max_pins);
                    let names: std::collections::HashSet<Arc<str>> =
                        fleet.snapshot().iter().map(|r| r.id.clone()).collect();
                    let released = pins.release_unused(|name| names.contains(name));
                    if pruned + released > 0 {
                        tracing::debug!("pruned {pruned} pin(s), released {released} replica name(s)");
                    }
                    access.prune();
                }
            }
        }
    });
    // The sessions' own task: the sweep, and their half of a shared store.
    let sessions = actix_web::rt::spawn(
        sessions::sync::SessionSync {
            sessions: state.sessions.clone(),
            store: state.store.clone(),
            fleet: state.fleet.clone(),
            keep_every: Duration::from_millis(state.config.pins.flush_interval_ms),
        }
        .run(),
    );
    let mut others = vec![health, housekeeping, sessions];
    if state.config.timeline.interval_ms > 0 {
        others.push(actix_web::rt::spawn(sample_timeline(state.clone())));
    }
    others.extend(state.discovery.spawn(&state.operator, &state.metrics, state.telemetry.tracer().cloned()));
    Background { flusher, stop_flusher, others }
}

/// The timeline's sampler: every `timeline.interval_ms`, each replica's
/// gauges and series totals, and the held sessions (`timeline.rs`).
async fn sample_timeline(state: Arc<AppState>) {
    let every = Duration::from_millis(state.config.timeline.interval_ms);
    loop {
        tokio::time::sleep(every).await;
        let readings = state
            .fleet
            .snapshot()
            .iter()
            .map(|r| timeline::Reading {
                id: r.id.clone(),
                resident_tokens: sessions::Sessions::resident(r).counted_tokens,
                capacity_tokens: r.kv_capacity(),
                wall_tokens: r.residents.evidence.wall(),
                inflight: r.inflight(),
                paused_by_class: sessions::Sessions::paused_by_class(r),
                totals: r.series.totals(),
            })
            .collect();
        state.timeline.record(clock::now_ms(), readings, state.sessions.held_by_class());
    }
}

/// The pin and event flusher: every `pins.flush_interval_ms`, the heartbeat
/// and one batch of pins and events (an fsync on the blocking pool, or round
/// trips to a shared store, awaited). Until `stop` is told (between rounds);
/// a failed batch is retried at the next tick.
pub async fn flusher(state: Arc<AppState>, admin_url: Option<String>, stop: Arc<tokio::sync::Notify>) {
    let every = Duration::from_millis(state.config.pins.flush_interval_ms);
    loop {
        tokio::select! {
            _ = stop.notified() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) = state.sync_with_store(admin_url.clone()).await {
            tracing::error!("pin flush failed (will retry): {e}");
        }
    }
}

/// The client-facing app: `/v1/*` and `/healthz`.
pub fn create_traffic_app(
    state: web::Data<AppState>,
) -> App<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let upstream = web::Data::new(proxy::Upstream::new(&state.config.timeouts));
    let recorder = web::Data::new(proxy::outcome::OutcomeRecorder::new(&state));
    App::new()
        .app_data(state)
        .app_data(upstream)
        .app_data(recorder)
        .route("/healthz", web::get().to(healthz))
        // A scope matches its prefix as a plain string; a `{tail:.*}` route
        // would run a regex on every request.
        .service(
            web::scope("/v1")
                .service(web::resource("").to(no_route))
                .route("/models", web::get().to(list_models))
                .default_service(web::to(proxy::forward)),
        )
        .default_service(web::to(no_route))
}

async fn no_route() -> Result<HttpResponse, ApiError> {
    Err(ApiError::NotFound("no such route; the API lives under /v1".into()))
}

/// 200 while any replica is routable. An unreachable shared store or a
/// failing discovery source does not make the gateway unhealthy (it routes
/// from memory, and from the source's last good answer), but both are
/// reported: a probe that failed every gateway while DNS is down would empty
/// the service exactly when its replicas are still there.
async fn healthz(state: web::Data<AppState>) -> HttpResponse {
    let routable = state.fleet.snapshot().iter().filter(|r| r.routable()).count();
    let store = if state.store_up.load(std::sync::atomic::Ordering::Acquire) { "ok" } else { "unreachable" };
    let stale: Vec<String> = state.discovery.statuses().into_iter().filter(|s| s.stale).map(|s| s.source).collect();
    let body = serde_json::json!({
        "status": if routable > 0 { "ok" } else { "degraded" },
        "routable_replicas": routable,
        "store": store,
        "stale_sources": stale,
    });
    if routable > 0 {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// `GET /v1/models`: the union of the models the replicas reported.
async fn list_models(req: actix_web::HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    if let Some(refused) = proxy::refuse_client(&state, &req, policy::Dialect::Chat) {
        return refused;
    }
    let fleet = &state.fleet;
    let mut ids: Vec<String> = fleet.snapshot().iter().flat_map(|r| r.models().as_ref().clone()).collect();
    ids.sort();
    ids.dedup();
    let data: Vec<_> =
        ids.iter().map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": "prefixgate"})).collect();
    HttpResponse::Ok().json(serde_json::json!({"object": "list", "data": data}))
}

pub use admin::create_admin_app;
