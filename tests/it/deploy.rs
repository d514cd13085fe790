//! The deployment examples under `deploy/` cannot drift from the binary:
//! nothing here can pull an image or reach a cluster, so this reads every
//! file and checks that each flag, environment variable, config key, port
//! and path it names exists: the gateway commands are parsed by the real
//! `serve` flags into a config that must load, every `PREFIXGATE_*` name is
//! a config key, every TOML file loads (unknown keys are errors), the
//! gateway's ports are the ones its listeners are given, and the paths its
//! probes ask for are served.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::{Args, Command, FromArgMatches};
use prefixgate::config::Config;
use prefixgate::config_flags::{keys, ServeArgs};

use crate::common::*;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// Flags of the other programs the examples run (vLLM, Redis, the
/// Containerfile's COPY): listed, so that any new one is a decision.
const FOREIGN_FLAGS: &[&str] = &["--model", "--port", "--enable-prefix-caching", "--appendonly", "--from"];

/// A gateway command line in a file: `serve` and its flags.
fn gateway_commands(path: &Path, text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim();
        // The Containerfile's CMD and a manifest's `args: [...]`: JSON arrays.
        for prefix in ["CMD ", "args: "] {
            if let Some(array) = t.strip_prefix(prefix) {
                let args: Vec<String> = serde_json::from_str(array).unwrap_or_else(|e| panic!("{path:?}: {t}: {e}"));
                if args.first().map(String::as_str) == Some("serve") {
                    out.push(args);
                }
            }
        }
        // Compose: `command:` then one `- item` per line.
        if t == "command:" {
            let mut args = Vec::new();
            while let Some(item) = lines.peek().and_then(|l| l.trim().strip_prefix("- ")) {
                args.push(item.to_string());
                lines.next();
            }
            if args.first().map(String::as_str) == Some("serve") {
                out.push(args);
            }
        }
    }
    out
}

/// Loads the config a gateway command line describes; a `--config` path is
/// read from the file of that name beside the manifest.
fn load(path: &Path, args: &[String]) -> Config {
    let m = ServeArgs::augment_args(Command::new("serve"))
        .try_get_matches_from(args)
        .unwrap_or_else(|e| panic!("{path:?}: {args:?}: {e}"));
    let parsed = ServeArgs::from_arg_matches(&m).unwrap();
    let file = parsed.config.map(|c| path.parent().unwrap().join(c.file_name().unwrap()));
    let env = [("PREFIXGATE_ADMIN_TOKEN".to_string(), "example".to_string())];
    Config::load(file.as_deref(), env.into_iter(), &parsed.overrides)
        .unwrap_or_else(|e| panic!("{path:?}: {args:?}: {e}"))
}

/// The numbers after `key` on each line that has it (`containerPort: 8080`).
fn numbers_after(text: &str, key: &str) -> Vec<u64> {
    let re = regex::Regex::new(&format!(r"{key}\s*(\d+)")).unwrap();
    re.captures_iter(text).map(|c| c[1].parse().unwrap()).collect()
}

/// The Compose services that run a gateway (`<<: *gateway`), as text: the
/// others (Prometheus, Grafana, Redis, the engines) listen where they like.
fn gateway_services(compose: &str) -> String {
    let mut out = String::new();
    let mut block = String::new();
    let mut flush = |block: &mut String| {
        if block.contains("<<: *gateway") {
            out.push_str(block);
        }
        block.clear();
    };
    for line in compose.lines() {
        let service = line.starts_with("  ") && !line.starts_with("   ") && line.trim_end().ends_with(':');
        if service || !line.starts_with(' ') {
            flush(&mut block);
        }
        block.push_str(line);
        block.push('\n');
    }
    flush(&mut block);
    out
}

#[actix_web::test]
async fn every_flag_variable_key_port_and_path_in_the_deployment_examples_exists() {
    let mut all = Vec::new();
    files(&deploy(), &mut all);
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_prefixgate")).args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let env_names: BTreeSet<String> = keys()
        .iter()
        .map(|k| format!("PREFIXGATE_{}", k.key.replace('.', "_").to_ascii_uppercase()))
        .chain(["PREFIXGATE_LOG".to_string()])
        .collect();
    let flag = regex::Regex::new(r"(^|[\s\[,])(--[a-z][a-z0-9-]*)").unwrap();
    let variable = regex::Regex::new(r"PREFIXGATE_[A-Z0-9_]+").unwrap();
    let mut gateways = Vec::new();
    let mut checked = 0;
    for path in &all {
        let text = std::fs::read_to_string(path).unwrap();
        let mut in_run = false;
        for line in text.lines() {
            let t = line.trim();
            // Build steps run cargo and apt-get, not the gateway.
            let run = in_run || t.starts_with("RUN ");
            in_run = run && t.ends_with('\\');
            if t.starts_with('#') || run {
                continue;
            }
            for c in flag.captures_iter(line) {
                let f = &c[2];
                if !FOREIGN_FLAGS.contains(&f) {
                    let listed = help.split(|ch: char| ch.is_whitespace() || ch == ',').any(|w| w == f);
                    assert!(listed, "{path:?}: flag {f} is not in `prefixgate serve --help`");
                    checked += 1;
                }
            }
        }
        for name in variable.find_iter(&text) {
            assert!(env_names.contains(name.as_str()), "{path:?}: {} is not a config key's variable", name.as_str());
            checked += 1;
        }
        if path.extension().is_some_and(|e| e == "toml") {
            let env = [("PREFIXGATE_ADMIN_TOKEN".to_string(), "example".to_string())];
            Config::load(Some(path), env.into_iter(), &[]).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            checked += 1;
        }
        for args in gateway_commands(path, &text) {
            gateways.push((path.clone(), load(path, &args)));
        }
    }
    let names: BTreeSet<&str> = gateways.iter().map(|(p, _)| p.file_name().unwrap().to_str().unwrap()).collect();
    assert_eq!(
        names,
        ["Containerfile", "compose.yaml", "gateway.yaml"].into_iter().collect(),
        "every example runs a gateway"
    );

    // Ports: what the gateway's listeners are given, in every file that runs it.
    for (path, config) in &gateways {
        let ports = [config.listen.port() as u64, config.admin_listen.port() as u64];
        let text = std::fs::read_to_string(path).unwrap();
        let named: Vec<u64> = match path.file_name().unwrap().to_str().unwrap() {
            "Containerfile" => text
                .lines()
                .filter_map(|l| l.strip_prefix("EXPOSE "))
                .flat_map(|l| l.split_whitespace().map(|p| p.parse().unwrap()))
                .collect(),
            "gateway.yaml" => numbers_after(&text, "containerPort:"),
            // Compose's "HOST:CONTAINER" mappings of the gateway services: the container side.
            _ => numbers_after(&gateway_services(&text), r#"- "(?:[0-9.]+:)?\d+:"#),
        };
        assert!(!named.is_empty(), "{path:?} names the gateway's ports");
        for p in named {
            assert!(ports.contains(&p), "{path:?}: port {p} is not a listener's ({ports:?})");
        }
        // A stop must wait for the in-flight streams the gateway lets finish.
        let grace = config.timeouts.shutdown_grace_secs;
        let waits = numbers_after(&text, "terminationGracePeriodSeconds:")
            .into_iter()
            .chain(numbers_after(&text, "stop_grace_period:"))
            .collect::<Vec<_>>();
        if path.extension().is_some_and(|e| e == "yaml") {
            assert!(!waits.is_empty() && waits.iter().all(|w| *w > grace), "{path:?}: grace {waits:?} vs {grace} s");
        }
    }

    // Paths the probes and health checks ask for are served (not 404).
    let sim = start_sim("a", fast_sim()).await;
    let gw = start_gateway(test_config(&[&sim])).await;
    let probe = regex::Regex::new(r"path: (/[^\s,}]*)|http://127\.0\.0\.1:\d+(/[^\s\x22]*)").unwrap();
    let mut paths = 0;
    for name in ["deploy/kubernetes/gateway.yaml", "deploy/compose.yaml"] {
        let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(name)).unwrap();
        for c in probe.captures_iter(&text) {
            let path = c.get(1).or(c.get(2)).unwrap().as_str();
            let traffic = client().get(format!("{}{path}", gw.base)).send().await.unwrap().status().as_u16();
            assert_eq!(traffic, 200, "{name}: {path} is not served on the traffic listener");
            paths += 1;
        }
    }
    assert!(paths >= 3 && checked >= 10, "the examples were read ({paths} paths, {checked} names)");
    gw.stop().await;
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy().join(path)).unwrap_or_else(|e| panic!("deploy/{path}: {e}"))
}

/// Every PromQL expression of the dashboard (its panels' targets) and of the
/// alert rules (`expr:` lines), with where each came from.
fn promql() -> Vec<(String, String)> {
    let dashboard: serde_json::Value = serde_json::from_str(&read("grafana/dashboards/prefixgate.json")).unwrap();
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = format!("dashboard panel '{}'", panel["title"].as_str().unwrap());
            out.push((title, target["expr"].as_str().unwrap().to_string()));
        }
    }
    let rules = read("prometheus/alerts.yml");
    let mut alert = String::new();
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            alert = name.to_string();
        }
        if let Some(expr) = line.strip_prefix("expr: ") {
            out.push((format!("alert {alert}"), expr.to_string()));
        }
    }
    out
}

/// The metric names an expression reads (a histogram's `_bucket`, `_sum`
/// and `_count` samples are the histogram's).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let name = regex::Regex::new(r"prefixgate_[a-z0-9_]+").unwrap();
    name.find_iter(expr).map(|m| m.as_str().to_string()).collect()
}

#[actix_web::test]
async fn every_metric_the_dashboard_and_the_alert_rules_name_is_exposed_after_traffic() {
    let exprs = promql();
    let dashboard_panels = exprs.iter().filter(|(from, _)| from.starts_with("dashboard")).count();
    let alerts: BTreeSet<&str> = exprs.iter().filter_map(|(from, _)| from.strip_prefix("alert ")).collect();
    assert!(dashboard_panels >= 15, "the dashboard was read ({dashboard_panels} queries)");
    for wanted in [
        "PrefixgateReplicaDown",
        "PrefixgateKvWallSeen",
        "PrefixgateWarmShareLow",
        "PrefixgateHoldQueueGrowing",
        "PrefixgateSharedStoreUnreachable",
        "PrefixgateDiscoverySourceFailing",
        "PrefixgateErrorRatioHigh",
        "PrefixgateMetricsAbsent",
        "PrefixgateStreamsNotContinued",
    ] {
        assert!(alerts.contains(wanted), "alert {wanted} is in deploy/prometheus/alerts.yml");
    }

    // A gateway with a discovery source, sessions, streams with usage, a
    // stored response and a failover: every family has its samples.
    let (a, b, c) =
        (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await, start_sim("c", fast_sim()).await);
    let dir = tempfile::tempdir().unwrap();
    let listing = dir.path().join("engines.toml");
    std::fs::write(&listing, format!("[[replicas]]\nid = \"c\"\nurl = \"{}\"\n", c.url)).unwrap();
    let mut config = test_config(&[&a, &b]);
    config.discovery = vec![prefixgate::config::SourceConfig::new(&format!("file://{}", listing.display()))];
    let gw = start_gateway(config).await;
    wait_until("c found", std::time::Duration::from_secs(10), || gw.gw.fleet.get("c").is_some_and(|r| r.routable()))
        .await;
    let mut turns = vec![("user".to_string(), "an agent's task".to_string())];
    for turn in 0..3 {
        let view: Vec<(&str, &str)> = turns.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
        let body = chat_body(&view, serde_json::json!({"stream": true, "stream_options": {"include_usage": true}}));
        let r = post(&format!("{}/v1/chat/completions", gw.base), &body).await;
        assert_eq!(r.status, 200);
        turns.push(("assistant".into(), format!("answer {turn}")));
        turns.push(("user".into(), format!("next {turn}")));
    }
    b.stop(true).await;
    for i in 0..3 {
        assert_eq!(chat(&gw, &[("user", &format!("after the stop {i}"))]).await.status, 200);
    }
    let metrics = scrape(&gw).await;
    let exposed: BTreeSet<&str> =
        metrics.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let mut checked = 0;
    for (from, expr) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{from}: `{expr}` reads no prefixgate metric");
        for name in names {
            assert!(exposed.contains(name.as_str()), "{from}: {name} is not in /metrics after traffic");
            checked += 1;
        }
    }
    assert!(checked >= 30, "{checked} names checked");
    gw.stop().await;
}

/// Metrics that appear only with their feature, as docs/observability.md says.
const WITH_THEIR_FEATURE: [&str; 2] = ["prefixgate_discovery_stale", "prefixgate_discovery_changes_total"];

#[actix_web::test]
async fn every_metric_the_dashboard_and_the_alert_rules_name_is_in_a_fresh_gateways_metrics_before_any_traffic() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    let metrics = scrape(&gw).await;
    let exposed: BTreeSet<&str> =
        metrics.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let observability = std::fs::read_to_string(deploy().join("../docs/observability.md")).unwrap();
    let mut missing = Vec::new();
    for (from, expr) in promql() {
        for name in metric_names(&expr) {
            if WITH_THEIR_FEATURE.contains(&name.as_str()) {
                let family = name.trim_end_matches("_total");
                assert!(observability.contains(family), "docs/observability.md says when {name} appears");
                continue;
            }
            if !exposed.contains(name.as_str()) {
                missing.push(format!("{from}: {name}"));
            }
        }
    }
    assert!(missing.is_empty(), "not in a fresh gateway's /metrics: {missing:#?}");
    gw.stop().await;
}

#[test]
fn the_compose_example_brings_prometheus_and_grafana_up_with_the_dashboard_and_rules_provisioned() {
    let compose = read("compose.yaml");
    // Each mounted folder exists, and holds what the service reads there.
    for (mount, inside) in [
        ("./prometheus:/etc/prometheus:ro", "prometheus/prometheus.yml"),
        ("./grafana/provisioning:/etc/grafana/provisioning:ro", "grafana/provisioning/datasources/prometheus.yaml"),
        ("./grafana/dashboards:/var/lib/grafana/dashboards:ro", "grafana/dashboards/prefixgate.json"),
    ] {
        assert!(compose.contains(&format!("- {mount}")), "compose.yaml mounts {mount}");
        assert!(deploy().join(inside).is_file(), "deploy/{inside}");
    }
    // Prometheus scrapes the gateway services on their admin port, and loads the rules.
    let prometheus = read("prometheus/prometheus.yml");
    assert!(prometheus.contains("- alerts.yml"));
    for gateway in ["gateway-a", "gateway-b"] {
        assert!(compose.contains(&format!("\n  {gateway}:\n")), "{gateway} is a service");
        assert!(prometheus.contains(&format!("\"{gateway}:9090\"")), "{gateway}'s admin listener is scraped");
    }
    // Grafana's data source is that Prometheus, under the uid the dashboard names.
    let datasource = read("grafana/provisioning/datasources/prometheus.yaml");
    assert!(datasource.contains("url: http://prometheus:9090") && datasource.contains("uid: prometheus"));
    assert!(read("grafana/provisioning/dashboards/prefixgate.yaml").contains("path: /var/lib/grafana/dashboards"));
    let dashboard: serde_json::Value = serde_json::from_str(&read("grafana/dashboards/prefixgate.json")).unwrap();
    for panel in dashboard["panels"].as_array().unwrap().iter().filter(|p| p["type"] != "row") {
        assert_eq!(panel["datasource"]["uid"], "prometheus", "{}", panel["title"]);
    }
}

#[test]
fn the_alert_rules_their_unit_tests_and_the_prometheus_config_pass_promtool() {
    let found = std::process::Command::new("promtool").arg("--version").output().is_ok_and(|o| o.status.success());
    if !require("promtool", found, "apt-get install -y prometheus") {
        return;
    }
    for args in [
        ["check", "rules", "prometheus/alerts.yml"],
        ["check", "config", "prometheus/prometheus.yml"],
        // The rules' unit tests: silent at 0/0, the absent() guard, the ratios.
        ["test", "rules", "prometheus/alerts_test.yml"],
    ] {
        let out = std::process::Command::new("promtool").args(args).current_dir(deploy()).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "promtool {args:?}: {said}");
    }
}
