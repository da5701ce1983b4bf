//! The job metrics of `/metrics` as OpenTelemetry metrics, exported over OTLP/HTTP (protobuf) to
//! `ENDPOINT/v1/metrics` when an endpoint is configured — installed with the span export by
//! [`super::otel::install`]. Without one nothing is installed and recording is one `OnceLock` read.
//!
//! Names are those of `/metrics` (counters without `_total`, which OTLP-to-Prometheus bridges add back);
//! every job instrument carries `troupe.job` and `troupe.job.name`. The controller's [`NodeMetrics`]
//! hooks record them as the events pass; bytes per link are observed from the daemon's counters at each
//! collection. Collected every 10 s (`OTEL_METRIC_EXPORT_INTERVAL`, in ms, overrides), cumulative.
//!
//! [`NodeMetrics`]: super::NodeMetrics

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::Resource;

use super::link_bytes::LinkBytes;
use super::prometheus::SECONDS_BUCKETS;

/// How often metrics are collected and sent, unless `OTEL_METRIC_EXPORT_INTERVAL` says otherwise.
const EXPORT_INTERVAL_MS: u64 = 10_000;

/// The installed instruments (once per process: the daemon's).
static INSTRUMENTS: OnceLock<Instruments> = OnceLock::new();
/// The meter, for instruments registered later ([`observe_links`]).
static METER: OnceLock<Meter> = OnceLock::new();

/// The instruments the controller's hooks record into.
#[derive(Debug)]
pub struct Instruments {
    pub step_seconds: Histogram<f64>,
    pub steps_committed: Counter<u64>,
    pub tokens_per_second: Gauge<f64>,
    pub model_flops_per_second: Gauge<f64>,
    pub mfu: Gauge<f64>,
    pub bubble: Gauge<f64>,
    pub loss: Gauge<f64>,
    pub skipped_steps: Counter<u64>,
    pub checkpoint_seconds: Histogram<f64>,
    pub checkpoint_bytes: Counter<u64>,
    pub checkpoint_bytes_per_second: Gauge<f64>,
    pub recovery_seconds: Histogram<f64>,
    pub failure_detection_seconds: Histogram<f64>,
}

/// The instruments when OTLP export is installed.
pub fn instruments() -> Option<&'static Instruments> {
    INSTRUMENTS.get()
}

/// The attributes of a job's measurements.
pub fn job_attributes(job: u64, name: &str) -> [KeyValue; 2] {
    [KeyValue::new("troupe.job", job as i64), KeyValue::new("troupe.job.name", name.to_owned())]
}

/// Keeps the metric export alive; collects and sends the last values when dropped.
#[derive(Debug)]
pub struct MetricsGuard {
    provider: SdkMeterProvider,
}

impl Drop for MetricsGuard {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("OTLP metric export: the last values may be lost: {e}");
        }
    }
}

/// Installs the metric export to `url` (a `/v1/metrics` URL) for `resource`, over the span export's
/// `client`, each export answered within `answer_timeout`.
pub(super) fn install(
    url: &str,
    resource: Resource,
    client: reqwest::blocking::Client,
    answer_timeout: Duration,
) -> anyhow::Result<MetricsGuard> {
    let exporter = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(url.to_owned())
        .with_timeout(answer_timeout)
        .build()
        .map_err(|e| anyhow::anyhow!("OTLP metric exporter to {url}: {e}"))?;
    let mut reader = PeriodicReader::builder(exporter);
    if std::env::var_os("OTEL_METRIC_EXPORT_INTERVAL").is_none() {
        reader = reader.with_interval(Duration::from_millis(EXPORT_INTERVAL_MS));
    }
    let provider = SdkMeterProvider::builder().with_reader(reader.build()).with_resource(resource).build();
    let meter = provider.meter("troupe");
    let instruments = Instruments::register(&meter);
    if INSTRUMENTS.set(instruments).is_err() || METER.set(meter).is_err() {
        anyhow::bail!("OTLP metric export is already installed in this process");
    }
    tracing::info!(endpoint = %url, "exporting metrics over OTLP/HTTP");
    Ok(MetricsGuard { provider })
}

impl Instruments {
    /// Every job instrument, registered with `meter` under its `/metrics` name.
    fn register(meter: &Meter) -> Self {
        let seconds = |name: &'static str, help: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(help)
                .with_boundaries(SECONDS_BUCKETS.to_vec())
                .build()
        };
        let gauge = |name: &'static str, unit: &'static str, help: &'static str| {
            meter.f64_gauge(name).with_unit(unit).with_description(help).build()
        };
        let counter = |name: &'static str, unit: &'static str, help: &'static str| {
            meter.u64_counter(name).with_unit(unit).with_description(help).build()
        };
        Instruments {
            step_seconds: seconds("troupe_job_step_seconds", "Wall time between step commits at the controller."),
            steps_committed: counter(
                "troupe_job_steps_committed",
                "{step}",
                "Step commits (a step redone after a rollback counts again).",
            ),
            tokens_per_second: gauge(
                "troupe_job_tokens_per_second",
                "{token}/s",
                "Tokens per second of the last committed step.",
            ),
            model_flops_per_second: gauge(
                "troupe_job_model_flops_per_second",
                "{flop}/s",
                "Achieved model FLOP/s: 3 x forward FLOPs per token x tokens/s.",
            ),
            mfu: gauge(
                "troupe_job_mfu",
                "1",
                "Model FLOPs utilisation: achieved FLOP/s over world x peak_tflops_per_slot.",
            ),
            bubble: gauge(
                "troupe_job_bubble_fraction",
                "1",
                "Pipeline jobs: idle over device time in the last committed step's schedule.",
            ),
            loss: gauge("troupe_job_loss", "1", "Loss of the last committed step."),
            skipped_steps: counter(
                "troupe_job_skipped_steps",
                "{step}",
                "Steps committed without an update because the fp16 gradients overflowed.",
            ),
            checkpoint_seconds: seconds(
                "troupe_job_checkpoint_seconds",
                "Time rank 0 took to write and commit a durable checkpoint.",
            ),
            checkpoint_bytes: counter("troupe_job_checkpoint_bytes", "By", "Bytes of durable checkpoints written."),
            checkpoint_bytes_per_second: gauge(
                "troupe_job_checkpoint_bytes_per_second",
                "By/s",
                "Write throughput of the last durable checkpoint.",
            ),
            recovery_seconds: seconds(
                "troupe_job_recovery_seconds",
                "From the view change that aborted an attempt to the next committed step.",
            ),
            failure_detection_seconds: seconds(
                "troupe_failure_detection_seconds",
                "Silence of a member when it was declared failed or its connection was lost.",
            ),
        }
    }
}

/// Exports this daemon's bytes per peer node (`troupe_link_bytes{peer, direction}`) at every collection;
/// nothing unless the export is installed. Called once, by the daemon that owns `metrics` (its
/// [`NodeMetrics`](super::NodeMetrics), which holds the daemon's [`LinkBytes`]).
pub fn observe_links(metrics: Arc<impl AsRef<LinkBytes> + Send + Sync + 'static>) {
    static OBSERVED: OnceLock<()> = OnceLock::new();
    let Some(meter) = METER.get() else { return };
    if OBSERVED.set(()).is_err() {
        return;
    }
    // Registered with the meter for the life of the process (the instrument handle is not needed).
    let _ = meter
        .u64_observable_counter("troupe_link_bytes")
        .with_unit("By")
        .with_description("Data-plane payload bytes this daemon's ranks exchanged with each peer node.")
        .with_callback(move |observer| {
            for (peer, sent, received) in AsRef::<LinkBytes>::as_ref(&*metrics).snapshot() {
                let peer = KeyValue::new("peer", peer);
                observer.observe(sent, &[peer.clone(), KeyValue::new("direction", "sent")]);
                observer.observe(received, &[peer, KeyValue::new("direction", "received")]);
            }
        })
        .build();
}
