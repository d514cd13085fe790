//! Issue 5: the admin web UI driven in a real headless Chromium over the
//! DevTools protocol: sign in (wrong token first), see the fleet, drain a
//! replica with a click, find a pin, see a failover in the history, narrow
//! width, no console errors. Screenshots land in `target/screenshots/`
//! (and `docs/fleet.png` with `UPDATE_SCREENSHOTS=1`).
//!
//! Without Chromium the test says it was skipped; in CI (`CI` set, as
//! `.ci/run` does) a missing browser fails.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;
use base64::Engine;
use futures_util::{SinkExt, StreamExt};
use prefixgate::fleet::AdminState;
use serde_json::{json, Value};

fn chromium() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|name| {
        let found = Command::new("which").arg(name).output().ok()?;
        found.status.success().then(|| String::from_utf8_lossy(&found.stdout).trim().to_string())
    })
}

struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    devtools: String,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn launch(bin: &str) -> Browser {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            "--window-size=1280,1000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut devtools = None;
    for line in stderr.lines() {
        let line = line.unwrap();
        if let Some(url) = line.strip_prefix("DevTools listening on ") {
            devtools = Some(url.trim().to_string());
            break;
        }
    }
    let ws = devtools.expect("chromium printed its DevTools address");
    let port = ws.trim_start_matches("ws://127.0.0.1:").split('/').next().unwrap().to_string();
    Browser { child, _profile: profile, devtools: format!("http://127.0.0.1:{port}") }
}

type Socket = actix_codec::Framed<awc::BoxedSocket, awc::ws::Codec>;

struct Cdp {
    ws: Socket,
    next_id: u64,
    problems: Vec<String>,
}

impl Cdp {
    async fn connect(browser: &Browser) -> Cdp {
        let mut list = client().get(format!("{}/json/list", browser.devtools)).send().await.unwrap();
        let targets: Vec<Value> = list.json().await.unwrap();
        let page = targets.iter().find(|t| t["type"] == "page").expect("a page target");
        let url = page["webSocketDebuggerUrl"].as_str().unwrap();
        let (_, ws) = awc::Client::new().ws(url).max_frame_size(64 << 20).connect().await.unwrap();
        let mut cdp = Cdp { ws, next_id: 1, problems: Vec::new() };
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            cdp.call(domain, json!({})).await;
        }
        cdp
    }

    async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(awc::ws::Message::Text(msg.into())).await.unwrap();
        let mut partial = Vec::new();
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(30), self.ws.next())
                .await
                .expect("devtools answered")
                .unwrap()
                .unwrap();
            let bytes = match frame {
                awc::ws::Frame::Text(b) => b.to_vec(),
                awc::ws::Frame::Continuation(actix_http::ws::Item::FirstText(b)) => {
                    partial = b.to_vec();
                    continue;
                }
                awc::ws::Frame::Continuation(actix_http::ws::Item::Continue(b)) => {
                    partial.extend_from_slice(&b);
                    continue;
                }
                awc::ws::Frame::Continuation(actix_http::ws::Item::Last(b)) => {
                    partial.extend_from_slice(&b);
                    std::mem::take(&mut partial)
                }
                _ => continue,
            };
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
            self.observe(&v);
        }
    }

    /// Collects JavaScript exceptions and console errors (network 4xx
    /// entries from the deliberate wrong-token sign-in are expected).
    fn observe(&mut self, event: &Value) {
        match event["method"].as_str() {
            Some("Runtime.exceptionThrown") => self.problems.push(event["params"]["exceptionDetails"].to_string()),
            Some("Runtime.consoleAPICalled") if event["params"]["type"] == "error" => {
                self.problems.push(event["params"]["args"].to_string())
            }
            Some("Log.entryAdded")
                if event["params"]["entry"]["level"] == "error" && event["params"]["entry"]["source"] != "network" =>
            {
                self.problems.push(event["params"]["entry"]["text"].to_string())
            }
            _ => {}
        }
    }

    async fn eval(&mut self, expr: &str) -> Value {
        let r = self
            .call("Runtime.evaluate", json!({"expression": expr, "awaitPromise": true, "returnByValue": true}))
            .await;
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {r}");
        r["result"]["value"].clone()
    }

    async fn wait_for(&mut self, what: &str, expr: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        // Not there yet (or the page is still loading) is "not yet", not a failure.
        let guarded = format!("(() => {{ try {{ return !!({expr}); }} catch (e) {{ return false; }} }})()");
        while self.eval(&guarded).await != Value::Bool(true) {
            assert!(tokio::time::Instant::now() < deadline, "the page never showed: {what}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn screenshot(&mut self, name: &str) {
        self.capture(name, json!({"format": "png", "captureBeyondViewport": true})).await;
    }

    /// A screenshot of the part of the page `selector` covers.
    async fn screenshot_of(&mut self, name: &str, selector: &str) {
        let rect = self
            .eval(&format!(
                "(() => {{ const r = document.querySelector('{selector}').getBoundingClientRect(); \
                  return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height]; }})()"
            ))
            .await;
        let [x, y, width, height] = [0, 1, 2, 3].map(|i| rect[i].as_f64().unwrap());
        let clip = json!({"x": x, "y": y, "width": width, "height": height, "scale": 1});
        self.capture(name, json!({"format": "png", "captureBeyondViewport": true, "clip": clip})).await;
    }

    async fn capture(&mut self, name: &str, params: Value) {
        let r = self.call("Page.captureScreenshot", params).await;
        let png = base64::engine::general_purpose::STANDARD.decode(r["data"].as_str().unwrap()).unwrap();
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/target/screenshots");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(format!("{dir}/{name}.png"), &png).unwrap();
        // The README's pictures.
        if ["fleet", "over-time"].contains(&name) && std::env::var_os("UPDATE_SCREENSHOTS").is_some() {
            std::fs::write(format!("{}/docs/{name}.png", env!("CARGO_MANIFEST_DIR")), &png).unwrap();
        }
    }
}

/// Four streamed agent loops for a second: usage and first tokens for the
/// timeline's samples.
async fn streamed_agents(gw: &Gw) {
    let until = tokio::time::Instant::now() + Duration::from_millis(1_200);
    let loops = (0..4).map(|family| async move {
        let mut messages = vec![("user".to_string(), format!("family {family} starts"))];
        while tokio::time::Instant::now() < until {
            let view: Vec<(&str, &str)> = messages.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect();
            let body = chat_body(&view, json!({"stream": true, "stream_options": {"include_usage": true}}));
            let mut resp = client().post(format!("{}/v1/chat/completions", gw.base)).send_json(&body).await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.body().await.unwrap();
            messages.push(("assistant".into(), "ok".into()));
            messages.push(("user".into(), format!("turn {}", messages.len())));
        }
    });
    futures_util::future::join_all(loops).await;
}

#[actix_web::test]
async fn the_admin_ui_steers_the_fleet_in_a_real_browser() {
    let Some(bin) = chromium() else {
        require("Chromium", false, "apt-get install -y chromium");
        return;
    };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let mut config = test_config(&[&a, &b]);
    config.admin_token = Some("ui-token".into());
    config.health.interval_ms = 3_600_000; // only requests notice the stop below
    for r in &mut config.replicas {
        r.kv_tokens = Some(122_636);
    }
    // The timeline sampled often, so a second of traffic draws its charts;
    // a session stays resident while the page is looked at.
    config.timeline.interval_ms = 200;
    config.sessions.idle_ms = 600_000;
    config.priority.client_header = true;
    // A third replica comes from a discovery source (a file listing it).
    let c = start_sim("c", fast_sim()).await;
    let dir = tempfile::tempdir().unwrap();
    let listing = dir.path().join("engines.toml");
    std::fs::write(&listing, format!("[[replicas]]\nid = \"c\"\nurl = \"{}\"\nkv_tokens = 122636\n", c.url)).unwrap();
    config.discovery = vec![prefixgate::config::SourceConfig::new(&format!("file://{}", listing.display()))];
    let gw = start_gateway(config).await;
    wait_until("c found", Duration::from_secs(10), || gw.gw.fleet.get("c").is_some_and(|r| r.routable())).await;
    for i in 0..4 {
        chat(&gw, &[("user", &format!("a question {i}"))]).await;
    }
    let convo = chat(&gw, &[("user", "a conversation"), ("assistant", "yes"), ("user", "go on")]).await;
    streamed_agents(&gw).await;
    // A new session of a named client, one turn so far: resident until idle_ms.
    let url = format!("{}/v1/chat/completions", gw.base);
    let session =
        chat_body(&[("system", "an agent"), ("user", "plan"), ("assistant", "ok"), ("user", "do it")], json!({}));
    let headers = [("x-prefixgate-client", "ui-agent"), ("x-prefixgate-priority", "interactive")];
    assert_eq!(post_with(&url, &session, &headers).await.status, 200);

    let browser = launch(&bin);
    let mut page = Cdp::connect(&browser).await;
    page.call("Page.navigate", json!({"url": format!("{}/", gw.admin)})).await;
    page.wait_for("the token form", "!document.querySelector('#login').hidden").await;

    // A wrong token gets a clear message; the right one opens the fleet view.
    let sign_in = |token: &str| {
        format!("document.querySelector('#token').value = '{token}'; document.querySelector('#login-form').requestSubmit(); true")
    };
    page.eval(&sign_in("wrong")).await;
    page.wait_for("the refusal", "document.querySelector('#login-error').textContent.includes('refused')").await;
    page.eval(&sign_in("ui-token")).await;
    page.wait_for("three replicas", "document.querySelectorAll('#replicas tbody tr').length === 3").await;
    // The discovered one shows its source, has no Remove button, and its source is listed.
    let source = format!("file:{}", listing.display());
    page.wait_for(
        "c's source",
        &format!("document.querySelector('tr[data-replica=\"c\"] .source').textContent === '{source}'"),
    )
    .await;
    page.wait_for("no remove for c", "!document.querySelector('tr[data-replica=\"c\"] button[data-action=\"remove\"]') && !!document.querySelector('tr[data-replica=\"a\"] button[data-action=\"remove\"]')").await;
    page.wait_for(
        "the discovery source",
        &format!("(() => {{ const row = document.querySelector('#discovery-table tr[data-source=\"{source}\"]'); return !!row && row.textContent.includes('ok') && row.cells[2].textContent === '1'; }})()"),
    )
    .await;
    // Disabled with a click, as any replica.
    page.eval("window.confirm = () => true; document.querySelector('tr[data-replica=\"c\"] button[data-action=\"disable\"]').click(); true").await;
    page.wait_for(
        "c disabled in the page",
        "document.querySelector('tr[data-replica=\"c\"] .badge.state').textContent === 'disabled'",
    )
    .await;
    assert_eq!(gw.gw.fleet.get("c").unwrap().admin(), AdminState::Disabled);
    page.wait_for(
        "the instance line",
        "document.querySelector('#instances').textContent.includes('One gateway instance')",
    )
    .await;
    page.wait_for("health shown", "[...document.querySelectorAll('.badge.health')].every(b => b.textContent === 'up')")
        .await;
    // What each replica declares and what its receipts taught (no wall seen yet).
    page.wait_for(
        "declared and learned capacity",
        "(() => { const t = document.querySelector('tr[data-replica=\"a\"] .learned').textContent; return t.includes('declared') && t.includes('learned') && t.includes('no wall seen'); })()",
    )
    .await;
    // Each replica's TTFB value sits under the TTFB header: its column,
    // left-aligned with the header's text.
    page.wait_for(
        "TTFB values",
        "[...document.querySelectorAll('#replicas .ttfb-value')].some(v => v.textContent.endsWith('ms'))",
    )
    .await;
    page.wait_for(
        "the TTFB value under its header",
        "(() => { const th = [...document.querySelectorAll('#replicas thead th')].find(t => t.textContent === 'TTFB'); \
          const h = th.getBoundingClientRect(); \
          return [...document.querySelectorAll('#replicas .ttfb-value')].every(v => { \
            const b = v.getBoundingClientRect(); \
            return v.closest('td').cellIndex === th.cellIndex && b.left >= h.left && b.right <= h.right + 1 && b.left - h.left < 16; }); })()",
    )
    .await;
    page.screenshot("fleet").await;

    // Fleet over time: every chart drew the samples of the traffic above:
    // its canvas holds pixels of its lines' colours (axes and grid are grey).
    let charts = ["kv", "warm", "ttft", "inflight", "waiting", "failovers"];
    for chart in charts {
        page.wait_for(
            &format!("the {chart} chart drawn"),
            &format!(
                "(() => {{ const box = document.querySelector('.chart[data-chart=\"{chart}\"]'); \
                  if (!box || Number(box.dataset.points) < 3) return false; \
                  const canvas = box.querySelector('canvas'); \
                  const u = window.prefixgateCharts && window.prefixgateCharts['{chart}']; if (!canvas || !u) return false; \
                  const colours = u.series.slice(1).map((s, i) => typeof s.stroke === 'function' ? s.stroke(u, i + 1) : s.stroke) \
                    .map(hex => [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16))); \
                  const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data; \
                  let n = 0; for (let i = 0; i < px.length; i += 4) {{ \
                    if (px[i + 3] > 200 && colours.some(c => Math.abs(px[i] - c[0]) + Math.abs(px[i + 1] - c[1]) + Math.abs(px[i + 2] - c[2]) < 40)) n++; }} \
                  return n >= 20; }})()"
            ),
        )
        .await;
    }
    page.wait_for("the timeline's scope", "document.querySelector('#timeline-scope').textContent.includes('timeline')")
        .await;
    // The sessions view lists the resident session with its class and client.
    page.wait_for(
        "the resident session",
        "[...document.querySelectorAll('#session-table tbody tr')].some(tr => \
           tr.querySelector('.client').textContent === 'ui-agent' && tr.querySelector('.class').textContent === 'interactive' \
           && ['running', 'idle'].includes(tr.dataset.state))",
    )
    .await;
    page.eval("document.querySelector('#over-time').scrollIntoView(); true").await;
    page.screenshot_of("over-time", "#over-time").await;
    page.screenshot_of("sessions", "#sessions").await;

    // Drain b with a click, handing its streams over (the confirmation
    // dialog answered yes); the plain drain is beside it.
    page.wait_for(
        "a plain drain button",
        "!!document.querySelector('tr[data-replica=\"b\"] button[data-action=\"drain\"]')",
    )
    .await;
    page.eval("window.confirm = () => true; document.querySelector('tr[data-replica=\"b\"] button[data-action=\"handoff\"]').click(); true").await;
    page.wait_for(
        "b draining in the page",
        "document.querySelector('tr[data-replica=\"b\"] .badge.state').textContent === 'draining'",
    )
    .await;
    assert_eq!(gw.gw.fleet.get("b").unwrap().admin(), AdminState::Draining, "and in the admin API");
    let (_, v) = admin("GET", &format!("{}/admin/v1/replicas/b", gw.admin), Some("ui-token"), None).await;
    assert_eq!(v["admin_state"], "draining");
    page.screenshot("drained").await;

    // Find the conversation's pin by searching its key (its own pin, not a
    // boundary it passed: those say `passed`).
    let pins = gw.gw.pins.page(Some(&convo.replica), "", 0, 100).1;
    let own = pins.iter().find(|(_, p)| p.origin.source == prefixgate::pins::PinSource::Prefix);
    let key = own.expect("the conversation's own pin").0;
    let key = format!("{key:032x}");
    page.eval(&format!(
        "const s = document.querySelector('#pin-search'); s.value = '{}'; s.dispatchEvent(new Event('input')); true",
        &key[..10]
    ))
    .await;
    page.wait_for("the pin row", &format!("!!document.querySelector('#pin-table tr[data-key=\"{key}\"]') && document.querySelectorAll('#pin-table tbody tr').length === 1")).await;
    // The row says which API and which kind of key pinned the conversation.
    page.wait_for(
        "the pin's API and key kind",
        &format!("(() => {{ const t = document.querySelector('#pin-table tr[data-key=\"{key}\"]').textContent; return t.includes('chat') && t.includes('prefix'); }})()"),
    )
    .await;
    page.screenshot("pins").await;

    // Resume b, stop a: the next request fails over, and history shows it.
    page.eval("document.querySelector('tr[data-replica=\"b\"] button[data-action=\"resume\"]').click(); true").await;
    page.wait_for(
        "b active again",
        "document.querySelector('tr[data-replica=\"b\"] .badge.state').textContent === 'active'",
    )
    .await;
    a.stop(true).await;
    for i in 0..2 {
        assert_eq!(chat(&gw, &[("user", &format!("after the stop {i}"))]).await.status, 200);
    }
    page.wait_for("a failover in history", "!!document.querySelector('#events li.failover')").await;
    page.screenshot("history").await;

    // Narrow width: nothing overflows the page sideways.
    page.call(
        "Emulation.setDeviceMetricsOverride",
        json!({"width": 390, "height": 900, "deviceScaleFactor": 1, "mobile": true}),
    )
    .await;
    page.wait_for("a narrow layout", "document.documentElement.scrollWidth <= window.innerWidth + 1").await;
    page.screenshot("narrow").await;

    // Keyboard: the first focusable control is reachable with Tab.
    page.call(
        "Input.dispatchKeyEvent",
        json!({"type": "keyDown", "key": "Tab", "code": "Tab", "windowsVirtualKeyCode": 9}),
    )
    .await;
    assert_ne!(page.eval("document.activeElement.tagName").await, "BODY");

    page.eval("1").await; // flush pending events
    assert!(page.problems.is_empty(), "console errors: {:?}", page.problems);
    drop(browser);
    gw.stop().await;
}
