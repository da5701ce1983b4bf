//! Building a job.

use std::path::PathBuf;

use troupe_model::config::JobConfig;

use crate::protocol::{DataPlane, JobSpec};

/// A job under construction. Every setter returns the job, so they chain.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    spec: JobSpec,
}

impl Job {
    /// A job training `config` (see `troupe_model::config::JobConfig`; its `[parallel]` section is the
    /// layout).
    pub fn new(config: JobConfig) -> Self {
        Job {
            spec: JobSpec {
                config,
                name: "job".into(),
                save_final: None,
                data_plane: DataPlane::Auto,
                trace: false,
                trace_seed: 0,
            },
        }
    }

    /// gpt-tiny on the built-in synthetic corpus.
    pub fn gpt_tiny() -> Self {
        Self::new(JobConfig::default())
    }

    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.spec.name = name.into();
        self
    }

    pub fn steps(mut self, steps: u64) -> Self {
        self.spec.config.train.steps = steps;
        self
    }

    pub fn seed(mut self, seed: u64) -> Self {
        self.spec.config.train.seed = seed;
        self
    }

    /// Data-parallel layout: `dp` ranks (0: every slot the cluster offers), sharding mode.
    pub fn data_parallel(mut self, dp: usize, shard: &str) -> Self {
        self.spec.config.parallel.dp = dp;
        self.spec.config.parallel.shard = shard.into();
        self
    }

    /// Elasticity (`[elastic]`): train while at least `min_nodes` members offer ranks, on at most
    /// `max_nodes` of them (0: all); below `min_nodes` wait at most `wait_s` seconds (0: forever) for
    /// members to come back, then fail.
    pub fn elastic(mut self, min_nodes: usize, max_nodes: usize, wait_s: u64) -> Self {
        let elastic = &mut self.spec.config.elastic;
        elastic.min_nodes = min_nodes;
        elastic.max_nodes = max_nodes;
        elastic.wait_s = wait_s;
        self
    }

    /// Rank 0 writes the final parameters to `path` (on its machine).
    pub fn save_final(mut self, path: impl Into<PathBuf>) -> Self {
        self.spec.save_final = Some(path.into());
        self
    }

    /// Pipeline layout: `pp` stages, `schedule` (gpipe, 1f1b, interleaved, zb-h1), `microbatches`.
    /// Submitting a layout this build cannot run fails with a message saying so.
    pub fn pipeline(mut self, pp: usize, schedule: &str, microbatches: usize) -> Self {
        let parallel = &mut self.spec.config.parallel;
        parallel.pp = pp;
        parallel.schedule = schedule.into();
        parallel.microbatches = microbatches;
        self
    }

    /// How a pipeline's blocks are split among its stages: `params` (equal parameter counts, the
    /// default) or `measured` (equal seconds of forward and backward, timed when each attempt starts).
    pub fn balance(mut self, balance: &str) -> Self {
        self.spec.config.parallel.balance = balance.into();
        self
    }

    /// Compute precision: fp32, bf16 or fp16.
    pub fn precision(mut self, precision: &str) -> Self {
        self.spec.config.parallel.precision = precision.into();
        self
    }

    /// Where a device rank keeps its optimizer (`parallel.offload`): `none`, or `host` (fp32 masters,
    /// optimizer state and the update in host memory; a CPU rank's are there already).
    pub fn offload(mut self, offload: &str) -> Self {
        self.spec.config.parallel.offload = offload.into();
        self
    }

    /// Durable checkpoints every `every_steps` steps under `dir`, keeping the last `keep_last`.
    pub fn checkpoints(mut self, dir: impl Into<PathBuf>, every_steps: u64, keep_last: usize) -> Self {
        let checkpoint = &mut self.spec.config.checkpoint;
        checkpoint.dir = Some(dir.into());
        checkpoint.every_steps = every_steps;
        checkpoint.keep_last = keep_last;
        self
    }

    /// The transport of the collectives: `Auto` (same-host sockets when every rank shares a host) or
    /// `Quic` always.
    pub fn data_plane(mut self, plane: DataPlane) -> Self {
        self.spec.data_plane = plane;
        self
    }

    /// Every rank reports the phases of each step (`JobEvent::Phases`), for a timeline of the run.
    pub fn trace(mut self, on: bool) -> Self {
        self.spec.trace = on;
        self
    }

    pub fn config_mut(&mut self) -> &mut JobConfig {
        &mut self.spec.config
    }

    pub fn spec(&self) -> &JobSpec {
        &self.spec
    }

    pub fn into_spec(self) -> JobSpec {
        self.spec
    }
}
