//! Typed configuration: file, then `PREFIXGATE_*` environment variables, then
//! CLI flags (each later source wins). Validated once at startup; an invalid
//! value fails with a message that names its key.
//!
//! Environment mapping: `PREFIXGATE_<KEY>` for top-level keys and
//! `PREFIXGATE_<SECTION>_<KEY>` for keys of a section, e.g.
//! `PREFIXGATE_POLICY=roundrobin`, `PREFIXGATE_TIMEOUTS_CONNECT_MS=500`.
//! Values are read as TOML values (numbers, booleans), else as strings.
//! `PREFIXGATE_REPLICAS="a=http://127.0.0.1:8001,b=http://127.0.0.1:8002"`
//! sets the replica list.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

// Each component's settings live with it; the config gathers them.
pub use crate::fleet::health::HealthConfig;

pub use crate::discovery::SourceConfig;
use crate::fleet::ReplicaSpec;
use crate::policy::tenancy::{CacheSalt, IdentityScope};
use crate::policy::{IdentityBlocks, Mode};
pub use crate::priority::PriorityConfig;
pub use crate::sessions::SessionConfig;
pub use crate::telemetry::TracingConfig;
pub use crate::timeline::TimelineConfig;

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Client traffic listener (`/v1`, `/healthz`).
    #[schema(value_type = String)]
    pub listen: SocketAddr,
    /// Admin listener (admin API, metrics, Swagger UI, web UI).
    #[schema(value_type = String)]
    pub admin_listen: SocketAddr,
    /// Where the sled database lives. Unset: in-memory only (nothing survives a restart).
    #[schema(value_type = Option<String>)]
    pub data_dir: Option<PathBuf>,
    /// Routing mode: shape, roundrobin or affinity.
    #[schema(inline)]
    pub policy: Mode,
    #[schema(inline)]
    pub routing: RoutingConfig,
    /// Bearer token for the admin API. Required when `admin_listen` is not loopback.
    pub admin_token: Option<String>,
    /// Client API keys accepted on `/v1` (empty: no key required).
    pub api_keys: Vec<String>,
    #[schema(inline)]
    pub identity: IdentityConfig,
    #[schema(inline)]
    pub timeouts: Timeouts,
    #[schema(inline)]
    pub failover: FailoverConfig,
    #[schema(inline)]
    pub health: HealthConfig,
    #[schema(inline)]
    pub limits: Limits,
    #[schema(inline)]
    pub pins: PinConfig,
    #[schema(inline)]
    pub history: HistoryConfig,
    #[schema(inline)]
    pub rate_limits: RateLimits,
    #[schema(inline)]
    pub admission: AdmissionConfig,
    #[schema(inline)]
    pub capacity: CapacityConfig,
    #[schema(inline)]
    pub sessions: SessionConfig,
    /// Who waits at the wall: priority classes, clients, preemption (docs/sessions.md, "Priority").
    #[schema(inline)]
    pub priority: PriorityConfig,
    #[schema(inline)]
    pub store: StoreConfig,
    #[schema(inline)]
    pub tracing: TracingConfig,
    /// The fleet over time (`GET /admin/v1/timeline`, the UI's charts).
    #[schema(inline)]
    pub timeline: TimelineConfig,
    /// Replicas as `ID=URL` (repeatable); they seed an empty database only.
    pub replicas: Vec<ReplicaSpec>,
    /// Where to find more replicas: `dns://NAME:PORT`, `dns+srv://_SERVICE._PROTO.NAME`
    /// (optional `?resolver=IP:PORT`) or `file://PATH` (repeatable; `[[discovery]]` tables in the file).
    pub discovery: Vec<SourceConfig>,
}

/// How requests that continue nothing are placed, and when a pinned turn
/// moves (docs/routing.md, "Placement").
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `load`: the replica with the least outstanding work (uncached prompt
    /// tokens queued or prefilling, streams decoding), the counter breaking
    /// ties; `counter`: the seed's counter alone.
    #[schema(inline)]
    pub spread: crate::policy::Spread,
}

/// How conversations are told apart: the identity blocks of a string or
/// token prompt (their runtime values: `PUT /admin/v1/policy`), and whether
/// tenants share pins (`policy::tenancy`; docs/routing.md, "Tenants").
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct IdentityConfig {
    /// Bytes per identity block of a `/v1/completions` string prompt.
    #[serde(deserialize_with = "crate::json_int::usize")]
    pub block_bytes: usize,
    /// Token ids per identity block of a `/v1/completions` token-array prompt.
    #[serde(deserialize_with = "crate::json_int::usize")]
    pub block_tokens: usize,
    /// Whose conversations share pins: `shared` (everyone's: a common system
    /// prompt is worth sharing) or `client` (the client, an API key's hash,
    /// is part of every key: tenants never share a pin or a stored-response pin).
    #[schema(inline)]
    pub scope: IdentityScope,
    /// `client`: set vLLM's `cache_salt` on bodies that carry none, derived
    /// from the client, so the engine keeps tenants' prefix caches apart
    /// (one of the two body edits the README lists). `none`: bodies as sent.
    #[schema(inline)]
    pub cache_salt: CacheSalt,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        let blocks = IdentityBlocks::default();
        IdentityConfig {
            block_bytes: blocks.block_bytes,
            block_tokens: blocks.block_tokens,
            scope: IdentityScope::Shared,
            cache_salt: CacheSalt::None,
        }
    }
}

impl IdentityConfig {
    /// The block sizes the policy starts with.
    pub fn blocks(&self) -> IdentityBlocks {
        IdentityBlocks { block_bytes: self.block_bytes, block_tokens: self.block_tokens }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// A store shared by several gateway instances: `redis://[:password@]host:port/db`,
    /// `rediss://...` (TLS), `redis+unix:///path`, or `redis+sentinel://host:port,.../service`.
    /// Unset: sled under `data_dir` (or memory).
    pub url: Option<String>,
    /// This instance's name in the shared store (default: hostname and process id).
    pub instance: Option<String>,
    /// A stored response id, a continuation's prefixes or a session key this
    /// instance does not know are looked up in the shared store for at most
    /// this long (a stored response's replicas are asked next; a request
    /// nobody pinned is spread).
    pub read_through_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig { url: None, instance: None, read_through_ms: 5 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP connect to a replica. Short: a refused or silent replica fails over fast.
    pub connect_ms: u64,
    /// From sending the request to the response head. Long: some servers send
    /// headers only after a cold prefill (90k tokens: 20+ s).
    pub response_head_ms: u64,
    /// Longest silence between two chunks of a response body.
    pub idle_stream_ms: u64,
    /// On SIGTERM/SIGINT, how long in-flight requests may run on before they
    /// are cut. Sized for long decodes: a 4k-token answer at 10 tokens/s is
    /// almost 7 minutes.
    pub shutdown_grace_secs: u64,
    /// A stored response id nobody here knows: how long the replicas are
    /// asked (`GET /v1/responses/{id}`, in parallel) before the request is
    /// forwarded as it is.
    pub locate_response_ms: u64,
    /// A stored response id no replica held is not looked for again for
    /// this long: each replica is asked at most once per id in the window
    /// (0: asked on every request).
    pub unknown_response_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FailoverConfig {
    /// A stream whose replica dies, stalls or is drained with hand-over
    /// after its first byte is continued on another replica: token for token
    /// where the engine gives ids (a chat or completion asks for
    /// `return_token_ids`), else from its text. False: such a stream breaks.
    pub continue_streams: bool,
    /// A stream that could be continued and sent nothing for this long
    /// (after its first event) is taken as stalled and continued elsewhere.
    pub stall_ms: u64,
    /// Most next legs per request.
    pub max_continuations: u32,
    /// Most next legs starting at once on this instance, and of one
    /// model across the instances sharing a store: deaths come in bursts,
    /// and each next leg is a full prefill elsewhere. Past it a broken
    /// stream ends broken.
    pub max_resuming: usize,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        FailoverConfig { continue_streams: true, stall_ms: 30_000, max_continuations: 1, max_resuming: 8 }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body accepted (a 90k-token context is ~400 KB).
    pub max_body_bytes: usize,
    /// A client must send its request head within this time (slowloris guard).
    pub header_timeout_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PinConfig {
    /// A pin unused for this long is forgotten (the replica has evicted it anyway).
    pub ttl_secs: u64,
    /// Most pins kept; the least recently used go first.
    pub max_pins: usize,
    /// Pins (and history) are written to disk behind the requests, in batches, this often.
    pub flush_interval_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HistoryConfig {
    /// Most events kept in history; the oldest go first.
    pub max_events: usize,
    /// Most events waiting to be written to the store (while it is
    /// unreachable); past it the oldest are dropped unwritten, and counted.
    pub max_unwritten: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimits {
    /// Requests per second per client on `/v1` (0: off).
    pub client_rps: u32,
    /// Requests a client may send at once above its rate.
    pub client_burst: u32,
    /// Failed admin authentications per minute per IP before 429.
    pub admin_auth_failures_per_minute: u32,
    /// Requests per second per IP on the admin API (0: off).
    pub admin_rps: u32,
    /// Peers whose `X-Forwarded-For` is believed.
    #[schema(value_type = Vec<String>)]
    pub trusted_proxies: Vec<std::net::IpAddr>,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionConfig {
    /// Requests estimated at or above this many prompt tokens are "large".
    pub large_context_tokens: u64,
    /// Longest a large request waits for a slot before 503.
    pub wait_ms: u64,
    /// Most large requests queued per replica before 503 at once.
    pub max_queue: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CapacityConfig {
    /// Families active within this window count toward a replica's working set.
    pub working_set_window_secs: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "0.0.0.0:8080".parse().expect("literal"),
            admin_listen: "127.0.0.1:9090".parse().expect("literal"),
            data_dir: None,
            policy: Mode::Shape,
            routing: RoutingConfig::default(),
            admin_token: None,
            api_keys: Vec::new(),
            identity: IdentityConfig::default(),
            timeouts: Timeouts::default(),
            failover: FailoverConfig::default(),
            health: HealthConfig::default(),
            limits: Limits::default(),
            pins: PinConfig::default(),
            history: HistoryConfig::default(),
            rate_limits: RateLimits::default(),
            admission: AdmissionConfig::default(),
            capacity: CapacityConfig::default(),
            sessions: SessionConfig::default(),
            priority: PriorityConfig::default(),
            tracing: TracingConfig::default(),
            timeline: TimelineConfig::default(),
            store: StoreConfig::default(),
            replicas: Vec::new(),
            discovery: Vec::new(),
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: 2_000,
            response_head_ms: 300_000,
            idle_stream_ms: 120_000,
            shutdown_grace_secs: 600,
            locate_response_ms: 500,
            unknown_response_ms: 10_000,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_body_bytes: 64 * 1024 * 1024, header_timeout_ms: 10_000 }
    }
}

impl Default for PinConfig {
    fn default() -> Self {
        PinConfig { ttl_secs: 3_600, max_pins: 1_000_000, flush_interval_ms: 200 }
    }
}

impl Default for HistoryConfig {
    fn default() -> Self {
        HistoryConfig { max_events: 100_000, max_unwritten: 10_000 }
    }
}

impl Default for CapacityConfig {
    fn default() -> Self {
        CapacityConfig { working_set_window_secs: 300 }
    }
}

impl Default for RateLimits {
    fn default() -> Self {
        RateLimits {
            client_rps: 0,
            client_burst: 100,
            admin_auth_failures_per_minute: 10,
            admin_rps: 50,
            trusted_proxies: Vec::new(),
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig { large_context_tokens: 32_768, wait_ms: 30_000, max_queue: 64 }
    }
}

/// `PREFIXGATE_*` variables that are not config keys: the log filter and
/// the bench tool's API key.
/// Any other unknown `PREFIXGATE_*` variable is an error: a typo must not
/// silently leave a setting at its default.
const NOT_CONFIG: &[&str] = &["LOG", "BENCH_API_KEY"];

/// Top-level keys whose value is a table (for the env mapping).
const SECTIONS: &[&str] = &[
    "identity",
    "timeouts",
    "health",
    "limits",
    "pins",
    "history",
    "rate_limits",
    "admission",
    "capacity",
    "sessions",
    "store",
    "tracing",
    "timeline",
];

/// Keys renamed since operators wrote their config files: (old section, new
/// section, key). The old spelling still works, with a warning.
const RENAMED: &[(&str, &str, &str)] =
    &[("pins", "history", "max_events"), ("admission", "capacity", "working_set_window_secs")];

/// Moves renamed keys to their new place; returns one warning per key moved.
/// A key given in both places keeps the new spelling's value.
fn migrate_renamed_keys(table: &mut toml::Table) -> Vec<String> {
    let mut warnings = Vec::new();
    for (old, new, key) in RENAMED {
        let Some(value) = table.get_mut(*old).and_then(|t| t.as_table_mut()).and_then(|t| t.remove(*key)) else {
            continue;
        };
        warnings.push(format!("config key '{old}.{key}' is deprecated: use '{new}.{key}'"));
        let entry = table.entry(new.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
        if let Some(t) = entry.as_table_mut() {
            t.entry(key.to_string()).or_insert(value);
        }
    }
    warnings
}

impl Config {
    /// Reads `path` (if any), then overlays `PREFIXGATE_*` variables from
    /// `env`, then `overrides` (dotted key, value: the command line).
    pub fn load(
        path: Option<&Path>,
        env: impl Iterator<Item = (String, String)>,
        overrides: &[(String, String)],
    ) -> Result<Config, String> {
        let mut table = match path {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).map_err(|e| format!("cannot read config {}: {e}", p.display()))?;
                text.parse::<toml::Table>().map_err(|e| format!("invalid config {}: {e}", p.display()))?
            }
            None => toml::Table::new(),
        };
        for (name, value) in env {
            let Some(key) = name.strip_prefix("PREFIXGATE_") else {
                continue;
            };
            if NOT_CONFIG.contains(&key) {
                continue;
            }
            apply_env(&mut table, &key.to_ascii_lowercase(), &value).map_err(|e| format!("{name}: {e}"))?;
        }
        for (key, value) in overrides {
            apply_key(&mut table, key, value).map_err(|e| format!("{key}: {e}"))?;
        }
        for w in migrate_renamed_keys(&mut table) {
            tracing::warn!("{w}");
        }
        let config: Config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| format!("invalid config: {}", e.message().trim()))?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for (i, r) in self.replicas.iter().enumerate() {
            r.validate().map_err(|e| format!("replicas[{i}]: {e}"))?;
            if !seen.insert(r.id.as_str()) {
                return Err(format!("replicas[{i}].id: duplicate replica id '{}'", r.id));
            }
        }
        let mut urls = std::collections::HashSet::new();
        for (i, d) in self.discovery.iter().enumerate() {
            d.validate().map_err(|e| format!("discovery[{i}]: {e}"))?;
            if !urls.insert(d.url.as_str()) {
                return Err(format!("discovery[{i}].url: '{}' is listed twice", d.url));
            }
        }
        if self.identity.block_bytes == 0 || self.identity.block_tokens == 0 {
            return Err("identity.block_bytes and identity.block_tokens must be at least 1".into());
        }
        if self.health.rise == 0 || self.health.fall == 0 {
            return Err("health.rise and health.fall must be at least 1".into());
        }
        if self.timeouts.connect_ms == 0 || self.timeouts.response_head_ms == 0 || self.timeouts.idle_stream_ms == 0 {
            return Err("timeouts.*_ms must be greater than 0".into());
        }
        if self.timeouts.shutdown_grace_secs == 0 {
            return Err("timeouts.shutdown_grace_secs must be greater than 0".into());
        }
        if let Some(h) =
            self.sessions.headers.iter().find(|h| h.is_empty() || h.chars().any(|c| c.is_ascii_uppercase()))
        {
            return Err(format!("sessions.headers: '{h}' must be a non-empty lowercase header name"));
        }
        if let Some(url) = &self.store.url {
            if !["redis://", "rediss://", "redis+unix://", "redis+sentinel://"].iter().any(|s| url.starts_with(s)) {
                return Err(format!(
                    "store.url: '{url}' is not a redis://, rediss://, redis+unix:// or redis+sentinel:// URL"
                ));
            }
        }
        if self.pins.flush_interval_ms == 0 {
            return Err("pins.flush_interval_ms must be greater than 0".into());
        }
        if !self.admin_listen.ip().is_loopback() && self.admin_token.as_deref().unwrap_or("").is_empty() {
            return Err(format!(
                "admin_listen: refusing to serve the admin API on non-loopback address {} without an admin_token \
                 (set admin_token in the config or PREFIXGATE_ADMIN_TOKEN)",
                self.admin_listen
            ));
        }
        Ok(())
    }
}

/// `PREFIXGATE_TIMEOUTS_CONNECT_MS` (lowercased, prefix off) as the dotted
/// key `timeouts.connect_ms`: a section name, then the key.
fn env_key_to_dotted(key: &str) -> String {
    SECTIONS
        .iter()
        .find_map(|section| {
            key.strip_prefix(section).and_then(|k| k.strip_prefix('_')).map(|sub| format!("{section}.{sub}"))
        })
        .unwrap_or_else(|| key.to_string())
}

fn apply_env(table: &mut toml::Table, key: &str, value: &str) -> Result<(), String> {
    apply_key(table, &env_key_to_dotted(key), value)
}

/// Sets `section.key` (or a top-level `key`) to `value`, read as a TOML
/// value; `replicas` takes `ID=URL[,ID=URL...]` and `discovery` takes
/// `URL[,URL...]` (or a TOML array of tables). The one way a key is set
/// from outside the file: environment variables and `--set` both come here.
pub fn apply_key(table: &mut toml::Table, key: &str, value: &str) -> Result<(), String> {
    let list = match key {
        "replicas" => Some(comma_list(value, parse_replica_flag)?),
        "discovery" if !value.trim_start().starts_with('[') => {
            Some(comma_list(value, |url| Ok(SourceConfig::new(url)))?)
        }
        _ => None,
    };
    if let Some(list) = list {
        table.insert(key.into(), list);
        return Ok(());
    }
    let value = parse_env_value(value);
    match key.split_once('.') {
        Some((section, sub)) => {
            let entry = table.entry(section.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
            let toml::Value::Table(t) = entry else {
                return Err(format!("config key '{section}' is not a table"));
            };
            t.insert(sub.to_string(), value);
        }
        None => {
            table.insert(key.to_string(), value);
        }
    }
    Ok(())
}

/// `A,B,...` as a TOML array, one table per item (`item` parses one).
fn comma_list<T: Serialize>(value: &str, item: impl Fn(&str) -> Result<T, String>) -> Result<toml::Value, String> {
    let items = value.split(',').map(str::trim).filter(|s| !s.is_empty());
    let list = items.map(|s| item(s).map(|t| toml::Value::try_from(t).expect("serializable")));
    list.collect::<Result<Vec<_>, _>>().map(toml::Value::Array)
}

/// `42`, `true`, `["a"]` are TOML values; anything else is a string.
fn parse_env_value(raw: &str) -> toml::Value {
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

/// Parses the `--replica ID=URL` flag.
pub fn parse_replica_flag(s: &str) -> Result<ReplicaSpec, String> {
    let (id, url) = s.split_once('=').ok_or_else(|| format!("expected ID=URL, got '{s}'"))?;
    let spec = ReplicaSpec::new(id.trim(), url.trim());
    spec.validate()?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Iterator<Item = (String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>().into_iter()
    }

    #[test]
    fn env_overrides_file_and_sections_map() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "policy = \"affinity\"\n[timeouts]\nconnect_ms = 10\n").unwrap();
        let c = Config::load(
            Some(&path),
            env(&[
                ("PREFIXGATE_POLICY", "roundrobin"),
                ("PREFIXGATE_TIMEOUTS_IDLE_STREAM_MS", "77"),
                ("PREFIXGATE_REPLICAS", "a=http://127.0.0.1:1,b=http://127.0.0.1:2/"),
                ("OTHER", "x"),
                ("PREFIXGATE_LOG", "debug"),
            ]),
            &[],
        )
        .unwrap();
        assert_eq!(c.policy, Mode::RoundRobin);
        assert_eq!(c.timeouts.connect_ms, 10);
        assert_eq!(c.timeouts.idle_stream_ms, 77);
        assert_eq!(c.replicas[1].url, "http://127.0.0.1:2");
    }

    #[test]
    fn invalid_config_names_the_key() {
        let err = Config::load(None, env(&[("PREFIXGATE_POLICY", "fastest")]), &[]).unwrap_err();
        assert!(err.contains("policy") || err.contains("fastest"), "{err}");
        let err = Config::load(None, env(&[("PREFIXGATE_TIMEOUTS_CONECT_MS", "1")]), &[]).unwrap_err();
        assert!(err.contains("conect_ms"), "{err}");
        let err = Config::load(None, env(&[("PREFIXGATE_REPLICAS", "a=ftp://x")]), &[]).unwrap_err();
        assert!(err.contains("PREFIXGATE_REPLICAS"), "{err}");
        let err = Config::load(None, env(&[("PREFIXGATE_ADMIN_LISTEN", "0.0.0.0:9090")]), &[]).unwrap_err();
        assert!(err.contains("admin_listen") && err.contains("admin_token"), "{err}");
    }

    #[test]
    fn renamed_keys_still_work_and_the_new_spelling_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[pins]\nmax_events = 7\n[admission]\nworking_set_window_secs = 9\n").unwrap();
        let c = Config::load(Some(&path), std::iter::empty(), &[]).unwrap();
        assert_eq!((c.history.max_events, c.capacity.working_set_window_secs), (7, 9));
        let c = Config::load(Some(&path), env(&[("PREFIXGATE_HISTORY_MAX_EVENTS", "11")]), &[]).unwrap();
        assert_eq!(c.history.max_events, 11);
        let mut t: toml::Table = "[pins]\nmax_events = 1".parse().unwrap();
        assert_eq!(
            migrate_renamed_keys(&mut t),
            vec!["config key 'pins.max_events' is deprecated: use 'history.max_events'"]
        );
    }

    #[test]
    fn discovery_sources_come_from_the_file_the_environment_and_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[[discovery]]\nurl = \"dns+srv://_http._tcp.engines\"\ninterval_ms = 1000\nmax_large_inflight = 1\n",
        )
        .unwrap();
        let c = Config::load(Some(&path), std::iter::empty(), &[]).unwrap();
        assert_eq!((c.discovery.len(), c.discovery[0].interval_ms), (1, 1000));
        assert_eq!(c.discovery[0].max_large_inflight, Some(1));
        let c = Config::load(
            Some(&path),
            env(&[("PREFIXGATE_DISCOVERY", "dns://engines:8000,file:///etc/engines.toml")]),
            &[],
        )
        .unwrap();
        let urls: Vec<&str> = c.discovery.iter().map(|d| d.url.as_str()).collect();
        assert_eq!(urls, ["dns://engines:8000", "file:///etc/engines.toml"]);
        assert_eq!(c.discovery[0].grace_secs, 600, "defaults fill what a URL does not say");
        // Whole tables from the environment, as a TOML array.
        let tables = r#"[{url = "dns://engines:8000", interval_ms = 250, weight = 2}]"#;
        let c = Config::load(None, env(&[("PREFIXGATE_DISCOVERY", tables)]), &[]).unwrap();
        assert_eq!((c.discovery[0].interval_ms, c.discovery[0].weight), (250, Some(2)));
        let err = Config::load(None, env(&[("PREFIXGATE_DISCOVERY", "dns://engines")]), &[]).unwrap_err();
        assert!(err.contains("discovery[0]") && err.contains("NAME:PORT"), "{err}");
        let err = Config::load(None, env(&[("PREFIXGATE_DISCOVERY", "file:///a,file:///a")]), &[]).unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }

    #[test]
    fn the_example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("prefixgate.example.toml");
        let c = Config::load(Some(&path), std::iter::empty(), &[]).unwrap();
        assert!(!c.replicas.is_empty());
    }
}
