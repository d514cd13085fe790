//! The routing path in isolation: shape extraction (parse + hash chain) of
//! chat bodies of 4 KB, 100 KB and 400 KB, the pin lookup and decision
//! against a million-pin table, and the pin write each request makes.
//! Run: `cargo bench --bench routing`. Numbers go in docs/benchmarks.md.

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use prefixgate::pins::{Pin, PinTable};
use prefixgate::policy::{self, Candidate, Endpoint, IdentityBlocks, Mode};

/// An agent-loop body of about `bytes`: a system prompt and alternating turns
/// with realistic escapes (newlines, quotes).
fn chat_body(bytes: usize) -> Vec<u8> {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a coding agent.\nFollow the \"rules\"."})];
    let mut i = 0;
    while serde_json::to_vec(&messages).unwrap().len() < bytes {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let content = turn_text(i);
        messages.push(serde_json::json!({"role": role, "content": content}));
        i += 1;
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages, "stream": true, "max_tokens": 256}))
        .unwrap()
}

/// One turn's text: code with escapes (newlines, quotes) and prose.
fn turn_text(i: usize) -> String {
    format!(
        "Turn {i}: here is a file\n```rust\nfn main() {{ println!(\"{i}\"); }}\n```\n{}",
        "lorem ipsum dolor sit amet ".repeat(60)
    )
}

/// The same conversation as a Responses API body (Codex-style: messages,
/// function calls and their outputs as input items, instructions, tools).
fn responses_body(bytes: usize) -> Vec<u8> {
    let mut input = Vec::new();
    let mut i = 0;
    while serde_json::to_vec(&input).unwrap().len() < bytes {
        let text = turn_text(i);
        input.push(match i % 3 {
            0 => serde_json::json!({"role": "user", "content": text}),
            1 => serde_json::json!({"type": "message", "id": format!("msg_{i}"), "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}),
            _ => serde_json::json!({"type": "function_call_output", "call_id": format!("call_{i}"), "output": text}),
        });
        i += 1;
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "instructions": "You are a coding agent.", "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}], "input": input, "stream": true})).unwrap()
}

/// The same conversation as an Anthropic Messages body (Claude-Code-style:
/// content blocks, tool use and results, cache_control on the newest).
fn messages_body(bytes: usize) -> Vec<u8> {
    let mut messages = Vec::new();
    let mut i = 0;
    while serde_json::to_vec(&messages).unwrap().len() < bytes {
        let text = turn_text(i);
        messages.push(if i % 2 == 0 {
            serde_json::json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("t{i}"), "content": text}]})
        } else {
            serde_json::json!({"role": "assistant", "content": [{"type": "text", "text": text}, {"type": "tool_use", "id": format!("t{i}"), "name": "bash", "input": {"cmd": "ls"}}]})
        });
        i += 1;
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}], "messages": messages, "max_tokens": 256, "stream": true})).unwrap()
}

fn dialects(c: &mut Criterion) {
    let mut group = c.benchmark_group("shape_extraction_400KB");
    for (name, endpoint, body) in [
        ("chat", Endpoint::Chat, chat_body(400 * 1024)),
        ("responses", Endpoint::Responses, responses_body(400 * 1024)),
        ("messages", Endpoint::Messages, messages_body(400 * 1024)),
    ] {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| policy::identity::extract(endpoint, black_box(body), IdentityBlocks::default()).unwrap())
        });
    }
    group.finish();
}

fn extraction(c: &mut Criterion) {
    let mut group = c.benchmark_group("shape_extraction");
    for kib in [4usize, 100, 400] {
        let body = chat_body(kib * 1024);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(format!("{kib}KB")), &body, |b, body| {
            b.iter(|| policy::identity::extract(Endpoint::Chat, black_box(body), IdentityBlocks::default()).unwrap())
        });
    }
    // The hop benchmark's body (bench/hop.sh): one short user message.
    let tiny = br#"{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"overhead probe"}]}"#;
    group.throughput(Throughput::Bytes(tiny.len() as u64));
    group.bench_function("hop_body_90B", |b| {
        b.iter(|| policy::identity::extract(Endpoint::Chat, black_box(tiny), IdentityBlocks::default()).unwrap())
    });
    group.finish();
}

fn decision(c: &mut Criterion) {
    let body = chat_body(400 * 1024);
    let shape = policy::identity::extract(Endpoint::Chat, &body, IdentityBlocks::default()).unwrap();
    // The real pin table with a million conversations, this one among them.
    let pins = PinTable::default();
    let (r0, r1): (Arc<str>, Arc<str>) = (Arc::from("r0"), Arc::from("r1"));
    pins.restore((0..1_000_000u128).map(|k| {
        let pin = Pin {
            replica: r1.clone(),
            created_ms: 0,
            last_used_ms: 0,
            turns: 1,
            est_tokens: 1,
            family: k,
            origin: Default::default(),
            went_on: 0,
        };
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15), pin)
    }));
    pins.record(shape.boundaries[shape.boundaries.len() - 3].key, &r0, None, 1, 1, Default::default());
    let ids = ["r0", "r1", "r2", "r3"];
    let candidates: Vec<Candidate> = ids.iter().map(|id| Candidate::idle(id)).collect();
    let route = |s: &policy::RequestShape| {
        let found = pins.lookup_longest(&s.boundaries, &s.leads, s.boundaries.len() - 1).continued;
        let pinned = found.as_ref().map(|(b, p)| (*b, &*p.replica));
        policy::decide(Mode::Shape, policy::Spread::Load, s, &candidates, pinned, None).unwrap()
    };
    c.bench_function("decide_pinned_400KB", |b| b.iter(|| route(black_box(&shape))));
    c.bench_function("extract_and_decide_400KB", |b| {
        b.iter(|| {
            let s = policy::identity::extract(Endpoint::Chat, black_box(&body), IdentityBlocks::default()).unwrap();
            route(&s)
        })
    });
    // The write every served request makes: a new turn's pin (parent kept alive).
    // Keys cycle through a million new conversations, so the table stays bounded.
    let mut n = 0u128;
    c.bench_function("pin_record_1M_table", |b| {
        b.iter(|| {
            n = (n + 1) % 1_000_000;
            let key = (1u128 << 100) + n;
            pins.record(black_box(key), &r0, Some(key - 1), 1_000, 2, Default::default())
        })
    });
}

criterion_group!(benches, extraction, dialects, decision);
criterion_main!(benches);
