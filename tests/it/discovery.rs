//! Issue 21 (in progress): resolving the DNS sources against a real DNS
//! server, dnsmasq (installed by `.ci/run`), started on a free loopback port
//! with its own records, changed between steps and reloaded with SIGHUP.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;
use prefixgate::discovery::dns::{resolve_addresses, resolve_srv, resolver};

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
        // A free UDP port: the one the kernel hands out, released for dnsmasq.
        let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        // Debian puts it in /usr/sbin, which a non-root PATH may lack.
        let program = if std::path::Path::new("/usr/sbin/dnsmasq").exists() { "/usr/sbin/dnsmasq" } else { "dnsmasq" };
        let mut cmd = Command::new(program);
        cmd.args(["--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--bind-interfaces"])
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
        Some(Dnsmasq {
            child: child.unwrap(),
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            hosts: file,
            _dir: dir,
        })
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
    let Some(mut dns) = Dnsmasq::start("127.0.0.2 engines.test\n127.0.0.3 engines.test\n", &[]) else { return };
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
    let Some(dns) = Dnsmasq::start("", &srv) else { return };
    let r = resolver(Some(dns.addr), Duration::from_millis(500)).unwrap();
    wait_until_async("dnsmasq answers", || async {
        resolve_srv(&r, "_http._tcp.engines.test").await.is_ok_and(|a| !a.replicas.is_empty())
    })
    .await;
    let answer = resolve_srv(&r, "_http._tcp.engines.test").await.unwrap();
    let found: Vec<(&str, &str)> = answer.replicas.iter().map(|s| (s.id.as_str(), s.url.as_str())).collect();
    assert_eq!(
        found,
        [("node-a-test-8001", "http://node-a.test:8001"), ("node-b-test-8002", "http://node-b.test:8002")]
    );
}

/// Polls an async condition every 20 ms for at most 10 s.
async fn wait_until_async<F, Fut>(what: &str, cond: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
