//! Finding replicas where fleets run: sources (DNS A/AAAA and SRV records, a
//! file of `[[replicas]]` tables) read again on an interval, and the
//! lifecycle their answers drive.
//!
//! - `source.rs`: the sources' URLs, replica names, the file source's reader;
//! - `dns.rs`: DNS resolution through the system's resolver or a named one;
//! - `lifecycle.rs`: what an answer means for the fleet (pure, no I/O);
//! - `runner.rs`: one task per source: read, decide, apply through the
//!   operator (`Operator::apply_discovered`), report.

pub mod dns;
pub mod lifecycle;
pub mod runner;
pub mod source;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::fleet::ReplicaSpec;

pub use runner::{Discovery, SourceStatus};

/// One discovery source as configured (`[[discovery]]` in the config file,
/// `--discover URL`, `PREFIXGATE_DISCOVERY`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    /// `dns://NAME:PORT`, `dns+srv://_SERVICE._PROTO.NAME` (both with an
    /// optional `?resolver=IP:PORT`) or `file://PATH`.
    pub url: String,
    /// How often the source is read again (at least 100). A DNS answer whose records have a
    /// shorter TTL is read again when it expires; a file is checked for
    /// changes every 250 ms and read when it changed.
    pub interval_ms: u64,
    /// A replica gone from its source drains and is removed once idle, or
    /// after this many seconds with requests still running.
    pub grace_secs: u64,
    /// An answer that would remove more than this fraction of the source's
    /// replicas at once is applied only when the next answer says the same.
    pub max_removal_fraction: f64,
    /// The models every replica of this source is expected to serve, used
    /// until the replica's own `/v1/models` answers (empty: any).
    pub models: Vec<String>,
    /// Share of spread traffic of each replica of this source (default 1).
    pub weight: Option<u32>,
    /// Labels given to each replica of this source.
    pub labels: BTreeMap<String, String>,
    /// Upstream API key sent to this source's replicas.
    pub api_key: Option<String>,
    /// Health probe path of this source's replicas.
    pub health_path: Option<String>,
    /// Most concurrent large-context requests per replica of this source.
    pub max_large_inflight: Option<u32>,
    /// KV cache capacity in tokens of each replica of this source.
    pub kv_tokens: Option<u64>,
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            url: String::new(),
            interval_ms: 5_000,
            grace_secs: 600,
            max_removal_fraction: 0.5,
            models: Vec::new(),
            weight: None,
            labels: BTreeMap::new(),
            api_key: None,
            health_path: None,
            max_large_inflight: None,
            kv_tokens: None,
        }
    }
}

impl SourceConfig {
    pub fn new(url: &str) -> SourceConfig {
        SourceConfig { url: url.to_string(), ..SourceConfig::default() }
    }

    /// A found replica with this source's settings, where the replica does
    /// not carry its own (a file's tables may).
    pub fn dress(&self, mut spec: ReplicaSpec) -> ReplicaSpec {
        spec.api_key = spec.api_key.or_else(|| self.api_key.clone());
        spec.health_path = spec.health_path.or_else(|| self.health_path.clone());
        spec.max_large_inflight = spec.max_large_inflight.or(self.max_large_inflight);
        spec.kv_tokens = spec.kv_tokens.or(self.kv_tokens);
        spec.weight = spec.weight.or(self.weight);
        if spec.models.is_empty() {
            spec.models = self.models.clone();
        }
        for (k, v) in &self.labels {
            spec.labels.entry(k.clone()).or_insert_with(|| v.clone());
        }
        spec
    }

    pub fn validate(&self) -> Result<source::Source, String> {
        let parsed = source::Source::parse(&self.url)?;
        // Each source's task wakes at least this often anyway; reading a
        // DNS server or a file faster only costs it and us.
        if self.interval_ms < 100 {
            return Err(format!("interval_ms: {} is below the smallest interval, 100 ms", self.interval_ms));
        }
        if !(0.0..=1.0).contains(&self.max_removal_fraction) {
            return Err("max_removal_fraction must be from 0 to 1".into());
        }
        self.dress(ReplicaSpec::new("x", "http://x")).validate()?;
        Ok(parsed)
    }

    pub fn lifecycle(&self) -> lifecycle::Settings {
        lifecycle::Settings {
            grace_ms: self.grace_secs.saturating_mul(1000),
            max_removal_fraction: self.max_removal_fraction,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_dresses_its_replicas_without_overriding_their_own_settings() {
        let mut source = SourceConfig::new("file:///e.toml");
        source.max_large_inflight = Some(2);
        source.kv_tokens = Some(100);
        source.labels.insert("zone".into(), "a".into());
        source.models = vec!["m".into()];
        let mut own = ReplicaSpec::new("e-1", "http://127.0.0.2:8000");
        own.kv_tokens = Some(7);
        own.labels.insert("zone".into(), "b".into());
        let dressed = source.dress(own);
        assert_eq!((dressed.max_large_inflight, dressed.kv_tokens), (Some(2), Some(7)));
        assert_eq!(dressed.labels["zone"], "b");
        assert_eq!(dressed.models, ["m"]);
        assert!(source.validate().is_ok());
        for (bad, says) in [
            (SourceConfig { interval_ms: 0, ..source.clone() }, "interval_ms"),
            (SourceConfig { max_removal_fraction: 1.5, ..source.clone() }, "max_removal_fraction"),
            (SourceConfig { health_path: Some("x".into()), ..source.clone() }, "health_path"),
            (SourceConfig::new("consul://x"), "scheme"),
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }
}
