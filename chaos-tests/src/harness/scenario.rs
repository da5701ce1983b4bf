//! A chaos scenario: the job to run, the cluster to run it on, and the faults to inject (the nemesis
//! schedule). Scenarios are TOML files; the shipped ones are compiled in and listed by `troupe chaos list`.
//!
//! ```toml
//! description = "SIGKILL one worker node mid-run; the job shrinks and continues"
//! nodes = 3                 # daemons; node 0 runs the controller
//! controller_slots = 1      # 0: a dedicated controller node without a worker
//! steps = 30                # training steps of the small test model (JobConfig::small)
//! checkpoint_every = 0      # durable checkpoints every N steps (0: none)
//! progress_bound_s = 30     # after each fault heals, a step commits within this bound
//! network = "loopback"      # or "namespaces": a network namespace per daemon (link faults; root)
//! precision = "fp32"        # or "bf16" / "fp16": the job's compute precision (the checks then allow
//!                           # the 16-bit tolerance, docs/runtime-semantics.md "Mixed precision")
//! inject_overflow_at = []   # fp16: steps whose gradient overflows (train.inject_overflow_at); each must
//!                           # be committed as skipped, every time it is committed
//! pp = 1                    # pipeline stages (one rank each; the world is whole pipelines)
//! schedule = "1f1b"         # pipeline schedule with pp > 1: gpipe | 1f1b | interleaved | zb-h1
//!
//! [[faults]]
//! kind = "kill"             # kill | pause | partition | flaky-link | corrupt-checkpoint | fill-disk |
//!                           # rolling-restart
//! node = "random-worker"    # an index, "random-worker", or "all-workers"
//! at_step = 8               # when the job has committed this step ...
//! jitter_ms = 300           # ... plus a delay drawn from the seed in [0, jitter_ms] (mid-step)
//! duration_s = 4.0          # pause: stopped this long; fill-disk: kept full this long
//! return_after_s = 3.0      # kill: the node's daemon starts again after this long (shrink, then grow)
//! one_way = false           # partition: drop only what the node receives
//! loss_percent = 5.0        # flaky-link: packets lost each way
//! delay_ms = 20             # flaky-link: delay each way (tc netem, where the kernel has it)
//!
//! [expect]                  # effects the faults must visibly have
//! regrown = true            # after the last fault heals, steps commit on every node again
//! rolled_back = false       # the job rolled back to a durable checkpoint (not a corrupted one)
//! checkpoints_failed = false  # a checkpoint due was not written, and a later one was
//! ```

use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

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
    ("flaky-link", include_str!("../../scenarios/flaky-link.toml")),
    ("fp16-overflow-and-kill", include_str!("../../scenarios/fp16-overflow-and-kill.toml")),
    ("pipeline-kill-stage", include_str!("../../scenarios/pipeline-kill-stage.toml")),
    ("kill-controller-node", include_str!("../../scenarios/kill-controller-node.toml")),
    ("pause-controller-node", include_str!("../../scenarios/pause-controller-node.toml")),
    ("partition-controller-node", include_str!("../../scenarios/partition-controller-node.toml")),
];

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(skip)]
    pub name: String,
    pub description: String,
    #[serde(default = "three")]
    pub nodes: usize,
    #[serde(default)]
    pub controller_slots: Option<u32>,
    #[serde(default = "thirty")]
    pub steps: u64,
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
    #[serde(default = "fp32")]
    pub precision: String,
    #[serde(default)]
    pub inject_overflow_at: Vec<u64>,
    /// Pipeline stages (`parallel.pp`): each rank one stage, the world whole pipelines.
    #[serde(default = "one")]
    pub pp: usize,
    #[serde(default = "one_f_one_b")]
    pub schedule: String,
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

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub kind: FaultKind,
    #[serde(default)]
    pub node: Target,
    pub at_step: u64,
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
    /// flaky-link: delay added each way (needs tc netem in the kernel; reported when missing).
    #[serde(default)]
    pub delay_ms: u64,
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
    /// `one_way`): it is dropped from the view, and when the link heals it is fenced and rejoins.
    Partition,
    /// Lose `loss_percent` of the node's packets (and delay them `delay_ms`) for `duration_s`, or for
    /// the rest of the run when 0: the job runs on, slower, and still lands on the reference.
    FlakyLink,
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
        }
    }
}

/// Which daemon(s) a fault hits.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Target {
    Index(usize),
    #[default]
    RandomWorker,
    AllWorkers,
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
            Raw::Name(n) => Err(serde::de::Error::custom(format!(
                "node = {n:?}: use a node index, \"random-worker\" or \"all-workers\""
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
        Self::parse(&text, &name).with_context(|| format!("scenario {}", path.display()))
    }

    pub fn parse(text: &str, name: &str) -> anyhow::Result<Self> {
        let mut scenario: Scenario = toml::from_str(text).with_context(|| format!("scenario {name}"))?;
        scenario.name = name.to_owned();
        scenario.validate()?;
        Ok(scenario)
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
        let workers: Vec<usize> = self.worker_nodes();
        if workers.is_empty() {
            bail!("scenario {name}: no node runs a worker; raise controller_slots or nodes");
        }
        for (i, fault) in self.faults.iter().enumerate() {
            let which = format!("scenario {name}: faults[{i}] ({})", fault.kind.as_str());
            if fault.at_step >= self.steps {
                bail!("{which}: at_step = {} is not below steps = {}", fault.at_step, self.steps);
            }
            if let Target::Index(n) = fault.node {
                if n == 0 && fault.kind == FaultKind::Kill && fault.return_after_s.is_none() {
                    bail!(
                        "{which}: node 0 runs the controller, which restarts from its catalog but has no standby; \
                         set return_after_s (the daemon starts again, as systemd would restart it)"
                    );
                }
                if n >= self.nodes {
                    bail!("{which}: node = {n} but the cluster has nodes 0..{}", self.nodes);
                }
            }
            match fault.kind {
                FaultKind::Pause | FaultKind::FillDisk if fault.duration_s <= 0.0 => {
                    bail!("{which}: needs duration_s > 0")
                }
                FaultKind::CorruptCheckpoint | FaultKind::FillDisk if self.checkpoint_every == 0 => {
                    bail!("{which}: the job takes no checkpoints; set checkpoint_every")
                }
                FaultKind::Partition | FaultKind::FlakyLink if self.network != NetworkKind::Namespaces => {
                    bail!("{which}: link faults need network = \"namespaces\"")
                }
                FaultKind::Partition if fault.duration_s <= 0.0 => bail!("{which}: needs duration_s > 0"),
                FaultKind::FlakyLink if !(fault.loss_percent > 0.0 && fault.loss_percent < 100.0) => {
                    bail!("{which}: loss_percent = {} is not in (0, 100)", fault.loss_percent)
                }
                FaultKind::FillDisk if self.checkpoint_tmpfs_mib == 0 => {
                    bail!("{which}: needs the checkpoints on a tmpfs; set checkpoint_tmpfs_mib")
                }
                _ => {}
            }
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
        ];
        for (text, needle) in cases {
            let err = format!("{:#}", Scenario::parse(text, "t").unwrap_err());
            assert!(err.contains(needle), "error for {text:?} lacks {needle:?}: {err}");
        }
    }
}
