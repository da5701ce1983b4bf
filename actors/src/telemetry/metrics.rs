//! What a daemon counts for `/metrics`. The node actor updates a [`NodeMetrics`] as job events, view
//! changes and worker failures pass through it; the HTTP endpoint renders it together with the node's
//! [`ClusterStatus`] (epoch, members, jobs) at scrape time. Updating is a short lock and a few additions:
//! cheap enough to do on every event whether or not anyone scrapes. When OTLP export is installed, the
//! same hooks export the controller's spans (a job's life, each recovery, each failure detection) and
//! record the job metrics as OpenTelemetry instruments ([`super::otel_metrics`]). The same hooks keep
//! each job's history for the dashboard ([`super::dashboard`]) and tell its open pages that something
//! changed.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::KeyValue;

use troupe_cluster::membership::Change;

use super::dashboard::{JobHistory, JobSnapshot};
use super::link_bytes::LinkBytes;
use super::prometheus::{Exposition, Histogram, MetricKind};
use super::{otel, otel_metrics};
use crate::protocol::{ClusterStatus, JobEvent, JobId, JobSpec, JobState};

/// Per-job figures the controller daemon sees pass.
#[derive(Clone, Debug)]
struct JobMetrics {
    /// Tokens of one global batch (step time = tokens / tokens_per_s, as the controller measured it).
    tokens_per_step: f64,
    /// Training FLOPs per token: 3 × the forward's (backward ≈ 2 × forward).
    train_flops_per_token: f64,
    commits: u64,
    step_seconds: Histogram,
    tokens_per_s: Option<f64>,
    /// The last committed step's MFU as its step event reported it (the controller's, over each rank's
    /// own peak), when every rank's peak was known.
    mfu: Option<f64>,
    world: usize,
    checkpoint_seconds: Histogram,
    /// Bytes of the durable checkpoints written, and the last one's write throughput.
    checkpoint_bytes: u64,
    checkpoint_bytes_per_second: Option<f64>,
    /// Pipeline jobs: the last committed step's bubble.
    bubble: Option<f64>,
    recovery_seconds: Histogram,
    recoveries: u64,
    rollbacks: u64,
    /// Steps committed without an update because fp16 overflowed.
    skipped_steps: u64,
    /// The loss scale of the last committed step (1 unless fp16).
    loss_scale: Option<f64>,
    /// The last validation loss reported (`train.eval_every`).
    eval_loss: Option<f64>,
    /// When the running attempt was aborted by a view change, until the next committed step.
    interrupted_at: Option<Instant>,
    /// For the OTLP spans: the job's name, when it was submitted, and the wall time and changes of the
    /// interruption in progress.
    name: String,
    /// The job's `JobSpec::trace_seed` (ids of its `job_step` spans).
    trace_seed: u64,
    submitted: SystemTime,
    interrupted: Option<(SystemTime, Vec<String>)>,
    /// What the dashboard draws of the job.
    history: JobHistory,
    /// Finished, failed or cancelled.
    ended: bool,
}

/// Ended jobs whose dashboard history is kept (the newest); older ones keep their counters only.
pub const ENDED_HISTORIES_MAX: usize = 8;

#[derive(Debug, Default)]
struct State {
    jobs: BTreeMap<JobId, JobMetrics>,
    worker_restarts: u64,
    membership_changes: BTreeMap<&'static str, u64>,
    /// By cause: "timeout" (silent for the failure timeout) or "connection_lost" (the transport said so).
    detection_seconds: BTreeMap<&'static str, Histogram>,
}

/// A daemon's counters (shared by the node actor and the HTTP endpoint).
#[derive(Debug)]
pub struct NodeMetrics {
    state: Mutex<State>,
    /// Bumped after every job event and view change: the dashboard's pages wait on it.
    changes: tokio::sync::watch::Sender<u64>,
    /// Peak FLOP/s of one slot (from `telemetry.peak_tflops_per_slot`).
    peak_flops_per_slot: Option<f64>,
    /// Data-plane bytes per peer node, counted by this daemon's ranks.
    pub links: LinkBytes,
}

/// What [`super::otel_metrics::observe_links`] exports.
impl AsRef<LinkBytes> for NodeMetrics {
    fn as_ref(&self) -> &LinkBytes {
        &self.links
    }
}

impl NodeMetrics {
    pub fn new(peak_tflops_per_slot: Option<f64>) -> Self {
        NodeMetrics {
            state: Mutex::default(),
            changes: tokio::sync::watch::Sender::new(0),
            peak_flops_per_slot: peak_tflops_per_slot.map(|t| t * 1e12),
            links: LinkBytes::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Wakes when a job event or a view change passed (the dashboard's live updates).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Each job's last figures for the dashboard, and the histories of the jobs in `drawn`.
    pub fn dashboard(&self, drawn: &[JobId]) -> BTreeMap<JobId, JobSnapshot> {
        let state = self.lock();
        state
            .jobs
            .iter()
            .map(|(id, m)| {
                let history = if drawn.contains(id) { m.history.clone() } else { JobHistory::default() };
                (*id, JobSnapshot { history, tokens_per_s: m.tokens_per_s, mfu: self.mfu(m) })
            })
            .collect()
    }

    /// Keeps the histories of the newest [`ENDED_HISTORIES_MAX`] ended jobs only.
    fn forget_old_histories(state: &mut State) {
        let ended: Vec<JobId> =
            state.jobs.iter().filter(|(_, m)| m.ended && !m.history.is_empty()).map(|(id, _)| *id).collect();
        for id in ended.iter().rev().skip(ENDED_HISTORIES_MAX) {
            if let Some(m) = state.jobs.get_mut(id) {
                m.history = JobHistory::default();
            }
        }
    }

    /// A job was submitted to this (controller) daemon.
    pub fn on_submit(&self, job: JobId, spec: &JobSpec) {
        let config = &spec.config;
        let metrics = JobMetrics {
            tokens_per_step: (config.train.global_batch * config.model.context) as f64,
            train_flops_per_token: 3.0 * config.model.forward_flops_per_token(),
            commits: 0,
            step_seconds: Histogram::seconds(),
            tokens_per_s: None,
            mfu: None,
            world: 0,
            checkpoint_seconds: Histogram::seconds(),
            checkpoint_bytes: 0,
            checkpoint_bytes_per_second: None,
            bubble: None,
            recovery_seconds: Histogram::seconds(),
            recoveries: 0,
            rollbacks: 0,
            skipped_steps: 0,
            loss_scale: None,
            eval_loss: None,
            interrupted_at: None,
            name: spec.name.clone(),
            trace_seed: spec.trace_seed,
            submitted: SystemTime::now(),
            interrupted: None,
            history: JobHistory::default(),
            ended: false,
        };
        self.lock().jobs.insert(job, metrics);
        self.changed();
    }

    pub fn on_job_event(&self, job: JobId, event: &JobEvent, now: Instant) {
        self.record_job_event(job, event, now);
        self.changed();
    }

    fn record_job_event(&self, job: JobId, event: &JobEvent, now: Instant) {
        let mut state = self.lock();
        let Some(m) = state.jobs.get_mut(&job) else { return };
        m.history.record(event);
        match event {
            JobEvent::Step { .. } => self.record_step(job, m, event, now),
            JobEvent::Started { world, .. } => m.world = *world,
            JobEvent::Membership { world, changes, .. } => {
                m.world = *world;
                m.interrupted_at.get_or_insert(now);
                m.interrupted.get_or_insert_with(|| (SystemTime::now(), changes.clone()));
            }
            JobEvent::Recovered { world, .. } => {
                m.world = *world;
                m.recoveries += 1;
            }
            JobEvent::Checkpoint { seconds, bytes, .. } => record_checkpoint(job, m, *seconds, *bytes),
            JobEvent::Eval { loss, .. } => m.eval_loss = Some(*loss),
            JobEvent::RolledBack { .. } => m.rollbacks += 1,
            JobEvent::Finished { .. } | JobEvent::Failed { .. } | JobEvent::Cancelled => {
                export_job_span(job, m, event);
                m.ended = true;
                Self::forget_old_histories(&mut state);
            }
            _ => {}
        }
    }

    /// A committed step (`event`, a [`JobEvent::Step`]): its span, the job's figures, the end of the
    /// interruption in progress (its recovery span) and the OpenTelemetry instruments.
    fn record_step(&self, job: JobId, m: &mut JobMetrics, event: &JobEvent, now: Instant) {
        let JobEvent::Step { step, loss, tokens_per_s, world, epoch, skipped, loss_scale, bubble, mfu, .. } = *event
        else {
            return;
        };
        if otel::enabled() {
            export_step_span(job, m, (step, epoch, world), (loss, tokens_per_s));
        }
        m.commits += 1;
        m.skipped_steps += u64::from(skipped);
        m.loss_scale = Some(loss_scale);
        m.world = world;
        m.tokens_per_s = Some(tokens_per_s);
        m.mfu = mfu;
        m.bubble = bubble;
        let step_seconds = (tokens_per_s > 0.0).then(|| m.tokens_per_step / tokens_per_s);
        if let Some(seconds) = step_seconds {
            m.step_seconds.observe(seconds);
        }
        let recovery = m.interrupted_at.take().map(|at| now.duration_since(at).as_secs_f64());
        if let Some(seconds) = recovery {
            m.recovery_seconds.observe(seconds);
        }
        if let Some((from, changes)) = m.interrupted.take() {
            let attributes = vec![
                KeyValue::new("troupe.job", job as i64),
                KeyValue::new("troupe.epoch", epoch as i64),
                KeyValue::new("troupe.world", world as i64),
                KeyValue::new("troupe.changes", changes.join("; ")),
            ];
            otel::export_job_span("recovery", from, SystemTime::now(), attributes);
        }
        if let Some(i) = otel_metrics::instruments() {
            let attrs = otel_metrics::job_attributes(job, &m.name);
            i.steps_committed.add(1, &attrs);
            step_seconds.inspect(|s| i.step_seconds.record(*s, &attrs));
            recovery.inspect(|s| i.recovery_seconds.record(*s, &attrs));
            i.tokens_per_second.record(tokens_per_s, &attrs);
            i.model_flops_per_second.record(tokens_per_s * m.train_flops_per_token, &attrs);
            if let Some(mfu) = self.mfu(m) {
                i.mfu.record(mfu, &attrs);
            }
            bubble.inspect(|b| i.bubble.record(*b, &attrs));
            if loss.is_finite() {
                i.loss.record(loss, &attrs);
            }
            if skipped {
                i.skipped_steps.add(1, &attrs);
            }
        }
    }

    /// The controller changed the view to `epoch`. A member declared dead — silent for the failure
    /// timeout (`Failed`) or its connection lost (`ConnectionLost`) — had been silent for `silent_ms`
    /// then: that is the failure detection time (a crash to its detection, at most), by cause.
    pub fn on_view_change(&self, epoch: u64, changes: &[Change]) {
        self.record_view_change(epoch, changes);
        self.changed();
    }

    fn record_view_change(&self, epoch: u64, changes: &[Change]) {
        let mut state = self.lock();
        for change in changes {
            let (kind, detected) = match change {
                Change::Joined(_) => ("joined", None),
                Change::Left(_) => ("left", None),
                Change::Failed { node, silent_ms } => ("failed", Some((node, *silent_ms, "timeout"))),
                Change::ConnectionLost { node, silent_ms } => {
                    ("connection_lost", Some((node, *silent_ms, "connection_lost")))
                }
                Change::Restarted(_) => ("restarted", None),
            };
            *state.membership_changes.entry(kind).or_default() += 1;
            let Some((node, silent_ms, cause)) = detected else { continue };
            let seconds = silent_ms as f64 / 1e3;
            state.detection_seconds.entry(cause).or_insert_with(Histogram::seconds).observe(seconds);
            let end = SystemTime::now();
            let attributes = vec![
                KeyValue::new("troupe.failed_node", node.0.clone()),
                KeyValue::new("troupe.cause", cause),
                KeyValue::new("troupe.epoch", epoch as i64),
            ];
            let start = end.checked_sub(Duration::from_millis(silent_ms)).unwrap_or(end);
            otel::export_job_span("failure_detection", start, end, attributes);
            if let Some(i) = otel_metrics::instruments() {
                i.failure_detection_seconds.record(seconds, &[KeyValue::new("cause", cause)]);
            }
        }
    }

    /// A job's model FLOPs utilisation at its last step: the step event's (what `troupe train` and the
    /// dashboard show), else — the controller did not know every rank's peak — over world × this
    /// node's configured peak.
    fn mfu(&self, m: &JobMetrics) -> Option<f64> {
        if m.mfu.is_some() {
            return m.mfu;
        }
        let peak = self.peak_flops_per_slot?;
        (m.world > 0).then_some(())?;
        m.tokens_per_s.map(|t| t * m.train_flops_per_token / (peak * m.world as f64))
    }

    pub fn on_worker_failure(&self) {
        self.lock().worker_restarts += 1;
    }

    /// The Prometheus exposition of this daemon: its view of the cluster and its counters.
    pub fn render(&self, status: &ClusterStatus) -> String {
        let state = self.lock();
        let mut e = Exposition::default();
        let role = if status.controller { "controller" } else { "member" };
        e.single(
            "troupe_node_info",
            MetricKind::Gauge,
            "This daemon (always 1).",
            &[("node", &status.node), ("role", role)],
            1.0,
        );
        e.single(
            "troupe_membership_epoch",
            MetricKind::Gauge,
            "Epoch of the membership view this daemon acts on.",
            &[],
            status.epoch as f64,
        );
        e.single(
            "troupe_membership_members",
            MetricKind::Gauge,
            "Members in the view.",
            &[],
            status.members.len() as f64,
        );
        e.family("troupe_membership_slots", MetricKind::Gauge, "Device slots each member offers.");
        for m in &status.members {
            e.sample("troupe_membership_slots", &[("member", &m.name)], f64::from(m.slots));
        }
        e.single(
            "troupe_membership_joining",
            MetricKind::Gauge,
            "Nodes waiting for a step boundary to join.",
            &[],
            status.joining.len() as f64,
        );
        e.single(
            "troupe_refused_stale_total",
            MetricKind::Counter,
            "Messages refused for a stale epoch (fencing).",
            &[],
            status.refused_stale as f64,
        );
        e.family(
            "troupe_membership_changes_total",
            MetricKind::Counter,
            "View changes made by this controller, by kind.",
        );
        for kind in ["joined", "left", "failed", "connection_lost", "restarted"] {
            let n = state.membership_changes.get(kind).copied().unwrap_or(0);
            e.sample("troupe_membership_changes_total", &[("kind", kind)], n as f64);
        }
        if !state.detection_seconds.is_empty() {
            let name = "troupe_failure_detection_seconds";
            e.family(
                name,
                MetricKind::Histogram,
                "Silence of a member when it was declared failed or its connection lost.",
            );
            for (cause, h) in &state.detection_seconds {
                e.histogram(name, &[("cause", cause)], h);
            }
        }
        e.family(
            "troupe_link_bytes_total",
            MetricKind::Counter,
            "Data-plane payload bytes this daemon's ranks exchanged with each peer node.",
        );
        for (peer, sent, received) in self.links.snapshot() {
            e.sample("troupe_link_bytes_total", &[("peer", &peer), ("direction", "sent")], sent as f64);
            e.sample("troupe_link_bytes_total", &[("peer", &peer), ("direction", "received")], received as f64);
        }
        e.single(
            "troupe_worker_restarts_total",
            MetricKind::Counter,
            "Worker actors of this daemon that failed and were restarted.",
            &[],
            state.worker_restarts as f64,
        );
        self.render_jobs(&state, status, &mut e);
        e.finish()
    }

    /// The job families, one sample per job of `status` in each.
    fn render_jobs(&self, state: &State, status: &ClusterStatus, e: &mut Exposition) {
        if status.jobs.is_empty() {
            return;
        }
        let jobs = JobFamilies { status, state, ids: status.jobs.iter().map(|j| j.id.to_string()).collect() };
        jobs.render_progress(e);
        jobs.render_throughput(e, self);
        jobs.render_durability(e);
        jobs.render_states(e);
        jobs.render_histograms(e);
    }
}

/// The jobs of one exposition: each family has a sample per job of `status` (labelled with its id and
/// name), from the status or from the job's [`JobMetrics`].
struct JobFamilies<'a> {
    status: &'a ClusterStatus,
    state: &'a State,
    /// The jobs' ids as label values.
    ids: Vec<String>,
}

impl<'a> JobFamilies<'a> {
    fn labels(&self, i: usize) -> [(&'static str, &str); 2] {
        [("job", self.ids[i].as_str()), ("name", self.status.jobs[i].name.as_str())]
    }

    /// The figures this daemon counted of job `i` (none when it is not its controller).
    fn job(&self, i: usize) -> Option<&'a JobMetrics> {
        self.state.jobs.get(&self.status.jobs[i].id)
    }

    /// Family `name` with a sample for each job `value` has one of.
    fn each(&self, e: &mut Exposition, name: &str, kind: MetricKind, help: &str, value: &dyn Fn(usize) -> Option<f64>) {
        e.family(name, kind, help);
        for i in 0..self.status.jobs.len() {
            if let Some(v) = value(i) {
                e.sample(name, &self.labels(i), v);
            }
        }
    }

    /// Where each job is: steps, world, attempts, losses.
    fn render_progress(&self, e: &mut Exposition) {
        let (status, job) = (self.status, |i| self.job(i));
        self.each(
            e,
            "troupe_job_step",
            MetricKind::Gauge,
            "Committed steps of the job (its position in training).",
            &|i| Some(status.jobs[i].step as f64),
        );
        // Named `troupe_job_steps_total` before: a gauge named like a counter, which promtool refuses.
        self.each(e, "troupe_job_planned_steps", MetricKind::Gauge, "Steps the job trains for.", &|i| {
            Some(status.jobs[i].total_steps as f64)
        });
        self.each(
            e,
            "troupe_job_steps_committed_total",
            MetricKind::Counter,
            "Step commits (a step redone after a rollback counts again).",
            &|i| job(i).map(|m| m.commits as f64),
        );
        self.each(e, "troupe_job_world", MetricKind::Gauge, "Ranks of the job's current attempt.", &|i| {
            Some(status.jobs[i].world as f64)
        });
        self.each(
            e,
            "troupe_job_attempts_total",
            MetricKind::Counter,
            "Attempts started (the first, then one per recovery or retry).",
            &|i| Some(status.jobs[i].attempts as f64),
        );
        self.each(e, "troupe_job_loss", MetricKind::Gauge, "Loss of the last committed step.", &|i| {
            status.jobs[i].last_loss
        });
        self.each(
            e,
            "troupe_job_eval_loss",
            MetricKind::Gauge,
            "Validation loss of the last evaluation (train.eval_every).",
            &|i| job(i).and_then(|m| m.eval_loss).filter(|l| l.is_finite()),
        );
    }

    /// How fast each job trains: tokens/s, model FLOP/s, MFU (where known) and bubble.
    fn render_throughput(&self, e: &mut Exposition, metrics: &NodeMetrics) {
        let job = |i| self.job(i);
        self.each(
            e,
            "troupe_job_tokens_per_second",
            MetricKind::Gauge,
            "Tokens per second of the last committed step.",
            &|i| job(i).and_then(|m| m.tokens_per_s),
        );
        self.each(
            e,
            "troupe_job_model_flops_per_second",
            MetricKind::Gauge,
            "Achieved model FLOP/s: 3 x forward FLOPs per token x tokens/s.",
            &|i| job(i).and_then(|m| m.tokens_per_s.map(|t| t * m.train_flops_per_token)),
        );
        self.each(
            e,
            "troupe_job_mfu",
            MetricKind::Gauge,
            "Model FLOPs utilisation of the last committed step: achieved FLOP/s over the sum of the ranks' peaks (the step event's mfu), else over world x peak_tflops_per_slot.",
            &|i| job(i).and_then(|m| metrics.mfu(m)),
        );
        self.each(
            e,
            "troupe_job_bubble_fraction",
            MetricKind::Gauge,
            "Pipeline jobs: idle over device time in the last committed step's schedule.",
            &|i| job(i).and_then(|m| m.bubble),
        );
    }

    /// What each job kept and lost: checkpoints, recoveries, rollbacks, skipped steps, loss scale.
    fn render_durability(&self, e: &mut Exposition) {
        let job = |i| self.job(i);
        self.each(
            e,
            "troupe_job_checkpoint_bytes_total",
            MetricKind::Counter,
            "Bytes of durable checkpoints written.",
            &|i| job(i).map(|m| m.checkpoint_bytes as f64),
        );
        self.each(
            e,
            "troupe_job_checkpoint_bytes_per_second",
            MetricKind::Gauge,
            "Write throughput of the last durable checkpoint (bytes over its write and commit time).",
            &|i| job(i).and_then(|m| m.checkpoint_bytes_per_second),
        );
        self.each(
            e,
            "troupe_job_recoveries_total",
            MetricKind::Counter,
            "Attempts resumed after a membership change.",
            &|i| job(i).map(|m| m.recoveries as f64),
        );
        self.each(
            e,
            "troupe_job_rollbacks_total",
            MetricKind::Counter,
            "Continuations from a durable checkpoint after the committed state was lost.",
            &|i| job(i).map(|m| m.rollbacks as f64),
        );
        self.each(
            e,
            "troupe_job_skipped_steps_total",
            MetricKind::Counter,
            "Steps committed without an update because the fp16 gradients overflowed.",
            &|i| job(i).map(|m| m.skipped_steps as f64),
        );
        self.each(
            e,
            "troupe_job_loss_scale",
            MetricKind::Gauge,
            "The loss scale of the last committed step (1 unless fp16).",
            &|i| job(i).and_then(|m| m.loss_scale),
        );
    }

    /// `troupe_job_state`: 1 for each job's state.
    fn render_states(&self, e: &mut Exposition) {
        e.family("troupe_job_state", MetricKind::Gauge, "1 for the job's state.");
        for (i, j) in self.status.jobs.iter().enumerate() {
            let [job, name] = self.labels(i);
            e.sample("troupe_job_state", &[job, name, ("state", state_name(j.state))], 1.0);
        }
    }

    /// The histograms of the jobs this daemon controls: step, checkpoint and recovery times.
    fn render_histograms(&self, e: &mut Exposition) {
        for (metric, help, pick) in [
            (
                "troupe_job_step_seconds",
                "Wall time between step commits at the controller.",
                (|m: &JobMetrics| &m.step_seconds) as fn(&JobMetrics) -> &Histogram,
            ),
            ("troupe_job_checkpoint_seconds", "Time rank 0 took to write and commit a durable checkpoint.", |m| {
                &m.checkpoint_seconds
            }),
            (
                "troupe_job_recovery_seconds",
                "From the view change that aborted an attempt to the next committed step.",
                |m| &m.recovery_seconds,
            ),
        ] {
            e.family(metric, MetricKind::Histogram, help);
            for i in 0..self.status.jobs.len() {
                if let Some(m) = self.job(i) {
                    e.histogram(metric, &self.labels(i), pick(m));
                }
            }
        }
    }
}

/// The OTLP span of step `step` of `job`, ending now and as long as the step took at `tokens_per_s`.
fn export_step_span(
    job: JobId,
    m: &JobMetrics,
    (step, epoch, world): (u64, u64, usize),
    (loss, tokens_per_s): (f64, f64),
) {
    let seconds = if tokens_per_s > 0.0 { m.tokens_per_step / tokens_per_s } else { 0.0 };
    let end = SystemTime::now();
    let start = end.checked_sub(Duration::from_secs_f64(seconds)).unwrap_or(end);
    let attributes = vec![
        KeyValue::new("troupe.job", job as i64),
        KeyValue::new("troupe.step", step as i64),
        KeyValue::new("troupe.epoch", epoch as i64),
        KeyValue::new("troupe.world", world as i64),
        KeyValue::new("troupe.loss", loss),
    ];
    otel::export_job_step(m.trace_seed, job, step, start, end, attributes);
}

/// A durable checkpoint of `bytes` written and committed in `seconds`.
fn record_checkpoint(job: JobId, m: &mut JobMetrics, seconds: f64, bytes: u64) {
    m.checkpoint_seconds.observe(seconds);
    m.checkpoint_bytes += bytes;
    let rate = (bytes > 0 && seconds > 0.0).then(|| bytes as f64 / seconds);
    if rate.is_some() {
        m.checkpoint_bytes_per_second = rate;
    }
    if let Some(i) = otel_metrics::instruments() {
        let attrs = otel_metrics::job_attributes(job, &m.name);
        i.checkpoint_seconds.record(seconds, &attrs);
        i.checkpoint_bytes.add(bytes, &attrs);
        rate.inspect(|r| i.checkpoint_bytes_per_second.record(*r, &attrs));
    }
}

/// The OTLP span of the job's life, from its submission to now: `event` ended it (finished, failed or
/// cancelled).
fn export_job_span(job: JobId, m: &JobMetrics, event: &JobEvent) {
    let outcome = if let JobEvent::Failed { .. } = event {
        "failed"
    } else if let JobEvent::Cancelled = event {
        "cancelled"
    } else {
        "finished"
    };
    let attributes = vec![
        KeyValue::new("troupe.job", job as i64),
        KeyValue::new("troupe.job.name", m.name.clone()),
        KeyValue::new("troupe.outcome", outcome),
        KeyValue::new("troupe.steps_committed", m.commits as i64),
    ];
    otel::export_job_span("job", m.submitted, SystemTime::now(), attributes);
}

fn state_name(state: JobState) -> &'static str {
    match state {
        JobState::Waiting => "waiting",
        JobState::Running => "running",
        JobState::Finished => "finished",
        JobState::Failed => "failed",
        JobState::Cancelled => "cancelled",
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use troupe_cluster::membership::NodeId;
    use troupe_model::config::JobConfig;

    use super::*;
    use crate::api::Job;
    use crate::protocol::{JobInfo, MemberInfo};
    use crate::telemetry::prometheus::{parse, Sample};

    fn status(step: u64) -> ClusterStatus {
        let member = |name: &str| MemberInfo {
            name: name.into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            slots: 1,
            dashboard: None,
            raft_listen: None,
            devices: Vec::new(),
            load: None,
        };
        ClusterStatus {
            node: "a".into(),
            controller: true,
            controller_addr: None,
            epoch: 3,
            members: vec![member("a"), member("b")],
            joining: vec![],
            jobs: vec![JobInfo {
                id: 7,
                name: "t".into(),
                state: JobState::Running,
                step,
                total_steps: 10,
                epoch: 3,
                world: 1,
                attempts: 2,
                last_loss: Some(2.5),
                reason: None,
                events: 0,
                ranks: vec![],
                data_plane: Default::default(),
                plane: Default::default(),
                plane_reason: String::new(),
            }],
            refused_stale: 1,
            changes: vec![],
        }
    }

    fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
        samples
            .iter()
            .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
            .unwrap_or_else(|| panic!("no {name}{labels:?}"))
            .value
    }

    #[test]
    fn the_dashboard_keeps_the_histories_of_the_newest_ended_jobs_and_copies_only_those_drawn() {
        let metrics = NodeMetrics::new(None);
        let spec = Job::new(JobConfig::small(10)).into_spec();
        let jobs: Vec<JobId> = (1..=ENDED_HISTORIES_MAX as u64 + 2).collect();
        let changes = metrics.subscribe();
        for &id in &jobs {
            metrics.on_submit(id, &spec);
            metrics.on_job_event(id, &JobEvent::Finished { steps: 10, final_loss: None }, Instant::now());
        }
        assert!(changes.has_changed().unwrap(), "open pages are told");
        let kept = |drawn: &[JobId]| -> Vec<JobId> {
            metrics.dashboard(drawn).into_iter().filter(|(_, s)| !s.history.is_empty()).map(|(id, _)| id).collect()
        };
        assert_eq!(kept(&jobs), jobs[2..], "the two oldest ended jobs' histories are forgotten");
        assert_eq!(kept(&[5]), [5], "only the drawn jobs' histories are copied");
        assert_eq!(metrics.dashboard(&[]).len(), jobs.len(), "every job's figures");
    }

    #[test]
    fn steps_recoveries_detections_and_mfu_are_counted_and_rendered() {
        let metrics = NodeMetrics::new(Some(1.0));
        let spec = Job::new(JobConfig::small(10)).into_spec();
        metrics.on_submit(7, &spec);
        let tokens = (spec.config.train.global_batch * spec.config.model.context) as f64;
        let step = |step, tokens_per_s, world| JobEvent::Step {
            peak_rss_bytes: vec![],
            step,
            loss: 2.5,
            lr: 1e-3,
            grad_norm: 1.0,
            skipped: step == 2,
            loss_scale: 65536.0 / step as f64,
            tokens_per_s,
            epoch: 3,
            world,
            bubble: (step == 2).then_some(0.25),
            mfu: None,
        };
        let t0 = Instant::now();
        metrics.on_job_event(7, &step(1, tokens / 0.2, 2), t0);
        metrics.on_job_event(7, &JobEvent::Membership { epoch: 3, world: 1, changes: vec!["b failed".into()] }, t0);
        metrics.on_view_change(3, &[Change::Failed { node: NodeId::from("b"), silent_ms: 1_600 }]);
        metrics.on_view_change(4, &[Change::ConnectionLost { node: NodeId::from("c"), silent_ms: 300 }]);
        metrics.on_job_event(7, &JobEvent::Recovered { step: 1, epoch: 3, world: 1 }, t0 + Duration::from_millis(100));
        metrics.on_job_event(7, &step(2, tokens / 0.05, 1), t0 + Duration::from_millis(400));
        metrics.on_job_event(
            7,
            &JobEvent::Checkpoint { step: 2, path: "/c".into(), seconds: 0.5, bytes: 3_000_000 },
            t0,
        );
        let eval = |step, loss: f64| JobEvent::Eval { step, loss, perplexity: loss.exp(), windows: 4, tokens: 128 };
        metrics.on_job_event(7, &eval(1, 3.25), t0);
        metrics.on_job_event(7, &eval(2, 3.125), t0);
        metrics.on_worker_failure();
        metrics.links.link("b").sent.fetch_add(10, std::sync::atomic::Ordering::Relaxed);

        let samples = parse(&metrics.render(&status(2))).unwrap();
        let job = [("job", "7"), ("name", "t")];
        assert_eq!(value(&samples, "troupe_job_steps_committed_total", &job), 2.0);
        assert_eq!(value(&samples, "troupe_job_step_seconds_count", &job), 2.0);
        assert!((value(&samples, "troupe_job_step_seconds_sum", &job) - 0.25).abs() < 1e-9);
        assert_eq!(value(&samples, "troupe_job_step_seconds_bucket", &[("job", "7"), ("le", "0.1")]), 1.0);
        assert_eq!(value(&samples, "troupe_job_recovery_seconds_count", &job), 1.0);
        assert!((value(&samples, "troupe_job_recovery_seconds_sum", &job) - 0.4).abs() < 1e-9);
        assert_eq!(value(&samples, "troupe_job_recoveries_total", &job), 1.0);
        assert_eq!(value(&samples, "troupe_job_skipped_steps_total", &job), 1.0);
        assert_eq!(value(&samples, "troupe_job_loss_scale", &job), 32768.0);
        assert_eq!(value(&samples, "troupe_job_eval_loss", &job), 3.125, "the last evaluation's");
        assert_eq!(value(&samples, "troupe_job_checkpoint_seconds_count", &job), 1.0);
        assert_eq!(value(&samples, "troupe_failure_detection_seconds_sum", &[("cause", "timeout")]), 1.6);
        assert_eq!(value(&samples, "troupe_failure_detection_seconds_sum", &[("cause", "connection_lost")]), 0.3);
        assert_eq!(value(&samples, "troupe_membership_changes_total", &[("kind", "failed")]), 1.0);
        assert_eq!(value(&samples, "troupe_membership_changes_total", &[("kind", "connection_lost")]), 1.0);
        assert_eq!(value(&samples, "troupe_job_bubble_fraction", &job), 0.25, "the last step's");
        assert_eq!(value(&samples, "troupe_job_checkpoint_bytes_total", &job), 3e6);
        assert_eq!(value(&samples, "troupe_job_checkpoint_bytes_per_second", &job), 6e6);
        assert_eq!(value(&samples, "troupe_membership_members", &[]), 2.0);
        assert_eq!(value(&samples, "troupe_worker_restarts_total", &[]), 1.0);
        assert_eq!(value(&samples, "troupe_link_bytes_total", &[("peer", "b"), ("direction", "sent")]), 10.0);
        let flops = value(&samples, "troupe_job_model_flops_per_second", &job);
        assert!((flops - tokens / 0.05 * 3.0 * spec.config.model.forward_flops_per_token()).abs() < 1e-6 * flops);
        assert!((value(&samples, "troupe_job_mfu", &job) - flops / 1e12).abs() < 1e-12, "one rank × 1 TFLOP/s");
        // A step whose event carries the controller's MFU (each rank's own peak) is reported as it is,
        // on any node, with or without a peak configured there.
        let mut reported = step(3, tokens / 0.05, 1);
        if let JobEvent::Step { mfu, .. } = &mut reported {
            *mfu = Some(0.375);
        }
        for node in [&metrics, &NodeMetrics::new(None)] {
            node.on_submit(7, &spec);
            node.on_job_event(7, &reported, t0);
            let samples = parse(&node.render(&status(2))).unwrap();
            assert_eq!(value(&samples, "troupe_job_mfu", &job), 0.375, "the step event's");
        }
        assert_eq!(value(&samples, "troupe_job_state", &[("state", "running")]), 1.0);

        // Every family rendered is in the metrics table of docs/runtime-semantics.md.
        let docs = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/runtime-semantics.md"));
        let table = &docs[docs.find("| metric | type | meaning |").expect("the metrics table")..];
        let table = &table[..table.find("\n\n").unwrap_or(table.len())];
        let text = metrics.render(&status(2));
        let families: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next()).collect();
        assert!(families.len() >= 30, "every family rendered: {families:?}");
        let missing: Vec<&&str> = families
            .iter()
            .filter(|f| !table.contains(&format!("`{f}`")) && !table.contains(&format!("`{f}{{")))
            .collect();
        assert!(missing.is_empty(), "metrics missing from the table in docs/runtime-semantics.md: {missing:?}");
    }
}
