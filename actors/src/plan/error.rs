//! Why a layout is refused: each variant names the flag (and its config key), the numbers that do not
//! fit, and the nearest choice that would.

/// A layout the planner refuses, before anything starts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{flag} 0: a parallel degree is at least 1 (1 means no parallelism of that kind)")]
    ZeroDegree { flag: &'static str },
    #[error("--zero {stage} (parallel.shard): ZeRO stages are 0 (none), 1, 2 or 3; nearest valid: --zero 3")]
    ZeroStage { stage: u8 },
    #[error("--hosts: {reason}")]
    Hosts { reason: String },
    #[error(
        "--pp {pp} (parallel.pp) cuts {layers} blocks (model.n_layers = {layers}) into more stages than \
         blocks; nearest valid: --pp {layers}"
    )]
    TooManyStages { pp: usize, layers: usize },
    #[error(
        "--tp {tp} (parallel.tp) does not divide {key} = {value}: each tensor rank must hold a whole share \
         of {what}; nearest valid: --tp {nearest}"
    )]
    TpDoesNotDivide { tp: usize, key: &'static str, value: usize, what: &'static str, nearest: usize },
    #[error(
        "--tp {tp} (parallel.tp) neither divides model.n_kv_heads = {kv_heads} nor is a multiple of it \
         (model.n_heads = {n_heads}): each tensor rank holds whole key/value heads, or one replicated over \
         tp / n_kv_heads ranks; nearest valid: --tp {nearest}"
    )]
    KvHeads { tp: usize, kv_heads: usize, n_heads: usize, nearest: usize },
    #[error(
        "--tp {tp} (parallel.tp) with --sp (parallel.sp) does not divide the sequence, model.context = \
         {context}: sequence parallelism shards it over the tensor ranks; nearest valid: --tp {nearest}, \
         or --no-sp"
    )]
    SequenceNotDivisible { tp: usize, context: usize, nearest: usize },
    #[error(
        "--tp {tp} × --pp {pp} × --dp {dp} = {needed} ranks, but {world_source} gives {world} slots; \
         nearest valid: {suggestion}"
    )]
    WorldMismatch {
        tp: usize,
        pp: usize,
        dp: usize,
        needed: usize,
        world: usize,
        world_source: String,
        suggestion: String,
    },
    #[error(
        "--tp {tp} (parallel.tp): a tensor group of {tp} ranks must stay inside one host, and the largest \
         host ({host}) has {slots} slots; nearest valid: --tp {nearest}, or --tp-across-hosts to let \
         tensor groups span hosts (their collectives then cross the network)"
    )]
    TensorGroupTooLarge { tp: usize, host: String, slots: usize, nearest: usize },
    #[error(
        "--tp {tp} (parallel.tp): the hosts' slots ({slots}) hold {fit} whole tensor groups of {tp}, and \
         --pp × --dp needs {needed}; give every host a multiple of {tp} slots, or --tp-across-hosts"
    )]
    TensorGroupsDoNotFit { tp: usize, slots: String, fit: usize, needed: usize },
    #[error("--tp {tp} (parallel.tp): {reason}")]
    TensorLayout { tp: usize, reason: String },
    #[error(
        "train.global_batch = {global_batch} does not split over --dp {dp} replicas; nearest valid: \
         train.global_batch = {nearest}"
    )]
    BatchNotDivisible { global_batch: usize, dp: usize, nearest: usize },
}
