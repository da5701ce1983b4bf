//! What a controller daemon keeps of each job for its dashboard, fed by [`super::super::NodeMetrics`]'s
//! hook as the job's events pass: the events the loss/throughput chart and the step-phase timeline are
//! drawn from (the same shapes as a run directory's `events.jsonl`, so `troupe plot`'s and `troupe
//! trace`'s drawing serves both), each rank's peak memory at the last step, and a log of what happened.
//! Everything is bounded: the oldest entries go first.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::protocol::JobEvent;
use crate::telemetry::run_dir::now_us;

/// Chart events kept per job (steps, membership changes, recoveries, rollbacks, checkpoints,
/// evaluations); a long job shows its latest steps.
pub const CHART_EVENTS_MAX: usize = 4_000;
/// Phase reports kept per job (one per rank and step): the timeline shows the last few steps.
pub const PHASE_REPORTS_MAX: usize = 64;
/// Log lines kept per job.
pub const LOG_LINES_MAX: usize = 200;

/// One job's history.
#[derive(Clone, Debug, Default)]
pub struct JobHistory {
    pub chart: VecDeque<Value>,
    pub phases: VecDeque<Value>,
    /// (kind, "HH:MM:SS what happened"), oldest first. Kinds: start, membership, recovery, rollback,
    /// checkpoint, eval, waiting, saved, finished, failed, cancelled.
    pub log: VecDeque<(&'static str, String)>,
    /// Each rank's peak resident memory when it voted for the last committed step, in bytes.
    pub peak_rss_bytes: Vec<u64>,
}

fn push<T>(queue: &mut VecDeque<T>, max: usize, item: T) {
    if queue.len() == max {
        queue.pop_front();
    }
    queue.push_back(item);
}

/// The UTC time of day, for log lines.
fn clock() -> String {
    let s = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("{:02}:{:02}:{:02}", s / 3600 % 24, s / 60 % 60, s % 60)
}

impl JobHistory {
    fn chart(&mut self, event: Value) {
        push(&mut self.chart, CHART_EVENTS_MAX, event);
    }

    fn log(&mut self, kind: &'static str, line: String) {
        push(&mut self.log, LOG_LINES_MAX, (kind, format!("{} {line}", clock())));
    }

    /// Takes in one of the job's events.
    pub fn record(&mut self, event: &JobEvent) {
        let t = now_us();
        match event {
            JobEvent::Started { world, epoch, from_step, attempt, .. } => {
                self.chart(json!({ "event": "start", "time_us": t }));
                self.log(
                    "start",
                    format!("attempt {attempt} started on {world} rank(s) at epoch {epoch}, after step {from_step}"),
                );
            }
            JobEvent::Step { step, loss, tokens_per_s, peak_rss_bytes, .. } => {
                self.peak_rss_bytes.clone_from(peak_rss_bytes);
                let loss = loss.is_finite().then_some(*loss);
                self.chart(
                    json!({ "event": "step", "step": step, "loss": loss, "tokens_per_s": tokens_per_s, "time_us": t }),
                );
            }
            JobEvent::Membership { epoch, world, changes } => {
                self.chart(
                    json!({ "event": "membership", "epoch": epoch, "world": world, "changes": changes, "time_us": t }),
                );
                self.log(
                    "membership",
                    format!("membership changed (epoch {epoch}, {world} ranks): {}", changes.join("; ")),
                );
            }
            JobEvent::Recovered { step, epoch, world } => {
                self.chart(json!({ "event": "recovery", "step": step, "epoch": epoch, "world": world, "time_us": t }));
                self.log(
                    "recovery",
                    format!("recovered: continuing after step {step} on {world} ranks (epoch {epoch})"),
                );
            }
            JobEvent::RolledBack { from_step, to_step } => {
                self.chart(json!({ "event": "rollback", "from_step": from_step, "to_step": to_step, "time_us": t }));
                self.log("rollback", format!("every node holding step {from_step} was lost: continuing from the checkpoint of step {to_step}"));
            }
            JobEvent::Checkpoint { step, seconds, bytes, path } => {
                self.chart(json!({ "event": "checkpoint", "step": step, "time_us": t }));
                let mib = *bytes as f64 / (1 << 20) as f64;
                self.log(
                    "checkpoint",
                    format!("checkpoint of step {step} written in {seconds:.2} s ({mib:.1} MiB) to {}", path.display()),
                );
            }
            JobEvent::Eval { step, loss, perplexity, .. } => {
                self.chart(json!({ "event": "eval", "step": step, "loss": loss, "time_us": t }));
                self.log("eval", format!("validation after step {step}: loss {loss:.4}, perplexity {perplexity:.2}"));
            }
            JobEvent::Waiting { nodes, min_nodes, .. } => {
                self.log("waiting", format!("waiting: {nodes} node(s) offer ranks, at least {min_nodes} needed"))
            }
            JobEvent::Saved { path } => self.log("saved", format!("final parameters saved to {}", path.display())),
            JobEvent::Placed { tp, pp, dp, ranks, .. } => {
                self.log("placed", crate::protocol::describe_placement(*tp, *pp, *dp, ranks))
            }
            JobEvent::Usage { step, ranks, .. } => self.log("usage", crate::protocol::describe_usage(*step, ranks)),
            JobEvent::Finished { steps, .. } => self.log("finished", format!("finished after {steps} steps")),
            JobEvent::Failed { reason } => self.log("failed", format!("failed: {reason}")),
            JobEvent::Cancelled => self.log("cancelled", "cancelled".to_owned()),
            JobEvent::Phases { rank, node, attempt, step, spans, stage } => push(
                &mut self.phases,
                PHASE_REPORTS_MAX,
                json!({ "event": "phases", "rank": rank, "node": node, "attempt": attempt, "step": step, "spans": spans, "stage": stage }),
            ),
        }
    }

    /// Nothing recorded (or forgotten).
    pub fn is_empty(&self) -> bool {
        self.chart.is_empty() && self.phases.is_empty() && self.log.is_empty()
    }

    /// The last committed step with phase reports, if any.
    pub fn last_phase_step(&self) -> Option<u64> {
        self.phases.iter().filter_map(|e| e.get("step")?.as_u64()).max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histories_are_bounded_and_keep_the_newest() {
        let mut h = JobHistory::default();
        let step = |step| JobEvent::Step {
            step,
            loss: 1.0,
            lr: 1e-3,
            grad_norm: 1.0,
            skipped: false,
            loss_scale: 1.0,
            tokens_per_s: 10.0,
            epoch: 1,
            world: 1,
            peak_rss_bytes: vec![step],
            bubble: None,
            mfu: None,
        };
        for s in 1..=(CHART_EVENTS_MAX as u64 + 10) {
            h.record(&step(s));
        }
        assert_eq!(h.chart.len(), CHART_EVENTS_MAX);
        assert_eq!(h.chart.front().unwrap()["step"], 11);
        assert_eq!(h.peak_rss_bytes, [CHART_EVENTS_MAX as u64 + 10]);
        for _ in 0..LOG_LINES_MAX + 1 {
            h.record(&JobEvent::Cancelled);
        }
        assert_eq!(h.log.len(), LOG_LINES_MAX);
        h.record(&JobEvent::Membership { epoch: 2, world: 1, changes: vec!["node-2 failed".into()] });
        let (kind, line) = h.log.back().unwrap();
        assert_eq!(*kind, "membership");
        assert!(line.ends_with("membership changed (epoch 2, 1 ranks): node-2 failed"), "{line}");
    }
}
