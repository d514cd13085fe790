//! OpenTelemetry traces: the exporter, configured the standard way, and the
//! propagation of W3C trace context in and out of the gateway.
//!
//! Off unless an endpoint is set (`tracing.endpoint`, or the SDK's own
//! `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`). Spans are exported over
//! OTLP/HTTP protobuf in batches by the SDK's batch processor, which runs on
//! a thread of its own with a bounded queue: a request only hands a finished
//! span over, never waits on the collector. A collector that is down or slow
//! costs spans, counted (`prefixgate_spans_dropped_total`), not latency.
//!
//! What the spans are (names and attributes) lives with the request path
//! (`proxy/trace.rs`); this module knows only how they leave.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt as _, TraceId, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor, Tracer,
};

use actix_web::http::header::{HeaderName, HeaderValue};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use serde::{Deserialize, Serialize};

/// OpenTelemetry traces. The standard variables work too and are read by the
/// OpenTelemetry SDK itself (`OTEL_EXPORTER_OTLP_ENDPOINT`,
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME`,
/// `OTEL_TRACES_SAMPLER` and `_ARG`, `OTEL_RESOURCE_ATTRIBUTES`); a key set
/// here wins. Off when no endpoint is set either way.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// OTLP/HTTP (protobuf) endpoint for traces, e.g.
    /// `http://collector:4318/v1/traces` (unset: the OTEL_* variables, else off).
    pub endpoint: Option<String>,
    /// The `service.name` of the spans (unset: `OTEL_SERVICE_NAME`, else `prefixgate`).
    pub service_name: Option<String>,
    /// Fraction of traces sampled, 0 to 1, when the request carries no
    /// sampled parent (unset: `OTEL_TRACES_SAMPLER`, else every trace).
    pub sample_ratio: Option<f64>,
    /// How often finished spans are exported in a batch, ms (unset:
    /// `OTEL_BSP_SCHEDULE_DELAY`, else 1000).
    pub export_interval_ms: Option<u64>,
    /// How long one export may take before its spans count as dropped, ms
    /// (unset: `OTEL_EXPORTER_OTLP_TIMEOUT`, else 10000).
    pub export_timeout_ms: Option<u64>,
    /// Finished spans kept while waiting for export; past it, spans are
    /// dropped and counted (unset: `OTEL_BSP_MAX_QUEUE_SIZE`, else 8192).
    pub max_queued_spans: Option<usize>,
    /// Where a trace is shown, with `{trace_id}` in it (e.g. Jaeger's
    /// `http://jaeger:16686/trace/{trace_id}`): the UI links history events to it.
    pub trace_url: Option<String>,
}

/// The tracer, when tracing is on, and what it lost.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    tracer: Option<Tracer>,
    lost: Lost,
    propagator: TraceContextPropagator,
}

/// Counts the spans of batches the collector did not take (down, slow,
/// refusing): they are gone, and an operator should know how many. A batch
/// handed over here has left the queue (`Bounded`).
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    lost: Lost,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        self.lost.queued.fetch_sub(n, Ordering::Relaxed);
        let result = self.inner.export(batch).await;
        if result.is_err() {
            self.lost.dropped.fetch_add(n, Ordering::Relaxed);
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The spans waiting for export, and the spans lost: shared by the request
/// path (`Bounded`) and the exporter's thread (`Counted`).
#[derive(Debug, Clone, Default)]
struct Lost {
    queued: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
}

/// Hands finished spans to the batch processor while its queue has room,
/// and drops and counts them when it has none. The SDK drops them too when
/// its queue is full (a slow collector holds an export up to its timeout),
/// but says so only in its own log: counted here, the loss shows in
/// `prefixgate_spans_dropped_total` beside failed exports. The count of
/// queued spans is never below the SDK queue's own, so the SDK never drops.
#[derive(Debug)]
struct Bounded<P> {
    inner: P,
    capacity: u64,
    lost: Lost,
}

impl<P: SpanProcessor> SpanProcessor for Bounded<P> {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.lost.queued.fetch_add(1, Ordering::Relaxed) >= self.capacity {
            self.lost.queued.fetch_sub(1, Ordering::Relaxed);
            self.lost.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

fn env_endpoint() -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|e| !e.is_empty()))
}

impl Telemetry {
    /// No tracing.
    pub fn off() -> Telemetry {
        Telemetry { provider: None, tracer: None, lost: Lost::default(), propagator: TraceContextPropagator::new() }
    }

    /// Tracing as `cfg` and the OTEL_* variables say; off without an endpoint.
    pub fn from_config(cfg: &TracingConfig) -> Result<Telemetry, String> {
        if cfg.endpoint.is_none() && !env_endpoint() {
            return Ok(Telemetry::off());
        }
        let lost = Lost::default();
        let (cfg, counter) = (cfg.clone(), lost.clone());
        // The blocking HTTP client makes (and later drops) a runtime of its
        // own: built on a plain thread, never on the server's.
        let provider = std::thread::spawn(move || build(&cfg, counter))
            .join()
            .map_err(|_| "building the trace exporter panicked".to_string())??;
        let tracer = provider.tracer("prefixgate");
        Ok(Telemetry {
            provider: Some(provider),
            tracer: Some(tracer),
            lost,
            propagator: TraceContextPropagator::new(),
        })
    }

    pub fn tracer(&self) -> Option<&Tracer> {
        self.tracer.as_ref()
    }

    /// Spans lost on the way to the collector.
    pub fn dropped(&self) -> u64 {
        self.lost.dropped.load(Ordering::Relaxed)
    }

    /// The W3C trace context carried by `headers` (`traceparent`, `tracestate`).
    pub fn extract(&self, headers: &actix_web::http::header::HeaderMap) -> opentelemetry::Context {
        self.propagator.extract(&HeaderExtractor(headers))
    }

    /// The `traceparent` (and a `tracestate` that is not empty) naming
    /// `cx`'s span, as headers.
    pub fn inject(&self, cx: &opentelemetry::Context) -> Vec<(HeaderName, HeaderValue)> {
        let mut out = HeaderInjector(Vec::new());
        self.propagator.inject_context(cx, &mut out);
        out.0
    }

    /// Exports what is finished now (tests, shutdown).
    pub fn flush(&self) {
        if let Some(p) = self.provider.clone() {
            let _ = std::thread::spawn(move || p.force_flush()).join();
        }
    }

    /// Exports what is left and stops the exporter's thread.
    pub fn shutdown(&self) {
        if let Some(p) = self.provider.clone() {
            let _ = std::thread::spawn(move || p.shutdown()).join();
        }
    }
}

fn build(cfg: &TracingConfig, lost: Lost) -> Result<SdkTracerProvider, String> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http().with_protocol(Protocol::HttpBinary);
    if let Some(endpoint) = &cfg.endpoint {
        exporter = exporter.with_endpoint(endpoint);
    }
    if let Some(ms) = cfg.export_timeout_ms {
        exporter = exporter.with_timeout(Duration::from_millis(ms));
    }
    let exporter = exporter.build().map_err(|e| format!("tracing: cannot build the OTLP exporter: {e}"))?;
    let (batch, capacity) = batch_config(cfg);
    let exporter = Counted { inner: exporter, lost: lost.clone() };
    let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batch).build();
    let processor = Bounded { inner: processor, capacity: capacity as u64, lost };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if let Some(name) = &cfg.service_name {
        resource = resource.with_service_name(name.clone());
    } else if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("prefixgate");
    }
    let mut provider = SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource.build());
    if let Some(ratio) = cfg.sample_ratio {
        provider = provider.with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))));
    }
    Ok(provider.build())
}

/// The batch processor's settings, and its queue's size: `[tracing]` keys,
/// else the SDK's `OTEL_BSP_*` variables, else ours. Larger batches and
/// queue than the SDK's (512 of 2,048): with every request sampled, a
/// gateway ends ~40,000 spans a second, which the SDK's queue holds for
/// 50 ms; batches of 2,048 cost the export thread less CPU per span (fewer
/// posts), and 8,192 queued spans are a few MB at most.
fn batch_config(cfg: &TracingConfig) -> (opentelemetry_sdk::trace::BatchConfig, usize) {
    use opentelemetry_sdk::trace::{OTEL_BSP_MAX_EXPORT_BATCH_SIZE, OTEL_BSP_MAX_QUEUE_SIZE, OTEL_BSP_SCHEDULE_DELAY};
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok());
    let queue = cfg.max_queued_spans.or_else(|| env(OTEL_BSP_MAX_QUEUE_SIZE)).unwrap_or(8_192).max(1);
    let batch_size = env(OTEL_BSP_MAX_EXPORT_BATCH_SIZE).unwrap_or(2_048).min(queue);
    let mut batch = opentelemetry_sdk::trace::BatchConfigBuilder::default()
        .with_max_queue_size(queue)
        .with_max_export_batch_size(batch_size);
    if cfg.export_interval_ms.is_some() || std::env::var_os(OTEL_BSP_SCHEDULE_DELAY).is_none() {
        batch = batch.with_scheduled_delay(Duration::from_millis(cfg.export_interval_ms.unwrap_or(1_000)));
    }
    (batch.build(), queue)
}

struct HeaderExtractor<'a>(&'a actix_web::http::header::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeaderInjector(Vec<(HeaderName, HeaderValue)>);

impl Injector for HeaderInjector {
    fn set(&mut self, key: &str, value: String) {
        if value.is_empty() {
            return;
        }
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::try_from(value)) {
            self.0.push((name, value));
        }
    }
}

/// The trace of the span current on this thread (a request's, an admin
/// action's, a discovery change's), if any: what log lines and history
/// events written meanwhile carry.
pub fn current_trace_id() -> Option<TraceId> {
    let cx = opentelemetry::Context::current();
    let traced = cx.span().span_context().clone();
    traced.is_valid().then(|| traced.trace_id())
}

/// A span for an operation outside any request (an admin action, a
/// discovery change), to attach around the code that performs it. Named and
/// described only when tracing is on.
pub fn operation_span(
    tracer: Option<&Tracer>,
    describe: impl FnOnce() -> (String, Vec<opentelemetry::KeyValue>),
) -> Option<opentelemetry::Context> {
    use opentelemetry::trace::Tracer as _;
    let tracer = tracer?;
    let (name, attributes) = describe();
    let span = tracer.span_builder(name).with_attributes(attributes).start(tracer);
    Some(opentelemetry::Context::current_with_span(span))
}

/// Log lines written while a traced request's (or admin action's) context
/// is current end with its `trace_id=`, so an operator goes from a log line
/// to its trace. Read from the OpenTelemetry context the request's future
/// runs in: a line costs this only when it is written, a request nothing.
pub struct WithTraceId<F>(pub F);

impl<S, N, F> FormatEvent<S, N> for WithTraceId<F>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let Some(trace_id) = current_trace_id() else {
            return self.0.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        writeln!(writer, "{} trace_id={trace_id}", line.trim_end_matches('\n'))
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

    use super::WithTraceId;

    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_log_line_written_in_a_traced_context_ends_with_its_trace_id() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .event_format(WithTraceId(tracing_subscriber::fmt::format().without_time().with_ansi(false)))
            .with_writer(move || writer.clone())
            .finish();
        let traced = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(replica = "a", "outside any request");
            let _current = opentelemetry::Context::new().with_remote_span_context(traced).attach();
            tracing::warn!(replica = "a", "inside a traced request");
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].ends_with("outside any request replica=\"a\""), "{text}");
        assert!(!lines[0].contains("trace_id"), "{text}");
        assert!(
            lines[1].ends_with("inside a traced request replica=\"a\" trace_id=4bf92f3577b34da6a3ce929d0e0e4736"),
            "{text}"
        );
    }
}
