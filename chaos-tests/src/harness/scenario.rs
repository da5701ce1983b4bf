//! A chaos scenario: the job to run, the cluster to run it on, and the faults to inject (the nemesis
//! schedule). Scenarios are TOML files; the shipped ones are compiled in and listed by `troupe chaos list`.
//!
//! ```toml
//! description = "SIGKILL one worker node mid-run; the job shrinks and continues"
//! nodes = 3                 # daemons; node 0 runs the controller
//! controllers = 1           # controller-eligible daemons: 3 (or 5) lists nodes 0..3 in every node.toml's
//!                           # `controllers`, a Raft group whose leader is the controller (docs/runtime-
//!                           # semantics.md, "Replicated controller"); 1: node 0 alone, restarting in place
//! controller_slots = 1      # 0: a dedicated controller node without a worker (one controller only)
//! steps = 30                # training steps of the small test model (JobConfig::small)
//! job = "job.toml"          # or train this job config (the TOML `troupe train --config` takes; relative
//!                           # to the scenario file): steps, precision, pp, tp, schedule and
//!                           # inject_overflow_at then come from it and may not be set here
//! checkpoint_every = 0      # durable checkpoints every N steps (0: none)
//! progress_bound_s = 30     # after each fault heals, a step commits within this bound
//! network = "loopback"      # or "namespaces": a network namespace per daemon (link faults; root)
//! precision = "fp32"        # or "bf16" / "fp16": the job's compute precision (the checks then allow
//!                           # the 16-bit tolerance, docs/runtime-semantics.md "Mixed precision")
//! inject_overflow_at = []   # fp16: steps whose gradient overflows (train.inject_overflow_at); each must
//!                           # be committed as skipped, every time it is committed
//! pp = 1                    # pipeline stages (one rank each; the world is whole pipelines)
//! schedule = "1f1b"         # pipeline schedule with pp > 1: gpipe | 1f1b | interleaved | zb-h1
//! tp = 1                    # tensor parallelism (parallel.tp): the world is whole tensor groups
//!
//! [membership]              # every daemon's [membership] (node.toml's table; defaults as there), e.g.
//! failure_detector = "fixed"         # the fixed timeout instead of the adaptive detector (the default,
//!                                    # floor failure_timeout_min_ms, ceiling failure_timeout_ms)
//!
//! [[faults]]
//! kind = "kill"             # kill | pause | partition | flaky-link | reorder | corrupt-checkpoint |
//!                           # fill-disk | rolling-restart
//! node = "random-worker"    # an index, "random-worker", "all-workers", "all-nodes" (node 0 too) or
//!                           # "controller": the node that is the controller when the fault starts (the
//!                           # Raft leader, asked of the daemons then; node 0 with one controller)
//! at_step = 8               # when the job has committed this step ... (or at_s: exactly one of them)
//! at_s = 2.5                # ... or this many seconds after the job committed its first step ...
//! jitter_ms = 300           # ... plus a delay drawn from the seed in [0, jitter_ms] (mid-step)
//! duration_s = 4.0          # pause: stopped this long; fill-disk: kept full this long; partition: cut
//!                           # this long, or for the rest of the run when 0 (a machine gone silent)
//! return_after_s = 3.0      # kill: the node's daemon starts again after this long (shrink, then grow)
//! one_way = false           # partition: drop only what the node receives
//! loss_percent = 5.0        # flaky-link / reorder: packets lost each way
//! delay_ms = 20             # flaky-link / reorder: every packet held this long each way ...
//! delay_jitter_ms = 5       # ... plus or minus up to this much
//! reorder_percent = 0.0     # a share of packets held reorder_ms longer, so later ones overtake them
//! reorder_ms = 10
//! duplicate_percent = 0.0   # a share of the packets the node sends, sent twice
//!                           # (link faults: tc netem where the kernel has it, else a userspace nemesis
//!                           # on NFQUEUE; the report says which)
//!
//! [expect]                  # effects the faults must visibly have
//! regrown = true            # after the last fault heals, steps commit on every node again
//! rolled_back = false       # the job rolled back to a durable checkpoint (not a corrupted one)
//! checkpoints_failed = false  # a checkpoint due was not written, and a later one was
//! fenced = false            # pause: the woken zombie was fenced (the controller refused its stale
//!                           # messages) and rejoined as a new member
//! taken_over = false        # controllers >= 3: each fault on the controller made another controller the
//!                           # leader, in a later Raft term
//! deposed = false           # ... and the old leader, woken or reachable again, recorded that it is no
//!                           # longer the controller and was admitted again as a member
//! ```

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Deserialize;
use troupe_cluster::membership::MembershipConfig;
use troupe_model::config::JobConfig;

use super::link::LinkShape;

/// The scenarios that ship with troupe: (name, TOML).
pub const SHIPPED: &[(&str, &str)] = &[
    ("kill-worker", include_str!("../../scenarios/kill-worker.toml")),
    ("kill-two-workers", include_str!("../../scenarios/kill-two-workers.toml")),
    ("kill-and-return", include_str!("../../scenarios/kill-and-return.toml")),
    ("pause-beyond-timeout", include_str!("../../scenarios/pause-beyond-timeout.toml")),
    ("rolling-restart", include_str!("../../scenarios/rolling-restart.toml")),
    ("corrupt-latest-checkpoint", include_str!("../../scenarios/corrupt-latest-checkpoint.toml")),
    ("disk-full-during-checkpoint", include_str!("../../scenarios/disk-full-during-checkpoint.toml")),
    ("partition-minority", include_str!("../../scenarios/partition-minority.toml")),
    ("partition-one-way", include_str!("../../scenarios/partition-one-way.toml")),
    ("partition-plaintext-tcp", include_str!("../../scenarios/partition-plaintext-tcp.toml")),
    ("partition-encrypted-tcp", include_str!("../../scenarios/partition-encrypted-tcp.toml")),
    ("flaky-link", include_str!("../../scenarios/flaky-link.toml")),
    ("fp16-overflow-and-kill", include_str!("../../scenarios/fp16-overflow-and-kill.toml")),
    ("pipeline-kill-stage", include_str!("../../scenarios/pipeline-kill-stage.toml")),
    ("kill-controller-node", include_str!("../../scenarios/kill-controller-node.toml")),
    ("pause-controller-node", include_str!("../../scenarios/pause-controller-node.toml")),
    ("partition-controller-node", include_str!("../../scenarios/partition-controller-node.toml")),
    ("reorder-link", include_str!("../../scenarios/reorder-link.toml")),
    ("silent-machine", include_str!("../../scenarios/silent-machine.toml")),
    ("kill-controller-permanently", include_str!("../../scenarios/kill-controller-permanently.toml")),
    ("partition-controller-minority", include_str!("../../scenarios/partition-controller-minority.toml")),
    ("pause-controller-beyond-election", include_str!("../../scenarios/pause-controller-beyond-election.toml")),
    ("rolling-restart-three-controllers", include_str!("../../scenarios/rolling-restart-three-controllers.toml")),
    ("tensor-group-across-hosts-kill", include_str!("../../scenarios/tensor-group-across-hosts-kill.toml")),
    ("tensor-pipeline-across-hosts-kill", include_str!("../../scenarios/tensor-pipeline-across-hosts-kill.toml")),
];

/// The scenario keys a job config file sets instead.
const JOB_KEYS: [&str; 6] = ["steps", "precision", "pp", "tp", "schedule", "inject_overflow_at"];

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(skip)]
    pub name: String,
    pub description: String,
    #[serde(default = "three")]
    pub nodes: usize,
    /// Controller-eligible daemons (nodes `0..controllers`): 1, node 0 alone; 3 or 5, a Raft group.
    #[serde(default = "one")]
    pub controllers: usize,
    #[serde(default)]
    pub controller_slots: Option<u32>,
    #[serde(default = "thirty")]
    pub steps: u64,
    /// A job config file (the TOML `troupe train --config` takes) to train instead of the small test
    /// model; see [`Scenario::with_job_file`].
    #[serde(default)]
    pub job: Option<PathBuf>,
    /// The job config `job` names, loaded.
    #[serde(skip)]
    pub job_config: Option<JobConfig>,
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Size of the tmpfs that holds the checkpoints (MiB); 0: a plain directory. `fill-disk` needs one.
    #[serde(default)]
    pub checkpoint_tmpfs_mib: u64,
    #[serde(default = "thirty_s")]
    pub progress_bound_s: f64,
    /// `loopback` (default), or `namespaces`: every daemon in its own network namespace behind a
    /// bridge, so that partition and flaky-link faults can cut and degrade its links (needs root).
    #[serde(default)]
    pub network: NetworkKind,
    /// The job's data plane: `auto` (default), `quic`, `encrypted_tcp` or `plaintext_tcp` (tensors
    /// between the daemons' namespaces over TCP, sealed or not, set up through QUIC).
    #[serde(default)]
    pub data_plane: troupe_actors::api::DataPlane,
    #[serde(default = "fp32")]
    pub precision: String,
    #[serde(default)]
    pub inject_overflow_at: Vec<u64>,
    /// Pipeline stages (`parallel.pp`): each rank one stage, the world whole pipelines.
    #[serde(default = "one")]
    pub pp: usize,
    #[serde(default = "one_f_one_b")]
    pub schedule: String,
    /// Tensor-parallel degree (`parallel.tp`): the world is whole tensor groups of `tp` ranks.
    #[serde(default = "one")]
    pub tp: usize,
    /// Every daemon's `[membership]`: the failure detector and its timeouts (node.toml's table).
    #[serde(default)]
    pub membership: MembershipConfig,
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// What the faults must visibly cause, beyond the invariants every run checks.
    #[serde(default)]
    pub expect: Expect,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum NetworkKind {
    #[default]
    Loopback,
    Namespaces,
}

/// Effects a scenario expects of its faults (all default to false).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// After the last fault heals, steps commit on every node again (the lost node rejoined).
    #[serde(default)]
    pub regrown: bool,
    /// The job rolled back to a durable checkpoint, and not to one the nemesis corrupted.
    #[serde(default)]
    pub rolled_back: bool,
    /// Some checkpoint due was not written, and a later one was.
    #[serde(default)]
    pub checkpoints_failed: bool,
    /// Every paused node was fenced when it woke (the controller refused its stale messages) and
    /// rejoined as a new member.
    #[serde(default)]
    pub fenced: bool,
    /// Replicated controllers: every fault on the controller made another controller the leader, in a
    /// later Raft term.
    #[serde(default)]
    pub taken_over: bool,
    /// Replicated controllers: every old leader a fault hit, back (woken, reachable again), recorded that
    /// it is no longer the controller and was admitted again as a member.
    #[serde(default)]
    pub deposed: bool,
}

fn fp32() -> String {
    "fp32".into()
}

fn one() -> usize {
    1
}

fn one_f_one_b() -> String {
    "1f1b".into()
}

fn three() -> usize {
    3
}
fn thirty() -> u64 {
    30
}
fn thirty_s() -> f64 {
    30.0
}
fn ten() -> u64 {
    10
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub kind: FaultKind,
    #[serde(default)]
    pub node: Target,
    /// When the job has committed this step (exactly one of `at_step` and `at_s`).
    #[serde(default)]
    pub at_step: Option<u64>,
    /// This many seconds after the job committed its first step.
    #[serde(default)]
    pub at_s: Option<f64>,
    #[serde(default)]
    pub jitter_ms: u64,
    #[serde(default)]
    pub duration_s: f64,
    #[serde(default)]
    pub return_after_s: Option<f64>,
    /// partition: drop only what the node receives (it can still send).
    #[serde(default)]
    pub one_way: bool,
    /// flaky-link: the share of packets lost each way, in percent.
    #[serde(default)]
    pub loss_percent: f64,
    /// flaky-link / reorder: every packet held this long each way ...
    #[serde(default)]
    pub delay_ms: u64,
    /// ... plus or minus up to this much.
    #[serde(default)]
    pub delay_jitter_ms: u64,
    /// flaky-link / reorder: the share of packets held `reorder_ms` longer than the rest, in percent.
    #[serde(default)]
    pub reorder_percent: f64,
    #[serde(default = "ten")]
    pub reorder_ms: u64,
    /// flaky-link / reorder: the share of the packets the node sends that are sent twice, in percent.
    #[serde(default)]
    pub duplicate_percent: f64,
}

/// When a fault starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Trigger {
    /// When the job has committed this step.
    Step(u64),
    /// Seconds after the job committed its first step.
    Seconds(f64),
}

impl Fault {
    /// A fault of `kind` on `node` when the job has committed step `at_step`; the other keys at their
    /// defaults (set the public fields for more).
    pub fn at_step(kind: FaultKind, node: Target, at_step: u64) -> Self {
        Fault { at_step: Some(at_step), ..Self::of(kind, node) }
    }

    /// A fault of `kind` on `node` `at_s` seconds after the job committed its first step.
    pub fn at_s(kind: FaultKind, node: Target, at_s: f64) -> Self {
        Fault { at_s: Some(at_s), ..Self::of(kind, node) }
    }

    fn of(kind: FaultKind, node: Target) -> Self {
        Fault {
            kind,
            node,
            at_step: None,
            at_s: None,
            jitter_ms: 0,
            duration_s: 0.0,
            return_after_s: None,
            one_way: false,
            loss_percent: 0.0,
            delay_ms: 0,
            delay_jitter_ms: 0,
            reorder_percent: 0.0,
            reorder_ms: 10,
            duplicate_percent: 0.0,
        }
    }

    /// When it starts (validated: exactly one of `at_step` and `at_s`).
    pub fn trigger(&self) -> Trigger {
        match (self.at_step, self.at_s) {
            (Some(step), _) => Trigger::Step(step),
            (None, Some(s)) => Trigger::Seconds(s),
            (None, None) => Trigger::Step(0),
        }
    }

    /// What a link fault does to the node's packets.
    pub fn link_shape(&self) -> LinkShape {
        LinkShape {
            loss_percent: self.loss_percent,
            delay_ms: self.delay_ms,
            delay_jitter_ms: self.delay_jitter_ms,
            reorder_percent: self.reorder_percent,
            reorder_ms: self.reorder_ms,
            duplicate_percent: self.duplicate_percent,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL the node's daemon (and with it its workers).
    Kill,
    /// SIGSTOP the daemon for `duration_s`, then SIGCONT: beyond the failure timeout the node is dropped,
    /// and when it wakes it must be fenced (a zombie) and rejoin as a new member.
    Pause,
    /// Flip one byte of the newest durable checkpoint: restores must skip it for the previous one.
    CorruptCheckpoint,
    /// Fill the checkpoint disk (a tmpfs) for `duration_s`: checkpoints fail cleanly, training goes on.
    FillDisk,
    /// Cut the node off from the others for `duration_s` (iptables DROP; both ways, or inbound only with
    /// `one_way`): it is dropped from the view, and when the link heals it is fenced and rejoins. With
    /// `duration_s` = 0 the cut lasts to the end of the run: a machine gone silent (no reset, no FIN),
    /// which only the heartbeat detector can find.
    Partition,
    /// Lose `loss_percent` of the node's packets and hold the rest `delay_ms` (± `delay_jitter_ms`)
    /// each way, for `duration_s`, or for the rest of the run when 0: the job runs on, slower, and still
    /// lands on the reference.
    FlakyLink,
    /// Hold `reorder_percent` of the node's packets `reorder_ms` longer than the rest, so later packets
    /// overtake them (with the other link keys as for flaky-link).
    Reorder,
    /// SIGTERM every worker node in turn (a graceful leave), start it again, and wait for the job to be
    /// back on the full world before the next.
    RollingRestart,
}

impl FaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Pause => "pause",
            FaultKind::CorruptCheckpoint => "corrupt-checkpoint",
            FaultKind::FillDisk => "fill-disk",
            FaultKind::RollingRestart => "rolling-restart",
            FaultKind::Partition => "partition",
            FaultKind::FlakyLink => "flaky-link",
            FaultKind::Reorder => "reorder",
        }
    }

    /// Whether it degrades links (tc netem or the NFQUEUE nemesis).
    pub fn degrades_links(self) -> bool {
        matches!(self, FaultKind::FlakyLink | FaultKind::Reorder)
    }
}

/// Which daemon(s) a fault hits.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Target {
    Index(usize),
    #[default]
    RandomWorker,
    AllWorkers,
    /// Every node, the controller's (node 0) first.
    AllNodes,
    /// The node that is the controller when the fault starts: the Raft leader the daemons name then
    /// (node 0 with one controller).
    Controller,
}

impl<'de> Deserialize<'de> for Target {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Index(usize),
            Name(String),
        }
        match Raw::deserialize(d)? {
            Raw::Index(i) => Ok(Target::Index(i)),
            Raw::Name(n) if n == "random-worker" => Ok(Target::RandomWorker),
            Raw::Name(n) if n == "all-workers" => Ok(Target::AllWorkers),
            Raw::Name(n) if n == "all-nodes" => Ok(Target::AllNodes),
            Raw::Name(n) if n == "controller" => Ok(Target::Controller),
            Raw::Name(n) => Err(serde::de::Error::custom(format!(
                "node = {n:?}: use a node index, \"random-worker\", \"all-workers\", \"all-nodes\" or \"controller\""
            ))),
        }
    }
}

impl Scenario {
    /// A shipped scenario by name, or a scenario file by path.
    pub fn load(name_or_path: &str) -> anyhow::Result<Self> {
        if let Some((name, text)) = SHIPPED.iter().find(|(n, _)| *n == name_or_path) {
            return Self::parse(text, name);
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            let names: Vec<&str> = SHIPPED.iter().map(|(n, _)| *n).collect();
            bail!("--scenario {name_or_path}: neither a shipped scenario ({}) nor a file", names.join(", "));
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("reading scenario {}", path.display()))?;
        let name = path.file_stem().map_or("scenario".into(), |s| s.to_string_lossy().into_owned());
        Self::parse_in(&text, &name, path.parent()).with_context(|| format!("scenario {}", path.display()))
    }

    /// A scenario from its TOML text; a relative `job` path is taken from the working directory.
    pub fn parse(text: &str, name: &str) -> anyhow::Result<Self> {
        Self::parse_in(text, name, None)
    }

    /// A scenario from its TOML text; a relative `job` path is taken from `dir` (the scenario file's).
    pub fn parse_in(text: &str, name: &str, dir: Option<&Path>) -> anyhow::Result<Self> {
        let mut scenario: Scenario = toml::from_str(text).with_context(|| format!("scenario {name}"))?;
        scenario.name = name.to_owned();
        if let Some(job) = scenario.job.clone() {
            let table: toml::Table = toml::from_str(text).with_context(|| format!("scenario {name}"))?;
            let set: Vec<&str> = JOB_KEYS.iter().copied().filter(|k| table.contains_key(*k)).collect();
            if !set.is_empty() {
                bail!(
                    "scenario {name}: {} set beside job = {:?}, whose config sets them; remove them from the scenario \
                     (or set them in the job config)",
                    set.join(", "),
                    job.display().to_string()
                );
            }
            let path = match dir {
                Some(dir) if job.is_relative() => dir.join(&job),
                _ => job,
            };
            return scenario.with_job_file(&path);
        }
        scenario.validate()?;
        Ok(scenario)
    }

    /// Trains the job config in file `path` (the TOML `troupe train --config` takes) instead of the
    /// scenario's own job: its steps, precision, pp, schedule and injected overflows replace the
    /// scenario's. `troupe chaos run --job FILE` does this; the checker's reference trains the same config.
    pub fn with_job_file(self, path: &Path) -> anyhow::Result<Self> {
        let config = JobConfig::from_file(path).with_context(|| {
            format!(
                "scenario {}: job = {:?} is not a job config that `troupe train --config` takes",
                self.name,
                path.display().to_string()
            )
        })?;
        let mut scenario = self.with_job(config)?;
        scenario.job = Some(path.to_owned());
        Ok(scenario)
    }

    /// Trains `config` instead of the scenario's own job (see [`Scenario::with_job_file`]).
    pub fn with_job(mut self, config: JobConfig) -> anyhow::Result<Self> {
        self.steps = config.train.steps;
        self.precision.clone_from(&config.parallel.precision);
        self.pp = config.parallel.pp;
        self.tp = config.parallel.tp;
        self.schedule.clone_from(&config.parallel.schedule);
        self.inject_overflow_at.clone_from(&config.train.inject_overflow_at);
        self.job_config = Some(config);
        self.validate()?;
        Ok(self)
    }

    fn validate(&self) -> anyhow::Result<()> {
        let name = &self.name;
        if !(2..=8).contains(&self.nodes) {
            bail!("scenario {name}: nodes = {} is not in 2..=8 (a chaos run needs survivors)", self.nodes);
        }
        if self.steps == 0 {
            bail!("scenario {name}: steps = 0; train at least one step");
        }
        super::run::job_config(self).validate().with_context(|| format!("scenario {name}: the job"))?;
        self.membership.validate().map_err(|e| anyhow::anyhow!("scenario {name}: [membership] {e}"))?;
        self.validate_controllers()?;
        let workers: Vec<usize> = self.worker_nodes();
        if workers.is_empty() {
            bail!("scenario {name}: no node runs a worker; raise controller_slots or nodes");
        }
        for (i, fault) in self.faults.iter().enumerate() {
            let which = format!("scenario {name}: faults[{i}] ({})", fault.kind.as_str());
            match (fault.at_step, fault.at_s) {
                (Some(_), Some(_)) | (None, None) => bail!(
                    "{which}: set exactly one of at_step (when the job has committed that step) and at_s \
                     (seconds after its first committed step)"
                ),
                (Some(step), None) if step >= self.steps => {
                    bail!("{which}: at_step = {step} is not below steps = {}", self.steps)
                }
                (None, Some(s)) if !(s.is_finite() && s >= 0.0) => {
                    bail!("{which}: at_s = {s} is not a number of seconds ≥ 0")
                }
                _ => {}
            }
            let hits_node_0 = matches!(fault.node, Target::Index(0) | Target::AllNodes | Target::Controller);
            let standby = self.controllers >= 3;
            if hits_node_0 && !standby && fault.kind == FaultKind::Kill && fault.return_after_s.is_none() {
                bail!(
                    "{which}: node 0 runs the controller, which restarts from its catalog but has no standby; \
                     set return_after_s (the daemon starts again, as systemd would restart it), or controllers = 3 \
                     (a standby takes over)"
                );
            }
            if let Target::Index(n) = fault.node {
                if n >= self.nodes {
                    bail!("{which}: node = {n} but the cluster has nodes 0..{}", self.nodes);
                }
            }
            for (key, percent) in [
                ("loss_percent", fault.loss_percent),
                ("reorder_percent", fault.reorder_percent),
                ("duplicate_percent", fault.duplicate_percent),
            ] {
                if !(0.0..100.0).contains(&percent) {
                    bail!("{which}: {key} = {percent} is not in [0, 100)");
                }
            }
            match fault.kind {
                FaultKind::Pause | FaultKind::FillDisk if fault.duration_s <= 0.0 => {
                    bail!("{which}: needs duration_s > 0")
                }
                FaultKind::CorruptCheckpoint | FaultKind::FillDisk if self.checkpoint_every == 0 => {
                    bail!("{which}: the job takes no checkpoints; set checkpoint_every")
                }
                k if (k == FaultKind::Partition || k.degrades_links()) && self.network != NetworkKind::Namespaces => {
                    bail!("{which}: link faults need network = \"namespaces\"")
                }
                FaultKind::Partition if !(fault.duration_s.is_finite() && fault.duration_s >= 0.0) => {
                    bail!("{which}: duration_s = {} is not a number of seconds ≥ 0 (0: cut for good)", fault.duration_s)
                }
                FaultKind::Partition if fault.duration_s == 0.0 && self.expect.regrown => bail!(
                    "{which}: duration_s = 0 cuts the node for good, so it cannot rejoin; set duration_s or \
                     expect.regrown = false"
                ),
                FaultKind::FlakyLink
                    if fault.loss_percent == 0.0 && fault.delay_ms == 0 && fault.duplicate_percent == 0.0 =>
                {
                    bail!("{which}: the link stays clean; set loss_percent, delay_ms or duplicate_percent")
                }
                FaultKind::Reorder if fault.reorder_percent == 0.0 || fault.reorder_ms == 0 => {
                    bail!("{which}: needs reorder_percent > 0 and reorder_ms > 0")
                }
                FaultKind::FillDisk if self.checkpoint_tmpfs_mib == 0 => {
                    bail!("{which}: needs the checkpoints on a tmpfs; set checkpoint_tmpfs_mib")
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The `controllers` key and what depends on it: 1, or an odd number up to `nodes`; the expectations
    /// about take-overs need a replicated controller and a fault on it.
    fn validate_controllers(&self) -> anyhow::Result<()> {
        let (name, n) = (&self.name, self.controllers);
        if n == 0 || n > self.nodes || (n > 1 && n % 2 == 0) {
            bail!(
                "scenario {name}: controllers = {n}; use 1 (node 0 alone) or an odd number up to nodes = {} \
                 (3 or 5: a Raft group, a majority of which must stay up)",
                self.nodes
            );
        }
        if n > 1 && self.controller_slots.is_some() {
            bail!("scenario {name}: controller_slots is for one controller (node 0); with controllers = {n} remove it");
        }
        if (self.expect.taken_over || self.expect.deposed) && n < 3 {
            bail!("scenario {name}: expect.taken_over and expect.deposed need a standby; set controllers = 3");
        }
        let on_controller = self.faults.iter().any(|f| f.node == Target::Controller);
        if (self.expect.taken_over || self.expect.deposed) && !on_controller {
            bail!("scenario {name}: expect.taken_over and expect.deposed are about a fault on node = \"controller\"; add one");
        }
        Ok(())
    }

    /// Indices of the nodes that run at least one worker.
    pub fn worker_nodes(&self) -> Vec<usize> {
        (0..self.nodes).filter(|&i| i > 0 || self.controller_slots != Some(0)).collect()
    }

    /// Nodes that faults may take down: workers other than the controller node.
    pub fn victims(&self) -> Vec<usize> {
        (1..self.nodes).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_file_replaces_the_job_and_a_bad_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("job.toml"), "[train]\nsteps = 12\nlr = 2e-3\n").unwrap();
        let text = "description = \"x\"\njob = \"job.toml\"\n[[faults]]\nkind = \"kill\"\nat_s = 0.5\n";
        let s = Scenario::parse_in(text, "t", Some(dir.path())).unwrap();
        assert_eq!(s.steps, 12);
        let config = crate::harness::job_config(&s);
        assert_eq!((config.train.steps, config.train.lr), (12, 2e-3));
        assert_eq!(s.faults[0].trigger(), Trigger::Seconds(0.5));

        std::fs::write(dir.path().join("job.toml"), "[train]\nlr = -1.0\n").unwrap();
        let err = format!("{:#}", Scenario::parse_in(text, "t", Some(dir.path())).unwrap_err());
        assert!(err.contains("job = ") && err.contains("train.lr"), "{err}");
        std::fs::write(dir.path().join("job.toml"), "[trian]\n").unwrap();
        let err = format!("{:#}", Scenario::parse_in(text, "t", Some(dir.path())).unwrap_err());
        assert!(err.contains("job = ") && err.contains("trian"), "{err}");
    }

    #[test]
    fn the_controller_may_be_killed_for_good_only_with_a_standby() {
        let text =
            "description = \"x\"\ncontrollers = 3\n[[faults]]\nkind = \"kill\"\nnode = \"controller\"\nat_step = 1\n\
                    [expect]\ntaken_over = true\n";
        let s = Scenario::parse(text, "t").unwrap();
        assert_eq!((s.controllers, &s.faults[0].node, s.expect.taken_over), (3, &Target::Controller, true));
        assert_eq!(Scenario::parse("description = \"x\"\n", "t").unwrap().controllers, 1);
    }

    #[test]
    fn every_shipped_scenario_parses_and_validates() {
        for (name, text) in SHIPPED {
            let s = Scenario::parse(text, name).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert!(!s.faults.is_empty(), "{name} injects nothing");
        }
    }

    #[test]
    fn bad_scenarios_name_the_key_and_the_fix() {
        let cases = [
            ("description = \"x\"\nnodes = 1\n", "nodes = 1"),
            ("description = \"x\"\n[[faults]]\nkind = \"explode\"\nat_step = 1\n", "explode"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\nnode = 0\nat_step = 1\n", "return_after_s"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\nnode = \"somebody\"\nat_step = 1\n", "random-worker"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\nat_step = 99\n", "at_step = 99"),
            ("description = \"x\"\n[[faults]]\nkind = \"pause\"\nat_step = 3\n", "duration_s"),
            ("description = \"x\"\n[[faults]]\nkind = \"corrupt-checkpoint\"\nat_step = 3\n", "checkpoint_every"),
            ("description = \"x\"\nstepz = 3\n", "stepz"),
            ("description = \"x\"\n[[faults]]\nkind = \"partition\"\nat_step = 3\nduration_s = 1\n", "namespaces"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\n", "exactly one of at_step"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\nat_step = 2\nat_s = 1.0\n", "exactly one of at_step"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\nat_s = -1.0\n", "at_s = -1"),
            ("description = \"x\"\n[[faults]]\nkind = \"kill\"\nnode = \"all-nodes\"\nat_s = 1\n", "return_after_s"),
            (
                "description = \"x\"\nnetwork = \"namespaces\"\n[[faults]]\nkind = \"reorder\"\nat_step = 1\n",
                "reorder_percent > 0",
            ),
            (
                "description = \"x\"\nnetwork = \"namespaces\"\n[[faults]]\nkind = \"flaky-link\"\nat_step = 1\n\
                 loss_percent = 100\n",
                "loss_percent = 100",
            ),
            ("description = \"x\"\njob = \"/no/such/job.toml\"\n", "job = \"/no/such/job.toml\""),
            ("description = \"x\"\njob = \"j.toml\"\nsteps = 5\n", "steps set beside job"),
            ("description = \"x\"\n[membership]\nfailure_detector = \"phi\"\n", "phi"),
            ("description = \"x\"\ncontrollers = 2\n", "controllers = 2"),
            ("description = \"x\"\ncontrollers = 5\n", "up to nodes = 3"),
            ("description = \"x\"\ncontrollers = 3\ncontroller_slots = 0\n", "remove it"),
            (
                "description = \"x\"\n[[faults]]\nkind = \"kill\"\nnode = \"controller\"\nat_step = 1\n",
                "return_after_s",
            ),
            ("description = \"x\"\n[expect]\ntaken_over = true\n", "set controllers = 3"),
            ("description = \"x\"\ncontrollers = 3\n[expect]\ndeposed = true\n", "add one"),
            (
                "description = \"x\"\n[membership]\nfailure_detector = \"phi_accrual\"\nfailure_timeout_min_ms = 2000\n",
                "[membership] failure_timeout_min_ms (2000)",
            ),
            (
                "description = \"x\"\nnetwork = \"namespaces\"\n[[faults]]\nkind = \"partition\"\nat_step = 3\n\
                 [expect]\nregrown = true\n",
                "cuts the node for good",
            ),
        ];
        for (text, needle) in cases {
            let err = format!("{:#}", Scenario::parse(text, "t").unwrap_err());
            assert!(err.contains(needle), "error for {text:?} lacks {needle:?}: {err}");
        }
    }
}
