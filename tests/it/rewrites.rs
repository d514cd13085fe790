//! Real agent traffic (issue 49): a turn whose tail the agent rewrote still
//! continues its conversation, in every dialect, and a first turn that
//! shares only a system prompt is a session of its own.

use crate::common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// How an agent rewrites the tail of its context each turn.
#[derive(Debug, Clone, Copy)]
enum Rewrite {
    /// A status line ("step N of 100") after everything, replaced each turn.
    Status,
    /// A reminder appended to the latest user message, stripped from older ones.
    Reminder,
    /// The tool result of two turns back cleared to a placeholder.
    Cleared,
    /// The last user message edited and sent again before the loop goes on.
    Edited,
}

const FORMS: [Rewrite; 4] = [Rewrite::Status, Rewrite::Reminder, Rewrite::Cleared, Rewrite::Edited];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Dialect {
    Chat,
    Completions,
    Responses,
    Messages,
}

const SYSTEM: &str = "You are a coding agent. Use the tools.";

/// The logical context of turn `turn` (0-based): (role, text) pairs after
/// the system prompt, with the form's rewrite applied as the agent sends it.
fn context(task: &str, form: Rewrite, turn: usize, edited: bool) -> Vec<(&'static str, String)> {
    let mut m = vec![("user", format!("Task {task}: fix the failing test. {}", text("task", 300)))];
    for t in 0..turn {
        m.push(("assistant", format!("I will run tool call {t}.")));
        let result = match form {
            Rewrite::Cleared if t + 2 <= turn => "[old tool result cleared]".to_string(),
            _ => format!("tool result {t}: {}", text(&format!("result {t}"), 200)),
        };
        m.push(("user", result));
    }
    match form {
        Rewrite::Status => m.push(("user", format!("Tool-call turn {turn} of 100. Keep going."))),
        Rewrite::Reminder => {
            m.last_mut().unwrap().1.push_str("\n<system-reminder>todo list is empty</system-reminder>")
        }
        Rewrite::Edited if edited => m.last_mut().unwrap().1.push_str(" (edited: use the other approach)"),
        Rewrite::Cleared | Rewrite::Edited => {}
    }
    m
}

fn request(dialect: Dialect, messages: &[(&str, String)]) -> (&'static str, Value) {
    let items = |assistant: &str| -> Vec<Value> {
        messages
            .iter()
            .map(|(r, c)| json!({"role": if *r == "assistant" { assistant } else { r }, "content": c}))
            .collect()
    };
    match dialect {
        Dialect::Chat => {
            let mut msgs = vec![json!({"role": "system", "content": SYSTEM})];
            msgs.extend(items("assistant"));
            ("/v1/chat/completions", json!({"model": "sim-model", "messages": msgs, "max_tokens": 4}))
        }
        Dialect::Completions => {
            let mut prompt = format!("system: {SYSTEM}\n");
            for (r, c) in messages {
                prompt.push_str(&format!("{r}: {c}\n"));
            }
            ("/v1/completions", json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4}))
        }
        Dialect::Responses => (
            "/v1/responses",
            json!({"model": "sim-model", "instructions": SYSTEM, "input": items("assistant"), "max_output_tokens": 4, "store": false}),
        ),
        Dialect::Messages => (
            "/v1/messages",
            json!({"model": "sim-model", "system": SYSTEM, "messages": items("assistant"), "max_tokens": 4}),
        ),
    }
}

#[actix_web::test]
async fn every_rewritten_tail_form_continues_its_conversation_on_its_replica_in_every_dialect() {
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    for dialect in [Dialect::Chat, Dialect::Completions, Dialect::Responses, Dialect::Messages] {
        for form in FORMS {
            let mut home = String::new();
            for turn in 0..6 {
                // The edited form sends each turn after the first twice: as
                // first written, then edited (an edited first turn shares
                // only the system prompt: a conversation of its own).
                let edits = matches!(form, Rewrite::Edited) && turn > 0;
                let sends: &[bool] = if edits { &[false, true] } else { &[false] };
                for &edited in sends {
                    let task = format!("{dialect:?} {form:?}");
                    let (path, body) = request(dialect, &context(&task, form, turn, edited));
                    let r = post(&format!("{}{path}", gw.base), &body).await;
                    assert_eq!(r.status, 200, "{dialect:?} {form:?} turn {turn}: {}", r.body);
                    // A reminder's second turn sends its first user message
                    // bare: the message's lead (how it begins) finds the
                    // turn before, which ended at it with the reminder.
                    if turn == 0 && !edited {
                        home = r.replica.clone();
                        continue;
                    }
                    assert_eq!(
                        (r.route.as_str(), r.replica.as_str()),
                        ("pinned", home.as_str()),
                        "{dialect:?} {form:?} turn {turn} (edited: {edited})"
                    );
                }
            }
        }
    }
    gw.stop().await;
}

#[actix_web::test]
async fn a_first_turn_sharing_only_the_system_prompt_is_a_new_session_placed_by_load() {
    // Decoding at 50 tokens a second: a long stream keeps its replica busy.
    let (a, b) = (start_sim("a", slow_decoder(50.0)).await, start_sim("b", slow_decoder(50.0)).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    // A request's work leaves its replica when its body ends, a moment
    // after the client read the last byte.
    let idle = || async {
        wait_until("no work outstanding", std::time::Duration::from_secs(5), || {
            gw.gw.fleet.snapshot().iter().all(|r| r.work.outstanding() == 0)
        })
        .await
    };
    let system = text("shared system prompt and tools", 3_000);
    let first_turn = |task: &str, extra| chat_body(&[("system", &system), ("user", task)], extra);
    let url = format!("{}/v1/chat/completions", gw.base);
    let one = post(&url, &first_turn("task one: fix the parser", json!({}))).await;
    assert_eq!((one.status, one.route.as_str()), (200, "spread"));
    idle().await;
    // Not a continuation of task one: a session of its own, placed like
    // one; with equal (no) load, where the shared prompt is held.
    let two = post(&url, &first_turn("task two: write the docs", json!({}))).await;
    assert_eq!((two.status, two.route.as_str(), two.replica.as_str()), (200, "spread", one.replica.as_str()));
    // Task one's next turn still continues task one.
    let next = chat_body(
        &[("system", &system), ("user", "task one: fix the parser"), ("assistant", "done"), ("user", "now test it")],
        json!({}),
    );
    let r = post(&url, &next).await;
    assert_eq!((r.route.as_str(), r.replica.as_str()), ("pinned", one.replica.as_str()));
    idle().await;
    // While a long stream decodes there, the holder has more work than the
    // other replica: a new session goes to the other.
    let busy = first_turn("task three: a long answer", json!({"stream": true, "max_tokens": 400}));
    let mut stream = client().post(&url).send_json(&busy).await.unwrap();
    let on = stream.headers().get("x-prefixgate-replica").unwrap().to_str().unwrap().to_string();
    assert_eq!(on, one.replica, "the third also goes where the prompt is held");
    stream.next().await.expect("a first chunk").unwrap();
    let four = post(&url, &first_turn("task four: refactor", json!({}))).await;
    assert_eq!(four.route, "spread");
    assert_ne!(four.replica, one.replica, "the holder is busier: the new session goes where less work is");
    gw.stop().await;
}

#[actix_web::test]
async fn a_new_session_prefers_any_replica_holding_the_shared_prompt_not_only_the_latest() {
    let sims = [start_sim("a", slow_decoder(50.0)).await, start_sim("b", slow_decoder(50.0)).await];
    let c = start_sim("c", slow_decoder(50.0)).await;
    let gw = start_gateway(test_config(&[&sims[0], &sims[1], &c])).await;
    let work_of = |id: &str| gw.gw.fleet.snapshot().iter().find(|r| &*r.id == id).map(|r| r.work.outstanding());
    let idle = |id: String| {
        let work_of = &work_of;
        async move {
            wait_until("its work done", std::time::Duration::from_secs(10), || work_of(&id) == Some(0)).await;
        }
    };
    let system = text("shared system prompt and tools", 3_000);
    let first_turn = |task: &str, extra| chat_body(&[("system", &system), ("user", task)], extra);
    let url = format!("{}/v1/chat/completions", gw.base);
    let streaming = |task: &str, tokens: u32| {
        let body = first_turn(task, json!({"stream": true, "max_tokens": tokens}));
        let url = url.clone();
        async move {
            let mut stream = client().post(&url).send_json(&body).await.unwrap();
            let on = stream.headers().get("x-prefixgate-replica").unwrap().to_str().unwrap().to_string();
            stream.next().await.expect("a first chunk").unwrap();
            (on, stream)
        }
    };
    // Two conversations pass the prompt on x: shared, held by x.
    let x = post(&url, &first_turn("task one", json!({}))).await.replica;
    idle(x.clone()).await;
    assert_eq!(post(&url, &first_turn("task two", json!({}))).await.replica, x);
    idle(x.clone()).await;
    // While x streams, a third goes elsewhere (y): y holds it too, and is
    // the latest to have served it.
    let (on, mut on_x) = streaming("task three", 300).await;
    assert_eq!(on, x);
    let y = post(&url, &first_turn("task four", json!({}))).await.replica;
    assert_ne!(y, x);
    idle(y.clone()).await;
    // y streams now, and x finishes: x and the third replica are idle, y busy.
    let (on, _on_y) = streaming("task five", 400).await;
    assert_eq!(on, y, "among the idle, the holders go first");
    while on_x.next().await.is_some() {}
    idle(x.clone()).await;
    // New sessions go to x, which holds the prompt, not to the idle third
    // replica (the counter alone would alternate between them).
    for task in ["task six", "task seven"] {
        let r = post(&url, &first_turn(task, json!({}))).await;
        assert_eq!((r.route.as_str(), r.replica.as_str()), ("spread", x.as_str()), "{task}");
        idle(x.clone()).await;
    }
    gw.stop().await;
}

#[actix_web::test]
async fn a_pinned_turn_moves_when_its_replicas_queue_outweighs_a_whole_prefill_elsewhere_and_stays_when_it_does_not() {
    // Prefill at 1,000 tokens a second, time scaled by 0.1: 20,000 tokens take 2 s.
    let card = || prefixgate::sim::SimConfig { prefill_tps: 1_000.0, time_scale: 0.1, ..fast_sim() };
    let (a, b) = (start_sim("a", card()).await, start_sim("b", card()).await);
    let gw = start_gateway(test_config(&[&a, &b])).await;
    let url = format!("{}/v1/chat/completions", gw.base);
    let replicas = format!("{}/admin/v1/replicas", gw.admin);
    // Both conversations start on a (b disabled meanwhile).
    assert_eq!(admin("POST", &format!("{replicas}/b/disable"), None, None).await.0, 200);
    let short = text("short conversation", 2_000);
    let long = text("long conversation", 30_000);
    let turn = |context: &str, n: usize| {
        let mut m = vec![("user", context.to_string())];
        for i in 1..n {
            m.push(("assistant", format!("answer {i}")));
            m.push(("user", format!("go on {i}")));
        }
        m
    };
    let send = |m: Vec<(&'static str, String)>| {
        let url = url.clone();
        async move {
            let refs: Vec<(&str, &str)> = m.iter().map(|(r, c)| (*r, c.as_str())).collect();
            post(&url, &chat_body(&refs, json!({}))).await
        }
    };
    assert_eq!(send(turn(&short, 1)).await.replica, "a");
    assert_eq!(send(turn(&long, 1)).await.replica, "a");
    // A 20,000-token one-shot keeps a prefilling for 2 s.
    let big = chat_body(&[("user", &text("a big cold prompt", 20_000))], json!({}));
    let busy = actix_web::rt::spawn({
        let url = url.clone();
        async move { post(&url, &big).await }
    });
    wait_until("a prefilling", std::time::Duration::from_secs(5), || {
        gw.gw.fleet.get("a").unwrap().work.prefill_tokens() > 15_000
    })
    .await;
    assert_eq!(admin("POST", &format!("{replicas}/b/enable"), None, None).await.0, 200);
    // The short conversation's turn: ~2,000 tokens cached on a, behind
    // ~20,000 queued there; prefilling its whole context on b is quicker.
    let moved = send(turn(&short, 2)).await;
    assert_eq!((moved.status, moved.route.as_str(), moved.replica.as_str()), (200, "moved", "b"));
    // The long one: ~30,000 cached on a outweighs the queue: it waits its turn there.
    assert!(gw.gw.fleet.get("a").unwrap().work.prefill_tokens() > 15_000, "a still prefilling");
    let stayed = send(turn(&long, 2)).await;
    assert_eq!((stayed.route.as_str(), stayed.replica.as_str()), ("pinned", "a"));
    assert_eq!(busy.await.unwrap().status, 200);
    // The next turn of the moved conversation follows its pin to b.
    assert_eq!(send(turn(&short, 3)).await.replica, "b");
    let metrics = scrape(&gw).await;
    assert!(metrics.contains("prefixgate_session_moves_total{reason=\"queue\"} 1"), "{metrics}");
    let (_, events) = admin("GET", &format!("{}/admin/v1/events?kind=pin_moved", gw.admin), None, None).await;
    let detail = events["items"][0]["detail"].as_str().unwrap_or_default().to_string();
    assert!(detail.starts_with("moved:"), "{events}");
    gw.stop().await;
}
