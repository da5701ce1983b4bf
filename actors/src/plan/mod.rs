//! The 3-D layout planner: where every rank of a `--tp T --pp P --dp D` job runs, what it holds and what
//! it sends per step — the single source of truth for each rank's (dp, pp, tp) coordinates.
//!
//! Pure (no IO, no async, no clock): a [`LayoutRequest`] in, a [`LayoutPlan`] or a [`LayoutError`] out.
//! Placement follows Megatron-LM and torchtitan: tensor groups innermost and inside one host (their
//! collectives on the host's shared memory), pipeline stages across hosts, data-parallel replicas of a
//! stage beside each other (see [`placement`] for the rank order). The stage split is the pipeline
//! engine's own ([`crate::engine::pipeline::partition`]), each parameter's tensor split the model's own
//! table ([`troupe_model::tensor_parallel::TpLayout`]). `troupe plan` prints it.

mod check;
mod error;
pub mod memory;
pub mod placement;
pub mod plane;
mod request;
pub mod traffic;

use std::collections::BTreeMap;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use troupe_model::tensor_parallel::TpLayout;

use crate::engine::pipeline::{partition, ChunkLayout};
pub use error::LayoutError;
pub use memory::RankMemory;
pub use placement::{coords_of, rank_of, Coords, Groups};
pub use request::{Degrees, Host, LayoutRequest};
pub use traffic::{CollectiveKind, GroupKind, Traffic};

/// One rank: its coordinates, where it runs, what it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlan {
    pub rank: usize,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    pub host: String,
    pub slot: usize,
    pub memory: RankMemory,
}

/// One pipeline stage: its blocks and its ranks' traffic per step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePlan {
    pub stage: usize,
    /// The transformer blocks it runs, `start..end`.
    pub layers: Range<usize>,
    /// Whether it holds the embeddings (the first stage) and the final norm, head and loss (the last).
    pub embed: bool,
    pub head: bool,
    /// What each of its ranks moves per step.
    pub traffic: Vec<Traffic>,
}

/// Where every rank runs and why; see docs/guide.md (`troupe plan`) for the JSON's fields.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutPlan {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub sp: bool,
    pub zero: u8,
    pub world: usize,
    pub hosts: Vec<Host>,
    /// Indexed by rank.
    pub ranks: Vec<RankPlan>,
    pub groups: Groups,
    /// Indexed by stage.
    pub stages: Vec<StagePlan>,
    /// Bytes all ranks together send per step, by collective (`all_reduce`, `all_gather`,
    /// `reduce_scatter`, `send`).
    pub traffic_bytes_by_collective: BTreeMap<String, u64>,
    /// Why the ranks are where they are, one sentence each.
    pub why: Vec<String>,
}

impl LayoutPlan {
    /// The host index of each rank, in the request's host order.
    pub fn host_of(&self, rank: usize) -> usize {
        let name = &self.ranks[rank].host;
        self.hosts.iter().position(|h| &h.name == name).expect("a rank's host is one of the plan's")
    }
}

/// Places every rank of `request`, or says why it cannot.
pub fn plan_layout(request: &LayoutRequest) -> Result<LayoutPlan, LayoutError> {
    check::check(request)?;
    let d = request.degrees;
    let chunks = partition(&request.model, d.pp)
        .map_err(|_| LayoutError::TooManyStages { pp: d.pp, layers: request.model.n_layers })?;
    let seats = placement::seats(d, &request.hosts, request.tp_within_host)?;
    let layout = TpLayout::new(&request.model, d.tp, request.sp)
        .map_err(|e| LayoutError::TensorLayout { tp: d.tp, reason: e.to_string() })?;
    let stages: Vec<StagePlan> =
        chunks.iter().enumerate().map(|(s, chunk)| stage_plan(request, &layout, s, chunk)).collect();
    let ranks: Vec<RankPlan> = (0..d.world())
        .map(|rank| {
            let c = coords_of(d, rank);
            let seat = seats[rank];
            let memory = stage_memory(request, &layout, &chunks[c.pp], c.pp);
            let host = request.hosts[seat.host].name.clone();
            RankPlan { rank, dp: c.dp, pp: c.pp, tp: c.tp, host, slot: seat.slot, memory }
        })
        .collect();
    let mut traffic_bytes_by_collective = BTreeMap::new();
    for rank in &ranks {
        for t in &stages[rank.pp].traffic {
            *traffic_bytes_by_collective.entry(t.collective.as_str().to_owned()).or_insert(0) += t.bytes_per_rank;
        }
    }
    let mut plan = LayoutPlan {
        tp: d.tp,
        pp: d.pp,
        dp: d.dp,
        sp: request.sp,
        zero: request.zero,
        world: d.world(),
        hosts: request.hosts.clone(),
        ranks,
        groups: placement::groups(d),
        stages,
        traffic_bytes_by_collective,
        why: Vec::new(),
    };
    plan.why = why(&plan, request);
    Ok(plan)
}

/// Whether the last stage of a pipeline holds a copy of the tied embedding.
fn holds_tied_copy(request: &LayoutRequest, stage: usize) -> bool {
    let pp = request.degrees.pp;
    pp > 1 && stage + 1 == pp && request.model.head_takes_embedding()
}

fn stage_memory(request: &LayoutRequest, layout: &TpLayout, chunk: &ChunkLayout, stage: usize) -> RankMemory {
    let tied = holds_tied_copy(request, stage);
    memory::rank_memory(layout, chunk.params.clone(), tied, request.degrees.dp, request.zero)
}

fn stage_plan(request: &LayoutRequest, layout: &TpLayout, stage: usize, chunk: &ChunkLayout) -> StagePlan {
    let d = request.degrees;
    let memory = stage_memory(request, layout, chunk, stage);
    let samples = (request.global_batch / d.dp) as u64;
    let microbatches = samples.div_ceil(request.micro_batch.max(1) as u64).max(1);
    let tied = request.degrees.pp > 1 && request.model.head_takes_embedding() && (chunk.embed || chunk.head);
    let step = traffic::StageStep {
        tp: d.tp,
        dp: d.dp,
        pp: d.pp,
        stage,
        sp: request.sp,
        zero: request.zero,
        layers: chunk.blocks.len() as u64,
        samples,
        microbatches,
        context: request.model.context as u64,
        d_model: request.model.d_model as u64,
        grad_elements: memory.sharded_elements + memory.replicated_elements,
        replicated_elements: if request.sp { memory.replicated_elements } else { 0 },
        tied_elements: if tied { memory::tensor_share(layout, 0..1).0 } else { 0 },
    };
    StagePlan {
        stage,
        layers: chunk.blocks.clone(),
        embed: chunk.embed,
        head: chunk.head,
        traffic: traffic::stage_traffic(&step),
    }
}

/// The reasons for the placement, in words.
fn why(plan: &LayoutPlan, request: &LayoutRequest) -> Vec<String> {
    let mut out = Vec::new();
    let hosts_of = |group: &[usize]| {
        let mut h: Vec<usize> = group.iter().map(|&r| plan.host_of(r)).collect();
        h.dedup();
        h
    };
    let spanning = plan.groups.tensor.iter().filter(|g| hosts_of(g).len() > 1).count();
    if plan.tp > 1 && spanning == 0 {
        out.push(format!(
            "each tensor group of {} ranks is on one host: its 4 collectives per block{} run on the host's shared memory",
            plan.tp,
            if plan.sp { " (all-gathers and reduce-scatters, SP)" } else { " (all-reduces)" }
        ));
    } else if spanning > 0 {
        out.push(format!(
            "{spanning} tensor group(s) span two hosts: the hosts' slots are not multiples of --tp {} and \
             --tp-across-hosts allowed it; their collectives cross the network",
            plan.tp
        ));
    }
    let (vocab, kv_heads) = (request.model.vocab_size, request.model.kv_heads());
    if !vocab.is_multiple_of(plan.tp) {
        out.push(format!(
            "model.vocab_size = {vocab} is padded to {} rows, {} per tensor rank; the padded logits are left out of \
             the cross-entropy and the padded rows out of checkpoints and exports",
            vocab.next_multiple_of(plan.tp),
            vocab.div_ceil(plan.tp)
        ));
    }
    if plan.tp > kv_heads {
        out.push(format!(
            "--tp {} exceeds model.n_kv_heads = {kv_heads}: each key/value head is replicated on the {} tensor ranks \
             whose query heads use it, its gradient summed over them",
            plan.tp,
            plan.tp / kv_heads
        ));
    }
    if plan.pp > 1 {
        let split = plan.groups.pipeline.iter().filter(|g| hosts_of(g).len() == plan.pp).count();
        out.push(format!(
            "ranks are numbered tp + T·(dp + D·pp), stages outermost: {split} of {} pipelines have every stage on a \
             different host (only activations and their gradients cross between stages)",
            plan.groups.pipeline.len()
        ));
    }
    if plan.dp > 1 {
        let local = plan.groups.data.iter().filter(|g| hosts_of(g).len() == 1).count();
        out.push(format!(
            "the {} replicas of each stage are beside each other: {local} of {} data-parallel groups are inside one host; \
             their gradient {} happens once per step{}",
            plan.dp,
            plan.groups.data.len(),
            if request.zero == 0 { "all-reduce" } else { "reduce-scatter" },
            if request.zero > 0 { format!(", ZeRO-{} inside them", request.zero) } else { String::new() }
        ));
    }
    let stages = plan.stages.iter().map(|s| format!("{}..{}", s.layers.start, s.layers.end)).collect::<Vec<_>>();
    out.push(format!(
        "blocks per stage {} (balanced by parameter count, as the pipeline engine cuts them)",
        stages.join(", ")
    ));
    out
}
