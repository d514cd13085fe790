//! Issue 10 with the real clients: the official `openai` and `anthropic`
//! Python SDKs drive the gateway (tests/sdk/agents.py) as Codex-style and
//! Claude-Code-style agents do. `.ci/run` installs both into a virtual
//! environment and points `SDK_PYTHON` at its interpreter; outside CI, a
//! machine without them skips with a message.

use crate::common::*;

#[actix_web::test]
async fn the_official_openai_and_anthropic_sdks_see_warm_pinned_turns_and_spread_one_shots() {
    let Some(python) = sdk_python() else { return };
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    sdk_checks(python, "agents.py", &gw).await;
    // The receipts the SDKs saw reached the gateway's metrics as well.
    let mut resp = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap();
    let metrics = String::from_utf8(resp.body().limit(1 << 22).await.unwrap().to_vec()).unwrap();
    assert!(metrics
        .lines()
        .any(|l| l.starts_with("prefixgate_cached_tokens_total{") && l.contains("route=\"response\"")));
    gw.stop().await;
}

/// The Python SDKs, when they are installed (else the test is skipped, or
/// fails under CI, saying what to install).
fn sdk_python() -> Option<String> {
    let python = runnable("SDK_PYTHON", "python3", &["-c", "import openai, anthropic"]);
    if python.is_none() {
        require("the openai and anthropic SDKs", false, "pip install openai anthropic; set SDK_PYTHON");
    }
    python
}

/// Runs `tests/sdk/{script}` against the gateway (`SALT`: this run's, for
/// scripts that salt their prompts); it must pass every check.
async fn sdk_checks(python: String, script: &str, gw: &Gw) {
    let script = format!("{}/tests/sdk/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = tokio::process::Command::new(python)
        .arg(script)
        .env("BASE_URL", &gw.base)
        .env("SALT", format!("{}", std::process::id()))
        .output()
        .await
        .expect("python runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "SDK checks failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all SDK checks passed"), "{stdout}");
}

async fn continued_events(gw: &Gw) -> usize {
    let (_, events) = admin("GET", &format!("{}/admin/v1/events?kind=stream_continued", gw.admin), None, None).await;
    events["items"].as_array().unwrap().len()
}

#[actix_web::test]
async fn the_official_sdks_read_a_stream_finished_on_three_replicas_as_one_answer_in_every_dialect() {
    let Some(python) = sdk_python() else { return };
    // Every replica dies after 150 tokens of any stream: 400 tokens take three legs.
    let dies = || prefixgate::sim::SimConfig { die_after_tokens: Some(150), ..fast_sim() };
    let (a, b, c) = (start_sim("a", dies()).await, start_sim("b", dies()).await, start_sim("c", dies()).await);
    let mut config = test_config(&[&a, &b, &c]);
    config.failover.max_continuations = 2;
    let gw = start_gateway(config).await;
    sdk_checks(python, "continued.py", &gw).await;
    assert_eq!(continued_events(&gw).await, 8, "two legs continued for each of four streams");
}

#[actix_web::test]
async fn the_official_sdks_parse_a_tool_call_made_after_the_seam_as_a_function_call_item_and_a_tool_use_block() {
    let Some(python) = sdk_python() else { return };
    // Each replica dies after 150 tokens of a stream, and its chat endpoint
    // calls the request's tool after 20: the next leg's call.
    let replica =
        || prefixgate::sim::SimConfig { die_after_tokens: Some(150), tool_call_after_tokens: Some(20), ..fast_sim() };
    let (a, b) = (start_sim("a", replica()).await, start_sim("b", replica()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    sdk_checks(python, "tool_after_seam.py", &gw).await;
    assert_eq!(continued_events(&gw).await, 2, "each stream went on once");
}
