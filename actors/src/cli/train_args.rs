//! `troupe train`'s flags, shared by the three ways a job runs (one process, in-process pipelines, a
//! cluster): below `train`, `train_pipeline` and `train_cluster`, which depend on it and never on each
//! other's flags.

use std::path::PathBuf;

use anyhow::bail;
use troupe_model::config::JobConfig;

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Job config (TOML). Without it: gpt-tiny on the built-in synthetic corpus.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Optimizer steps to run (train.steps).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seed of initialisation and sampling (train.seed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The optimizer (train.optimizer): adamw, or adafactor (its hyper-parameters in the config's
    /// `[train.adafactor]`; on one process, under DDP and ZeRO-1/2/3).
    #[arg(long, value_parser = ["adamw", "adafactor"])]
    pub optimizer: Option<String>,
    /// Daemons of the embedded local cluster.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Slots (ranks) per daemon of the embedded cluster. Default: 1, or — when --tp × --pp × --dp names
    /// more ranks than --nodes — that world divided over the daemons (`--tp 2 --pp 2 --dp 2 --nodes 4`:
    /// 2 slots each, one tensor group per daemon on its shared-memory arena, as `troupe plan` places it).
    #[arg(long)]
    pub slots: Option<usize>,
    /// Data-parallel degree (with --pp: replicas of the whole pipeline).
    #[arg(long)]
    pub dp: Option<usize>,
    /// Pipeline-parallel degree.
    #[arg(long)]
    pub pp: Option<usize>,
    /// Tensor-parallel degree: every block's matrices split over this many ranks (Megatron); the world
    /// is tp × pp × dp. Needs --nodes (or --cluster).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Sequence parallelism with --tp (the default): the norms and the residual stream split along the
    /// sequence too.
    #[arg(long, overrides_with = "no_sp")]
    pub sp: bool,
    /// Without sequence parallelism (--tp only).
    #[arg(long, overrides_with = "sp")]
    pub no_sp: bool,
    /// Pipeline schedule.
    #[arg(long, value_parser = ["gpipe", "1f1b", "interleaved", "zb-h1"])]
    pub schedule: Option<String>,
    /// Pipeline micro-batches per step (default: the global batch's micro-batches, at least --pp).
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Model chunks per pipeline stage (--schedule interleaved).
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// How the blocks are split among pipeline stages: equal parameter counts, or equal measured time.
    #[arg(long, value_parser = ["params", "measured"])]
    pub balance: Option<String>,
    /// Sharding of optimizer state, gradients and parameters.
    #[arg(long, value_parser = ["none", "zero1", "zero2", "zero3"])]
    pub shard: Option<String>,
    /// Compute precision.
    #[arg(long, value_parser = ["fp32", "bf16", "fp16"])]
    pub precision: Option<String>,
    /// Where a device rank keeps its optimizer (parallel.offload): beside the parameters, or on the host
    /// (fp32 masters, optimizer state and the update; ZeRO-Offload). CPU ranks have it on the host
    /// already: accepted, nothing changes.
    #[arg(long, value_parser = ["none", "host"])]
    pub offload: Option<String>,
    /// Recompute activations in backward instead of keeping them.
    #[arg(long)]
    pub recompute: bool,
    /// How often the data-parallel replicas synchronize (parallel.sync): every step (DDP), or every
    /// --sync-every local steps by averaging their parameters (local_sgd) or by DiLoCo's outer Nesterov
    /// step on the averaged delta (diloco). Needs --nodes (or --cluster).
    #[arg(long, value_parser = ["every_step", "local_sgd", "diloco"])]
    pub sync: Option<String>,
    /// Local steps between synchronizations with --sync local_sgd / diloco (parallel.sync_every).
    #[arg(long, value_name = "H")]
    pub sync_every: Option<u64>,
    /// DiLoCo's outer learning rate (parallel.outer_lr; default 0.7).
    #[arg(long)]
    pub outer_lr: Option<f64>,
    /// DiLoCo's outer Nesterov momentum (parallel.outer_momentum; default 0.9).
    #[arg(long)]
    pub outer_momentum: Option<f64>,
    /// Write the final parameters to this safetensors file.
    #[arg(long, value_name = "PATH.safetensors")]
    pub save_final: Option<PathBuf>,
    /// Address of a running cluster (without it: an embedded local cluster).
    #[arg(long, value_name = "ADDR")]
    pub cluster: Option<String>,
    /// Transport of the gradients between daemons: auto (shared memory and Unix sockets when every rank
    /// is on one host, else QUIC), quic, encrypted-tcp (as auto, but TCP between hosts over mutual TLS
    /// 1.3 with the cluster's certificates), or plaintext-tcp (the same unencrypted: for trusted
    /// fabrics only).
    #[arg(long, value_parser = ["auto", "quic", "encrypted-tcp", "plaintext-tcp"], default_value = "auto")]
    pub data_plane: String,
    /// With --cluster: the certificate to present.
    #[command(flatten)]
    pub identity: super::client::IdentityArgs,
    /// One JSON object per line on stdout instead of text.
    #[arg(long)]
    pub json: bool,
    /// Save resumable checkpoints under this directory (checkpoint.dir).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (checkpoint.every_steps; 0 = only at the end).
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Continue from a checkpoint directory, or the newest valid one under a checkpoint root.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Record the run here: every event (events.jsonl) and each rank's step phases as a Perfetto trace
    /// (trace.json); `troupe trace DIR` and `troupe plot DIR` draw them. Default: not recorded.
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Print a plain progress line every N steps (default: about 20 lines per run).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub log_every: u64,
}

impl TrainArgs {
    /// The job config: the file (or defaults) with the command-line flags applied, validated.
    pub fn job_config(&self) -> anyhow::Result<JobConfig> {
        let mut config = match &self.config {
            // Validated below, once the flags are applied: a flag may fix what the file alone gets wrong.
            Some(path) => JobConfig::parse_file(path)?,
            None => JobConfig::default(),
        };
        let train = &mut config.train;
        train.steps = self.steps.unwrap_or(train.steps);
        train.seed = self.seed.unwrap_or(train.seed);
        if let Some(optimizer) = &self.optimizer {
            train.optimizer.clone_from(optimizer);
        }
        let parallel = &mut config.parallel;
        parallel.nodes = self.nodes.unwrap_or(parallel.nodes);
        parallel.dp = self.dp.unwrap_or(parallel.dp);
        parallel.pp = self.pp.unwrap_or(parallel.pp);
        parallel.tp = self.tp.unwrap_or(parallel.tp);
        if self.sp || self.no_sp {
            parallel.sp = self.sp;
        }
        parallel.microbatches = self.microbatches.unwrap_or(parallel.microbatches);
        parallel.virtual_stages = self.virtual_stages.unwrap_or(parallel.virtual_stages);
        parallel.recompute |= self.recompute;
        parallel.sync_every = self.sync_every.unwrap_or(parallel.sync_every);
        parallel.outer_lr = self.outer_lr.unwrap_or(parallel.outer_lr);
        parallel.outer_momentum = self.outer_momentum.unwrap_or(parallel.outer_momentum);
        for (flag, value) in [
            (&mut parallel.schedule, &self.schedule),
            (&mut parallel.balance, &self.balance),
            (&mut parallel.shard, &self.shard),
            (&mut parallel.precision, &self.precision),
            (&mut parallel.sync, &self.sync),
            (&mut parallel.offload, &self.offload),
        ] {
            if let Some(v) = value {
                flag.clone_from(v);
            }
        }
        let checkpoint = &mut config.checkpoint;
        if self.checkpoint_dir.is_some() {
            checkpoint.dir.clone_from(&self.checkpoint_dir);
        }
        checkpoint.every_steps = self.checkpoint_every.unwrap_or(checkpoint.every_steps);
        config.validate()?;
        let (nodes, dp) = (config.parallel.nodes, config.parallel.dp);
        let slots = self.slots_per_daemon(&config);
        if slots == 0 {
            bail!("--slots 0: each daemon needs at least one slot");
        }
        let (ranks, given) = (nodes * slots, slots_phrase(nodes, slots));
        if self.cluster.is_none() && config.parallel.pp == 1 && config.parallel.tp <= 1 && dp > ranks {
            bail!("--dp {dp} needs at least {dp} ranks, and {given}; raise --nodes or lower --dp (or add --slots)");
        }
        let (pp, tp) = (config.parallel.pp, config.parallel.tp.max(1));
        if self.cluster.is_none() && pp > 1 && nodes > 1 && pp * tp * dp.max(1) > ranks {
            let needed = pp * tp * dp.max(1);
            bail!("--pp {pp} --dp {} on --nodes {nodes}: the pipelines need tp × pp × dp = {needed} ranks, and {given}; raise --nodes or lower --pp / --dp (or add --slots)", dp.max(1));
        }
        self.check_tensor_world(&config)?;
        let distributed = self.cluster.is_some() || nodes > 1;
        if !distributed && config.parallel.periodic_sync() {
            bail!("--sync {}: replicas synchronize across ranks, and one process trains one; add --nodes N (N ≥ 2 daemons, one replica each) or --cluster", config.parallel.sync);
        }
        if distributed && self.resume.is_some() {
            bail!("--resume: on a cluster, pass --checkpoint-dir instead: a job whose checkpoint directory holds a valid checkpoint continues from the newest one");
        }
        Ok(config)
    }

    /// The embedded cluster's slots per daemon: `--slots`, or 1 — unless the layout names more ranks
    /// (tp × pp × dp, dp given) than there are daemons (`--nodes` > 1) and they divide evenly: that many
    /// per daemon.
    pub fn slots_per_daemon(&self, config: &JobConfig) -> usize {
        let p = &config.parallel;
        let (world, nodes) = (p.tp.max(1) * p.pp.max(1) * p.dp, p.nodes);
        let spread = nodes > 1 && world > nodes && world.is_multiple_of(nodes);
        self.slots.unwrap_or(if spread { world / nodes } else { 1 })
    }

    /// `--tp` on the embedded cluster: the world is tp × pp × dp ranks of `--nodes` × slots.
    fn check_tensor_world(&self, config: &JobConfig) -> anyhow::Result<()> {
        let (tp, dp, nodes) = (config.parallel.tp, config.parallel.dp, config.parallel.nodes);
        let group = tp * config.parallel.pp.max(1);
        if tp <= 1 || self.cluster.is_some() {
            return Ok(());
        }
        if nodes == 1 {
            bail!(
                "--tp {tp} runs its ranks on daemons: add --nodes {} (tp × pp × dp ranks, one per daemon; or fewer daemons with --slots)",
                group * dp.max(1)
            );
        }
        let slots = self.slots_per_daemon(config);
        let (ranks, given) = (nodes * slots, slots_phrase(nodes, slots));
        if dp == 0 && !ranks.is_multiple_of(group) {
            bail!("--tp {tp} on {given}: the world must be whole model replicas of tp × pp = {group} ranks, and {group} does not divide {ranks}; set --dp {} (or change --nodes / --slots)", (ranks / group).max(1));
        }
        if dp > 0 && group * dp > ranks {
            bail!("--tp {tp} --dp {dp} needs tp × pp × dp = {} ranks, and {given}; raise --nodes or lower --tp / --dp (or add --slots)", group * dp);
        }
        Ok(())
    }
}

/// "--nodes N gives N ranks" / "--nodes N × --slots S gives N·S ranks", for the world checks' errors.
fn slots_phrase(nodes: usize, slots: usize) -> String {
    match slots {
        1 => format!("--nodes {nodes} gives {nodes} (one slot each)"),
        _ => format!("--nodes {nodes} × {slots} slots give {}", nodes * slots),
    }
}
