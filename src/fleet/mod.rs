//! The replica registry: what each replica is (its spec), what the operator
//! decided (admin state), what the health checker observed (health), and its
//! live counters. Readers take a snapshot (`Arc<Vec<..>>`) that is swapped
//! whole when the set changes, so routing never holds a lock across I/O.

pub mod health;
pub mod residents;
pub mod wall;
pub mod work;

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, Guard};

use crate::read_mostly::ReadMostly;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What a replica is. Persisted; secrets inside are never returned by the API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSpec {
    /// Slug: lowercase letters, digits, '-' and '_', at most 64 characters.
    #[schema(value_type = ReplicaId)]
    pub id: String,
    /// Base URL without `/v1`, e.g. `http://10.0.0.5:8000`.
    #[schema(value_type = ReplicaUrl)]
    pub url: String,
    /// Sent to the replica as `Authorization: Bearer ...` instead of the client's header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Health probe path; `/health` by default (falls back to `/v1/models` on 404).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_path: Option<String>,
    /// Most concurrent large-context requests (unset: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_large_inflight: Option<u32>,
    /// KV cache capacity in tokens, when the replica does not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tokens: Option<u64>,
    /// Share of spread traffic relative to the other replicas (default 1;
    /// 0 takes spread traffic only when no other replica can).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// Free-form labels, shown in the API and the UI (e.g. `zone`, `gpu`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    /// The models the replica is expected to serve, used for routing until
    /// its own `/v1/models` answers (empty: any model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

/// The wire formats the admin API documents (`openapi/admin.json` carries
/// these exact strings; a test checks they match) and the server enforces,
/// so a contract tester and the server agree on every input.
/// A replica's id on the admin API's wire (bodies, paths, queries): one
/// schema in the spec, carrying `patterns::ID` (checked by `validate_id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReplicaId(pub String);

/// A replica's base URL on the admin API's wire: one schema in the spec,
/// carrying `patterns::URL` (checked by `validate_url`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReplicaUrl(pub String);

fn string_schema(
    pattern: &str,
    description: &str,
    example: &str,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::schema::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .pattern(Some(pattern))
        .description(Some(description))
        .examples([serde_json::Value::from(example)])
        .into()
}

impl utoipa::PartialSchema for ReplicaId {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        string_schema(
            patterns::ID,
            "A replica id: lowercase letters, digits, '-' and '_', 1 to 64 characters.",
            "gpu-0",
        )
    }
}

impl utoipa::ToSchema for ReplicaId {}

impl utoipa::PartialSchema for ReplicaUrl {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        string_schema(
            patterns::URL,
            "A replica's base URL without /v1: http(s), a lowercase host name or IPv4 address, an optional port and plain path.",
            "http://10.0.0.5:8000",
        )
    }
}

impl utoipa::ToSchema for ReplicaUrl {}

fn nullable_string() -> utoipa::openapi::schema::SchemaType {
    use utoipa::openapi::schema::{SchemaType, Type};
    SchemaType::from_iter([Type::String, Type::Null])
}

/// The schema of an upstream API key field, in every body that carries one
/// (`patterns::API_KEY`, declared once): write-only, never echoed back.
pub fn api_key_schema() -> utoipa::openapi::schema::Object {
    utoipa::openapi::schema::ObjectBuilder::new()
        .schema_type(nullable_string())
        .pattern(Some(patterns::API_KEY))
        .description(Some(
            "An upstream API key: visible ASCII, write-only (never echoed back). On a new replica empty means none; on a patch empty changes nothing.",
        ))
        .build()
}

/// The schema of a health probe path field (`patterns::HEALTH_PATH`, declared once).
pub fn health_path_schema() -> utoipa::openapi::schema::Object {
    utoipa::openapi::schema::ObjectBuilder::new()
        .schema_type(nullable_string())
        .pattern(Some(patterns::HEALTH_PATH))
        .description(Some("The health probe's path (default /health)."))
        .build()
}

pub mod patterns {
    /// A replica id: a slug.
    pub const ID: &str = "^[a-z0-9_-]{1,64}$";
    /// A replica URL: http(s), a lowercase host name or a dotted IPv4
    /// address, an optional port, an optional plain path. A host label may
    /// not have hyphens in both its third and fourth places: that form is
    /// reserved for IDNA's `xn--` labels, which the URL parser decodes as
    /// punycode and refuses when they are not valid punycode. Each label is
    /// `[a-z0-9]` then, spelled without look-ahead (JSON Schema validators
    /// and Rust's regex differ there): 1 to 3 characters, or 4 to 63 whose
    /// third character is alphanumeric, or whose third is `-` and fourth is
    /// alphanumeric.
    pub const URL: &str = concat!(
        "^https?://(",
        "((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
        "|([a-z0-9](([a-z0-9-]?[a-z0-9])|[a-z0-9-]([a-z0-9][a-z0-9-]{0,59}[a-z0-9]|-[a-z0-9]([a-z0-9-]{0,58}[a-z0-9])?))?\\.)*[a-z](([a-z0-9-]?[a-z0-9])|[a-z0-9-]([a-z0-9][a-z0-9-]{0,59}[a-z0-9]|-[a-z0-9]([a-z0-9-]{0,58}[a-z0-9])?))?",
        ")(:([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?",
        "(/[A-Za-z0-9_~-]*)*$"
    );
    /// A health probe path (no dots: no `..` tricks).
    pub const HEALTH_PATH: &str = "^/[A-Za-z0-9_~/-]{0,255}$";
    /// An upstream API key: visible ASCII (it goes into a header); empty means none.
    pub const API_KEY: &str = "^[!-~]{0,4096}$";

    pub fn matches(pattern: &'static str, value: &str) -> bool {
        use std::collections::HashMap;
        use std::sync::{LazyLock, Mutex};
        static COMPILED: LazyLock<Mutex<HashMap<&'static str, regex::Regex>>> = LazyLock::new(Mutex::default);
        let mut compiled = COMPILED.lock().expect("pattern cache");
        compiled.entry(pattern).or_insert_with(|| regex::Regex::new(pattern).expect("valid pattern")).is_match(value)
    }
}

impl ReplicaSpec {
    /// The `Authorization` value every call to this replica carries when it
    /// has a key of its own (proxied requests, counts, probes, lookups of
    /// stored responses): one spelling of it (`proxy::headers` adds the
    /// client's where it has none).
    pub fn own_credentials(&self) -> Option<awc::http::header::HeaderValue> {
        let key = self.api_key.as_ref()?;
        awc::http::header::HeaderValue::from_str(&format!("Bearer {key}")).ok()
    }

    pub fn new(id: &str, url: &str) -> ReplicaSpec {
        ReplicaSpec {
            id: id.to_string(),
            url: normalize_url(url),
            api_key: None,
            health_path: None,
            max_large_inflight: None,
            kv_tokens: None,
            weight: None,
            labels: Default::default(),
            models: Vec::new(),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        validate_id(&self.id)?;
        validate_url(&self.url)?;
        if let Some(p) = &self.health_path {
            if !patterns::matches(patterns::HEALTH_PATH, p) {
                return Err(format!(
                    "health_path: '{}' must be an absolute path like /health (letters, digits, '_', '~', '-', '/')",
                    p.escape_debug()
                ));
            }
        }
        if let Some(k) = &self.api_key {
            if !patterns::matches(patterns::API_KEY, k) {
                return Err("api_key: must be visible ASCII characters, at most 4096".into());
            }
        }
        if let Some((k, v)) = self.labels.iter().find(|(k, v)| k.is_empty() || k.len() > 63 || v.len() > 255) {
            return Err(format!(
                "labels: '{}' = '{}': keys are 1-63 bytes, values at most 255",
                k.escape_debug(),
                v.escape_debug()
            ));
        }
        if self.models.iter().any(String::is_empty) {
            return Err("models: a model name must not be empty".into());
        }
        Ok(())
    }

    pub fn health_path(&self) -> &str {
        self.health_path.as_deref().unwrap_or("/health")
    }

    pub fn weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }
}

pub fn validate_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!("id: '{}' is not a slug (lowercase letters, digits, '-', '_'; 1-64 chars)", id.escape_debug()))
    }
}

/// Only plain http(s) URLs with a host: no `file:`, no credentials, no
/// query; and in the documented format (`patterns::URL`).
pub fn validate_url(raw: &str) -> Result<(), String> {
    if !patterns::matches(patterns::URL, raw) {
        return Err(format!(
            "url: '{}' is not an http(s) URL with a lowercase host name or IPv4 address, optional port and plain path",
            raw.escape_debug()
        ));
    }
    let url = url::Url::parse(raw).map_err(|e| format!("url: '{raw}' is not a valid URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("url: scheme '{}' is not allowed (http or https only)", url.scheme()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("url: '{raw}' has no host"));
    }
    if !url.username().is_empty() || url.password().is_some() || url.query().is_some() || url.fragment().is_some() {
        return Err(format!("url: '{raw}' must not carry credentials, a query or a fragment"));
    }
    Ok(())
}

/// Trailing `/` and a trailing `/v1` are dropped: request paths already start with `/v1`.
pub fn normalize_url(url: &str) -> String {
    let trimmed = url.trim().trim_end_matches('/');
    trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string()
}

/// What the operator decided. Sticky: only the operator changes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AdminState {
    Active,
    /// No new requests; in-flight ones finish.
    Draining,
    /// Demoted by hand until `enable`.
    Disabled,
}

/// What the health checker (or a failed connection) observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Unknown,
    Up,
    Down,
}

impl AdminState {
    pub fn as_str(self) -> &'static str {
        match self {
            AdminState::Active => "active",
            AdminState::Draining => "draining",
            AdminState::Disabled => "disabled",
        }
    }

    fn from_u8(v: u8) -> AdminState {
        match v {
            1 => AdminState::Draining,
            2 => AdminState::Disabled,
            _ => AdminState::Active,
        }
    }
}

impl Health {
    fn from_u8(v: u8) -> Health {
        match v {
            1 => Health::Up,
            2 => Health::Down,
            _ => Health::Unknown,
        }
    }
}

/// Health bookkeeping, written only by the `HealthTracker`.
#[derive(Debug, Default, Clone)]
pub struct ProbeState {
    pub ok_streak: u32,
    pub fail_streak: u32,
    pub last_check_ms: Option<u64>,
    pub last_error: Option<String>,
    /// Bumped by each connection failure: a probe that started before it
    /// carries an older epoch and its verdict is stale.
    pub epoch: u64,
}

/// Where a replica comes from: the config file (`static`), the admin API
/// (`api`), or a discovery source (its label, `dns:...`, `dns+srv:...`,
/// `file:...`). A discovered replica belongs to its source: the source adds,
/// changes and removes it; an operator can drain or disable it by name.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum ReplicaSource {
    #[default]
    Static,
    Api,
    Discovered(Arc<str>),
}

impl ReplicaSource {
    pub fn label(&self) -> &str {
        match self {
            ReplicaSource::Static => "static",
            ReplicaSource::Api => "api",
            ReplicaSource::Discovered(label) => label,
        }
    }

    pub fn is_discovered(&self) -> bool {
        matches!(self, ReplicaSource::Discovered(_))
    }
}

impl From<ReplicaSource> for String {
    fn from(s: ReplicaSource) -> String {
        s.label().to_string()
    }
}

impl From<String> for ReplicaSource {
    fn from(s: String) -> ReplicaSource {
        match s.as_str() {
            "static" => ReplicaSource::Static,
            "api" => ReplicaSource::Api,
            _ => ReplicaSource::Discovered(s.into()),
        }
    }
}

/// What a discovery source's answer does to a replica (`discovery::lifecycle`
/// decides, `Operator::apply_discovered` applies).
#[derive(Debug, Clone, PartialEq)]
pub enum SourceAction {
    /// A replica appeared: add it.
    Add(ReplicaSpec),
    /// Its settings changed in the source.
    Update(ReplicaSpec),
    /// It left its source: drain it (no new traffic; in-flight work finishes).
    Drain(String),
    /// It came back under the same name: back to rotation, unless an
    /// operator disabled or drained it.
    Return(String),
    /// It left, and is idle or past the grace period: remove it.
    Remove(String),
}

#[derive(Debug)]
pub struct Replica {
    pub id: Arc<str>,
    pub source: ReplicaSource,
    /// When a discovered replica left its source (ms since the epoch; 0:
    /// listed). It drains meanwhile, whatever the operator's state.
    left_source_ms: AtomicU64,
    // Read on every request by both workers: ArcSwap reads touch no shared
    // cache line (a lock or a reference count would, on every read).
    spec: ArcSwap<ReplicaSpec>,
    admin: AtomicU8,
    health: AtomicU8,
    models: ArcSwap<Vec<String>>,
    /// KV capacity in tokens as the prober read it from the replica's own
    /// metrics (0: none read).
    observed_kv: AtomicU64,
    /// One slot's context in tokens, where the capacity read is slots
    /// (llama.cpp's `/props`; 0: not slots).
    slot_tokens: AtomicU64,
    // Written on every request. Plain atomics: striping them per thread
    // measured inside the noise on two cores (docs/benchmarks-log.md).
    inflight: AtomicI64,
    large_inflight: AtomicI64,
    /// Hand-overs asked (`drain?handoff=true`): a stream that may go on
    /// and saw fewer moves to another replica (`proxy::body`).
    handoffs: AtomicU64,
    attempts: AtomicU64,
    /// When a response's first event last came from here: a request
    /// queued behind it began its prefill then (`InflightGuard::prefilled`).
    last_first_event: Mutex<Option<std::time::Instant>>,
    /// Only `health::HealthTracker` locks this (with `health` changes under it).
    probe: Mutex<ProbeState>,
    /// Its bytes per token, from its own usage reports.
    pub calibration: crate::tokens::Calibration,
    /// Its large-context slots and their queue (`max_large_inflight`).
    pub large_slots: Arc<crate::admission::LargeSlots>,
    /// Its working set, last capacity figures and warning.
    pub capacity: Arc<crate::capacity::CapacityRecord>,
    /// The sessions resident here (the KV wall).
    pub residents: residents::Residents,
    /// Its outstanding work (`work.rs`): where new sessions and one-shots go.
    pub work: work::Work,
    /// Its metric series: they leave the exposition when it leaves the fleet.
    pub series: crate::metrics::ReplicaSeries,
    /// Its name as the `x-prefixgate-replica` response header's value.
    pub name_header: awc::http::header::HeaderValue,
}

impl Replica {
    pub fn new(spec: ReplicaSpec, admin: AdminState) -> Replica {
        Replica::from_source(spec, admin, ReplicaSource::Static)
    }

    pub fn from_source(spec: ReplicaSpec, admin: AdminState, source: ReplicaSource) -> Replica {
        let id: Arc<str> = Arc::from(spec.id.as_str());
        Replica {
            series: crate::metrics::ReplicaSeries::new(&id),
            name_header: awc::http::header::HeaderValue::from_str(&id).expect("a slug is a valid header value"),
            id,
            source,
            left_source_ms: AtomicU64::new(0),
            spec: ArcSwap::from_pointee(spec),
            admin: AtomicU8::new(admin as u8),
            health: AtomicU8::new(Health::Unknown as u8),
            models: ArcSwap::from_pointee(Vec::new()),
            observed_kv: AtomicU64::new(0),
            slot_tokens: AtomicU64::new(0),
            inflight: AtomicI64::new(0),
            large_inflight: AtomicI64::new(0),
            handoffs: AtomicU64::new(0),
            attempts: AtomicU64::new(0),
            last_first_event: Mutex::new(None),
            probe: Mutex::new(ProbeState::default()),
            calibration: Default::default(),
            large_slots: Default::default(),
            capacity: Default::default(),
            residents: Default::default(),
            work: Default::default(),
        }
    }

    /// The current spec; hold it briefly (never across an await).
    pub fn spec(&self) -> Guard<Arc<ReplicaSpec>> {
        self.spec.load()
    }

    /// The current spec, for holding across an await.
    pub fn spec_owned(&self) -> Arc<ReplicaSpec> {
        self.spec.load_full()
    }

    pub fn set_spec(&self, spec: ReplicaSpec) {
        self.spec.store(Arc::new(spec));
    }

    pub fn admin(&self) -> AdminState {
        AdminState::from_u8(self.admin.load(Ordering::Acquire))
    }

    pub fn set_admin(&self, s: AdminState) -> AdminState {
        AdminState::from_u8(self.admin.swap(s as u8, Ordering::AcqRel))
    }

    pub fn health(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Acquire))
    }

    /// Only the health tracker sets health (under the probe lock).
    fn set_health(&self, h: Health) -> Health {
        Health::from_u8(self.health.swap(h as u8, Ordering::AcqRel))
    }

    /// The health checker's bookkeeping, for views.
    pub fn probe_state(&self) -> ProbeState {
        self.probe.lock().expect("probe lock").clone()
    }

    /// Takes new traffic: active and not known to be down. A replica named
    /// by hand is trusted until a probe says otherwise (a restarted gateway
    /// routes at once); a discovered one only once a probe said it is up
    /// (a pod listed as it starts may not serve yet).
    pub fn routable(&self) -> bool {
        self.admin() == AdminState::Active
            && match self.health() {
                Health::Up => true,
                Health::Down => false,
                Health::Unknown => !self.source.is_discovered(),
            }
    }

    pub fn inflight(&self) -> i64 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Asks the streams on this replica that may go on elsewhere to move
    /// there now, at their next event (a drain with hand-over).
    pub fn hand_off(&self) {
        self.handoffs.fetch_add(1, Ordering::AcqRel);
    }

    /// Hand-overs asked so far.
    pub fn handoffs(&self) -> u64 {
        self.handoffs.load(Ordering::Acquire)
    }

    pub fn large_inflight(&self) -> i64 {
        self.large_inflight.load(Ordering::Acquire)
    }

    /// Attempts sent to this replica (a failed-over request counts on each replica it tried).
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Counts one request in flight until the guard drops, whichever path
    /// (success, error, client gone) ends it, and its `uncached` prompt
    /// tokens as outstanding work until its prefill ends
    /// (`InflightGuard::prefilled`) or it does.
    pub fn begin(self: &Arc<Self>, large: bool, uncached: u64) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        if large {
            self.large_inflight.fetch_add(1, Ordering::AcqRel);
        }
        self.attempts.fetch_add(1, Ordering::Relaxed);
        self.work.add_prefill(uncached);
        InflightGuard {
            replica: self.clone(),
            large,
            prefilling: uncached,
            decoding: false,
            sent: std::time::Instant::now(),
            prefill_took: None,
        }
    }

    /// Counts a stream that goes on here after it began elsewhere
    /// (`proxy::resume`): in flight and decoding at once. Its first event
    /// came on the other replica: it times no prefill here.
    pub fn resume(self: &Arc<Self>, large: bool) -> InflightGuard {
        let mut guard = self.begin(large, 0);
        guard.start_decoding();
        guard
    }

    /// A first event came here at `now`: returns when the one before it
    /// came (None: none yet).
    fn first_event_at(&self, now: std::time::Instant) -> Option<std::time::Instant> {
        let mut last = self.last_first_event.lock().unwrap_or_else(|p| p.into_inner());
        let before = *last;
        *last = Some(before.map_or(now, |b| b.max(now)));
        before
    }

    /// Outstanding prefill work, for tests of placement.
    #[cfg(test)]
    pub fn work_for_tests(&self, tokens: u64) {
        self.work.add_prefill(tokens);
    }

    pub fn models(&self) -> Guard<Arc<Vec<String>>> {
        self.models.load()
    }

    /// KV capacity read from the replica's metrics (vLLM), if any.
    pub fn observed_kv(&self) -> Option<u64> {
        Some(self.observed_kv.load(Ordering::Acquire)).filter(|kv| *kv > 0)
    }

    pub fn set_observed_kv(&self, kv: Option<u64>) {
        self.observed_kv.store(kv.unwrap_or(0), Ordering::Release);
    }

    /// One slot's context, when the capacity read is slots (llama.cpp).
    pub fn slot_tokens(&self) -> Option<u64> {
        Some(self.slot_tokens.load(Ordering::Acquire)).filter(|t| *t > 0)
    }

    pub fn set_slot_tokens(&self, tokens: Option<u64>) {
        self.slot_tokens.store(tokens.unwrap_or(0), Ordering::Release);
    }

    /// KV capacity in tokens: what the replica reports (vLLM's metrics,
    /// llama.cpp's slots), else what its spec declares.
    pub fn kv_capacity(&self) -> Option<u64> {
        self.observed_kv().or(self.spec().kv_tokens)
    }

    pub fn set_models(&self, models: Vec<String>) {
        self.models.store(Arc::new(models));
    }

    /// True when the replica serves `model`: by the list it reported, else
    /// by the list its spec expects, else yes (an unknown list must not make
    /// a fresh replica unroutable).
    pub fn serves(&self, model: &str) -> bool {
        let reported = self.models();
        if !reported.is_empty() {
            return reported.iter().any(|m| m == model);
        }
        let expected = &self.spec().models;
        expected.is_empty() || expected.iter().any(|m| m == model)
    }

    /// When a discovered replica left its source, if it did.
    pub fn left_source_ms(&self) -> Option<u64> {
        Some(self.left_source_ms.load(Ordering::Acquire)).filter(|ms| *ms > 0)
    }

    pub fn set_left_source(&self, at_ms: Option<u64>) {
        self.left_source_ms.store(at_ms.unwrap_or(0), Ordering::Release);
    }
}

#[derive(Debug)]
pub struct InflightGuard {
    pub replica: Arc<Replica>,
    large: bool,
    /// Its tokens still counted as prefilling (0 once its first token came).
    prefilling: u64,
    decoding: bool,
    /// When it was sent (after any wait for admission).
    sent: std::time::Instant,
    /// The engine's time on its prefill, once its first event came.
    prefill_took: Option<std::time::Duration>,
}

impl InflightGuard {
    /// Whether it counts as a large context too.
    pub fn large(&self) -> bool {
        self.large
    }

    /// Its first token came: its prefill leaves the replica's outstanding
    /// work, and it counts as a stream decoding until it ends.
    pub fn prefilled(&mut self) {
        if self.start_decoding() {
            // The engine began its prefill when it was sent, or, queued
            // behind another request, when that one's first event came
            // (an engine prefills one prompt after another: a one-slot
            // llama-server, vLLM's first-come steps). Why not the time
            // since it was sent: that holds the queue, and a rate read from
            // it made a busy one-slot engine look several times slower (a
            // pause bounded by the rate lasted that much longer). Prompts
            // prefilled in one step together count their tokens in a sum
            // over their time (`Residents::observe_prefill`), so the one
            // timed from the other's first event is not a faster engine.
            let now = std::time::Instant::now();
            let began = self.replica.first_event_at(now).map_or(self.sent, |ahead| ahead.max(self.sent));
            self.prefill_took = Some(now.saturating_duration_since(began));
        }
    }

    /// Moves its prefill out of the replica's outstanding work and counts
    /// it decoding; false when it already was.
    fn start_decoding(&mut self) -> bool {
        if self.decoding {
            return false;
        }
        self.replica.work.prefilled(std::mem::take(&mut self.prefilling), true);
        self.decoding = true;
        true
    }

    /// The engine's time on this request's prefill (None: no first event
    /// here yet, or the stream began on another replica).
    pub fn prefill_took(&self) -> Option<std::time::Duration> {
        self.prefill_took
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.replica.work.prefilled(self.prefilling, false);
        if self.decoding {
            self.replica.work.stopped_decoding();
        }
        self.replica.inflight.fetch_sub(1, Ordering::AcqRel);
        if self.large {
            self.replica.large_inflight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The set of replicas, in a stable order.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Read by every request, replaced by admin actions.
    list: ReadMostly<Vec<Arc<Replica>>>,
    /// Asks the prober for a round now instead of at its next interval
    /// (a discovered replica takes traffic only once a probe said it is up).
    pub probe_now: tokio::sync::Notify,
    /// Records removed from the list that something (a request in flight,
    /// a permit) still holds: they go when it lets go. Pruned at each
    /// removal, so it holds only records still alive.
    removed: Mutex<Vec<std::sync::Weak<Replica>>>,
}

impl Fleet {
    /// The replicas now. A request holds it only while planning: a guard
    /// kept across an await would pin a slot of arc-swap's per-thread cache.
    pub fn snapshot(&self) -> Guard<Arc<Vec<Arc<Replica>>>> {
        self.list.load()
    }

    /// The replicas now, for holding across an await.
    pub fn snapshot_owned(&self) -> Arc<Vec<Arc<Replica>>> {
        self.list.load_full()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Replica>> {
        self.snapshot().iter().find(|r| &*r.id == id).cloned()
    }

    /// Adds a replica; false when the id exists.
    pub fn add(&self, replica: Replica) -> bool {
        self.list
            .update(|list| (!list.iter().any(|r| r.id == replica.id)).then(|| list.push(Arc::new(replica))))
            .is_some()
    }

    /// What the capacity verdict needs of each replica: its declared and
    /// observed KV capacity, its calibrated bytes per token, and its working
    /// set (the conversations that came back there, resident or ended since
    /// `since_ms`: `Residents::working_set`).
    pub fn capacity_inputs(&self, since_ms: u64) -> Vec<crate::capacity::Tracked> {
        self.snapshot()
            .iter()
            .map(|r| crate::capacity::Tracked {
                input: crate::capacity::ReplicaInput {
                    id: r.id.clone(),
                    declared_kv: r.spec().kv_tokens,
                    metrics_kv: r.observed_kv(),
                    bytes_per_token: r.calibration.bytes_per_token(),
                },
                record: r.capacity.clone(),
                working_set: r.residents.working_set(since_ms),
            })
            .collect()
    }

    /// Takes the replica out of the list. Its record (everything kept per
    /// replica: calibration, capacity figures, admission slots, residency)
    /// goes with the last request that still holds it.
    pub fn remove(&self, id: &str) -> Option<Arc<Replica>> {
        let removed = self.list.update(|list| Some(list.remove(list.iter().position(|r| &*r.id == id)?)))?;
        removed.series.remove();
        let mut held = self.removed.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|r| r.strong_count() > 0);
        held.push(Arc::downgrade(&removed));
        drop(held);
        Some(removed)
    }

    /// Replica records alive: the fleet's and removed ones still held (for
    /// the churn test: nothing kept per replica outlives its record).
    pub fn records_alive(&self) -> usize {
        let held = self.removed.lock().unwrap_or_else(|e| e.into_inner());
        self.snapshot().len() + held.iter().filter(|r| r.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_queued_behind_another_is_timed_from_the_others_first_event() {
        use std::time::{Duration, Instant};
        let r = Arc::new(Replica::new(ReplicaSpec::new("a", "http://127.0.0.1:1"), AdminState::Active));
        let sent = Instant::now();
        let mut ahead = r.begin(false, 5_000);
        let mut queued = r.begin(false, 5_000);
        assert_eq!(ahead.prefill_took(), None, "no first event yet");
        std::thread::sleep(Duration::from_millis(5));
        ahead.prefilled();
        let ahead_took = ahead.prefill_took().expect("timed from its send");
        assert!(ahead_took >= Duration::from_millis(5), "{ahead_took:?}");
        std::thread::sleep(Duration::from_millis(5));
        queued.prefilled();
        let queued_took = queued.prefill_took().unwrap();
        assert!(queued_took >= Duration::from_millis(5), "{queued_took:?}");
        assert!(
            ahead_took + queued_took <= sent.elapsed(),
            "the queued one's time starts where the one ahead ended: {ahead_took:?} + {queued_took:?}"
        );
        drop((ahead, queued));
        // A stream that goes on here began elsewhere: it prefilled nothing here.
        let resumed = r.resume(false);
        assert_eq!(resumed.prefill_took(), None);
        assert_eq!(r.work.outstanding(), work::DECODING_STREAM_TOKENS, "counted as decoding at once");
        drop(resumed);
        assert_eq!((r.inflight(), r.work.outstanding()), (0, 0));
        // Sent after the last first event: timed from its own send.
        let mut next = r.begin(false, 100);
        std::thread::sleep(Duration::from_millis(5));
        next.prefilled();
        assert!(next.prefill_took().unwrap() >= Duration::from_millis(5));
    }

    #[test]
    fn urls_and_ids_are_validated() {
        assert!(validate_url("http://127.0.0.1:8000").is_ok());
        assert!(validate_url("https://gpu-3.internal").is_ok());
        for bad in ["ftp://x", "file:///etc/passwd", "gopher://x", "http://", "http://u:p@x", "x", "http://x/?a=1"] {
            assert!(validate_url(bad).is_err(), "{bad}");
        }
        assert!(validate_id("gpu-0").is_ok());
        for bad in ["", "../etc", "A", "a/b", "a b", &"x".repeat(65)] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
        assert_eq!(normalize_url("http://x:1/v1/"), "http://x:1");
        assert!(validate_url("http://a--b.c-d.example").is_ok());
        // Found by the property below: a label the URL parser decodes as
        // punycode and refuses; the pattern now refuses every `??--` label.
        for bad in ["http://xn--0aa-a0--a-0a-0000---a--a.a", "http://xn--a.b", "http://ab--c"] {
            assert!(validate_url(bad).is_err(), "{bad}");
        }
        for bad in ["http://X", "http://a:65536", "http://4294967296", " http://x", "http://x/a.b"] {
            assert!(validate_url(bad).is_err(), "{bad}");
        }
    }

    proptest::proptest! {
        /// The documented pattern promises a URL the server accepts: every
        /// string it matches passes the full validation (the url crate too).
        #[test]
        fn every_url_matching_the_documented_pattern_is_accepted(
            url in proptest::string::string_regex(patterns::URL.trim_start_matches('^').trim_end_matches('$')).unwrap()
        ) {
            proptest::prop_assert!(validate_url(&url).is_ok(), "{url}");
            proptest::prop_assert!(validate_url(&normalize_url(&url)).is_ok(), "{url}");
        }
    }

    #[test]
    fn a_discovered_replica_is_routable_only_once_a_probe_said_it_is_up() {
        let by_hand = Replica::new(ReplicaSpec::new("a", "http://x"), AdminState::Active);
        let found = Replica::from_source(
            ReplicaSpec::new("b", "http://y"),
            AdminState::Active,
            ReplicaSource::Discovered("dns:e:8000".into()),
        );
        assert!(by_hand.routable() && !found.routable());
        found.set_health(Health::Up);
        assert!(found.routable());
        assert_eq!(serde_json::to_value(&found.source).unwrap(), "dns:e:8000");
        assert_eq!(serde_json::from_value::<ReplicaSource>("api".into()).unwrap(), ReplicaSource::Api);
        // The names events spell are the ones the API serializes.
        for state in [AdminState::Active, AdminState::Draining, AdminState::Disabled] {
            assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
        }
    }

    #[test]
    fn guards_release_counters_on_drop() {
        let r = Arc::new(Replica::new(ReplicaSpec::new("a", "http://x"), AdminState::Active));
        let g1 = r.begin(true, 0);
        let g2 = r.begin(false, 0);
        assert_eq!((r.inflight(), r.large_inflight(), r.attempts()), (2, 1, 2));
        drop(g1);
        drop(g2);
        assert_eq!((r.inflight(), r.large_inflight(), r.attempts()), (0, 0, 2));
    }
}
