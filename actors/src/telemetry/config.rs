//! The `[telemetry]` table of `node.toml`: where the daemon serves its dashboard, `/metrics` and
//! `/status` (over https, and to clients with a certificate of the cluster only, if asked), the device
//! peak its MFU estimate divides by, and where it exports OpenTelemetry spans. Everything is off when
//! absent.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Serve the dashboard (`GET /`), `GET /metrics` (Prometheus text) and `GET /status` (JSON) over
    /// HTTP here, e.g. "127.0.0.1:9400". Absent: no HTTP server. Port 0 picks one (printed at start).
    pub metrics_listen: Option<SocketAddr>,
    /// Serve that endpoint over https (TLS 1.2 or 1.3) with this node's certificate from the cluster CA
    /// (it names the node: reach the daemon by that name, and trust the cluster's ca.pem).
    pub dashboard_tls: bool,
    /// Also require a client certificate from the cluster CA (`troupe cluster add-node NAME` issues
    /// one) on every connection — the dashboard shows job configs. Implies `dashboard_tls`.
    pub dashboard_auth: bool,
    /// Peak dense throughput of one slot's device in TFLOP/s (e.g. 989 for an H100 in bf16): the
    /// denominator of `troupe_job_mfu`. Absent: MFU is not exported (the achieved FLOP/s still is).
    pub peak_tflops_per_slot: Option<f64>,
    /// OTLP/HTTP endpoint that receives this daemon's spans and metrics, e.g. "http://127.0.0.1:4318" or
    /// "https://collector.example:4318" (trusted roots, client certificate and headers from the standard
    /// `OTEL_EXPORTER_OTLP_*` variables)
    /// (`/v1/traces` and `/v1/metrics` are added). Absent: `OTEL_EXPORTER_OTLP_ENDPOINT` if set, else no
    /// export.
    pub otlp_endpoint: Option<String>,
}

impl TelemetryConfig {
    /// Checks the values; the error names the key (under `telemetry.`) and the fix.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if let Some(peak) = self.peak_tflops_per_slot {
            if !(peak.is_finite() && peak > 0.0) {
                return Err((
                    "telemetry.peak_tflops_per_slot",
                    format!("{peak} is not a positive number of TFLOP/s (e.g. 989 for an H100 in bf16); leave it out to skip MFU"),
                ));
            }
        }
        if (self.dashboard_tls || self.dashboard_auth) && self.metrics_listen.is_none() {
            let key = if self.dashboard_auth { "telemetry.dashboard_auth" } else { "telemetry.dashboard_tls" };
            return Err((key, "there is no endpoint to secure: set telemetry.metrics_listen too".to_owned()));
        }
        if let Some(endpoint) = &self.otlp_endpoint {
            super::otel::parse_endpoint(endpoint, super::otel::Signal::Traces)
                .map_err(|why| ("telemetry.otlp_endpoint", why))?;
        }
        Ok(())
    }

    /// The OTLP endpoint in effect: the config's, else `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn otlp_endpoint(&self) -> Option<String> {
        self.otlp_endpoint
            .clone()
            .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().filter(|e| !e.is_empty()))
    }
}
