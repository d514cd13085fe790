//! The served OpenAPI document is an exact contract: schemathesis (every
//! operation, all checks) runs against the live admin API and must find
//! nothing. `.ci/run` installs schemathesis into a virtual environment;
//! outside CI, a machine without it skips this test with a message.

use crate::common::*;

#[actix_web::test]
async fn schemathesis_finds_no_contract_violation_in_the_admin_api() {
    let st = runnable("SCHEMATHESIS_BIN", "schemathesis", &["--version"]);
    let Some(st) = st else {
        require("schemathesis", false, "pip install schemathesis");
        return;
    };
    let a = start_sim("a", fast_sim()).await;
    let mut config = test_config(&[&a]);
    config.admin_token = Some("contract-token".into());
    // Thousands of requests in seconds, many without the token on purpose
    // (the ignored_auth check): the limits are raised for this test only.
    config.rate_limits.admin_rps = 0;
    config.rate_limits.admin_auth_failures_per_minute = 0;
    // A discovered replica and its source are in the answers too.
    let found = start_sim("found", fast_sim()).await;
    let dir = tempfile::tempdir().unwrap();
    let listing = dir.path().join("engines.toml");
    std::fs::write(&listing, format!("[[replicas]]\nid = \"found\"\nurl = \"{}\"\n", found.url)).unwrap();
    config.discovery = vec![prefixgate::config::SourceConfig::new(&format!("file://{}", listing.display()))];
    let gw = start_gateway(config).await;
    wait_until("found", std::time::Duration::from_secs(10), || gw.gw.fleet.get("found").is_some()).await;
    // schemathesis keeps a cache in its working directory: not in the repository.
    let scratch = tempfile::tempdir().unwrap();
    // One worker: with two threads CPython 3.11 (Debian's) now and then
    // fails building an AST inside schemathesis ("AST constructor recursion
    // depth mismatch", python/cpython#106905), a failure of the tool, not
    // of the API.
    let out = tokio::process::Command::new(st)
        .current_dir(scratch.path())
        .args(["run", &format!("{}/openapi.json", gw.admin)])
        .args(["--header", "Authorization: Bearer contract-token"])
        .args(["--checks", "all", "--max-examples", "50", "--workers", "1", "--seed", "1"])
        .env("NO_COLOR", "1")
        .env("SCHEMATHESIS_HOOKS", "")
        .output()
        .await
        .expect("schemathesis runs");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found contract violations:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(report.contains("passed") && !report.contains("failed"), "{report}");
    gw.stop().await;
}
