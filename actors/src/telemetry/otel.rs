//! OpenTelemetry export of the daemon's tracing spans over OTLP/HTTP (protobuf), when an endpoint is
//! configured (`telemetry.otlp_endpoint` or `OTEL_EXPORTER_OTLP_ENDPOINT`). Without one nothing is
//! installed: the spans stay plain `tracing` spans, filtered like the logs.
//!
//! Requests go through the SDK's supported client, reqwest (blocking: the SDK exports from threads of
//! its own), over http or https — rustls with ring as the cluster uses it, the platform's trusted roots
//! plus `OTEL_EXPORTER_OTLP_CERTIFICATE` (a PEM file), a client certificate from
//! `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and `OTEL_EXPORTER_OTLP_CLIENT_KEY` — with the headers of
//! `OTEL_EXPORTER_OTLP_HEADERS` (`key=value,...`, read by the SDK).
//!
//! One step of a job is one trace across the cluster: the controller exports a `job_step` span when
//! the step commits, and every rank's `step` span (on whichever node) is its child. No context travels
//! in the control messages: the trace and span ids of step N are derived from the job's `trace_seed`
//! (drawn by the controller at submission, carried in the `JobSpec`), the job id and N ([`step_ids`]),
//! so every node computes the same ones — a step redone by a later attempt lands in the same trace.

/// The signals exported over OTLP, each to its own path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Traces,
    Metrics,
}

impl Signal {
    fn path(self) -> &'static str {
        match self {
            Signal::Traces => "v1/traces",
            Signal::Metrics => "v1/metrics",
        }
    }
}

/// Checks an OTLP/HTTP endpoint — `http(s)://HOST:PORT` with an optional path — and gives the URL of
/// `signal`: the path is a base to which `/v1/traces` or `/v1/metrics` is appended, as the OTLP exporter
/// specification says, unless it already ends in one of them (then the other signal goes to its
/// sibling).
pub fn parse_endpoint(endpoint: &str, signal: Signal) -> Result<String, String> {
    let Some((scheme, rest)) = endpoint.split_once("://").filter(|(s, _)| ["http", "https"].contains(s)) else {
        return Err(format!(
            "{endpoint:?} is not an OTLP/HTTP endpoint like \"http://127.0.0.1:4318\" or \"https://collector:4318\""
        ));
    };
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let port_ok =
        authority.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if !port_ok {
        return Err(format!("{endpoint:?}: give host and port, like \"{scheme}://127.0.0.1:4318\""));
    }
    let path = path.trim_end_matches('/');
    let base = [Signal::Traces, Signal::Metrics]
        .iter()
        .find_map(|s| path.strip_suffix(s.path()))
        .map_or(path, |b| b.trim_end_matches('/'));
    let base = if base.is_empty() { String::new() } else { format!("/{base}") };
    Ok(format!("{scheme}://{authority}{base}/{}", signal.path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_ids_are_shared_by_every_node_and_differ_by_job_step_and_seed() {
        let (trace, span) = step_ids(7, 1, 3);
        assert_eq!((trace, span), step_ids(7, 1, 3), "the same on every node");
        assert!(trace != opentelemetry::trace::TraceId::INVALID && span != opentelemetry::trace::SpanId::INVALID);
        for other in [step_ids(7, 1, 4), step_ids(7, 2, 3), step_ids(8, 1, 3)] {
            assert_ne!(other.0, trace);
            assert_ne!(other.1, span);
        }
        assert_ne!(new_trace_seed(1), 0);
    }

    #[test]
    fn endpoints() {
        let check = |endpoint: &str, traces: &str, metrics: &str| {
            assert_eq!(parse_endpoint(endpoint, Signal::Traces).unwrap(), traces, "{endpoint}");
            assert_eq!(parse_endpoint(endpoint, Signal::Metrics).unwrap(), metrics, "{endpoint}");
        };
        check("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/metrics");
        check("http://c:4318/", "http://c:4318/v1/traces", "http://c:4318/v1/metrics");
        check("http://c:4318/v1/traces", "http://c:4318/v1/traces", "http://c:4318/v1/metrics");
        check("http://c:4318/otlp/v1/metrics", "http://c:4318/otlp/v1/traces", "http://c:4318/otlp/v1/metrics");
        check("http://c:4318/otlp", "http://c:4318/otlp/v1/traces", "http://c:4318/otlp/v1/metrics");
        check("https://c:4318/otlp", "https://c:4318/otlp/v1/traces", "https://c:4318/otlp/v1/metrics");
        assert!(parse_endpoint("grpc://c:4317", Signal::Traces).is_err());
        assert!(parse_endpoint("http://c", Signal::Metrics).is_err());
        assert!(parse_endpoint("https://c", Signal::Metrics).is_err());
    }
}

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::cell::Cell;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider,
};

use super::phases::PhaseSpan;

/// How long one export may take to connect, and to be answered.
const EXPORT_CONNECT_TIMEOUT_MS: u64 = 2_000;
const EXPORT_ANSWER_TIMEOUT_MS: u64 = 5_000;
/// How often batched spans go out.
const EXPORT_DELAY_MS: u64 = 1_000;
/// How long the daemon waits at exit for its last spans to go out.
const FLUSH_TIMEOUT_MS: u64 = 2_000;

/// The installed tracer (once per process: the daemon's).
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// Whether spans are exported from this process.
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// Keeps the exporters alive; flushes the last spans and metrics when dropped (bounded).
#[derive(Debug)]
pub struct OtelGuard {
    provider: SdkTracerProvider,
    _metrics: super::otel_metrics::MetricsGuard,
}

impl Drop for OtelGuard {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(Duration::from_millis(FLUSH_TIMEOUT_MS)) {
            tracing::warn!("OTLP export: the last spans may be lost: {e}");
        }
    }
}

/// Installs OTLP/HTTP (protobuf) export of this process's spans and metrics to `endpoint`, as service
/// `troupe`, instance `node`. Spans are batched and sent from the SDK's own thread, metrics collected and
/// sent from another ([`super::otel_metrics`]).
pub fn install(endpoint: &str, node: &str) -> anyhow::Result<OtelGuard> {
    let url = parse_endpoint(endpoint, Signal::Traces).map_err(anyhow::Error::msg)?;
    let metrics_url = parse_endpoint(endpoint, Signal::Metrics).map_err(anyhow::Error::msg)?;
    let client = http_client()?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client.clone())
        .with_endpoint(url.clone())
        .with_timeout(Duration::from_millis(EXPORT_ANSWER_TIMEOUT_MS))
        .build()
        .map_err(|e| anyhow::anyhow!("OTLP exporter to {url}: {e}"))?;
    let batch = BatchConfigBuilder::default().with_scheduled_delay(Duration::from_millis(EXPORT_DELAY_MS)).build();
    let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batch).build();
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("troupe")
        .with_attribute(KeyValue::new("service.instance.id", node.to_owned()))
        .build();
    let answer_timeout = Duration::from_millis(EXPORT_ANSWER_TIMEOUT_MS);
    let metrics = super::otel_metrics::install(&metrics_url, resource.clone(), client, answer_timeout)?;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource)
        .with_id_generator(StepIds::default())
        .build();
    if TRACER.set(provider.tracer("troupe")).is_err() {
        anyhow::bail!("OTLP export is already installed in this process");
    }
    tracing::info!(endpoint = %url, "exporting spans over OTLP/HTTP");
    Ok(OtelGuard { provider, _metrics: metrics })
}

/// splitmix64's finaliser: a fixed, well-mixed function every build computes alike.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A job's `trace_seed`: different for every submission (time, process, job id), never 0.
pub fn new_trace_seed(job: u64) -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    mix(nanos ^ mix(u64::from(std::process::id()) ^ mix(job))).max(1)
}

/// The trace id of step `step` (1-based, as `JobEvent::Step`) of job `job`, and the span id of the
/// controller's `job_step` span that every rank's `step` span of it is a child of.
pub fn step_ids(seed: u64, job: u64, step: u64) -> (TraceId, SpanId) {
    let high = mix(seed ^ mix(job));
    let low = mix(high ^ mix(step));
    let span = mix(low ^ 0x6A6F_625F_7374_6570).max(1);
    let trace = (u128::from(high) << 64) | u128::from(low.max(1));
    (TraceId::from_bytes(trace.to_be_bytes()), SpanId::from_bytes(span.to_be_bytes()))
}

thread_local! {
    /// Ids the next span built on this thread takes instead of random ones ([`export_job_step`]).
    static FORCED_IDS: Cell<Option<(TraceId, SpanId)>> = const { Cell::new(None) };
}

/// Random ids, except for a span built while [`FORCED_IDS`] is set: the SDK has no other way to give a
/// span an id chosen in advance.
#[derive(Debug, Default)]
struct StepIds(RandomIdGenerator);

impl IdGenerator for StepIds {
    fn new_trace_id(&self) -> TraceId {
        FORCED_IDS.with(Cell::get).map_or_else(|| self.0.new_trace_id(), |(trace, _)| trace)
    }

    fn new_span_id(&self) -> SpanId {
        FORCED_IDS.with(Cell::get).map_or_else(|| self.0.new_span_id(), |(_, span)| span)
    }
}

/// The controller's span of a committed step, `start`..`end` (the previous commit to this one), with the
/// ids of [`step_ids`]: the parent of every rank's `step` span of it.
pub fn export_job_step(seed: u64, job: u64, step: u64, start: SystemTime, end: SystemTime, attributes: Vec<KeyValue>) {
    let Some(tracer) = TRACER.get() else { return };
    FORCED_IDS.with(|ids| ids.set(Some(step_ids(seed, job, step))));
    let mut span = tracer
        .span_builder("job_step")
        .with_start_time(start)
        .with_attributes(attributes)
        .start_with_context(tracer, &Context::new());
    FORCED_IDS.with(|ids| ids.set(None));
    span.end_with_timestamp(end);
}

fn unix_time(us: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us)
}

/// Who a rank's spans belong to.
#[derive(Debug)]
pub struct RankAttrs<'a> {
    pub job: u64,
    /// The job's `JobSpec::trace_seed`.
    pub trace_seed: u64,
    pub attempt: u64,
    pub rank: usize,
    /// The pipeline stage the rank runs (pipeline jobs only).
    pub stage: Option<usize>,
    pub epoch: u64,
    pub node: &'a str,
}

impl RankAttrs<'_> {
    fn key_values(&self, step: u64) -> Vec<KeyValue> {
        let mut kv = vec![
            KeyValue::new("troupe.job", self.job as i64),
            KeyValue::new("troupe.attempt", self.attempt as i64),
            KeyValue::new("troupe.rank", self.rank as i64),
            KeyValue::new("troupe.epoch", self.epoch as i64),
            KeyValue::new("troupe.node", self.node.to_owned()),
            KeyValue::new("troupe.step", step as i64),
        ];
        if let Some(stage) = self.stage {
            kv.push(KeyValue::new("troupe.stage", stage as i64));
        }
        kv
    }
}

/// The span a recorded phase becomes, and what it adds to the rank's attributes: compute, forward,
/// backward, weight (F, B, W of a pipeline's micro-batch, with `troupe.microbatch` and `troupe.chunk`),
/// send and recv (a pipeline's activations and gradients), collective (with `troupe.collective`),
/// commit_wait, optimizer, checkpoint; a step cut short is `aborted` or `failed`.
fn span_of(s: &PhaseSpan) -> (&str, Vec<KeyValue>) {
    let mut kv = vec![KeyValue::new("troupe.phase", s.name.clone())];
    if let (Some(chunk), Some(microbatch)) = (s.chunk, s.microbatch) {
        kv.push(KeyValue::new("troupe.chunk", chunk as i64));
        kv.push(KeyValue::new("troupe.microbatch", microbatch as i64));
    }
    let name = match s.cat.as_str() {
        "comm" => {
            let collective = match s.name.as_str() {
                // A pipeline stage's flush all-reduces its gradients among the stage's replicas (and the
                // norm and loss across all devices).
                "all-reduce" | "flush" => Some("all_reduce"),
                "reduce-scatter" => Some("reduce_scatter"),
                "all-gather" => Some("all_gather"),
                "broadcast" => Some("broadcast"),
                _ => None,
            };
            match collective {
                Some(c) => {
                    kv.push(KeyValue::new("troupe.collective", c));
                    "collective"
                }
                None if s.name.starts_with("send") => "send",
                None if s.name.starts_with("recv") => "recv",
                None if s.name.starts_with("failed") => "failed",
                None => "aborted",
            }
        }
        "idle" => "commit_wait",
        "compute" | "optimizer" | "checkpoint" | "forward" | "backward" | "weight" => s.cat.as_str(),
        _ => s.name.as_str(),
    };
    (name, kv)
}

/// Exports a rank's phases of one step: a `step` span around its children ([`span_of`]: `compute` or a
/// pipeline's `forward`/`backward`/`weight`/`send`/`recv` ops, `collective`, `commit_wait`, `optimizer`,
/// `checkpoint`), with `troupe.step_outcome` committed, aborted (by a view change) or failed (a lost
/// peer), as a child of the controller's `job_step` span of the step (in its trace, [`step_ids`]); a
/// set-up, a resumed attempt's `mesh_rebuild` and `state_restore`, or a checkpoint restore is a span of
/// its own. Nothing happens unless export is installed.
pub fn export_step(attrs: &RankAttrs, step: u64, spans: &[PhaseSpan]) {
    let Some(tracer) = TRACER.get() else { return };
    let (setup, phases): (Vec<&PhaseSpan>, Vec<&PhaseSpan>) =
        spans.iter().partition(|s| s.cat == "recovery" || s.name == "setup");
    for s in setup {
        let name = match s.name.as_str() {
            "setup" => "setup",
            "checkpoint restore" => "checkpoint_restore",
            // A resumed attempt's set-up: the worker's start to its engine over the rebuilt mesh, then
            // the state brought to the committed step (a buddy's copy or a reshard).
            "mesh rebuild" => "mesh_rebuild",
            "state restore" => "state_restore",
            _ => "recovery",
        };
        export_span(tracer, name, s.start_us, s.start_us + s.dur_us, attrs.key_values(step), &Context::new());
    }
    let (Some(start), Some(end)) =
        (phases.iter().map(|s| s.start_us).min(), phases.iter().map(|s| s.start_us + s.dur_us).max())
    else {
        return;
    };
    let outcome = if phases.iter().any(|s| s.name.starts_with("failed")) {
        "failed"
    } else if phases.iter().any(|s| s.name.contains("aborted")) {
        "aborted"
    } else {
        "committed"
    };
    let mut kv = attrs.key_values(step);
    kv.push(KeyValue::new("troupe.step_outcome", outcome));
    let (trace_id, span_id) = step_ids(attrs.trace_seed, attrs.job, step);
    let job_step = SpanContext::new(trace_id, span_id, TraceFlags::SAMPLED, true, TraceState::default());
    let parent = tracer
        .span_builder("step")
        .with_kind(SpanKind::Internal)
        .with_start_time(unix_time(start))
        .with_attributes(kv)
        .start_with_context(tracer, &Context::new().with_remote_span_context(job_step));
    let cx = Context::new().with_span(parent);
    for s in phases {
        let (name, extra) = span_of(s);
        let mut kv = attrs.key_values(step);
        kv.extend(extra);
        export_span(tracer, name, s.start_us, s.start_us + s.dur_us, kv, &cx);
    }
    cx.span().end_with_timestamp(unix_time(end));
}

/// Exports one finished span (times in µs since the Unix epoch).
pub fn export_span(
    tracer: &SdkTracer,
    name: &str,
    start_us: u64,
    end_us: u64,
    attributes: Vec<KeyValue>,
    parent: &Context,
) {
    let mut span = tracer
        .span_builder(name.to_owned())
        .with_start_time(unix_time(start_us))
        .with_attributes(attributes)
        .start_with_context(tracer, parent);
    span.end_with_timestamp(unix_time(end_us));
}

/// A job-level span seen by the controller daemon (the job's life, a recovery, a failure detection).
pub fn export_job_span(name: &str, start: SystemTime, end: SystemTime, attributes: Vec<KeyValue>) {
    let Some(tracer) = TRACER.get() else { return };
    let mut span =
        tracer.span_builder(name.to_owned()).with_start_time(start).with_attributes(attributes).start(tracer);
    span.end_with_timestamp(end);
}

/// A PEM file named by environment variable `var`, if set.
fn pem_file(var: &str) -> anyhow::Result<Option<(std::path::PathBuf, Vec<u8>)>> {
    let Some(path) = std::env::var_os(var).filter(|p| !p.is_empty()).map(std::path::PathBuf::from) else {
        return Ok(None);
    };
    let bytes = std::fs::read(&path).map_err(|e| anyhow::anyhow!("{var}={}: {e}", path.display()))?;
    Ok(Some((path, bytes)))
}

/// The TLS settings of https exports: ring, the platform's roots plus `OTEL_EXPORTER_OTLP_CERTIFICATE`,
/// and the client certificate of `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`/`_CLIENT_KEY` if both are set.
fn tls_config() -> anyhow::Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let extra: Vec<CertificateDer<'static>> = match pem_file("OTEL_EXPORTER_OTLP_CERTIFICATE")? {
        Some((path, pem)) => {
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("OTEL_EXPORTER_OTLP_CERTIFICATE={}: {e}", path.display()))?;
            anyhow::ensure!(
                !certs.is_empty(),
                "OTEL_EXPORTER_OTLP_CERTIFICATE={}: no PEM certificate in it",
                path.display()
            );
            certs
        }
        None => Vec::new(),
    };
    let verifier = rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
        .map_err(|e| anyhow::anyhow!("OTLP over https: the trusted roots: {e}"))?;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| anyhow::anyhow!("OTLP over https: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let client_cert = (pem_file("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE")?, pem_file("OTEL_EXPORTER_OTLP_CLIENT_KEY")?);
    Ok(match client_cert {
        (Some((cert_path, cert)), Some((key_path, key))) => {
            let chain = CertificateDer::pem_slice_iter(&cert)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE={}: {e}", cert_path.display()))?;
            let key = PrivateKeyDer::from_pem_slice(&key)
                .map_err(|e| anyhow::anyhow!("OTEL_EXPORTER_OTLP_CLIENT_KEY={}: {e}", key_path.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| anyhow::anyhow!("OTLP client certificate {}: {e}", cert_path.display()))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => anyhow::bail!(
            "set both OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY, or neither"
        ),
    })
}

/// The exporters' HTTP client: reqwest's blocking client (built on a thread of its own: it must not be
/// built inside the daemon's async runtime), bounded connect and answer times, https as [`tls_config`].
fn http_client() -> anyhow::Result<reqwest::blocking::Client> {
    let tls = tls_config()?;
    std::thread::spawn(move || {
        reqwest::blocking::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(Duration::from_millis(EXPORT_CONNECT_TIMEOUT_MS))
            .timeout(Duration::from_millis(EXPORT_ANSWER_TIMEOUT_MS))
            .build()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("building the OTLP HTTP client panicked"))?
    .map_err(|e| anyhow::anyhow!("building the OTLP HTTP client: {e}"))
}
