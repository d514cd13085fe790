//! `prefixgate bench`: measurement tools for any OpenAI-compatible base URL
//! (the gateway, a replica, another router). The traps they avoid come from
//! the seed: a batch benchmark hides the round-robin problem (so
//! `agent-loop` is sequential per family), two runs sharing a prefix measure
//! a warm cache (so every corpus is salted), and small samples mislead (so
//! every report carries its sample size and warns below 20 warm turns).
//!
//! Prompt sizes are in estimated tokens (4 bytes each, the documented
//! estimate): no tokenizer needed.

mod client;
mod replay;
mod report;
mod workloads;

use std::path::PathBuf;

use clap::{Args, Subcommand};

pub use report::{Report, Sample};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub workload: Workload,
}

#[derive(Debug, Clone, Args)]
pub struct Common {
    /// Base URL of the server under test, e.g. http://127.0.0.1:8080 (without /v1).
    /// Several, comma-separated (gateway instances sharing a store): the
    /// agent loop sends each turn to the next one, so no two consecutive
    /// turns of a family reach the same instance.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub base_url: String,
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Sent as a bearer token.
    #[arg(long, env = "PREFIXGATE_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u64,
    /// Fixed salt for the corpus (reproducible runs); default: unique per run.
    #[arg(long)]
    pub salt: Option<String>,
    /// A name for this run in reports and charts (e.g. the routing mode).
    #[arg(long, default_value = "run")]
    pub label: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write an SVG chart (TTFT by turn) to this file.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Also write the report, every request's sample with it, as JSON to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// An extra request header, `NAME:VALUE` (repeatable): a priority class
    /// (`x-prefixgate-priority:background`), a client
    /// (`x-prefixgate-client:team-a`), a session header.
    #[arg(long = "header", value_name = "NAME:VALUE", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
}

/// `NAME:VALUE` as a header (the value trimmed; a valid name and value).
fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s.split_once(':').ok_or_else(|| format!("'{s}': expected NAME:VALUE"))?;
    let (name, value) = (name.trim(), value.trim());
    awc::http::header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| format!("'{name}': {e}"))?;
    awc::http::header::HeaderValue::from_str(value).map_err(|e| format!("'{value}': {e}"))?;
    Ok((name.to_string(), value.to_string()))
}

impl Common {
    /// The base URL for turn `turn` of family `family` (rotating over a list).
    pub fn base_for(&self, family: usize, turn: usize) -> Common {
        let urls: Vec<&str> = self.base_url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        let url = urls.get((family + turn) % urls.len().max(1)).copied().unwrap_or(&self.base_url);
        Common { base_url: url.to_string(), ..self.clone() }
    }
}

#[derive(Debug, Subcommand)]
pub enum Workload {
    /// F concurrent families, each a sequential-turn client whose context grows every turn.
    AgentLoop {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 2)]
        families: usize,
        #[arg(long, default_value_t = 6)]
        turns: usize,
        /// Shared context per family, in estimated tokens.
        #[arg(long, default_value_t = 8_000)]
        context_tokens: usize,
        /// New user text per turn, in estimated tokens.
        #[arg(long, default_value_t = 200)]
        turn_tokens: usize,
        /// The API the loop speaks.
        #[arg(long, value_enum, default_value_t = client::Api::Chat)]
        api: client::Api,
        /// Pause between a turn's end and the next turn (0: none, as an
        /// agent whose tool call returns at once).
        #[arg(long, default_value_t = 0)]
        pause_ms: u64,
        /// A system prompt (and tools) of this many tokens shared by every
        /// family, as its own first message (0: none; agent command lines
        /// send 15,000-20,000). With one, a first turn has two messages:
        /// the gateway sees a new session, not a one-shot.
        #[arg(long, visible_alias = "shared-tokens", default_value_t = 0)]
        system_tokens: usize,
        /// This many families are heavy (the first ones, or every other
        /// one with `--heavy-alternate`): each turn adds
        /// `--heavy-factor` times `--turn-tokens` (a coding agent reading
        /// files), the others are light.
        #[arg(long, default_value_t = 0)]
        heavy: usize,
        #[arg(long, default_value_t = 8)]
        heavy_factor: usize,
        /// Heavy and light families alternate (heavy first) instead of the
        /// heavy ones coming first: families start in order, so the seed's
        /// counter puts every heavy one on one replica of two.
        #[arg(long)]
        heavy_alternate: bool,
        /// How the agent rewrites its tail each turn: `status` (a status
        /// line after everything, replaced each turn), `reminder` (a
        /// reminder on the latest user message, stripped from older ones).
        #[arg(long, value_enum, default_value_t = workloads::Rewrite::None)]
        rewrite: workloads::Rewrite,
    },
    /// N distinct single-turn prompts sent at once.
    Burst {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 16)]
        requests: usize,
        #[arg(long, default_value_t = 8_000)]
        prompt_tokens: usize,
        /// A system prompt of this many tokens shared by every request (0: none).
        /// Shared prefixes are what make prefix-hash routing pile a batch onto one card.
        #[arg(long, default_value_t = 0)]
        shared_prefix_tokens: usize,
    },
    /// The same long prompt twice to one idle server, then with a varying tail: does its prefix cache work?
    ProbeCache {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 8_000)]
        prompt_tokens: usize,
    },
    /// The proxy hop's cost: small requests alternated between --base-url
    /// (the gateway) and --direct-url (a replica behind it), sequentially.
    Overhead {
        #[command(flatten)]
        common: Common,
        /// A replica URL to compare against (without /v1).
        #[arg(long)]
        direct_url: String,
        #[arg(long, default_value_t = 500)]
        requests: usize,
    },
    /// Recorded agent traffic sent again: a JSON-lines trace of model calls
    /// by task, each task's calls in order with their recorded tool pauses,
    /// every task at once (the format is in `src/bench/replay.rs` and
    /// docs/measuring.md).
    Replay {
        #[command(flatten)]
        common: Common,
        /// The trace (JSON lines: task, after_ms, path, body).
        #[arg(long)]
        trace: PathBuf,
        /// Keep this fraction of every text (contents, system prompts, tool
        /// descriptions), cut the same way in every call: a recorded prefix
        /// stays a prefix, and a long recording fits a small model.
        #[arg(long, default_value_t = 1.0)]
        keep_text: f64,
        /// Scales the recorded pauses between a task's calls (tool time).
        #[arg(long, default_value_t = 1.0)]
        pause_scale: f64,
    },
    /// Merge JSON reports into one SVG chart (one line per run).
    Chart {
        #[arg(long)]
        out: PathBuf,
        reports: Vec<PathBuf>,
    },
}

/// Runs a workload on its own runtime and prints the report.
pub fn run(args: BenchArgs) -> Result<(), String> {
    if let Workload::Chart { out, reports } = &args.workload {
        let runs = reports
            .iter()
            .map(|p| {
                let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                serde_json::from_str::<Report>(&text).map_err(|e| format!("{}: {e}", p.display()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        return std::fs::write(out, report::svg(&runs)).map_err(|e| e.to_string());
    }
    let report = actix_web::rt::System::new().block_on(workloads::run(&args.workload))?;
    let common = match &args.workload {
        Workload::AgentLoop { common, .. }
        | Workload::Burst { common, .. }
        | Workload::ProbeCache { common, .. }
        | Workload::Overhead { common, .. }
        | Workload::Replay { common, .. } => common,
        Workload::Chart { .. } => unreachable!("handled above"),
    };
    if let Some(path) = &common.svg {
        std::fs::write(path, report::svg(std::slice::from_ref(&report))).map_err(|e| e.to_string())?;
    }
    let json = || serde_json::to_string_pretty(&report).expect("serializable");
    if let Some(path) = &common.report {
        std::fs::write(path, json()).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if common.json {
        println!("{}", json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
