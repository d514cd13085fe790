//! Shared harness: real servers on ephemeral loopback ports (bind
//! `127.0.0.1:0`, hand the listener over, never rebind), simulated replicas
//! as the backend, and polling helpers instead of sleeps.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use prefixgate::config::{Config, HealthConfig, Timeouts};
use prefixgate::fleet::ReplicaSpec;
use prefixgate::sim::{self, SimConfig, SimState};
use prefixgate::state::AppState;
use serde_json::{json, Value};

pub struct Sim {
    pub id: String,
    pub url: String,
    pub state: Arc<SimState>,
    handle: ServerHandle,
}

impl Sim {
    /// Stops the replica: `graceful=false` drops its open connections at once.
    pub async fn stop(&self, graceful: bool) {
        self.handle.stop(graceful).await;
    }
}

/// A fast simulated card: the seed's numbers, time scaled down 1000x.
pub fn fast_sim() -> SimConfig {
    SimConfig { time_scale: 0.001, ..SimConfig::default() }
}

/// A card that decodes at `tokens_per_sec` in real time (prefill instant):
/// streams last long enough to act on them mid-flight.
pub fn slow_decoder(tokens_per_sec: f64) -> SimConfig {
    SimConfig { decode_tps: tokens_per_sec, time_scale: 1.0, prefill_tps: 1e9, ..fast_sim() }
}

pub async fn start_sim(id: &str, cfg: SimConfig) -> Sim {
    start_sim_on(id, TcpListener::bind("127.0.0.1:0").unwrap(), cfg)
}

/// A simulated replica on a listener the test bound (a given loopback address).
pub fn start_sim_on(id: &str, listener: TcpListener, cfg: SimConfig) -> Sim {
    let url = format!("http://{}", listener.local_addr().unwrap());
    let state = SimState::new(cfg);
    let server = sim::serve(listener, state.clone()).unwrap();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    Sim { id: id.to_string(), url, state, handle }
}

/// A config for tests: loopback, quick health checks, short connect timeout.
pub fn test_config(sims: &[&Sim]) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        replicas: sims.iter().map(|s| ReplicaSpec::new(&s.id, &s.url)).collect(),
        health: HealthConfig { interval_ms: 100, timeout_ms: 1_000, rise: 1, fall: 1 },
        timeouts: Timeouts { connect_ms: 500, response_head_ms: 30_000, idle_stream_ms: 30_000, ..Timeouts::default() },
        // The hold at the KV wall is off here: tests about it turn it on
        // (`tests/it/sessions.rs`); others measure placement and capacity as they are.
        sessions: prefixgate::config::SessionConfig { max_wait_ms: 0, ..Default::default() },
        ..Config::default()
    }
}

pub struct Gw {
    pub gw: Arc<AppState>,
    pub base: String,
    pub admin: String,
    running: Option<prefixgate::Running>,
}

impl Gw {
    pub async fn stop(mut self) {
        self.running.take().unwrap().stop().await;
    }
}

pub async fn start_gateway(config: Config) -> Gw {
    let state = AppState::open(config).await.unwrap();
    start_state(state).await
}

/// Starts a gateway over a store the test provides (to make it fail, say).
pub async fn start_gateway_with_store(config: Config, store: Arc<dyn prefixgate::store::Store>) -> Gw {
    start_state(AppState::with_store(config, store).await.unwrap()).await
}

async fn start_state(gw: Arc<AppState>) -> Gw {
    let traffic = TcpListener::bind(gw.config.listen).unwrap();
    let admin = TcpListener::bind(gw.config.admin_listen).unwrap();
    let running = prefixgate::start(gw.clone(), traffic, admin).unwrap();
    let g = Gw {
        gw: gw.clone(),
        base: format!("http://{}", running.traffic_addr),
        admin: format!("http://{}", running.admin_addr),
        running: Some(running),
    };
    // Ready when every replica has been probed once.
    wait_until("replicas probed", Duration::from_secs(10), || {
        gw.fleet.snapshot().iter().all(|r| r.health() != prefixgate::fleet::Health::Unknown)
    })
    .await;
    g
}

/// Polls `cond` every 10 ms until it holds; panics with `what` at the timeout.
pub async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn client() -> awc::Client {
    awc::Client::builder().timeout(Duration::from_secs(60)).finish()
}

pub fn chat_body(messages: &[(&str, &str)], extra: Value) -> Value {
    let msgs: Vec<Value> = messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    let mut body = json!({"model": "sim-model", "messages": msgs, "max_tokens": 4});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

pub struct Reply {
    pub status: u16,
    pub replica: String,
    pub route: String,
    pub headers: awc::http::header::HeaderMap,
    pub body: Value,
}

pub async fn post(url: &str, body: &Value) -> Reply {
    post_with(url, body, &[]).await
}

/// A JSON POST with extra headers; a body that is not JSON comes back as a string (SSE).
pub async fn post_with(url: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut req = client().post(url);
    for (k, v) in headers {
        req = req.insert_header((*k, *v));
    }
    let mut resp = req.send_json(body).await.unwrap();
    let header = |name: &str| resp.headers().get(name).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let (replica, route) = (header("x-prefixgate-replica"), header("x-prefixgate-route"));
    let bytes = resp.body().limit(64 << 20).await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    Reply { status: resp.status().as_u16(), replica, route, headers: resp.headers().clone(), body }
}

pub async fn chat(gw: &Gw, messages: &[(&str, &str)]) -> Reply {
    post(&format!("{}/v1/chat/completions", gw.base), &chat_body(messages, json!({}))).await
}

pub fn cached_tokens(r: &Reply) -> u64 {
    r.body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// The gateway's `/metrics`, as Prometheus reads it.
pub async fn scrape(gw: &Gw) -> String {
    let mut resp = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    String::from_utf8(resp.body().limit(16 << 20).await.unwrap().to_vec()).unwrap()
}

/// A JSON request to the admin API with an optional bearer token.
pub async fn admin(method: &str, url: &str, token: Option<&str>, body: Option<Value>) -> (u16, Value) {
    let c = client();
    let mut req = c.request(method.parse().unwrap(), url);
    if let Some(t) = token {
        req = req.insert_header(("authorization", format!("Bearer {t}")));
    }
    let mut resp = match body {
        Some(b) => req.send_json(&b).await.unwrap(),
        None => req.send().await.unwrap(),
    };
    let bytes = resp.body().limit(16 << 20).await.unwrap();
    (resp.status().as_u16(), serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// A long, unique text of about `tokens` estimated tokens.
pub fn text(tag: &str, tokens: usize) -> String {
    let mut s = format!("[{tag}] ");
    let mut i = 0;
    while s.len() < tokens * 4 {
        s.push_str(&format!("sentence {i} of {tag}. "));
        i += 1;
    }
    s
}

/// A real component a test needs (a browser, Redis, a Python tool): true
/// when present. Missing, the test is skipped, except in CI (`CI` set, as
/// `.ci/run` does), where a missing component is a failure. A skipped test
/// passes, and libtest hides what a passing test printed: the skip is
/// recorded instead, and the suite's end lists every one (`skip_summary`).
pub fn require(what: &str, present: bool, install: &str) -> bool {
    if !present {
        assert!(std::env::var_os("CI").is_none(), "CI must install {what} (see .ci/run)");
        let test = std::thread::current().name().unwrap_or("?").to_string();
        SKIPPED.lock().unwrap().push(Skip { test, what: what.to_string(), install: install.to_string() });
    }
    present
}

struct Skip {
    test: String,
    what: String,
    install: String,
}

static SKIPPED: std::sync::Mutex<Vec<Skip>> = std::sync::Mutex::new(Vec::new());

/// Printed when the test binary exits, after libtest's own summary: how
/// many tests skipped, and what to install so they run. A line is printed
/// when none skipped too, so its absence means the binary did not end.
// Runs after main: no panicking print (stdout is torn down), stderr only.
#[dtor::dtor(unsafe)]
fn skip_summary() {
    use std::io::Write;
    let skipped = match SKIPPED.lock() {
        Ok(s) => s,
        Err(poisoned) => poisoned.into_inner(),
    };
    let mut out = format!("\nprefixgate integration tests: {} skipped\n", skipped.len());
    let mut by_what: Vec<&Skip> = skipped.iter().collect();
    by_what.sort_by(|a, b| (&a.what, &a.test).cmp(&(&b.what, &b.test)));
    for s in by_what {
        out.push_str(&format!("  skipped {}: {} is not installed ({})\n", s.test, s.what, s.install));
    }
    let _ = std::io::stderr().write_all(out.as_bytes());
}

/// `$var` if set, else `default`, when running it with `args` succeeds.
pub fn runnable(var: &str, default: &str, args: &[&str]) -> Option<String> {
    let program = std::env::var(var).unwrap_or_else(|_| default.to_string());
    let ok = std::process::Command::new(&program).args(args).output().is_ok_and(|o| o.status.success());
    ok.then_some(program)
}

/// A streamed request of about 40k estimated tokens (over the default
/// large-context threshold) that decodes `max_tokens` tokens.
pub fn large_stream(tag: &str, max_tokens: u64) -> Value {
    chat_body(&[("user", &text(tag, 40_000))], json!({"stream": true, "max_tokens": max_tokens}))
}

/// The real binary, `prefixgate serve` on ephemeral loopback ports, as a
/// child process. Killed (SIGKILL) when dropped, a failed assertion included:
/// no test leaves a gateway running.
pub struct GatewayProcess {
    child: std::process::Child,
    pub base: String,
    pub admin: String,
}

impl GatewayProcess {
    /// Starts it with `args` after `serve --listen .. --admin-listen ..`,
    /// `env` on top of the environment, and stderr to `stderr`; returns once
    /// it printed where it listens.
    pub fn spawn(args: &[&str], env: &[(&str, &str)], stderr: std::process::Stdio) -> GatewayProcess {
        let serve = ["serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];
        GatewayProcess::run(&[&serve, args].concat(), env, stderr)
    }

    /// Starts the binary with exactly `args` (a command that serves, like `demo`).
    pub fn run(args: &[&str], env: &[(&str, &str)], stderr: std::process::Stdio) -> GatewayProcess {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_prefixgate"))
            .args(args)
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        // Keep reading what it prints after (the demo's banner): a closed
        // pipe would fail its next write.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let field = |n: &str| line.split_whitespace().find_map(|w| w.strip_prefix(n)).unwrap_or_default().to_string();
        let process = GatewayProcess { base: field("traffic="), admin: field("admin="), child };
        assert!(process.base.starts_with("http://"), "unexpected first line: {line:?}");
        process
    }

    /// SIGKILL, no warning: nothing is flushed or released.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits until `/healthz` answers 200.
    pub async fn wait_until_up(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(resp) = client().get(format!("{}/healthz", self.base)).send().await {
                if resp.status() == 200 {
                    return;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "gateway at {} never became healthy", self.base);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A "replica" that accepts connections and never answers.
pub async fn black_hole() -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (url, task)
}
