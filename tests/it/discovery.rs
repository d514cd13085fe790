//! Finding replicas (issue 21) against a real DNS server, dnsmasq
//! (installed by `.ci/run`), started on a free loopback port with its own
//! records, changed between steps and reloaded with SIGHUP; simulated
//! replicas bound to distinct loopback addresses (127.0.0.2, 127.0.0.3, ...).
//! Every wait is for a condition, never a fixed sleep.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::*;
use prefixgate::config::{Config, SourceConfig};
use prefixgate::discovery::dns::{resolve_addresses, resolve_srv, resolver};
use prefixgate::fleet::{AdminState, Health};

struct Dnsmasq {
    child: Child,
    addr: std::net::SocketAddr,
    hosts: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Dnsmasq {
    /// dnsmasq answering A records from a hosts file (`IP NAME` lines) and
    /// the SRV records given, nothing else (no upstream, no /etc/hosts).
    fn start(hosts: &str, srv: &[&str]) -> Option<Dnsmasq> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hosts");
        std::fs::write(&file, hosts).unwrap();
        // Debian puts it in /usr/sbin, which a non-root PATH may lack.
        let program = if std::path::Path::new("/usr/sbin/dnsmasq").exists() { "/usr/sbin/dnsmasq" } else { "dnsmasq" };
        loop {
            // A port free for UDP and TCP (dnsmasq serves both), released
            // for dnsmasq; if another process takes it first, dnsmasq exits
            // and the next port is tried.
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let port = udp.local_addr().unwrap().port();
            if TcpListener::bind(("127.0.0.1", port)).is_err() {
                continue;
            }
            drop(udp);
            let mut cmd = Command::new(program);
            cmd.args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
            ])
            .args(["--listen-address=127.0.0.1", "--local-ttl=1", "--user=root", "--pid-file="])
            // Names under .test it does not have are NXDOMAIN (no upstream to ask).
            .arg("--local=/test/")
            .arg(format!("--port={port}"))
            .arg(format!("--addn-hosts={}", file.display()))
            .args(srv.iter().map(|s| format!("--srv-host={s}")))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            let child = cmd.spawn();
            if !require("dnsmasq", child.is_ok(), "apt-get install -y dnsmasq-base") {
                return None;
            }
            let mut child = child.unwrap();
            // Up once its TCP side accepts; gone if it could not bind.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    let addr = format!("127.0.0.1:{port}").parse().unwrap();
                    return Some(Dnsmasq { child, addr, hosts: file, _dir: dir });
                }
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "dnsmasq did not start");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// New A records, read again by dnsmasq on SIGHUP.
    fn set_hosts(&self, hosts: &str) {
        std::fs::write(&self.hosts, hosts).unwrap();
        let _ = Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status();
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        self.stop();
    }
}

#[actix_web::test]
async fn address_records_name_one_replica_each_and_follow_the_server() {
    // A dual-stack name (A and AAAA records) and a name with an AAAA record only.
    let records = "127.0.0.2 engines.test\n127.0.0.3 engines.test\n::1 engines.test\n::1 v6.test\n";
    let Some(mut dns) = Dnsmasq::start(records, &[]) else { return };
    let r = resolver(Some(dns.addr), Duration::from_millis(500)).unwrap();
    // dnsmasq takes a moment to listen: ask until it answers.
    wait_until_async("dnsmasq answers", || async {
        resolve_addresses(&r, "engines.test", 8000).await.is_ok_and(|a| !a.replicas.is_empty())
    })
    .await;
    let answer = resolve_addresses(&r, "engines.test", 8000).await.unwrap();
    let found: Vec<(&str, &str)> = answer.replicas.iter().map(|s| (s.id.as_str(), s.url.as_str())).collect();
    assert_eq!(found, [("127-0-0-2-8000", "http://127.0.0.2:8000"), ("127-0-0-3-8000", "http://127.0.0.3:8000")]);
    assert!(answer.valid_for <= Duration::from_secs(1), "the record TTL bounds the answer: {:?}", answer.valid_for);
    // One address family per answer (not two replicas on a dual-stack engine); IPv6 when that is all there is.
    let v6 = resolve_addresses(&r, "v6.test", 8000).await.unwrap();
    assert_eq!(v6.replicas.iter().map(|s| s.url.as_str()).collect::<Vec<_>>(), ["http://[::1]:8000"]);
    // Scaled down: the next answers follow.
    dns.set_hosts("127.0.0.2 engines.test\n");
    wait_until_async("one address left", || async {
        resolve_addresses(&r, "engines.test", 8000).await.is_ok_and(|a| a.replicas.len() == 1)
    })
    .await;
    // A name with no records is an empty answer, not an error.
    assert!(resolve_addresses(&r, "nothing.test", 8000).await.unwrap().replicas.is_empty());
    // The server gone: an error (the lifecycle keeps the last good answer).
    dns.stop();
    assert!(resolve_addresses(&r, "engines.test", 8000).await.is_err());
}

#[actix_web::test]
async fn srv_records_give_each_replica_its_own_host_and_port() {
    let srv = ["_http._tcp.engines.test,node-a.test,8001", "_http._tcp.engines.test,node-b.test,8002"];
    let Some(dns) = Dnsmasq::start("127.0.0.2 node-a.test\n", &srv) else { return };
    let r = resolver(Some(dns.addr), Duration::from_millis(500)).unwrap();
    wait_until_async("dnsmasq answers", || async {
        resolve_srv(&r, "_http._tcp.engines.test").await.is_ok_and(|a| !a.replicas.is_empty())
    })
    .await;
    let answer = resolve_srv(&r, "_http._tcp.engines.test").await.unwrap();
    let found: Vec<(&str, &str)> = answer.replicas.iter().map(|s| (s.id.as_str(), s.url.as_str())).collect();
    assert_eq!(
        found,
        [("node-a-test-8001", "http://127.0.0.2:8001"), ("node-b-test-8002", "http://node-b.test:8002")],
        "a target the server resolves is reached at its address; one it cannot keeps its name"
    );
}

/// Polls an async check every 20 ms for at most 15 s, until it gives a value.
async fn poll<T, F, Fut>(what: &str, check: F) -> T
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        match check().await {
            Ok(value) => return value,
            Err(last) => assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what} ({last})"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls an async condition until it holds.
async fn wait_until_async<F, Fut>(what: &str, cond: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    poll(what, || async {
        if cond().await {
            Ok(())
        } else {
            Err("not yet".to_string())
        }
    })
    .await
}

/// Simulated replicas on 127.0.0.2, 127.0.0.3, ... all on one port (a DNS
/// A record carries no port: the source gives it). Returns the port.
fn sims_on_one_port(n: u8, cfg: prefixgate::sim::SimConfig) -> (u16, Vec<Sim>) {
    'port: loop {
        let first = TcpListener::bind("127.0.0.2:0").unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for i in 3..2 + n {
            match TcpListener::bind(format!("127.0.0.{i}:{port}")) {
                Ok(l) => listeners.push(l),
                // Taken on that address: try another port.
                Err(_) => continue 'port,
            }
        }
        let sims =
            listeners.into_iter().enumerate().map(|(i, l)| start_sim_on(&format!("s{i}"), l, cfg.clone())).collect();
        return (port, sims);
    }
}

/// A gateway config with one discovery source and no static replicas.
fn discovering(source: SourceConfig) -> Config {
    Config { discovery: vec![source], ..test_config(&[]) }
}

fn dns_source(dns: &Dnsmasq, name: &str, port: u16, interval_ms: u64) -> SourceConfig {
    SourceConfig { interval_ms, ..SourceConfig::new(&format!("dns://{name}:{port}?resolver={}", dns.addr)) }
}

fn hosts(ips: &[u8]) -> String {
    ips.iter().map(|i| format!("127.0.0.{i} engines.test\n")).collect()
}

fn id(ip: u8, port: u16) -> String {
    format!("127-0-0-{ip}-{port}")
}

/// The ids of the replicas in the fleet, sorted.
fn fleet_ids(gw: &Gw) -> Vec<String> {
    let mut ids: Vec<String> = gw.gw.fleet.snapshot().iter().map(|r| r.id.to_string()).collect();
    ids.sort();
    ids
}

fn routable(gw: &Gw, id: &str) -> bool {
    gw.gw.fleet.get(id).is_some_and(|r| r.routable() && r.health() == Health::Up)
}

async fn source_status(gw: &Gw) -> Value {
    let (status, sources) = admin("GET", &format!("{}/admin/v1/discovery", gw.admin), None, None).await;
    assert_eq!(status, 200);
    sources[0].clone()
}

async fn wait_for_status(gw: &Gw, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    poll(what, || async {
        let s = source_status(gw).await;
        if cond(&s) {
            Ok(s)
        } else {
            Err(format!("last: {s}"))
        }
    })
    .await
}

fn kinds(gw: &Gw) -> Vec<(String, Option<String>)> {
    gw.gw
        .events
        .query(&prefixgate::events::EventFilter { limit: 10_000, ..Default::default() })
        .into_iter()
        .map(|e| (serde_json::to_value(e.kind).unwrap().as_str().unwrap().to_string(), e.replica))
        .collect()
}

#[actix_web::test]
async fn a_dns_source_scales_the_fleet_up_and_down_and_survives_its_server_stopping() {
    let Some(mut dns) = Dnsmasq::start(&hosts(&[2, 3]), &[]) else { return };
    let (port, _sims) = sims_on_one_port(3, slow_decoder(40.0));
    let gw = start_gateway(discovering(dns_source(&dns, "engines.test", port, 200))).await;
    let label = format!("dns:engines.test:{port}");
    wait_until("both records routable", Duration::from_secs(15), || {
        routable(&gw, &id(2, port)) && routable(&gw, &id(3, port))
    })
    .await;
    assert_eq!(fleet_ids(&gw), [id(2, port), id(3, port)]);
    let (_, view) = admin("GET", &format!("{}/admin/v1/replicas/{}", gw.admin, id(2, port)), None, None).await;
    assert_eq!(
        (view["source"].as_str(), view["url"].as_str()),
        (Some(label.as_str()), Some(&*format!("http://127.0.0.2:{port}")))
    );
    let status = wait_for_status(&gw, "first read", |s| s["result"] == "ok").await;
    assert_eq!(
        (status["source"].as_str(), status["replicas"].as_u64(), status["stale"].as_bool()),
        (Some(label.as_str()), Some(2), Some(false))
    );
    assert!(status["last_resolution"].is_string());

    // Scale up: the new record is probed, then takes spread traffic.
    let asked = std::time::Instant::now();
    dns.set_hosts(&hosts(&[2, 3, 4]));
    wait_until("the new record routable", Duration::from_secs(15), || routable(&gw, &id(4, port))).await;
    eprintln!("scale-up: the new record was routable {:?} after the DNS change", asked.elapsed());
    let mut served = std::collections::BTreeSet::new();
    for i in 0..6 {
        served.insert(chat(&gw, &[("user", &format!("one-shot {i}"))]).await.replica);
    }
    assert!(served.contains(&id(4, port)), "spread reaches the new replica: {served:?}");

    // Scale down with a stream in flight on the replica that leaves.
    let leaving = id(3, port);
    // Up to 30 tries: this is about the drain, not the spread (tested on
    // its own); on a loaded machine (the whole suite in parallel) a
    // dropped stream can still count as another replica's work for a
    // moment, or a probe can be late, and six tries fell short once.
    let (mut stream, mut seen) = (None, Vec::new());
    for i in 0..30 {
        let body = chat_body(&[("user", &format!("long {i}"))], json!({"stream": true, "max_tokens": 40}));
        let resp = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
        let replica = resp.headers().get("x-prefixgate-replica").unwrap().to_str().unwrap().to_string();
        if replica == leaving {
            stream = Some(resp);
            break;
        }
        seen.push(replica);
    }
    let mut stream = stream.unwrap_or_else(|| panic!("spread never reached the replica that will leave: {seen:?}"));
    let r = gw.gw.fleet.get(&leaving).unwrap();
    dns.set_hosts(&hosts(&[2, 4]));
    wait_until("it drains", Duration::from_secs(15), || r.admin() == AdminState::Draining).await;
    assert_eq!(r.inflight(), 1, "the stream still runs");
    for i in 0..6 {
        let reply = chat(&gw, &[("user", &format!("after {i}"))]).await;
        assert_ne!(reply.replica, leaving, "no new traffic to a replica that left its source");
    }
    let body = stream.body().limit(1 << 20).await.unwrap();
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"), "the in-flight stream completed");
    wait_until("it leaves once idle", Duration::from_secs(15), || gw.gw.fleet.get(&leaving).is_none()).await;
    let events = kinds(&gw);
    for kind in ["replica_discovered", "replica_left_source", "replica_removed"] {
        assert!(events.contains(&(kind.to_string(), Some(leaving.clone()))), "{kind} for {leaving}: {events:?}");
    }

    // The DNS server stops: nothing changes but the source's staleness.
    dns.stop();
    let status = wait_for_status(&gw, "stale", |s| s["stale"] == true).await;
    assert_eq!((status["result"].as_str(), status["replicas"].as_u64()), (Some("failed"), Some(2)));
    assert!(status["error"].is_string() && status["stale_since"].is_string());
    assert_eq!(fleet_ids(&gw), [id(2, port), id(4, port)]);
    let (code, health) = admin("GET", &format!("{}/healthz", gw.base), None, None).await;
    assert_eq!((code, health["stale_sources"][0].as_str()), (200, Some(label.as_str())), "{health}");
    assert_eq!(chat(&gw, &[("user", "during the outage")]).await.status, 200);
    assert!(kinds(&gw).iter().any(|(k, _)| k == "discovery_failed"));
    let metrics = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap().body().await.unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains(&format!("prefixgate_discovery_stale{{source=\"{label}\"}} 1")), "{metrics}");
    gw.stop().await;
}

#[actix_web::test]
async fn an_answer_that_empties_most_of_a_source_is_applied_only_when_seen_twice() {
    let Some(dns) = Dnsmasq::start(&hosts(&[2, 3, 4, 5]), &[]) else { return };
    let (port, _sims) = sims_on_one_port(4, fast_sim());
    // A second between reads: room to put the records back after one read.
    let gw = start_gateway(discovering(dns_source(&dns, "engines.test", port, 1_000))).await;
    wait_until("four replicas", Duration::from_secs(15), || fleet_ids(&gw).len() == 4).await;
    // A resolver that restarts answers with one record, then all four.
    dns.set_hosts(&hosts(&[2]));
    let held = wait_for_status(&gw, "held", |s| s["result"] == "held").await;
    dns.set_hosts(&hosts(&[2, 3, 4, 5]));
    assert!(held["error"].as_str().unwrap().contains("3 of 4"), "{held}");
    wait_for_status(&gw, "read again", |s| s["result"] == "ok").await;
    let fleet = gw.gw.fleet.snapshot();
    assert!(fleet.iter().all(|r| r.admin() == AdminState::Active && r.left_source_ms().is_none()), "nothing drained");
    assert!(kinds(&gw).iter().any(|(k, _)| k == "discovery_held"));
    // A real scale-down to one: held once, applied at the second answer.
    dns.set_hosts(&hosts(&[2]));
    wait_until("three drained", Duration::from_secs(15), || {
        gw.gw.fleet.snapshot().iter().filter(|r| r.left_source_ms().is_some()).count() == 3 || fleet_ids(&gw).len() == 1
    })
    .await;
    wait_until("three removed", Duration::from_secs(15), || fleet_ids(&gw) == [id(2, port)]).await;
    gw.stop().await;
}

#[actix_web::test]
async fn srv_records_bring_replicas_on_their_own_ports() {
    let (a, b) = (TcpListener::bind("127.0.0.2:0").unwrap(), TcpListener::bind("127.0.0.3:0").unwrap());
    let (pa, pb) = (a.local_addr().unwrap().port(), b.local_addr().unwrap().port());
    let _sims = [start_sim_on("a", a, fast_sim()), start_sim_on("b", b, fast_sim())];
    let srv =
        [format!("_http._tcp.engines.test,node-a.test,{pa}"), format!("_http._tcp.engines.test,node-b.test,{pb}")];
    let srv: Vec<&str> = srv.iter().map(String::as_str).collect();
    let Some(dns) = Dnsmasq::start("127.0.0.2 node-a.test\n127.0.0.3 node-b.test\n", &srv) else { return };
    let source = SourceConfig {
        interval_ms: 200,
        ..SourceConfig::new(&format!("dns+srv://_http._tcp.engines.test?resolver={}", dns.addr))
    };
    let gw = start_gateway(discovering(source)).await;
    let (ia, ib) = (format!("node-a-test-{pa}"), format!("node-b-test-{pb}"));
    wait_until("both SRV targets routable", Duration::from_secs(15), || routable(&gw, &ia) && routable(&gw, &ib)).await;
    assert_eq!(gw.gw.fleet.get(&ib).unwrap().spec().url, format!("http://127.0.0.3:{pb}"));
    let mut served = std::collections::BTreeSet::new();
    for i in 0..4 {
        served.insert(chat(&gw, &[("user", &format!("q {i}"))]).await.replica);
    }
    assert_eq!(served, [ia, ib].into_iter().collect());
    gw.stop().await;
}

#[actix_web::test]
async fn an_operators_disable_outlives_the_replica_leaving_and_coming_back() {
    let Some(dns) = Dnsmasq::start(&hosts(&[2, 3]), &[]) else { return };
    let (port, _sims) = sims_on_one_port(2, fast_sim());
    let gw = start_gateway(discovering(dns_source(&dns, "engines.test", port, 200))).await;
    let (kept, gone) = (id(2, port), id(3, port));
    wait_until("both routable", Duration::from_secs(15), || routable(&gw, &kept) && routable(&gw, &gone)).await;
    let url = |tail: &str| format!("{}/admin/v1/replicas/{gone}{tail}", gw.admin);
    let (code, err) = admin("DELETE", &url(""), None, None).await;
    assert_eq!(code, 409);
    let message = err["error"]["message"].as_str().unwrap();
    assert!(message.contains("disable") && message.contains("dns:engines.test"), "{message}");
    let (code, _) = admin("PATCH", &url(""), None, Some(json!({"max_large_inflight": 1}))).await;
    assert_eq!(code, 409, "its settings are its source's");
    assert_eq!(admin("POST", &url("/disable"), None, None).await.0, 200);
    dns.set_hosts(&hosts(&[2]));
    wait_until("removed", Duration::from_secs(15), || gw.gw.fleet.get(&gone).is_none()).await;
    dns.set_hosts(&hosts(&[2, 3]));
    wait_until("back", Duration::from_secs(15), || gw.gw.fleet.get(&gone).is_some()).await;
    let (_, view) = admin("GET", &url(""), None, None).await;
    assert_eq!(view["admin_state"], "disabled", "{view}");
    for i in 0..4 {
        assert_eq!(chat(&gw, &[("user", &format!("q {i}"))]).await.replica, kept);
    }
    // Enabled: back in rotation.
    assert_eq!(admin("POST", &url("/enable"), None, None).await.0, 200);
    wait_until("routable", Duration::from_secs(15), || routable(&gw, &gone)).await;
    gw.stop().await;
}

#[actix_web::test]
async fn a_file_source_is_reloaded_when_it_changes_and_a_malformed_one_changes_nothing() {
    let sims = [start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await, start_sim("c", fast_sim()).await];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engines.toml");
    let tables = |n: usize| -> String {
        sims[..n].iter().map(|s| format!("[[replicas]]\nid = \"node-{}\"\nurl = \"{}\"\n\n", s.id, s.url)).collect()
    };
    std::fs::write(&path, tables(2)).unwrap();
    // A long interval: only a change to the file makes it read again.
    let mut source =
        SourceConfig { interval_ms: 3_600_000, ..SourceConfig::new(&format!("file://{}", path.display())) };
    source.max_large_inflight = Some(3);
    let gw = start_gateway(discovering(source)).await;
    wait_until("two replicas", Duration::from_secs(15), || fleet_ids(&gw) == ["node-a", "node-b"]).await;
    assert_eq!(gw.gw.fleet.get("node-a").unwrap().spec().max_large_inflight, Some(3), "the source's settings");
    std::fs::write(&path, tables(3)).unwrap();
    wait_until("reloaded", Duration::from_secs(15), || fleet_ids(&gw).len() == 3).await;
    // Caught mid-write: refused whole, the fleet stays, the source is stale.
    std::fs::write(&path, "[[replicas]]\nid = \"node-a\"\nurl = ").unwrap();
    let status = wait_for_status(&gw, "malformed", |s| s["stale"] == true).await;
    assert_eq!(status["result"], "failed");
    assert_eq!(fleet_ids(&gw), ["node-a", "node-b", "node-c"]);
    std::fs::write(&path, tables(3)).unwrap();
    wait_for_status(&gw, "fixed", |s| s["result"] == "ok").await;
    assert!(kinds(&gw).iter().any(|(k, _)| k == "discovery_recovered"));
    gw.stop().await;
}

#[actix_web::test]
async fn two_instances_on_one_redis_and_one_dns_server_share_the_operators_state_and_never_fight() {
    let Some(redis) = crate::shared::Redis::start() else { return };
    let Some(dns) = Dnsmasq::start(&hosts(&[2, 3]), &[]) else { return };
    let (port, _sims) = sims_on_one_port(2, fast_sim());
    let mut gws = Vec::new();
    for name in ["gw-a", "gw-b"] {
        let mut c = discovering(dns_source(&dns, "engines.test", port, 200));
        c.store.url = Some(redis.url.clone());
        c.store.instance = Some(name.into());
        gws.push(start_gateway(c).await);
    }
    let (a, b) = (&gws[0], &gws[1]);
    let both = [id(2, port), id(3, port)];
    for gw in [a, b] {
        wait_until("both found", Duration::from_secs(15), || fleet_ids(gw) == both).await;
    }
    // Nothing discovered is written where the other instance reads replicas.
    assert!(a.gw.store.replicas().await.unwrap().is_empty());
    // Disabled on one instance: disabled on the other.
    let disable = format!("{}/admin/v1/replicas/{}/disable", a.admin, both[1]);
    assert_eq!(admin("POST", &disable, None, None).await.0, 200);
    wait_until("shared", Duration::from_secs(10), || {
        b.gw.fleet.get(&both[1]).is_some_and(|r| r.admin() == AdminState::Disabled)
    })
    .await;
    // It leaves and comes back: disabled on both, and both agree on the fleet.
    dns.set_hosts(&hosts(&[2]));
    for gw in [a, b] {
        wait_until("removed", Duration::from_secs(15), || fleet_ids(gw) == both[..1]).await;
    }
    dns.set_hosts(&hosts(&[2, 3]));
    for gw in [a, b] {
        wait_until("back, disabled", Duration::from_secs(15), || {
            gw.gw.fleet.get(&both[1]).is_some_and(|r| r.admin() == AdminState::Disabled)
        })
        .await;
    }
    assert!(a.gw.store.replicas().await.unwrap().is_empty());
    for gw in gws {
        gw.stop().await;
    }
}

#[actix_web::test]
async fn the_demo_runs_with_a_file_source_and_follows_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("engines.toml");
    let file_arg = file.to_str().unwrap();
    let demo = GatewayProcess::run(
        &["demo", "--port", "0", "--admin-port", "0", "--time-scale", "0.001", "--discovery-file", file_arg],
        &[],
        std::process::Stdio::null(),
    );
    demo.wait_until_up().await;
    let replicas = || async {
        let (_, list) = admin("GET", &format!("{}/admin/v1/replicas", demo.admin), None, None).await;
        list.as_array()
            .unwrap()
            .iter()
            .map(|r| (r["id"].as_str().unwrap().to_string(), r["source"].clone()))
            .collect::<Vec<_>>()
    };
    let label = format!("file:{}", std::fs::canonicalize(&file).unwrap().display());
    assert_eq!(replicas().await, [("sim-a".to_string(), json!(label)), ("sim-b".to_string(), json!(label))]);
    // One more replica written into the file joins the fleet.
    let c = start_sim("c", fast_sim()).await;
    let mut tables = std::fs::read_to_string(&file).unwrap();
    tables.push_str(&format!("[[replicas]]\nid = \"sim-c\"\nurl = \"{}\"\n", c.url));
    std::fs::write(&file, tables).unwrap();
    wait_until_async("sim-c joined", || async { replicas().await.len() == 3 }).await;
    let reply = post(&format!("{}/v1/chat/completions", demo.base), &chat_body(&[("user", "hi")], json!({}))).await;
    assert_eq!(reply.status, 200);
}

#[actix_web::test]
async fn after_a_restart_discovered_replicas_are_found_again_and_their_pins_and_disables_hold() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let dir = tempfile::tempdir().unwrap();
    let listing = dir.path().join("engines.toml");
    let tables =
        format!("[[replicas]]\nid = \"a\"\nurl = \"{}\"\n\n[[replicas]]\nid = \"b\"\nurl = \"{}\"\n", a.url, b.url);
    std::fs::write(&listing, tables).unwrap();
    let mut config = discovering(SourceConfig::new(&format!("file://{}", listing.display())));
    config.data_dir = Some(dir.path().join("db"));
    let both_routable = |gw: &Gw| routable(gw, "a") && routable(gw, "b");

    let gw = start_gateway(config.clone()).await;
    wait_until("both found", Duration::from_secs(15), || both_routable(&gw)).await;
    let first = chat(&gw, &[("user", "a conversation that outlives a restart")]).await;
    let turn2 =
        chat(&gw, &[("user", "a conversation that outlives a restart"), ("assistant", "x"), ("user", "y")]).await;
    assert_eq!((turn2.route.as_str(), turn2.replica.as_str()), ("pinned", first.replica.as_str()));
    let other = if first.replica == "a" { "b" } else { "a" };
    gw.gw.operator.disable(other).await.unwrap();
    gw.stop().await;

    let gw = start_gateway(config).await;
    wait_until("found again", Duration::from_secs(15), || routable(&gw, &first.replica)).await;
    assert_eq!(gw.gw.fleet.get(other).unwrap().admin(), AdminState::Disabled, "the operator's disable persisted");
    let turn3 = chat(
        &gw,
        &[
            ("user", "a conversation that outlives a restart"),
            ("assistant", "x"),
            ("user", "y"),
            ("assistant", "z"),
            ("user", "after the restart"),
        ],
    )
    .await;
    assert_eq!((turn3.route.as_str(), turn3.replica.as_str()), ("pinned", first.replica.as_str()));
    assert!(gw.gw.store.replicas().await.unwrap().is_empty(), "discovered replicas are not stored");
    gw.stop().await;
}

#[actix_web::test]
async fn records_with_a_short_ttl_are_read_again_before_the_interval() {
    let Some(dns) = Dnsmasq::start(&hosts(&[2]), &[]) else { return };
    let (port, _sims) = sims_on_one_port(2, fast_sim());
    // An hour between reads, but dnsmasq's records live one second.
    let gw = start_gateway(discovering(dns_source(&dns, "engines.test", port, 3_600_000))).await;
    wait_until("the first record", Duration::from_secs(15), || routable(&gw, &id(2, port))).await;
    dns.set_hosts(&hosts(&[2, 3]));
    wait_until("the second record, read when the first answer expired", Duration::from_secs(15), || {
        routable(&gw, &id(3, port))
    })
    .await;
    gw.stop().await;
}

/// Issue 25: a discovered replica whose name a static replica holds is
/// refused, retried at every read, and appears as soon as the name is free.
#[actix_web::test]
async fn a_discovered_replica_whose_name_was_taken_appears_once_the_name_is_free() {
    let (a, b) = (start_sim("node-a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engines.toml");
    std::fs::write(&path, format!("[[replicas]]\nid = \"node-a\"\nurl = \"{}\"\n", b.url)).unwrap();
    let source = SourceConfig { interval_ms: 200, ..SourceConfig::new(&format!("file://{}", path.display())) };
    let gw = start_gateway(Config { discovery: vec![source], ..test_config(&[&a]) }).await;
    wait_for_status(&gw, "read", |s| s["result"] == "ok").await;
    let r = gw.gw.fleet.get("node-a").unwrap();
    assert_eq!((r.source.label(), r.spec().url.as_str()), ("static", a.url.as_str()), "the static replica keeps it");
    let (s, _) = admin("DELETE", &format!("{}/admin/v1/replicas/node-a", gw.admin), None, None).await;
    assert_eq!(s, 204);
    wait_until("the discovered node-a", Duration::from_secs(15), || {
        gw.gw.fleet.get("node-a").is_some_and(|r| r.source.is_discovered() && r.spec().url == b.url)
    })
    .await;
    let events = gw.gw.events.query(&prefixgate::events::EventFilter { limit: 100, ..Default::default() });
    assert!(
        events
            .iter()
            .any(|e| e.kind == prefixgate::events::EventKind::ReplicaDiscovered && e.detail.contains("name was taken")),
        "{events:?}"
    );
    wait_until("routable", Duration::from_secs(15), || routable(&gw, "node-a")).await;
    let reply = chat(&gw, &[("user", "hello")]).await;
    assert_eq!((reply.status, reply.replica.as_str()), (200, "node-a"));
    assert!(b.state.received.load(std::sync::atomic::Ordering::Relaxed) >= 1, "served by the discovered engine");
    gw.stop().await;
}
