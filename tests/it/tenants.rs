//! Tenants apart (`identity.scope`, `identity.cache_salt`;
//! `src/policy/tenancy.rs`): the same conversation under two API keys, on
//! two simulated replicas.

use crate::common::*;
use prefixgate::policy::tenancy::{cache_salt_for, CacheSalt, IdentityScope};
use serde_json::json;

const KEY_A: &str = "sk-tenant-a";
const KEY_B: &str = "sk-tenant-b";

async fn gateway(scope: IdentityScope, cache_salt: CacheSalt) -> (Sim, Sim, Gw) {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let mut config = test_config(&[&a, &b]);
    config.api_keys = vec![KEY_A.into(), KEY_B.into()];
    config.identity.scope = scope;
    config.identity.cache_salt = cache_salt;
    (a, b, start_gateway(config).await)
}

async fn chat_as(gw: &Gw, key: &str, messages: &[(&str, &str)]) -> Reply {
    let bearer = format!("Bearer {key}");
    let url = format!("{}/v1/chat/completions", gw.base);
    let r = post_with(&url, &chat_body(messages, json!({})), &[("authorization", &bearer)]).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

/// One conversation's two turns: the first, then its continuation as `key` sends it.
const FIRST: &[(&str, &str)] = &[("system", "a shared system prompt"), ("user", "the same question")];
const SECOND: &[(&str, &str)] = &[
    ("system", "a shared system prompt"),
    ("user", "the same question"),
    ("assistant", "an answer"),
    ("user", "go on"),
];

#[actix_web::test]
async fn with_client_scope_a_conversation_is_pinned_for_its_own_key_only() {
    let (_a, _b, gw) = gateway(IdentityScope::Client, CacheSalt::None).await;
    let first = chat_as(&gw, KEY_A, FIRST).await;
    assert_eq!(first.route, "spread");
    let other = chat_as(&gw, KEY_B, SECOND).await;
    assert_ne!(other.route, "pinned", "another key's continuation does not follow the first key's pin");
    let own = chat_as(&gw, KEY_A, SECOND).await;
    assert_eq!((own.route.as_str(), own.replica.as_str()), ("pinned", first.replica.as_str()));
    gw.stop().await;
}

#[actix_web::test]
async fn shared_by_default_a_conversation_is_pinned_whoever_continues_it() {
    let (a, b, gw) = gateway(IdentityScope::Shared, CacheSalt::None).await;
    let first = chat_as(&gw, KEY_A, FIRST).await;
    let other = chat_as(&gw, KEY_B, SECOND).await;
    assert_eq!((other.route.as_str(), other.replica.as_str()), ("pinned", first.replica.as_str()));
    // No salt is added: the engines see the bodies as sent.
    for sim in [&a, &b] {
        assert!(sim.state.cache_salts.lock().unwrap().is_empty());
    }
    gw.stop().await;
}

#[actix_web::test]
async fn with_client_salts_the_engine_receives_a_salt_derived_from_the_key_and_a_clients_own_stands() {
    let (a, b, gw) = gateway(IdentityScope::Shared, CacheSalt::Client).await;
    let salts = || -> Vec<String> {
        [&a, &b].iter().flat_map(|s| s.state.cache_salts.lock().unwrap().iter().cloned().collect::<Vec<_>>()).collect()
    };
    let first = chat_as(&gw, KEY_A, FIRST).await;
    let salt_a = cache_salt_for(&prefixgate::client_ids::key_id(KEY_A));
    assert_eq!(salts(), vec![salt_a.clone()]);
    // The salt is in the identity: the other key's continuation is its own conversation.
    let other = chat_as(&gw, KEY_B, SECOND).await;
    assert_ne!(other.route, "pinned");
    assert!(salts().contains(&cache_salt_for(&prefixgate::client_ids::key_id(KEY_B))));
    let own = chat_as(&gw, KEY_A, SECOND).await;
    assert_eq!((own.route.as_str(), own.replica.as_str()), ("pinned", first.replica.as_str()));
    // A body that carries its own salt is forwarded with it.
    let url = format!("{}/v1/completions", gw.base);
    let body = json!({"model": "sim-model", "prompt": "mine", "max_tokens": 2, "cache_salt": "the-clients-own"});
    let bearer = format!("Bearer {KEY_A}");
    assert_eq!(post_with(&url, &body, &[("authorization", &bearer)]).await.status, 200);
    assert_eq!(salts().iter().filter(|s| *s == "the-clients-own").count(), 1);
    assert_eq!(salts().len(), 4, "every generation request carried a salt");
    gw.stop().await;
}

#[actix_web::test]
async fn with_client_scope_another_key_cannot_reach_a_stored_responses_pin() {
    let (_a, _b, gw) = gateway(IdentityScope::Client, CacheSalt::None).await;
    let url = format!("{}/v1/responses", gw.base);
    let (bearer_a, bearer_b) = (format!("Bearer {KEY_A}"), format!("Bearer {KEY_B}"));
    let first = post_with(
        &url,
        &json!({"model": "sim-model", "input": "stored", "max_output_tokens": 4}),
        &[("authorization", &bearer_a)],
    )
    .await;
    assert_eq!(first.status, 200);
    let id = first.body["id"].as_str().unwrap().to_string();
    let follow = json!({"model": "sim-model", "input": "again", "previous_response_id": id, "max_output_tokens": 4});
    let located = || async {
        let metrics = client().get(format!("{}/metrics", gw.admin)).send().await.unwrap().body().await.unwrap();
        let text = String::from_utf8(metrics.to_vec()).unwrap();
        let line =
            text.lines().find(|l| l.starts_with(r#"prefixgate_stored_response_lookups_total{result="replica"}"#));
        line.unwrap().rsplit(' ').next().unwrap().parse::<u64>().unwrap()
    };
    // Its own key follows the pin: nothing is looked for.
    let own = post_with(&url, &follow, &[("authorization", &bearer_a)]).await;
    assert_eq!((own.route.as_str(), own.replica.as_str()), ("response", first.replica.as_str()));
    assert_eq!(located().await, 0);
    // Another key finds no pin: the id is looked for among the replicas,
    // as any id this gateway never pinned (the engine answers for itself).
    let other = post_with(&url, &follow, &[("authorization", &bearer_b)]).await;
    assert_eq!(other.status, 200);
    assert_eq!(located().await, 1, "the other key's request did not reach the first key's pin");
    gw.stop().await;
}

#[actix_web::test]
async fn the_capacity_view_says_whether_tenants_share() {
    for (scope, salt, said) in [
        (IdentityScope::Shared, CacheSalt::None, json!({"scope": "shared", "cache_salt": "none"})),
        (IdentityScope::Client, CacheSalt::Client, json!({"scope": "client", "cache_salt": "client"})),
    ] {
        let (_a, _b, gw) = gateway(scope, salt).await;
        let (status, v) = admin("GET", &format!("{}/admin/v1/capacity", gw.admin), None, None).await;
        assert_eq!(status, 200);
        assert_eq!(v["tenancy"], said);
        gw.stop().await;
    }
}
