//! Following a job on a cluster to its end — what `troupe train` on a cluster and `troupe job submit`
//! share: every event through one [`Reporter`] (a progress bar and lines for people, JSON lines with
//! `--json`, the run directory with `--run-dir`), Ctrl-C and SIGTERM, and the summary at the end.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use tokio::signal::unix::{signal, SignalKind};
use troupe_model::config::JobConfig;

use crate::api::{DataPlane, JobEvent, JobHandle, JobId};
use crate::progress::{Reporter, StepEvent};
use crate::protocol::GradientPlane;

/// How long an interrupted follower waits for the controller to confirm a cancellation.
pub const GOODBYE: Duration = Duration::from_secs(5);

/// What Ctrl-C or SIGTERM does to the job being followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnInterrupt {
    /// Cancel it (`troupe train`: the job is the command's own).
    Cancel,
    /// Leave it running on the cluster (`troupe job submit`: the job outlives its follower).
    Detach,
}

/// How a followed job ended.
#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Finished {
        steps: u64,
    },
    Failed {
        reason: String,
    },
    Cancelled,
    /// The follower was interrupted (the job was cancelled or left running, as [`OnInterrupt`] says).
    Interrupted,
}

/// What the follower saw of the job, for the summary and the error messages.
#[derive(Debug, Default)]
pub struct Tally {
    pub first_loss: Option<f64>,
    /// The last (up to) 10 losses.
    pub recent: Vec<f64>,
    pub tokens_per_s: Vec<f64>,
    pub world: usize,
    /// The last committed step seen.
    pub step: u64,
}

/// How the job splits the work, for the human lines.
#[derive(Debug)]
pub struct Mode {
    pub pp: usize,
    /// The tensor-parallel degree and whether sequence parallelism is on.
    pub tp: usize,
    pub sp: bool,
    pub schedule: String,
    pub shard: String,
    /// `parallel.offload` ("" when unknown).
    pub offload: String,
    pub total_steps: u64,
}

impl Mode {
    pub fn of(config: &JobConfig) -> Self {
        let parallel = &config.parallel;
        Self {
            pp: parallel.pp,
            tp: parallel.tp,
            sp: parallel.sp,
            schedule: parallel.schedule.clone(),
            shard: parallel.shard.clone(),
            offload: parallel.offload.clone(),
            total_steps: config.train.steps,
        }
    }

    /// A job watched from elsewhere, whose layout this command does not know (`pp` 0).
    pub fn unknown(total_steps: u64) -> Self {
        Self {
            pp: 0,
            tp: 1,
            sp: false,
            schedule: String::new(),
            shard: String::new(),
            offload: String::new(),
            total_steps,
        }
    }

    /// What else a job needs to run, for the waiting line.
    fn needs(&self) -> String {
        if self.pp > 1 {
            format!(" and one pipeline needs {} slots", self.pp)
        } else {
            String::new()
        }
    }

    fn describe(&self, world: usize) -> String {
        if self.tp > world {
            return format!(
                "a tensor degree below parallel.tp = {} (no whole tensor group left; the change names it)",
                self.tp
            );
        }
        if self.tp > 1 {
            let sp = if self.sp { " with sequence parallelism" } else { "" };
            return format!("{} tensor-parallel group(s) of {}{sp}", world / self.tp, self.tp);
        }
        match (self.pp, self.shard.as_str()) {
            (0, _) => "its layout".into(),
            (1, "none") => "data-parallel".into(),
            (1, shard) => format!("data-parallel with {shard}"),
            (pp, _) => format!("{} {} pipeline(s) of {pp} stages", world / pp, self.schedule),
        }
    }
}

/// Reports the job's events until it ends or the follower is interrupted. `nodes`: the local cluster's
/// size, for the start event (None on a running cluster).
pub async fn follow(
    handle: &mut JobHandle,
    reporter: &Reporter,
    mode: &Mode,
    nodes: Option<usize>,
    on_interrupt: OnInterrupt,
) -> anyhow::Result<(End, Tally)> {
    // Listen for Ctrl-C and SIGTERM before the loop: a signal that arrives while an event is being
    // printed is kept for the next poll (a fresh `ctrl_c()` future per iteration would miss it).
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut tally = Tally::default();
    let report = EventReport { job: handle.id(), reporter, mode, nodes };
    let end = loop {
        let event = tokio::select! {
            e = handle.next_event() => e?,
            _ = interrupt.recv() => break interrupted(handle, reporter, on_interrupt).await,
            _ = terminate.recv() => break interrupted(handle, reporter, on_interrupt).await,
        };
        let Some(event) = event else { anyhow::bail!("job {}: its event stream ended early", handle.id()) };
        if let Some(end) = report.event(&mut tally, event) {
            break end;
        }
    };
    Ok((end, tally))
}

impl Tally {
    /// A committed step: its loss and throughput, the world it ran on.
    fn record_step(&mut self, step: u64, loss: f64, tokens_per_s: f64, world: usize) {
        self.world = world;
        self.step = step;
        self.first_loss.get_or_insert(loss);
        self.recent.push(loss);
        self.tokens_per_s.push(tokens_per_s);
        if self.recent.len() > 10 {
            self.recent.remove(0);
        }
    }
}

/// How [`follow`] reports the events of job `job`.
struct EventReport<'a> {
    job: JobId,
    reporter: &'a Reporter,
    mode: &'a Mode,
    /// As for [`follow`].
    nodes: Option<usize>,
}

impl EventReport<'_> {
    /// Reports `event` and counts it into `tally`; how the job ended when `event` ended it.
    ///
    /// Long: a match with one arm per event, each reporting its own fields.
    fn event(&self, tally: &mut Tally, event: JobEvent) -> Option<End> {
        let (reporter, total) = (self.reporter, self.mode.total_steps);
        match event {
            JobEvent::Started { world, epoch, from_step, attempt, data_plane, plane, plane_reason } => {
                tally.world = world;
                self.started(world, epoch, from_step, attempt, data_plane, (plane, &plane_reason));
            }
            JobEvent::Step {
                step,
                loss,
                lr,
                grad_norm,
                skipped,
                loss_scale,
                tokens_per_s,
                epoch,
                world,
                peak_rss_bytes,
                bubble,
                mfu,
            } => {
                tally.record_step(step, loss, tokens_per_s, world);
                reporter.step(&StepEvent {
                    step,
                    loss,
                    lr,
                    grad_norm,
                    tokens_per_s,
                    epoch,
                    world,
                    peak_rss_bytes,
                    skipped,
                    loss_scale,
                    bubble,
                    mfu,
                });
            }
            JobEvent::Membership { epoch, world, changes } => reporter.event(
                "membership",
                json!({ "epoch": epoch, "world": world, "changes": changes }),
                &format!("membership changed (epoch {epoch}, {world} ranks): {}", changes.join("; ")),
            ),
            JobEvent::Recovered { step, epoch, world } => {
                tally.world = world;
                reporter.event(
                    "recovery",
                    json!({ "step": step, "epoch": epoch, "world": world }),
                    &format!("recovered: continuing after step {step} on {world} ranks (epoch {epoch})"),
                );
            }
            JobEvent::Waiting { nodes: have, min_nodes, wait_s } => self.waiting(have, min_nodes, wait_s),
            JobEvent::Checkpoint { step, path, seconds, bytes } => reporter.checkpoint(step, &path, seconds, bytes),
            JobEvent::Eval { step, loss, perplexity, windows, tokens } => {
                reporter.eval(step, loss, perplexity, windows, tokens)
            }
            JobEvent::RolledBack { from_step, to_step } => reporter.event(
                "rollback",
                json!({ "from_step": from_step, "to_step": to_step }),
                &format!(
                    "every node holding step {from_step} was lost: continuing from the checkpoint of step {to_step}"
                ),
            ),
            JobEvent::Saved { path } => reporter.event(
                "saved",
                json!({ "path": path }),
                &format!("saved final parameters to {}", path.display()),
            ),
            JobEvent::Placed { attempt, tp, pp, dp, ranks } => {
                let nodes: Vec<String> = ranks.iter().map(|r| format!("{}:{}", r.node.0, r.slot)).collect();
                reporter.event(
                    "placed",
                    json!({ "attempt": attempt, "tp": tp, "pp": pp, "dp": dp, "ranks": nodes }),
                    &format!("troupe: {}", crate::protocol::describe_placement(tp, pp, dp, &ranks)),
                );
            }
            JobEvent::Usage { attempt, step, ranks } => reporter.event(
                "usage",
                json!({ "attempt": attempt, "step": step, "ranks": ranks }),
                &format!("troupe: {}", crate::protocol::describe_usage(step, &ranks)),
            ),
            JobEvent::Phases { rank, node, attempt, step, spans, stage } => reporter.record_only(
                "phases",
                json!({ "rank": rank, "node": node, "attempt": attempt, "step": step, "spans": spans, "stage": stage }),
            ),
            JobEvent::Finished { steps, .. } => return Some(End::Finished { steps }),
            JobEvent::Failed { reason } => {
                reporter.event(
                    "failed",
                    json!({ "job": self.job, "reason": reason, "step": tally.step }),
                    &format!("job {} failed after step {} of {total}", self.job, tally.step),
                );
                return Some(End::Failed { reason });
            }
            JobEvent::Cancelled => {
                reporter.event(
                    "cancelled",
                    json!({ "job": self.job, "step": tally.step }),
                    &format!("job {} was cancelled after step {} of {total}", self.job, tally.step),
                );
                return Some(End::Cancelled);
            }
        }
        None
    }

    /// An attempt started on `world` ranks.
    fn started(
        &self,
        world: usize,
        epoch: u64,
        from_step: u64,
        attempt: u64,
        data_plane: DataPlane,
        (plane, plane_reason): (GradientPlane, &str),
    ) {
        let (job, mode, total) = (self.job, self.mode, self.mode.total_steps);
        self.reporter.event(
            "start",
            json!({ "world": world, "pp": mode.pp, "epoch": epoch, "from_step": from_step, "attempt": attempt,
                    "steps": total, "nodes": self.nodes, "job": job, "data_plane": data_plane,
                    "plane": plane, "plane_reason": plane_reason,
                    "offload": mode.offload, "offloaded_state_bytes": 0 }),
            &format!(
                "troupe: job {job} running {} on {world} rank(s), epoch {epoch}, data plane {data_plane}, gradients on the {plane} plane{}{}",
                mode.describe(world),
                if plane_reason.is_empty() { String::new() } else { format!(" ({plane_reason})") },
                if mode.offload == "host" {
                    format!("; {}", troupe_model::optim::offload::CPU_RANK_NOTE)
                } else {
                    String::new()
                }
            ),
        );
    }

    /// The job waits for nodes: `have` offer ranks, `min_nodes` are needed, for at most `wait_s` (0: no
    /// limit).
    fn waiting(&self, have: usize, min_nodes: usize, wait_s: u64) {
        let limit = if wait_s == 0 { "for as long as it takes".to_string() } else { format!("at most {wait_s} s") };
        self.reporter.event(
            "waiting",
            json!({ "nodes": have, "min_nodes": min_nodes, "wait_s": wait_s }),
            &format!(
                "waiting: {have} node(s) offer ranks, elastic.min_nodes is {min_nodes}{}; holding the last committed step {limit}",
                self.mode.needs()
            ),
        )
    }
}

/// Ctrl-C or SIGTERM: cancel the job (bounded) or leave it running, and say which.
async fn interrupted(handle: &mut JobHandle, reporter: &Reporter, on_interrupt: OnInterrupt) -> End {
    let id = handle.id();
    if on_interrupt == OnInterrupt::Detach {
        reporter.say(&format!(
            "troupe: interrupted; job {id} keeps running on the cluster (`troupe job status {id}` shows it, `troupe job cancel {id}` stops it)"
        ));
        return End::Interrupted;
    }
    reporter.say("troupe: interrupted; cancelling the job");
    match tokio::time::timeout(GOODBYE, handle.cancel()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => reporter.say(&format!("troupe: cancelling job {id} failed: {e:#}")),
        Err(_) => reporter.say(&format!("troupe: no answer to the cancellation of job {id} within {GOODBYE:?}")),
    }
    End::Interrupted
}

/// The summary of a finished job (`{"event":"summary",..}` or a `done:` line); `nodes` as for [`follow`].
pub fn summarize(reporter: Reporter, steps: u64, mut tally: Tally, started: Instant, nodes: Option<usize>) {
    let wall = started.elapsed().as_secs_f64();
    let recent = &tally.recent;
    let mean = recent.iter().sum::<f64>() / recent.len().max(1) as f64;
    let first = tally.first_loss.unwrap_or(f64::NAN);
    // Steady-state throughput: the median step (the first steps include start-up).
    tally.tokens_per_s.sort_by(f64::total_cmp);
    let median = tally.tokens_per_s.get(tally.tokens_per_s.len() / 2).copied().unwrap_or(0.0);
    let world = tally.world;
    let mut summary = json!({ "steps": steps, "first_loss": first, "final_loss": recent.last(), "final_loss_mean10": mean,
                              "tokens_per_s": median, "wall_s": wall, "world": world });
    if let (Some(nodes), Some(fields)) = (nodes, summary.as_object_mut()) {
        fields.insert("nodes".into(), json!(nodes));
    }
    reporter.finish(
        summary,
        &format!(
            "done: {steps} steps on {world} ranks in {wall:.1} s; loss {first:.4} → {mean:.4} (mean of the last {}); {median:.0} tokens/s",
            recent.len()
        ),
    );
}

/// Ends the report of a followed job: the summary when it finished, otherwise an error saying what
/// happened and what to try (`on_cluster`: the job ran on a cluster that outlives the command, where
/// `troupe job status` can still show it).
pub fn conclude(
    reporter: Reporter,
    (end, tally): (End, Tally),
    started: Instant,
    nodes: Option<usize>,
    id: u64,
    on_cluster: bool,
) -> anyhow::Result<()> {
    let (step, total) = (tally.step, reporter.total_steps());
    let look = if on_cluster {
        format!("; `troupe job status {id}` shows the job and the controller daemon's log has the details")
    } else {
        String::new()
    };
    match end {
        End::Finished { steps } => {
            summarize(reporter, steps, tally, started, nodes);
            Ok(())
        }
        End::Failed { reason } => {
            reporter.close();
            bail!("job {id} failed after step {step} of {total}: {reason}{look}")
        }
        End::Cancelled => {
            reporter.close();
            bail!(
                "job {id} was cancelled after step {step} of {total} (by `troupe job cancel {id}`); submit it again to \
                 start over, or with checkpoint.dir set to continue from its newest checkpoint"
            )
        }
        End::Interrupted => {
            reporter.close();
            bail!("interrupted after step {step} of {total}")
        }
    }
}
