//! Observability: what a daemon exposes over HTTP (the live dashboard at `/`, `/metrics`, `/status`) and
//! OpenTelemetry (spans and metrics over OTLP), what a run records (`--run-dir`: events and per-rank step
//! phases) and the pictures made from it (`troupe trace`: an SVG timeline and a Perfetto trace; `troupe
//! plot`: loss and throughput).
//!
//! Invariant: the OTLP export points one way — `otel_metrics` (the metric instruments and their export)
//! knows neither `otel` nor `metrics`; `otel` (the span export, whose `install` installs both) knows
//! `otel_metrics`; `metrics` (the daemon's counters, whose hooks feed both) sits above them.

pub mod config;
pub mod dashboard;
pub mod endpoint;
pub mod http;
pub mod link_bytes;
pub mod load;
pub mod memory;
pub mod metrics;
pub mod otel;
pub mod otel_metrics;
pub mod peak;
pub mod phases;
pub mod plot;
pub mod prometheus;
pub mod run_dir;
pub mod svg;
pub mod timeline;
pub mod trace_event;

pub use config::TelemetryConfig;
pub use metrics::NodeMetrics;
pub use phases::{PhaseRecorder, PhaseSpan};
pub use run_dir::RunDir;
