//! Issue 27 (in part): OpenTelemetry spans for the request path, exported
//! over OTLP/HTTP protobuf to a test collector that decodes them with the
//! published definitions (`opentelemetry-proto`).

use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode, Span};
use prost::Message;

use crate::common::*;

/// A collector on a loopback port: every span it received.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
}

fn collector() -> Collector {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let kept = spans.clone();
    let server = HttpServer::new(move || {
        let kept = kept.clone();
        App::new().route(
            "/v1/traces",
            web::post().to(move |body: web::Bytes| {
                let kept = kept.clone();
                async move {
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut kept = kept.lock().unwrap();
                    for r in request.resource_spans {
                        for s in r.scope_spans {
                            kept.extend(s.spans);
                        }
                    }
                    HttpResponse::Ok().content_type("application/x-protobuf").body(Vec::<u8>::new())
                }
            }),
        )
    })
    .workers(1)
    .listen(listener)
    .unwrap()
    .run();
    actix_web::rt::spawn(server);
    Collector { url, spans }
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a AnyValue> {
    span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn text_attr(span: &Span, key: &str) -> Option<String> {
    match attr(span, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        other => Some(format!("{other:?}")),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn traced(sims: &[&Sim], endpoint: &str) -> prefixgate::config::Config {
    let mut c = test_config(sims);
    c.tracing.endpoint = Some(endpoint.to_string());
    c.tracing.export_interval_ms = Some(50);
    c
}

async fn spans_of(c: &Collector, trace_id: &str, n: usize) -> Vec<Span> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let spans: Vec<Span> =
            c.spans.lock().unwrap().iter().filter(|s| hex(&s.trace_id) == trace_id).cloned().collect();
        if spans.len() >= n {
            return spans;
        }
        assert!(tokio::time::Instant::now() < deadline, "{} of {n} spans of trace {trace_id} arrived", spans.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

#[actix_web::test]
async fn a_request_is_a_server_span_under_the_clients_parent_with_an_attempt_the_engine_continues() {
    let c = collector();
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(traced(&[&a], &c.url)).await;
    let traceparent = format!("00-{TRACE}-{PARENT}-01");
    let r = post_with(
        &format!("{}/v1/chat/completions", gw.base),
        &chat_body(&[("user", "traced")], serde_json::json!({})),
        &[("traceparent", &traceparent), ("x-smg-priority", "bulk"), ("authorization", "Bearer sk-trace")],
    )
    .await;
    assert_eq!(r.status, 200);
    gw.gw.telemetry.flush();
    let spans = spans_of(&c, TRACE, 2).await;
    let server = spans.iter().find(|s| s.kind == SpanKind::Server as i32).expect("a server span");
    assert_eq!(hex(&server.parent_span_id), PARENT, "the client's span is its parent");
    assert_eq!(text_attr(server, "prefixgate.route").as_deref(), Some("spread"));
    assert_eq!(text_attr(server, "prefixgate.replica").as_deref(), Some("a"));
    assert_eq!(text_attr(server, "prefixgate.dialect").as_deref(), Some("chat"));
    // Its class (SGLang's bulk is background) and client: the key's hash, never the key.
    assert_eq!(text_attr(server, "prefixgate.priority").as_deref(), Some("background"));
    assert_eq!(text_attr(server, "prefixgate.client"), Some(prefixgate::client_ids::key_id("sk-trace")));
    assert!(!format!("{server:?}").contains("sk-trace"), "the key never leaves");
    assert_eq!(text_attr(server, "gen_ai.request.model").as_deref(), Some("sim-model"));
    assert!(attr(server, "gen_ai.usage.input_tokens").is_some(), "{server:?}");
    let attempt = spans.iter().find(|s| s.kind == SpanKind::Client as i32).expect("an attempt span");
    assert_eq!(attempt.parent_span_id, server.span_id);
    // The engine got a traceparent in the same trace, naming the attempt.
    let seen = a.state.traceparents.lock().unwrap().back().cloned().unwrap();
    assert_eq!(seen, format!("00-{TRACE}-{}-01", hex(&attempt.span_id)));
    gw.stop().await;
}

#[actix_web::test]
async fn a_failover_is_two_attempts_in_one_trace_the_first_an_error() {
    let c = collector();
    let (a, b) = (start_sim("a", fast_sim()).await, start_sim("b", fast_sim()).await);
    let mut config = traced(&[&a, &b], &c.url);
    config.health.interval_ms = 3_600_000; // only requests notice the stop
    let gw = start_gateway(config).await;
    a.stop(false).await;
    let mut failed_over = None;
    for i in 0..4 {
        let trace = format!("{:032x}", 0xabc0 + i);
        let r = post_with(
            &format!("{}/v1/chat/completions", gw.base),
            &chat_body(&[("user", &format!("q{i}"))], serde_json::json!({})),
            &[("traceparent", &format!("00-{trace}-{PARENT}-01"))],
        )
        .await;
        assert_eq!(r.status, 200);
        if r.route == "failover" {
            failed_over = Some(trace);
            break;
        }
    }
    let trace = failed_over.expect("one request failed over from the stopped replica");
    gw.gw.telemetry.flush();
    let spans = spans_of(&c, &trace, 3).await;
    let mut attempts: Vec<&Span> = spans.iter().filter(|s| s.kind == SpanKind::Client as i32).collect();
    attempts.sort_by_key(|s| s.start_time_unix_nano);
    assert_eq!(attempts.len(), 2, "{spans:?}");
    let first = attempts[0].status.as_ref().unwrap();
    assert_eq!(first.code, StatusCode::Error as i32);
    assert_eq!(text_attr(attempts[0], "prefixgate.replica").as_deref(), Some("a"));
    assert_eq!(text_attr(attempts[1], "prefixgate.replica").as_deref(), Some("b"));
    let server = spans.iter().find(|s| s.kind == SpanKind::Server as i32).unwrap();
    assert_eq!(text_attr(server, "prefixgate.route").as_deref(), Some("failover"));
    // The history's failover event links to the trace.
    let events = gw.gw.events.query(&prefixgate::events::EventFilter {
        kind: Some(prefixgate::events::EventKind::Failover),
        limit: 10,
        ..Default::default()
    });
    assert_eq!(events[0].trace_id.as_deref(), Some(trace.as_str()), "{events:?}");
    // An admin action is a span too, and its event carries its trace id.
    let (s, _) = admin("POST", &format!("{}/admin/v1/replicas/b/drain", gw.admin), None, None).await;
    assert_eq!(s, 200);
    let drained = gw.gw.events.query(&prefixgate::events::EventFilter {
        kind: Some(prefixgate::events::EventKind::DrainStarted),
        limit: 1,
        ..Default::default()
    });
    let admin_trace = drained[0].trace_id.clone().expect("the drain's trace id");
    gw.gw.telemetry.flush();
    let admin_spans = spans_of(&c, &admin_trace, 1).await;
    assert_eq!(admin_spans[0].name, "prefixgate.admin.drain");
    gw.stop().await;
}

#[actix_web::test]
async fn with_the_collector_down_every_request_is_answered() {
    // A port nothing listens on.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1/traces", dead.local_addr().unwrap());
    drop(dead);
    let a = start_sim("a", fast_sim()).await;
    let gw = start_gateway(traced(&[&a], &url)).await;
    for i in 0..20 {
        let r = chat(&gw, &[("user", &format!("question {i}"))]).await;
        assert_eq!(r.status, 200, "request {i}");
    }
    gw.gw.telemetry.flush();
    assert!(gw.gw.telemetry.dropped() >= 20, "the lost spans are counted: {}", gw.gw.telemetry.dropped());
    gw.stop().await;
}

#[actix_web::test]
async fn with_the_collector_slow_spans_past_the_queue_are_dropped_and_counted() {
    // A collector that takes connections and never answers: each export
    // waits for its timeout while spans keep ending.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1/traces", silent.local_addr().unwrap());
    let a = start_sim("a", fast_sim()).await;
    let mut c = traced(&[&a], &url);
    c.tracing.max_queued_spans = Some(4);
    c.tracing.export_timeout_ms = Some(2_000);
    let gw = start_gateway(c).await;
    // 20 requests at once: 40 spans, while the first export hangs.
    let answers = futures_util::future::join_all((0..20).map(|i| {
        let gw = &gw;
        async move { chat(gw, &[("user", &format!("question {i}"))]).await.status }
    }))
    .await;
    assert_eq!(answers, vec![200; 20], "every request answered");
    // At most 4 queued and 4 in the hanging export: the rest were dropped
    // as they ended (a server span ends just after its body), and counted
    // then, within the first export's timeout.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(1_500);
    while gw.gw.telemetry.dropped() < 20 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dropped = gw.gw.telemetry.dropped();
    assert!(dropped >= 20, "spans past the queue are counted as dropped: {dropped}");
    gw.stop().await;
    drop(silent);
}
