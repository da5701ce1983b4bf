//! The plain sections of the job config — `[data]`, `[train]`, `[checkpoint]`, `[parallel]` and
//! `[elastic]` — with their defaults, limits and the checks that need nothing but the section itself,
//! and [`ConfigError`], what every config check returns. The job config that holds them beside
//! `[model]`, reads them from TOML and checks them together is [`crate::config`] (which re-exports all of
//! this); they live below it so that what the optimizer, the precision and the model need of a config
//! does not depend on the model.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// What a bad config gets: the file or key, what was wrong, and what to do instead.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("config key `{key}` = {value}: {allowed}")]
    Invalid { key: &'static str, value: String, allowed: String },
}

/// Where the training tokens come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `synthetic` (built in, no files), `text` (the file at `path`: its bytes, or with `tokenizer` its
    /// ids), `jsonl` (one JSON object per line, its `text` a document) or `bin` (a token file: troupe's,
    /// written by `troupe data prepare`, or nanoGPT's headerless uint16).
    pub kind: DataKind,
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` that encodes `text` and `jsonl` (bytes without it).
    pub tokenizer: Option<PathBuf>,
    /// Size of the generated synthetic corpus.
    pub synthetic_bytes: usize,
    /// Seed of the synthetic corpus generator (independent of the training seed, so the data stays the
    /// same when the training seed changes).
    pub synthetic_seed: u64,
    /// Hold out this fraction of the corpus' tokens, its tail, for validation (nanoGPT's contiguous
    /// split): training samples are drawn from the head only, `train.eval_every`'s windows from the
    /// tail only. 0 (the default): nothing held out, the whole corpus trains.
    pub val_fraction: f64,
    /// A separate validation file of the same `kind` (and `tokenizer`) instead of `val_fraction`.
    pub val_path: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    Synthetic,
    Text,
    Jsonl,
    Bin,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            kind: DataKind::Synthetic,
            path: None,
            tokenizer: None,
            synthetic_bytes: 1 << 20,
            synthetic_seed: 0x7207,
            val_fraction: 0.0,
            val_path: None,
        }
    }
}

/// The optimisation: batch, optimizer (AdamW or Adafactor), schedule, clipping.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// `adamw` (the default; `beta1`, `beta2`, `eps`, `weight_decay` below) or `adafactor` (its own
    /// `[train.adafactor]` table).
    pub optimizer: String,
    /// Adafactor's hyper-parameters, used when `optimizer = "adafactor"`.
    pub adafactor: AdafactorConfig,
    pub steps: u64,
    pub seed: u64,
    /// Samples (sequences of `model.context` tokens) per optimizer step, over all ranks.
    pub global_batch: usize,
    /// Samples per forward/backward pass; gradients accumulate over the micro-batches of a step.
    pub micro_batch: usize,
    /// Peak learning rate, reached after `warmup_steps`.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    pub warmup_steps: u64,
    /// Steps over which the rate decays from `lr` to `min_lr`; 0 means `steps`.
    pub decay_steps: u64,
    /// AdamW decoupled weight decay, applied to matrices and embeddings (not to biases or LayerNorm).
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Clip the global gradient L2 norm to this; 0 disables clipping.
    pub grad_clip: f64,
    /// libtorch intra-op threads per rank; 0 means the machine's cores divided by the ranks on it.
    pub torch_threads: usize,
    /// Fault injection (tests, chaos scenarios): rank 0's gradient of each of these steps is made
    /// non-finite, as an fp16 overflow would make it. Needs `parallel.precision = "fp16"`, whose loss
    /// scaler must skip exactly those steps and lower the scale.
    pub inject_overflow_at: Vec<u64>,
    /// Evaluate the validation loss (`data.val_fraction` or `data.val_path`) after every N-th committed
    /// step and after the last; 0 (the default) never.
    pub eval_every: u64,
    /// Validation windows each evaluation reads (each `model.context` predicted tokens), the first of
    /// the held-out part; fewer when the part holds fewer.
    pub eval_samples: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            optimizer: "adamw".into(),
            adafactor: AdafactorConfig::default(),
            steps: 200,
            seed: 1,
            global_batch: 8,
            micro_batch: 8,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 10,
            decay_steps: 0,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            torch_threads: 0,
            inject_overflow_at: Vec::new(),
            eval_every: 0,
            eval_samples: 64,
        }
    }
}

/// `[train.adafactor]`: Adafactor (Shazeer & Stern 2018) with Hugging Face transformers' `Adafactor`
/// hyper-parameters and defaults. With `relative_step` the step size is its own `min(1e-2, 1/√t)`
/// (`warmup_init`: `min(1e-6·t, 1/√t)`) and `train.lr` is unused; without it the step size is the
/// schedule's (`train.lr`, warmup, cosine decay).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdafactorConfig {
    /// Added to the squared gradient (HF `eps[0]`).
    pub eps1: f64,
    /// The floor of a parameter's RMS when `scale_parameter` scales the step (HF `eps[1]`).
    pub eps2: f64,
    /// The update's RMS is clipped to this.
    pub clip_threshold: f64,
    /// The second moment's decay is `1 - t^decay_rate`.
    pub decay_rate: f64,
    /// The first moment's decay; absent (the default): no first moment.
    pub beta1: Option<f64>,
    /// Decoupled weight decay, times the step size, on matrices and embeddings.
    pub weight_decay: f64,
    /// Scale the step size by the parameter's RMS (at least `eps2`).
    pub scale_parameter: bool,
    pub relative_step: bool,
    pub warmup_init: bool,
}

impl Default for AdafactorConfig {
    fn default() -> Self {
        Self {
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }
}

/// Periodic checkpoints of the whole training state (resumable), and the in-memory copies that spare a
/// sharded job a trip to them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Directory that receives one `step-NNNNNNNN` directory per checkpoint.
    pub dir: Option<PathBuf>,
    /// Save every N committed steps; 0 saves only at the end (when `dir` is set).
    pub every_steps: u64,
    /// Keep the last K checkpoints; 0 keeps all.
    pub keep_last: usize,
    /// Sharded jobs (`parallel.shard = "zero1" | "zero2" | "zero3"`): how many other ranks keep a last-committed
    /// copy of each rank's shard in memory (0..=3), so that losing that many neighbouring ranks loses no
    /// state. A tensor-parallel job keeps one copy of each tensor rank's shard on the next rank, none at 0.
    /// DDP ranks all hold the whole state and ignore it.
    pub replicas: usize,
}

/// Most validation windows one evaluation reads (`train.eval_samples`).
pub const EVAL_SAMPLES_MAX: usize = 1 << 20;
/// The largest share of the corpus `data.val_fraction` may hold out.
pub const VAL_FRACTION_MAX: f64 = 0.5;

/// Most in-memory copies of a shard (`checkpoint.replicas`).
pub const SHARD_REPLICAS_MAX: usize = 3;

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { dir: None, every_steps: 0, keep_last: 0, replicas: 1 }
    }
}

/// How the job rides membership changes: it runs while at least `min_nodes` members offer it ranks,
/// uses at most `max_nodes` of them, and below `min_nodes` waits `wait_s` for members to come (back)
/// before it fails.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ElasticConfig {
    /// Fewest nodes the job trains on; below, it pauses at its last committed step.
    pub min_nodes: usize,
    /// Most nodes the job trains on (0: every member). Members over the cap wait as spares.
    pub max_nodes: usize,
    /// Longest the job waits below `min_nodes` before it fails (0: forever).
    pub wait_s: u64,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        Self { min_nodes: 1, max_nodes: 0, wait_s: 600 }
    }
}

/// Most nodes `[elastic]` may name.
pub const ELASTIC_NODES_MAX: usize = 4096;

impl ElasticConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=ELASTIC_NODES_MAX).contains(&self.min_nodes) {
            return Err(invalid("elastic.min_nodes", self.min_nodes, format!("must be in 1..={ELASTIC_NODES_MAX}")));
        }
        if self.max_nodes > ELASTIC_NODES_MAX {
            return Err(invalid(
                "elastic.max_nodes",
                self.max_nodes,
                format!("must be 0 (every member) or at most {ELASTIC_NODES_MAX}"),
            ));
        }
        if self.max_nodes != 0 && self.max_nodes < self.min_nodes {
            return Err(invalid(
                "elastic.max_nodes",
                self.max_nodes,
                format!("must be 0 (every member) or at least elastic.min_nodes ({})", self.min_nodes),
            ));
        }
        Ok(())
    }
}

/// Most daemons of an embedded local cluster (`--nodes`).
pub const NODES_MAX: usize = 64;
/// Most data-parallel ranks.
pub const RANKS_MAX: usize = 4096;
/// Most pipeline stages.
pub const PIPELINE_STAGES_MAX: usize = 256;

/// Largest DDP gradient bucket (`parallel.bucket_mib`).
pub const BUCKET_MIB_MAX: usize = 1024;

/// The parallel layout. Data parallelism (DDP) over `nodes` daemons is available in this build; the
/// other values are parsed so that a config written for a later build fails with a clear message, not
/// silently. `dp = 0` (the default) means every slot the cluster offers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    pub nodes: usize,
    pub dp: usize,
    pub pp: usize,
    pub shard: String,
    pub schedule: String,
    /// Pipeline micro-batches per step; 0 means [`ParallelConfig::pipeline_microbatches`]' default.
    pub microbatches: usize,
    /// Model chunks per pipeline stage (interleaved schedule only).
    pub virtual_stages: usize,
    /// How the blocks are split among the pipeline's chunks: `params` (equal parameter counts) or
    /// `measured` (equal seconds of forward and backward, timed on one micro-batch when an attempt starts).
    pub balance: String,
    /// Compute precision of the matrix products: `fp32`, `bf16` or `fp16`; the master weights, gradients
    /// and optimizer state are fp32 in every case (see `precision.rs`).
    pub precision: String,
    /// fp16: the initial loss scale, a power of two (PyTorch's GradScaler default, 2¹⁶).
    pub loss_scale_init: f64,
    /// fp16: clean steps in a row after which the loss scale doubles (GradScaler's growth_interval).
    pub loss_scale_window: u64,
    /// Activation recomputation: keep only each block's input in the forward and re-run the block in the
    /// backward (less activation memory, one more forward of the blocks).
    pub recompute: bool,
    /// DDP: all-reduce each gradient bucket as soon as the backward has finished its parameters, while
    /// the rest of the backward computes (`false`: after the whole backward, for comparison).
    pub overlap_comm: bool,
    /// DDP gradient bucket size in MiB; 0 means the engine's default (25 MiB, PyTorch's). Smaller buckets
    /// start their all-reduce earlier in the backward.
    pub bucket_mib: usize,
    /// Tensor-parallel degree (Megatron's column/row-parallel layers): each rank holds 1/tp of every
    /// block's matrices; the world is tp × dp × pp.
    pub tp: usize,
    /// Sequence parallelism with `tp` > 1 (the norms and the residual stream sharded along the sequence).
    pub sp: bool,
    /// How often the data-parallel replicas synchronize: `every_step` (DDP, ZeRO: gradients every step),
    /// `local_sgd` (each replica takes `sync_every` steps with its own AdamW on its share of each batch,
    /// then the parameters are averaged) or `diloco` (the same local steps, then an outer Nesterov SGD
    /// step on the averaged parameter delta: `outer_lr`, `outer_momentum`). See crate::periodic.
    pub sync: String,
    /// `local_sgd` / `diloco`: local steps between synchronizations (H).
    pub sync_every: u64,
    /// `diloco`: the outer optimizer's learning rate (the DiLoCo paper's 0.7).
    pub outer_lr: f64,
    /// `diloco`: the outer Nesterov momentum (the DiLoCo paper's 0.9).
    pub outer_momentum: f64,
    /// `local_sgd` / `diloco`: Streaming DiLoCo's fragments — the model cut into this many contiguous
    /// groups of blocks, each synchronized on its own offset in the interval (1: the whole model at once).
    /// At most `sync_every` and `model.n_layers`.
    pub fragments: usize,
    /// Where a device rank keeps its optimizer: `none` (beside the parameters) or `host` (ZeRO-Offload:
    /// the fp32 masters, the optimizer state and the update in host memory, see `optim::offload`). A CPU
    /// rank's are on the host already: `host` is accepted there and changes nothing.
    pub offload: String,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            nodes: 1,
            dp: 0,
            pp: 1,
            shard: "none".into(),
            schedule: "1f1b".into(),
            microbatches: 0,
            virtual_stages: 1,
            balance: "params".into(),
            precision: "fp32".into(),
            loss_scale_init: 65536.0,
            loss_scale_window: 2000,
            recompute: false,
            overlap_comm: true,
            bucket_mib: 0,
            tp: 1,
            sp: true,
            sync: "every_step".into(),
            sync_every: 1,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            fragments: 1,
            offload: "none".into(),
        }
    }
}

impl ParallelConfig {
    /// Pipeline micro-batches per step: `microbatches`, or by default the number of `train.micro_batch`
    /// samples the global batch holds, at least `pp` (fewer leave stages idle) and at most the samples of
    /// one pipeline (the global batch over `dp` replicas).
    pub fn pipeline_microbatches(&self, train: &TrainConfig) -> usize {
        if self.microbatches > 0 {
            return self.microbatches;
        }
        let samples = train.global_batch / self.dp.max(1);
        train.global_batch.div_ceil(train.micro_batch).max(self.pp).min(samples.max(1))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=NODES_MAX).contains(&self.nodes) {
            return Err(invalid("parallel.nodes", self.nodes, format!("must be in 1..={NODES_MAX}")));
        }
        if self.dp > RANKS_MAX {
            return Err(invalid("parallel.dp", self.dp, format!("must be 0 (every slot) or at most {RANKS_MAX}")));
        }
        if !(1..=PIPELINE_STAGES_MAX).contains(&self.pp) {
            return Err(invalid("parallel.pp", self.pp, format!("must be in 1..={PIPELINE_STAGES_MAX}")));
        }
        if self.microbatches != 0 && self.pp == 1 {
            return Err(invalid(
                "parallel.microbatches",
                self.microbatches,
                "pipeline micro-batches need --pp / parallel.pp > 1",
            ));
        }
        positive("parallel.virtual_stages", self.virtual_stages)?;
        one_of("parallel.balance", &self.balance, &["params", "measured"])?;
        if self.balance != "params" && self.pp == 1 {
            return Err(invalid(
                "parallel.balance",
                &self.balance,
                "balancing splits the model among pipeline stages: it needs --pp / parallel.pp > 1",
            ));
        }
        if self.virtual_stages > 1 && self.schedule != "interleaved" {
            return Err(invalid(
                "parallel.virtual_stages",
                self.virtual_stages,
                "more than 1 needs --schedule interleaved / parallel.schedule = \"interleaved\"",
            ));
        }
        if self.bucket_mib > BUCKET_MIB_MAX {
            return Err(invalid(
                "parallel.bucket_mib",
                self.bucket_mib,
                format!("must be 0 (the default, 25) or at most {BUCKET_MIB_MAX}"),
            ));
        }
        one_of("parallel.shard", &self.shard, &["none", "zero1", "zero2", "zero3"])?;
        one_of("parallel.schedule", &self.schedule, &["gpipe", "1f1b", "interleaved", "zb-h1"])?;
        one_of("parallel.precision", &self.precision, &["fp32", "bf16", "fp16"])?;
        one_of("parallel.offload", &self.offload, &OFFLOADS)?;
        let init = self.loss_scale_init;
        if !(init.is_finite() && init >= 1.0 && init.log2().fract() == 0.0 && init <= 2f64.powi(64)) {
            return Err(invalid(
                "parallel.loss_scale_init",
                init,
                "must be a power of two from 1 to 2^64 (unscaling is then exact), e.g. 65536",
            ));
        }
        positive("parallel.loss_scale_window", self.loss_scale_window as usize)?;
        self.validate_sync()
    }

    /// True for `local_sgd` and `diloco`: replicas step locally and synchronize every `sync_every` steps.
    pub fn periodic_sync(&self) -> bool {
        self.sync != "every_step"
    }

    /// `parallel.sync` and its keys: known values in range, and only beside what this build runs it with
    /// (plain data parallelism: no ZeRO, pipeline or tensor parallelism, no fp16 loss scaling).
    fn validate_sync(&self) -> Result<(), ConfigError> {
        one_of("parallel.sync", &self.sync, &["every_step", "local_sgd", "diloco"])?;
        if !self.periodic_sync() {
            return Ok(());
        }
        if !(1..=SYNC_EVERY_MAX).contains(&self.sync_every) {
            return Err(invalid(
                "parallel.sync_every",
                self.sync_every,
                format!("must be in 1..={SYNC_EVERY_MAX} local steps between synchronizations (e.g. 8 or 32)"),
            ));
        }
        let unit = |x: f64| x.is_finite() && x > 0.0 && x <= 10.0;
        if !unit(self.outer_lr) {
            return Err(invalid("parallel.outer_lr", self.outer_lr, "must be in (0, 10] (the DiLoCo paper's 0.7)"));
        }
        if !(self.outer_momentum.is_finite() && (0.0..1.0).contains(&self.outer_momentum)) {
            return Err(invalid("parallel.outer_momentum", self.outer_momentum, "must be in [0, 1) (DiLoCo: 0.9)"));
        }
        if !(1..=self.sync_every).contains(&(self.fragments as u64)) {
            return Err(invalid(
                "parallel.fragments",
                self.fragments,
                format!(
                    "must be in 1..=parallel.sync_every ({}): Streaming DiLoCo syncs one fragment at a time, spread over the interval (e.g. 4 with sync_every = 32; 1 syncs the whole model at once)",
                    self.sync_every
                ),
            ));
        }
        let sync = &self.sync;
        let beside = |key: &'static str, value: String, fix: &str| {
            let allowed = format!(
                "parallel.sync = {sync:?} runs on plain data-parallel replicas in this build: {fix} (or parallel.sync = \"every_step\")"
            );
            Err(invalid(key, value, allowed))
        };
        if self.shard != "none" {
            return beside("parallel.shard", format!("{:?}", self.shard), "set parallel.shard = \"none\"");
        }
        if self.pp > 1 {
            return beside("parallel.pp", self.pp.to_string(), "set parallel.pp = 1");
        }
        if self.tp > 1 {
            return beside("parallel.tp", self.tp.to_string(), "set parallel.tp = 1");
        }
        if self.precision == "fp16" {
            return beside("parallel.precision", "\"fp16\"".into(), "use \"fp32\" or \"bf16\" (no loss scaling)");
        }
        Ok(())
    }
}

/// Most local steps between two synchronizations (`parallel.sync_every`).
pub const SYNC_EVERY_MAX: u64 = 1 << 20;
/// `parallel.offload`'s values (optim::offload carries out `host`).
pub const OFFLOADS: [&str; 2] = ["none", "host"];

pub(crate) fn invalid(key: &'static str, value: impl fmt::Display, allowed: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, value: value.to_string(), allowed: allowed.into() }
}

pub(crate) fn positive(key: &'static str, value: usize) -> Result<(), ConfigError> {
    if value == 0 {
        return Err(invalid(key, value, "must be at least 1"));
    }
    Ok(())
}

fn one_of(key: &'static str, value: &str, allowed: &[&str]) -> Result<(), ConfigError> {
    if allowed.contains(&value) {
        return Ok(());
    }
    Err(invalid(key, format!("{value:?}"), format!("must be one of {}", allowed.join(", "))))
}
