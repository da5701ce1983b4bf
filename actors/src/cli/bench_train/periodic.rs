//! `troupe bench train --world N --sync local_sgd|diloco --sync-every H`: periodic synchronization
//! measured beside DDP (overlapped) in the same repetitions, each on a fresh cluster of N daemons, on the
//! same token budget (the same steps of the same global batch): tokens/s, the bytes all ranks sent per
//! step — read from the daemons' link counters (`troupe_link_bytes_total`, served on `/metrics`) after
//! each job, so they include the per-step loss all-reduce and everything else the job sent — and the
//! validation loss of each final model (a tenth of the corpus held out, evaluated after the last step:
//! less noisy than one batch's training loss).

use anyhow::Context;
use serde_json::{json, Value};

use super::{median, BenchTrainArgs, WARMUP_STEPS};
use crate::api::LocalCluster;

/// The bytes the daemons of `cluster` (`world` of them) sent to each other, from their `/metrics`.
pub(super) async fn bytes_sent(cluster: &LocalCluster, world: usize) -> anyhow::Result<u64> {
    let mut total = 0;
    for i in 0..world {
        let url = cluster.dashboard_url(i).with_context(|| format!("daemon {i} serves no /metrics"))?;
        let url = format!("{}metrics", url.trim_end_matches('/').to_owned() + "/");
        let text = tokio::task::spawn_blocking(move || get(&url)).await.context("reading /metrics")??;
        total += sent_bytes_of(&text);
    }
    Ok(total)
}

/// The body of a plain-HTTP GET of `url` (reqwest's blocking client, given a TLS configuration of the
/// project's provider so that it needs no process-wide default; the daemons' `/metrics` is plain HTTP).
fn get(url: &str) -> anyhow::Result<String> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let client = reqwest::blocking::Client::builder().use_preconfigured_tls(tls).build()?;
    Ok(client.get(url).send()?.error_for_status()?.text()?)
}

/// The sum of `troupe_link_bytes_total{…direction="sent"…}` in a Prometheus text exposition.
fn sent_bytes_of(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("troupe_link_bytes_total{") && l.contains("direction=\"sent\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// What the report takes of one repetition's run.
pub(super) struct RunFigures {
    pub(super) tokens_per_s: f64,
    pub(super) final_loss: f64,
    /// Bytes all ranks sent over the job.
    pub(super) bytes_sent: Option<u64>,
    /// The validation loss of the final model.
    pub(super) eval_loss: Option<f64>,
}

/// Bytes per step of a run (every step of the job, warm-up included).
fn per_step(run: &RunFigures, steps: u64) -> f64 {
    run.bytes_sent.unwrap_or(0) as f64 / (steps + WARMUP_STEPS) as f64
}

/// The JSON fields of a periodic run beside its DDP baseline (`ours`, `ddp`: the repetitions).
pub(super) fn report(args: &BenchTrainArgs, ours: &[RunFigures], ddp: &[RunFigures]) -> Value {
    let bytes = median(ours.iter().map(|r| per_step(r, args.steps)).collect());
    let ddp_bytes = median(ddp.iter().map(|r| per_step(r, args.steps)).collect());
    let tokens_per_s = median(ours.iter().map(|r| r.tokens_per_s).collect());
    let ddp_tokens_per_s = median(ddp.iter().map(|r| r.tokens_per_s).collect());
    json!({
        "sync": args.sync, "sync_every": args.sync_every,
        "ddp_tokens_per_s": ddp_tokens_per_s,
        "ddp_tokens_per_s_runs": ddp.iter().map(|r| r.tokens_per_s).collect::<Vec<_>>(),
        "ratio_vs_ddp": tokens_per_s / ddp_tokens_per_s,
        "bytes_sent_per_step": bytes, "ddp_bytes_sent_per_step": ddp_bytes, "bytes_ratio_vs_ddp": bytes / ddp_bytes,
        "ddp_final_loss": ddp.last().map(|r| r.final_loss),
        "final_loss_runs": ours.iter().map(|r| r.final_loss).collect::<Vec<_>>(),
        "ddp_final_loss_runs": ddp.iter().map(|r| r.final_loss).collect::<Vec<_>>(),
        "eval_loss_runs": ours.iter().map(|r| r.eval_loss).collect::<Vec<_>>(),
        "ddp_eval_loss_runs": ddp.iter().map(|r| r.eval_loss).collect::<Vec<_>>(),
        "eval_loss": median(ours.iter().filter_map(|r| r.eval_loss).collect()),
        "ddp_eval_loss": median(ddp.iter().filter_map(|r| r.eval_loss).collect()),
    })
}

/// The human line of the DDP baseline and the ratios.
pub(super) fn print_line(report: &Value) {
    let f = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    println!(
        "troupe   {:>9.0} tokens/s  (DDP, same run); {} H={} / DDP: tokens/s {:.3}, bytes sent per step {:.0} vs {:.0} ({:.4}), validation loss {:.4} vs {:.4}",
        f("ddp_tokens_per_s"),
        report["sync"].as_str().unwrap_or(""),
        report["sync_every"],
        f("ratio_vs_ddp"),
        f("bytes_sent_per_step"),
        f("ddp_bytes_sent_per_step"),
        f("bytes_ratio_vs_ddp"),
        f("eval_loss"),
        f("ddp_eval_loss"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sent_bytes_add_up_every_peer_and_skip_the_received() {
        let metrics = "# TYPE troupe_link_bytes_total counter\n\
            troupe_link_bytes_total{peer=\"node-1\",direction=\"sent\"} 1000\n\
            troupe_link_bytes_total{peer=\"node-1\",direction=\"received\"} 7\n\
            troupe_link_bytes_total{peer=\"node-2\",direction=\"sent\"} 24\n\
            troupe_other{direction=\"sent\"} 5\n";
        assert_eq!(sent_bytes_of(metrics), 1024);
    }
}
