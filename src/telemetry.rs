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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter, Tracer};

use crate::config::TracingConfig;

/// The tracer, when tracing is on, and what it lost.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    tracer: Option<Tracer>,
    dropped: Arc<AtomicU64>,
    propagator: TraceContextPropagator,
}

/// Counts the spans of batches the collector did not take (down, slow,
/// refusing): they are gone, and an operator should know how many.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    dropped: Arc<AtomicU64>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len() as u64;
        let result = self.inner.export(batch).await;
        if result.is_err() {
            self.dropped.fetch_add(n, Ordering::Relaxed);
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

fn env_endpoint() -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|e| !e.is_empty()))
}

impl Telemetry {
    /// No tracing.
    pub fn off() -> Telemetry {
        Telemetry { provider: None, tracer: None, dropped: Arc::default(), propagator: TraceContextPropagator::new() }
    }

    /// Tracing as `cfg` and the OTEL_* variables say; off without an endpoint.
    pub fn from_config(cfg: &TracingConfig) -> Result<Telemetry, String> {
        if cfg.endpoint.is_none() && !env_endpoint() {
            return Ok(Telemetry::off());
        }
        let dropped: Arc<AtomicU64> = Arc::default();
        let (cfg, counter) = (cfg.clone(), dropped.clone());
        // The blocking HTTP client makes (and later drops) a runtime of its
        // own: built on a plain thread, never on the server's.
        let provider = std::thread::spawn(move || build(&cfg, counter))
            .join()
            .map_err(|_| "building the trace exporter panicked".to_string())??;
        let tracer = provider.tracer("prefixgate");
        Ok(Telemetry {
            provider: Some(provider),
            tracer: Some(tracer),
            dropped,
            propagator: TraceContextPropagator::new(),
        })
    }

    pub fn tracer(&self) -> Option<&Tracer> {
        self.tracer.as_ref()
    }

    /// Spans lost on the way to the collector.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The W3C trace context carried by `headers` (`traceparent`, `tracestate`).
    pub fn extract(&self, headers: &actix_web::http::header::HeaderMap) -> opentelemetry::Context {
        self.propagator.extract(&HeaderExtractor(headers))
    }

    /// The `traceparent` (and `tracestate`) naming `cx`'s span, as headers.
    pub fn inject(&self, cx: &opentelemetry::Context) -> Vec<(String, String)> {
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

fn build(cfg: &TracingConfig, dropped: Arc<AtomicU64>) -> Result<SdkTracerProvider, String> {
    let mut exporter = opentelemetry_otlp::SpanExporter::builder().with_http().with_protocol(Protocol::HttpBinary);
    if let Some(endpoint) = &cfg.endpoint {
        exporter = exporter.with_endpoint(endpoint);
    }
    let exporter = exporter.build().map_err(|e| format!("tracing: cannot build the OTLP exporter: {e}"))?;
    let every = Duration::from_millis(cfg.export_interval_ms.unwrap_or(1_000));
    let batch = opentelemetry_sdk::trace::BatchConfigBuilder::default().with_scheduled_delay(every).build();
    let processor = BatchSpanProcessor::builder(Counted { inner: exporter, dropped }).with_batch_config(batch).build();
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

struct HeaderExtractor<'a>(&'a actix_web::http::header::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeaderInjector(Vec<(String, String)>);

impl Injector for HeaderInjector {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_string(), value));
    }
}
