//! A proxied request's spans (`telemetry.rs` exports them):
//!
//! - `prefixgate.proxy` (server): the whole request, its parent taken from
//!   the client's `traceparent`. Attributes: `prefixgate.dialect`,
//!   `prefixgate.route` (pinned, spread, session, response, failover, ...),
//!   `prefixgate.replica`, `prefixgate.predicted_cached_tokens`,
//!   `prefixgate.held_ms`, `gen_ai.request.model`, and at the end of the body
//!   `gen_ai.usage.input_tokens`, `prefixgate.cached_tokens`,
//!   `http.response.status_code` (and `prefixgate.body` when the body did
//!   not complete).
//! - `prefixgate.attempt` (client), one per upstream attempt: the replica,
//!   its outcome; a failed one is an error whose description says why and
//!   `prefixgate.retried` whether another attempt followed. The upstream
//!   request carries a `traceparent` naming it, so an engine started with
//!   tracing continues the same trace.
//! - `prefixgate.hold`, `prefixgate.locate` and `prefixgate.admission`: the
//!   wait for room at the KV wall, the search for a stored response, the
//!   wait for a large-context slot.
//!
//! A span ends when its last handle drops, on every path.

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, StringValue, Value};

use std::sync::Arc;

use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::http::Method;

use crate::policy::Endpoint;
use crate::state::AppState;

/// How many attributes a request's server span has room for from its start
/// (method, path, dialect, model, route, replica, predicted and reported
/// cached tokens, input tokens, status, and one more).
const SERVER_ATTRIBUTES: usize = 11;

/// The request's server span (None: tracing is off, or not sampled).
#[derive(Clone, Default)]
pub struct RequestTrace(Option<Context>);

impl RequestTrace {
    pub fn start(state: &AppState, req: &actix_web::HttpRequest, endpoint: Endpoint) -> RequestTrace {
        let Some(tracer) = state.telemetry.tracer() else { return RequestTrace(None) };
        let parent = state.telemetry.extract(req.headers());
        // Room for the attributes a request sets, so the list is allocated
        // once rather than grown as the request goes on; under 1 KiB, which
        // glibc's malloc serves from its per-thread cache. Static text where
        // the value is known, so few allocations cross to the exporter's
        // thread to be freed there.
        let mut attributes = Vec::with_capacity(SERVER_ATTRIBUTES);
        let method = match *req.method() {
            Method::POST => Value::from("POST"),
            Method::GET => Value::from("GET"),
            ref other => Value::from(other.to_string()),
        };
        let path = endpoint.path().map_or_else(|| Value::from(req.path().to_string()), Value::from);
        attributes.push(KeyValue::new("http.request.method", method));
        attributes.push(KeyValue::new("url.path", path));
        let span = tracer
            .span_builder("prefixgate.proxy")
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        RequestTrace(Some(parent.with_span(span)))
    }

    /// The request's context (its server span), when traced: made current
    /// while the request's future runs, so log lines and history events
    /// written meanwhile carry its trace id.
    pub fn context(&self) -> Option<Context> {
        self.0.clone()
    }

    /// Sets attributes, in one call on the span. They are made only when the
    /// request is traced: with tracing off, the request path allocates
    /// nothing for them.
    pub fn set<I: IntoIterator<Item = KeyValue>>(&self, attributes: impl FnOnce() -> I) {
        if let Some(cx) = &self.0 {
            cx.span().set_attributes(attributes());
        }
    }

    /// The request failed before any response reached the client.
    pub fn failed(&self, status: u16, why: impl FnOnce() -> String) {
        if let Some(cx) = &self.0 {
            cx.span().set_attribute(KeyValue::new("http.response.status_code", i64::from(status)));
            cx.span().set_status(Status::error(why()));
        }
    }

    /// A child span for a wait or a lookup; it ends when dropped.
    pub fn child(&self, state: &AppState, name: &'static str) -> Option<Context> {
        let (cx, tracer) = (self.0.as_ref()?, state.telemetry.tracer()?);
        let span = tracer.span_builder(name).with_kind(SpanKind::Internal).start_with_context(tracer, cx);
        Some(cx.with_span(span))
    }

    /// A client span for one upstream attempt, and the headers that carry
    /// it to the replica.
    pub fn attempt(&self, state: &AppState, replica: &Arc<str>) -> (Option<Context>, Vec<(HeaderName, HeaderValue)>) {
        let (Some(cx), Some(tracer)) = (self.0.as_ref(), state.telemetry.tracer()) else {
            return (None, Vec::new());
        };
        let span = tracer
            .span_builder("prefixgate.attempt")
            .with_kind(SpanKind::Client)
            .with_attributes(attempt_attributes(replica))
            .start_with_context(tracer, cx);
        let attempt = cx.with_span(span);
        let headers = state.telemetry.inject(&attempt);
        (Some(attempt), headers)
    }
}

/// An attempt's replica, with room for how it ended (its status, or the
/// retry mark). The name is shared, not copied.
fn attempt_attributes(replica: &Arc<str>) -> Vec<KeyValue> {
    let mut attributes = Vec::with_capacity(2);
    attributes.push(KeyValue::new("prefixgate.replica", StringValue::from(replica.clone())));
    attributes
}

/// How an attempt ended: its status, or why it failed and whether another
/// attempt followed.
pub fn attempt_ended(attempt: &Option<Context>, status: Result<u16, (&str, bool)>) {
    let Some(cx) = attempt else { return };
    let span = cx.span();
    match status {
        Ok(code) => span.set_attribute(KeyValue::new("http.response.status_code", i64::from(code))),
        Err((why, retried)) => {
            span.set_attribute(KeyValue::new("prefixgate.retried", retried));
            span.set_status(Status::error(why.to_string()));
        }
    }
    span.end();
}
