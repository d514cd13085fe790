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
use opentelemetry::{Context, KeyValue};

use actix_web::http::header::{HeaderName, HeaderValue};

use crate::state::AppState;

/// The request's server span (None: tracing is off, or not sampled).
#[derive(Clone, Default)]
pub struct RequestTrace(Option<Context>);

impl RequestTrace {
    pub fn start(state: &AppState, req: &actix_web::HttpRequest) -> RequestTrace {
        let Some(tracer) = state.telemetry.tracer() else { return RequestTrace(None) };
        let parent = state.telemetry.extract(req.headers());
        // Room for every attribute the request will set, so the span's list
        // is allocated once rather than grown as the request goes on.
        let mut attributes = Vec::with_capacity(16);
        attributes.push(KeyValue::new("http.request.method", req.method().to_string()));
        attributes.push(KeyValue::new("url.path", req.path().to_string()));
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
    pub fn attempt(&self, state: &AppState, replica: &str) -> (Option<Context>, Vec<(HeaderName, HeaderValue)>) {
        let (Some(cx), Some(tracer)) = (self.0.as_ref(), state.telemetry.tracer()) else {
            return (None, Vec::new());
        };
        let span = tracer
            .span_builder("prefixgate.attempt")
            .with_kind(SpanKind::Client)
            .with_attributes([KeyValue::new("prefixgate.replica", replica.to_string())])
            .start_with_context(tracer, cx);
        let attempt = cx.with_span(span);
        let headers = state.telemetry.inject(&attempt);
        (Some(attempt), headers)
    }
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
