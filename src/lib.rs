//! prefixgate: a gateway in front of OpenAI-compatible LLM replicas that
//! routes by request shape: continuations go back to the replica holding
//! their prefix in KV cache, everything else is spread by a counter.
//!
//! `create_traffic_app` and `create_admin_app` are the one place where the
//! HTTP surface is wired; `main` and the integration tests both use them.

pub mod access;
pub mod admin;
pub mod admission;
pub mod bench;
pub mod capacity;
pub mod clock;
pub mod config;
pub mod error;
pub mod events;
pub mod fleet;
pub mod gateway;
pub mod metrics;
pub mod pins;
pub mod policy;
pub mod proxy;
pub mod sim;
pub mod store;
pub mod tokens;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};

use error::ApiError;
use gateway::Gateway;

/// A running gateway: its two listeners and the handles to stop it.
pub struct Running {
    pub gateway: Arc<Gateway>,
    pub traffic_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    traffic: ServerHandle,
    admin: ServerHandle,
    servers: Vec<actix_web::rt::task::JoinHandle<std::io::Result<()>>>,
    background: Vec<actix_web::rt::task::JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, lets in-flight requests finish (bounded by the
    /// servers' shutdown timeout), then flushes pins and the store.
    pub async fn stop(self) {
        futures_util::future::join(self.traffic.stop(true), self.admin.stop(true)).await;
        futures_util::future::join_all(self.servers).await;
        // The background tasks hold the gateway (and so the database): end them.
        for task in &self.background {
            task.abort();
        }
        futures_util::future::join_all(self.background).await;
        if let Err(e) = self.gateway.flush_all() {
            tracing::error!("final flush failed: {e}");
        }
    }
}

/// Starts both listeners and the background tasks (health checks, pin
/// flusher and pruner). Must run inside an actix system.
pub fn start(gw: Arc<Gateway>, traffic: TcpListener, admin: TcpListener) -> std::io::Result<Running> {
    let traffic_addr = traffic.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let data = web::Data::from(gw.clone());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let traffic_server = HttpServer::new({
        let data = data.clone();
        move || create_traffic_app(data.clone())
    })
    .workers(workers)
    .backlog(4096)
    .tcp_nodelay(true)
    .max_connections(100_000)
    .client_request_timeout(Duration::from_millis(gw.config.limits.header_timeout_ms))
    // A client that closes its side has gone (OpenAI clients never half-close):
    // drop its handler at once, so a request queued for admission or waiting
    // for a slow first byte is cancelled instead of running for nobody.
    .h1_allow_half_closed(false)
    .shutdown_timeout(30)
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
    let background = spawn_background(gw.clone());
    let (traffic, admin) = (traffic_server.handle(), admin_server.handle());
    // Servers run only while polled: spawn them on this system.
    let servers = vec![actix_web::rt::spawn(traffic_server), actix_web::rt::spawn(admin_server)];
    Ok(Running { gateway: gw, traffic_addr, admin_addr, traffic, admin, servers, background })
}

/// Health checks; the pin flusher; capacity evaluation, pin pruning and
/// rate-limiter pruning.
fn spawn_background(gw: Arc<Gateway>) -> Vec<actix_web::rt::task::JoinHandle<()>> {
    let health = actix_web::rt::spawn(fleet::health::run(gw.clone()));
    let flush_every = Duration::from_millis(gw.config.pins.flush_interval_ms);
    let flusher = actix_web::rt::spawn({
        let gw = gw.clone();
        async move {
            loop {
                tokio::time::sleep(flush_every).await;
                // fsync off the runtime thread.
                let gw = gw.clone();
                match tokio::task::spawn_blocking(move || gw.flush_pins()).await {
                    Ok(Err(e)) => tracing::error!("pin flush failed (will retry): {e}"),
                    Err(e) => tracing::error!("pin flusher panicked: {e}"),
                    Ok(Ok(_)) => {}
                }
            }
        }
    });
    let housekeeping = actix_web::rt::spawn(async move {
        let mut tick = 0u64;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            tick += 1;
            capacity::evaluate(&gw);
            if tick.is_multiple_of(10) {
                let pruned = gw.pins.prune(clock::now_ms(), gw.config.pins.ttl_secs * 1000, gw.config.pins.max_pins);
                if pruned > 0 {
                    tracing::debug!("pruned {pruned} pin(s)");
                }
                gw.access.prune();
            }
        }
    });
    vec![health, flusher, housekeeping]
}

/// The client-facing app: `/v1/*` and `/healthz`.
pub fn create_traffic_app(
    gw: web::Data<Gateway>,
) -> App<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let upstream = web::Data::new(proxy::Upstream::new(&gw));
    App::new()
        .wrap(actix_web::middleware::from_fn(access::guard_traffic))
        .app_data(gw)
        .app_data(upstream)
        .route("/healthz", web::get().to(healthz))
        .route("/v1/models", web::get().to(list_models))
        .route("/v1/{tail:.*}", web::to(proxy::forward))
        .default_service(web::to(|| async {
            Err::<HttpResponse, _>(ApiError::NotFound("no such route; the API lives under /v1".into()))
        }))
}

async fn healthz(gw: web::Data<Gateway>) -> HttpResponse {
    let routable = gw.fleet.snapshot().iter().filter(|r| r.routable()).count();
    let body =
        serde_json::json!({"status": if routable > 0 { "ok" } else { "degraded" }, "routable_replicas": routable});
    if routable > 0 {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// `GET /v1/models`: the union of the models the replicas reported.
async fn list_models(gw: web::Data<Gateway>) -> HttpResponse {
    let mut ids: Vec<String> = gw.fleet.snapshot().iter().flat_map(|r| r.models().as_ref().clone()).collect();
    ids.sort();
    ids.dedup();
    let data: Vec<_> =
        ids.iter().map(|id| serde_json::json!({"id": id, "object": "model", "owned_by": "prefixgate"})).collect();
    HttpResponse::Ok().json(serde_json::json!({"object": "list", "data": data}))
}

pub use admin::create_admin_app;
