//! What the planner is asked: the degrees, the hosts and their slots, the model and the batch.

use serde::{Deserialize, Serialize};
use troupe_model::model::ModelConfig;

/// One machine and the ranks (slots) it runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    pub name: String,
    pub slots: usize,
}

impl Host {
    /// `count` hosts of `slots` slots each, named `host-0`, `host-1`, ….
    pub fn uniform(count: usize, slots: usize) -> Vec<Host> {
        (0..count).map(|i| Host { name: format!("host-{i}"), slots }).collect()
    }
}

/// The parallel degrees: world = tp × pp × dp.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Degrees {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
}

impl Degrees {
    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }
}

/// Everything a layout depends on; [`super::plan_layout`] is a pure function of it.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutRequest {
    pub degrees: Degrees,
    /// Sequence parallelism: the norms and residual stream sharded along the sequence over the tensor
    /// group (Megatron's all-gather / reduce-scatter pairs instead of all-reduces).
    pub sp: bool,
    /// ZeRO stage inside each data-parallel group: 0 none, 1 optimizer state, 2 and gradients, 3 and
    /// parameters.
    pub zero: u8,
    pub hosts: Vec<Host>,
    /// How the world was given, for errors (`--hosts 4 × --slots 2`).
    pub world_source: String,
    /// The model; the sequence length is `model.context`.
    pub model: ModelConfig,
    /// Samples per optimizer step over all replicas (`train.global_batch`).
    pub global_batch: usize,
    /// Samples per forward/backward pass (`train.micro_batch`).
    pub micro_batch: usize,
    /// A tensor group must stay inside one host (the default); false lets it span hosts when it must.
    pub tp_within_host: bool,
}

impl LayoutRequest {
    /// `degrees` over `hosts` for `model`, batch as `train`'s defaults, SP on when tp > 1, no ZeRO, tensor
    /// groups kept inside hosts.
    pub fn new(degrees: Degrees, hosts: Vec<Host>, model: ModelConfig) -> Self {
        let train = troupe_model::config::TrainConfig::default();
        let total: usize = hosts.iter().map(|h| h.slots).sum();
        Self {
            degrees,
            sp: degrees.tp > 1,
            zero: 0,
            world_source: format!("{} hosts with {total} slots in all", hosts.len()),
            hosts,
            model,
            global_batch: train.global_batch,
            micro_batch: train.micro_batch,
            tp_within_host: true,
        }
    }
}
