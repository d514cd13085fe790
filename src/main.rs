//! The command line: parse, then call into the library.

#![forbid(unsafe_code)]

use std::net::{SocketAddr, TcpListener};

use clap::{Parser, Subcommand};
use prefixgate::config::Config;
use prefixgate::config_flags::ServeArgs;
use prefixgate::fleet::ReplicaSpec;
use prefixgate::sim::{self, SimConfig, SimState};
use prefixgate::state::AppState;

#[derive(Parser)]
#[command(name = "prefixgate", version, about = "Routes OpenAI traffic across LLM replicas by request shape")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway in front of real replicas (vLLM, SGLang, llama.cpp server, ...).
    /// Every config key can be set here; `serve --help` lists them all.
    Serve(ServeArgs),
    /// Run one simulated replica (an OpenAI-compatible engine model).
    SimReplica {
        /// Port to listen on (127.0.0.1).
        #[arg(long)]
        port: u16,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[command(flatten)]
        sim: SimConfig,
    },
    /// Two simulated replicas and the gateway in one process.
    Demo {
        /// Gateway traffic port (replicas get free ports).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Admin API, Swagger UI and web UI port.
        #[arg(long, default_value_t = 9090)]
        admin_port: u16,
        /// Simulated-time factor for the replicas (0.05: a 22 s cold prefill takes 1.1 s).
        #[arg(long, default_value_t = 0.05)]
        time_scale: f64,
        /// Find the replicas through a file source instead of naming them:
        /// their `[[replicas]]` tables are written to FILE, and the gateway
        /// follows the file as it is edited (add a `prefixgate sim-replica`,
        /// remove one).
        #[arg(long, value_name = "FILE")]
        discovery_file: Option<std::path::PathBuf>,
    },
    /// Print the admin API's OpenAPI document.
    Openapi,
    /// Print the configuration reference (docs/configuration.md): every key, its default and what it does.
    ConfigReference,
    /// Work on a store offline (stop the gateways first).
    #[command(subcommand)]
    Store(StoreCommand),
    /// Measure any OpenAI-compatible server: agent loops, bursts, cache probes.
    Bench(prefixgate::bench::BenchArgs),
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Copy replicas, pins, history and the policy from one store to another:
    /// `sled:DIR` (or a directory), `redis://host:port/db`, `redis+unix:///socket`.
    Copy {
        #[arg(long)]
        from: String,
        #[arg(long)]
        to: String,
    },
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .event_format(prefixgate::telemetry::WithTraceId(tracing_subscriber::fmt::format()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PREFIXGATE_LOG")
                .unwrap_or_else(|_| "info,actix_server=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::SimReplica { port, host, sim } => sim_replica(&host, port, sim),
        Command::Demo { port, admin_port, time_scale, discovery_file } => {
            demo(port, admin_port, time_scale, discovery_file)
        }
        Command::Bench(args) => prefixgate::bench::run(args),
        Command::Store(StoreCommand::Copy { from, to }) => store_copy(&from, &to),
        Command::Openapi => {
            print!("{}", prefixgate::admin::openapi_json());
            Ok(())
        }
        Command::ConfigReference => {
            print!("{}", prefixgate::config_flags::configuration_markdown());
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefixgate: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let config = Config::load(args.config.as_deref(), std::env::vars(), &args.overrides)?;
    run_gateway(config, None)
}

fn bind(addr: SocketAddr, what: &str) -> Result<TcpListener, String> {
    TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr} ({what}): {e}"))
}

/// Runs the gateway until SIGINT/SIGTERM, then shuts down gracefully.
fn run_gateway(config: Config, banner: Option<String>) -> Result<(), String> {
    let traffic = bind(config.listen, "listen")?;
    let admin = bind(config.admin_listen, "admin_listen")?;
    actix_web::rt::System::new().block_on(async move {
        let state = AppState::open(config).await.map_err(|e| e.to_string())?;
        let running = prefixgate::start(state, traffic, admin).map_err(|e| e.to_string())?;
        // One machine-readable line: scripts (and tests) read the bound ports from it.
        println!("prefixgate listening traffic=http://{} admin=http://{}", running.traffic_addr, running.admin_addr);
        if let Some(b) = banner {
            println!("{b}");
        }
        shutdown_signal().await;
        tracing::info!("shutting down: finishing in-flight requests, then flushing state");
        running.stop().await;
        Ok(())
    })
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn sim_replica(host: &str, port: u16, cfg: SimConfig) -> Result<(), String> {
    let listener = bind(format!("{host}:{port}").parse().map_err(|e| format!("--host/--port: {e}"))?, "sim-replica")?;
    actix_web::rt::System::new().block_on(async move {
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        tracing::info!("simulated replica serving '{}' on http://{addr}", cfg.model);
        // One machine-readable line, as `serve` prints: scripts read the bound port (`--port 0`).
        println!("prefixgate sim-replica listening url=http://{addr}");
        sim::serve(listener, SimState::new(cfg)).map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())
    })
}

fn demo(port: u16, admin_port: u16, time_scale: f64, discovery_file: Option<std::path::PathBuf>) -> Result<(), String> {
    let mut replicas = Vec::new();
    let mut sims = Vec::new();
    for id in ["sim-a", "sim-b"] {
        let l = bind("127.0.0.1:0".parse().expect("literal"), id)?;
        let url = format!("http://{}", l.local_addr().map_err(|e| e.to_string())?);
        replicas.push(ReplicaSpec { kv_tokens: Some(122_636), ..ReplicaSpec::new(id, &url) });
        sims.push(l);
    }
    let mut config = Config {
        listen: SocketAddr::from(([127, 0, 0, 1], port)),
        admin_listen: SocketAddr::from(([127, 0, 0, 1], admin_port)),
        replicas: replicas.clone(),
        health: prefixgate::config::HealthConfig { interval_ms: 1_000, ..Default::default() },
        ..Config::default()
    };
    let mut found_in = String::new();
    if let Some(file) = discovery_file {
        let tables: String = replicas
            .iter()
            .map(|r| format!("[[replicas]]\nid = \"{}\"\nurl = \"{}\"\nkv_tokens = 122636\n\n", r.id, r.url))
            .collect();
        std::fs::write(&file, tables).map_err(|e| format!("--discovery-file {}: {e}", file.display()))?;
        let file = std::fs::canonicalize(&file).map_err(|e| format!("--discovery-file {}: {e}", file.display()))?;
        config.replicas.clear();
        config.discovery = vec![prefixgate::config::SourceConfig::new(&format!("file://{}", file.display()))];
        found_in = format!(" (found in {}: edit it and the gateway follows)", file.display());
    }
    // The replicas run on their own runtime thread, like separate processes.
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let servers: Vec<_> = sims
                .into_iter()
                .map(|l| {
                    sim::serve(l, SimState::new(SimConfig { time_scale, ..SimConfig::default() })).expect("sim starts")
                })
                .collect();
            futures_util::future::join_all(servers).await;
        })
    });
    let banner = format!(
        "\nprefixgate demo is up.\n  OpenAI endpoint:  http://127.0.0.1:{port}/v1   (model: sim-model, any API key)\n  \
         Admin web UI:     http://127.0.0.1:{admin_port}/\n  Swagger UI:       http://127.0.0.1:{admin_port}/swagger-ui/\n  \
         Metrics:          http://127.0.0.1:{admin_port}/metrics\n  Replicas:         {}{found_in}\n\nTry:\n  curl -s http://127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\":\"sim-model\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}' -i\n\nCtrl-C stops it.",
        replicas.iter().map(|r| format!("{}={}", r.id, r.url)).collect::<Vec<_>>().join(", ")
    );
    run_gateway(config, Some(banner))
}

/// `prefixgate store copy`: everything a gateway persists, from one store to another.
fn store_copy(from: &str, to: &str) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let copied = runtime.block_on(async {
        let name = format!("store-copy-{}", std::process::id());
        let src = prefixgate::store::open_url(from, &name).await.map_err(|e| format!("--from {from}: {e}"))?;
        let dst = prefixgate::store::open_url(to, &name).await.map_err(|e| format!("--to {to}: {e}"))?;
        prefixgate::store::copy(src.as_ref(), dst.as_ref()).await.map_err(|e| e.to_string())
    })?;
    println!(
        "copied {} replica(s), {} pin(s), {} event(s), {} setting(s) from {from} to {to}",
        copied.replicas, copied.pins, copied.events, copied.settings
    );
    Ok(())
}
