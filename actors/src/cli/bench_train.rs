//! `troupe bench train`: training throughput of a model preset (gpt-tiny by default; micro-batch 8 per
//! rank, context 128), and with `--peer` the identical model trained by PyTorch in the same run,
//! alternating the two so machine drift hits both alike. The figure that counts is the ratio.
//!
//! `--world 1` trains in this process beside PyTorch eager (bench/peers/train_gpt_tiny.py; another preset
//! beside transformers' own model of the config.json troupe writes for it, bench/peers/train_hf_model.py);
//! `--world N` (N ≥ 2) runs a job on a local cluster of N daemon processes beside PyTorch DDP over Gloo of
//! the same model (bench/peers/ddp_gpt_tiny.py, `--config-dir` for a preset other than gpt-tiny), twice
//! per repetition — bucket all-reduce overlapped with the backward (the default) and after it — see
//! `data_parallel`. `--world N --tp T` runs tensor degree T beside PyTorch's tensor parallelism, see
//! `tensor_parallel`.

mod data_parallel;
mod netns;
mod offload;
mod optimizer;
mod periodic;
mod tensor_parallel;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_model::config::{JobConfig, BUCKET_MIB_MAX};
use troupe_model::trainer::configure_torch_threads;
use troupe_model::{ModelConfig, Trainer};

use crate::cli::bench_kernels::BenchDevice;

#[derive(Debug, clap::Args)]
pub struct BenchTrainArgs {
    /// Data-parallel ranks: 1 trains in this process; N ≥ 2 starts a local cluster of N daemons.
    #[arg(long, default_value_t = 1)]
    pub world: usize,
    /// Timed steps per repetition (after 2 untimed warm-up steps).
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Sharding with `--world N ≥ 2`: none (DDP), zero1, zero2 or zero3 — a sharded run is measured beside DDP
    /// (overlapped) in the same repetitions, and the report carries both and the ratio.
    #[arg(long, value_parser = ["none", "zero1", "zero2", "zero3"], default_value = "none")]
    pub shard: String,
    /// Repetitions (each of troupe and, with --peer, of the peer); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// libtorch threads per rank (0: the cores divided by the ranks, at least 1).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Also run the PyTorch peer script and report the ratio.
    #[arg(long)]
    pub peer: bool,
    /// The `--world 1` peer's model under `torch.compile` (its compilation in the untimed warm-up
    /// steps) instead of eager.
    #[arg(long)]
    pub peer_compile: bool,
    /// DDP gradient bucket size in MiB for `--world N ≥ 2` (0: the default, 25). Both the overlapped and
    /// the sequential all-reduce are measured with it.
    #[arg(long, default_value_t = 0)]
    pub bucket_mib: usize,
    /// Compute precision of troupe and of the peer (PyTorch autocast; fp16 with its GradScaler).
    #[arg(long, value_parser = ["fp32", "bf16", "fp16"], default_value = "fp32")]
    pub precision: String,
    /// Python with torch for the peer (default: $TROUPE_PYTHON, else the provisioned venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Where `--world 1` trains: the CPU, or CUDA device 0 (fails plainly with `no CUDA device` without one).
    #[arg(long, value_enum, default_value_t = crate::cli::bench_kernels::BenchDevice::Cpu)]
    pub device: crate::cli::bench_kernels::BenchDevice,
    /// The model, a preset (`gpt-tiny`, `llama-tiny`, `gpt2`, `smollm2-135m`, `tinyllama-1.1b`) at
    /// `--context`, at any `--world`. With `--peer`, a preset other than gpt-tiny is trained beside
    /// transformers' own model of the config.json troupe writes for it (AutoModelForCausalLM, eager
    /// PyTorch; under DDP over Gloo with `--world N ≥ 2`).
    #[arg(long, default_value = "gpt-tiny")]
    pub model: String,
    /// Tokens per sample, for troupe and the peer, at any `--world`.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Samples per step for `--world 1` (one micro-batch; default 8, the peers' figure).
    #[arg(long, default_value_t = MICRO_BATCH)]
    pub micro_batch: usize,
    /// The device's peak TFLOP/s in the compute precision, for the MFU figure (default: known for
    /// H100 SXM / H200 on CUDA — 989 in bf16/fp16, 67 in fp32; otherwise MFU is left out).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Fine-tune with LoRA instead of training every parameter: the preset's model, drawn once and
    /// written as a Hugging Face directory, is the frozen base; with `--peer` transformers + PEFT
    /// (`get_peft_model`, the same r, alpha and targets) fine-tune the same weights (`--world 1`).
    #[arg(long, value_parser = ["none", "lora"], default_value = "none")]
    pub peft: String,
    /// LoRA's rank with `--peft lora` (alpha is twice the rank, a common choice).
    #[arg(long, default_value_t = 8)]
    pub lora_r: usize,
    /// LoRA's target modules with `--peft lora`, comma-separated (default: the family's, PEFT's
    /// default: q_proj,v_proj for Llama, c_attn for GPT-2).
    #[arg(long, default_value = "")]
    pub lora_targets: String,
    /// Tensor-parallel degree: the job of `--world N` ranks runs N / T tensor groups of T (gpt-tiny's
    /// plan beside PyTorch's DTensor tensor parallelism over Gloo with `--peer`); see `tensor_parallel`.
    #[arg(long)]
    pub tp: Option<usize>,
    /// With `--tp`: sequence parallelism on (the default).
    #[arg(long, conflicts_with = "no_sp")]
    pub sp: bool,
    /// With `--tp`: sequence parallelism off (the norms and the residual stream replicated).
    #[arg(long)]
    pub no_sp: bool,
    /// With `--world N ≥ 2`: how the replicas synchronize (parallel.sync). `local_sgd` or `diloco` is
    /// measured beside DDP in the same repetitions, on the same token budget: tokens/s, bytes the ranks
    /// sent per step (the daemons' link counters) and the validation loss of each final model (a tenth of
    /// the corpus held out).
    #[arg(long, value_parser = ["every_step", "local_sgd", "diloco"], default_value = "every_step")]
    pub sync: String,
    /// Local steps between synchronizations with `--sync local_sgd | diloco` (parallel.sync_every).
    #[arg(long, value_name = "H", default_value_t = 8)]
    pub sync_every: u64,
    /// The optimizer: with `adafactor`, Adafactor and AdamW are trained in the same repetitions — in
    /// this process (`--world 1`), or as jobs on local clusters (`--world N`, with `--shard` or `--tp`)
    /// — and the report carries each one's tokens/s and optimizer state bytes per rank, and the ratios;
    /// see `optimizer`.
    #[arg(long, value_parser = ["adamw", "adafactor"], default_value = "adamw")]
    pub optimizer: String,
    /// With `host`: the model trained with the optimizer offloaded to the host (parallel.offload) and
    /// without, in the same repetitions (`--world 1`; `--device cuda` for the device's figure, the CPU
    /// runs the emulated staging): tokens/s of each, the ratio and the device bytes saved; see `offload`.
    #[arg(long, value_parser = ["none", "host"], default_value = "none")]
    pub offload: String,
    /// With `--world N`: every daemon in its own network namespace (N of them), and the series DDP,
    /// DiLoCo H = 8 and 32, Streaming DiLoCo (4 fragments) trained in turn: tokens/s and bytes on the
    /// wire per step (with `--peer`, PyTorch DDP over Gloo in the same namespaces too); see `netns`.
    /// Needs root and iproute2.
    #[arg(long, default_value_t = 0)]
    pub netns: usize,
    /// With `--netns`: each namespace's egress shaped to this many Gbit/s (tc tbf).
    #[arg(long, requires = "netns")]
    pub rate_gbit: Option<f64>,
    /// JSON output (one object).
    #[arg(long)]
    pub json: bool,
}

/// Samples per rank per step (one micro-batch: no gradient accumulation).
const MICRO_BATCH: usize = 8;
const WARMUP_STEPS: u64 = 2;

pub fn run(args: BenchTrainArgs) -> anyhow::Result<()> {
    if args.world == 0 {
        bail!("--world 0: a benchmark needs at least one rank");
    }
    if args.optimizer != "adamw" && args.world > 1 {
        let model = bench_model(&args.model, args.context)?;
        optimizer::check(&args)?;
        return optimizer::run(args, model);
    }
    if let Some(tp) = args.tp {
        let model = bench_model(&args.model, args.context)?;
        tensor_parallel::check(&args, &model, tp)?;
        return tensor_parallel::run(args, model, tp);
    }
    if args.netns > 0 {
        netns::check(&args)?;
        let model = bench_model(&args.model, args.context)?;
        return netns::run(args, model);
    }
    if args.sync != "every_step" && (args.world < 2 || args.shard != "none" || args.tp.is_some()) {
        bail!(
            "--sync {} runs replicas on daemons beside DDP: use --world 2 (or more) without --shard or --tp",
            args.sync
        );
    }
    if args.sp || args.no_sp {
        bail!("--sp / --no-sp go with --tp: add --tp 2 (or more), or drop them");
    }
    if args.shard != "none" && args.world < 2 {
        bail!("--shard {} needs --world 2 or more (one rank holds every shard; that is --shard none)", args.shard);
    }
    if args.bucket_mib > BUCKET_MIB_MAX {
        bail!("--bucket-mib {}: must be 0 (the default, 25) or at most {BUCKET_MIB_MAX}", args.bucket_mib);
    }
    if args.device == BenchDevice::Cuda && args.world != 1 {
        bail!("--device cuda trains with --world 1 (the multi-rank jobs run on the CPU)");
    }
    if args.world != 1 && args.micro_batch != MICRO_BATCH {
        bail!("--micro-batch is for --world 1; data-parallel runs use {MICRO_BATCH} per rank");
    }
    if args.peer_compile && (!args.peer || args.world != 1) {
        bail!("--peer-compile compiles the --world 1 peer: add --peer (and --world 1), or drop --peer-compile");
    }
    let model = bench_model(&args.model, args.context)?;
    if args.device == BenchDevice::Cuda {
        // Before any setup (a fine-tuning base of a billion parameters takes a minute to write): a machine
        // without a GPU is told so at once.
        bench_device(&args)?;
    }
    if args.offload != "none" {
        offload::check(&args)?;
        return offload::run(args, model);
    }
    if args.optimizer != "adamw" {
        optimizer::check(&args)?;
        return optimizer::run(args, model);
    }
    // With --peft, the base's weights are written once; troupe reads them, and so does the peer.
    let base = fine_tuning_base(&args, &model)?;
    match args.world {
        1 => run_single(args, model, base.as_ref()),
        _ => data_parallel::run(args, model, base.as_ref()),
    }
}

/// `--world 1`: the trainer in this process.
fn run_single(
    args: BenchTrainArgs,
    model: ModelConfig,
    base: Option<&(tempfile::TempDir, ModelConfig)>,
) -> anyhow::Result<()> {
    let threads = configure_torch_threads(args.threads, 1);
    let (device, peak_tflops, device_name) = bench_device(&args)?;
    let (model, peer_config) = peer_model(model, base)?;
    let (peer_script, peer_flags) = single_peer(&args, &model, peer_config.as_ref(), threads);
    // The peak memory reported is training's: what writing the base took does not count.
    let setup_peak = reset_peak_rss();
    let mut ours = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..args.repeats.max(1) {
        ours.push(measure_troupe(&model, args.steps, &args.precision, args.micro_batch, device)?);
        if args.peer {
            peers.push(run_peer(&args, peer_script, &peer_flags)?);
        }
    }
    let tokens_per_s_runs: Vec<f64> = ours.iter().map(|r| r.0).collect();
    let tokens_per_s = median(tokens_per_s_runs.clone());
    let peak_mem = peak_rss_bytes();
    // On a GPU what counts is the device's memory: NVML's figure for this process, read after training
    // (libtorch's allocator keeps the blocks it reserved, so this is the run's peak reserve).
    let device_mem = match device {
        tch::Device::Cuda(ordinal) => crate::telemetry::load::process_device_memory(ordinal as u32)
            .map_err(|why| tracing::warn!(%why, "bench train: the GPU memory used is not reported"))
            .ok(),
        _ => None,
    };
    // Training ≈ 3 × the forward's FLOPs per token (DESIGN.md's MFU convention, gpt.rs).
    let achieved_tflops = 3.0 * model.forward_flops_per_token() * tokens_per_s / 1e12;
    let run = SingleRun {
        device_name,
        threads,
        setup_peak,
        tokens_per_s_runs,
        tokens_per_s,
        peak_mem,
        device_mem,
        achieved_tflops,
        peak_tflops,
        peers,
    };
    let report = run.report(&args, &model);
    if args.json {
        println!("{report}");
    } else {
        run.print_lines(&args, &report);
    }
    Ok(())
}

/// The device `--device` names: libtorch's, its peak TFLOP/s (`--peak-tflops`, or the known figure of
/// the CUDA device) and its name.
fn bench_device(args: &BenchTrainArgs) -> anyhow::Result<(tch::Device, Option<f64>, String)> {
    Ok(match args.device {
        BenchDevice::Cpu => (tch::Device::Cpu, args.peak_tflops, "cpu".to_owned()),
        BenchDevice::Cuda => {
            let cuda = troupe_kernels::CudaBackend::new(0)?;
            if !tch::Cuda::is_available() {
                bail!("no CUDA device: libtorch sees none");
            }
            let name = cuda.device_name()?;
            let peak = args.peak_tflops.or_else(|| crate::telemetry::peak::known_peak_tflops(&name, &args.precision));
            (tch::Device::Cuda(0), peak, name)
        }
    })
}

/// The peer's script and flags for `--world 1`: PyTorch's gpt-tiny, or transformers' model of
/// `peer_config`.
fn single_peer(
    args: &BenchTrainArgs,
    model: &ModelConfig,
    peer_config: Option<&PeerDir>,
    threads: usize,
) -> (&'static str, Vec<(&'static str, String)>) {
    let mut peer_flags = vec![
        ("--micro-batch", args.micro_batch.to_string()),
        ("--context", args.context.to_string()),
        ("--threads", threads.to_string()),
        ("--precision", args.precision.clone()),
        ("--device", if args.device == BenchDevice::Cuda { "cuda".into() } else { "cpu".into() }),
        ("--compile", u8::from(args.peer_compile).to_string()),
    ];
    let peer_script = match peer_config {
        None => "train_gpt_tiny.py",
        Some(dir) => {
            peer_flags.extend(peer_model_flags(dir, model));
            "train_hf_model.py"
        }
    };
    (peer_script, peer_flags)
}

/// What a `--world 1` benchmark measured.
struct SingleRun {
    device_name: String,
    threads: usize,
    /// The peak memory could be reset after the setup (it is training's only).
    setup_peak: bool,
    tokens_per_s_runs: Vec<f64>,
    /// Their median.
    tokens_per_s: f64,
    peak_mem: u64,
    /// On a GPU: the device memory the process held after training (NVML), where it could be read.
    device_mem: Option<u64>,
    achieved_tflops: f64,
    peak_tflops: Option<f64>,
    /// The peer's report of each repetition (with `--peer`).
    peers: Vec<Value>,
}

impl SingleRun {
    /// The JSON report, the peer's figures included with `--peer`.
    fn report(&self, args: &BenchTrainArgs, model: &ModelConfig) -> Value {
        let (ours_tps, peak_tflops, achieved_tflops) = (self.tokens_per_s, self.peak_tflops, self.achieved_tflops);
        let mut report = json!({
            "bench": "train", "world": args.world, "shard": args.shard, "steps": args.steps, "precision": args.precision,
            "model": args.model, "arch": model.arch.as_str(), "params": troupe_model::model::base_specs(model).iter().map(|s| s.numel()).sum::<usize>(),
            "trainable_params": model.param_count(), "peft": args.peft,
            "lora_r": model.peft.as_ref().map(|p| p.r), "lora_targets": model.peft.as_ref().map(|p| p.targets(model.arch)),
            "device": self.device_name, "micro_batch": args.micro_batch, "context": args.context, "torch_threads": self.threads,
            "repeats": self.tokens_per_s_runs.len(), "tokens_per_s": ours_tps, "peak_mem_is_training_only": self.setup_peak,
            "tokens_per_s_runs": self.tokens_per_s_runs, "peak_mem_bytes": self.peak_mem,
            "device_mem_bytes": self.device_mem,
            "achieved_tflops": achieved_tflops, "peak_tflops": peak_tflops,
            "mfu": peak_tflops.map(|peak| achieved_tflops / peak),
        });
        if args.peer {
            let peers = &self.peers;
            let peer_tps = median(peers.iter().map(|p| p["tokens_per_s"].as_f64().unwrap_or(f64::NAN)).collect());
            let peer_name = match (args.model.as_str(), args.peft.as_str()) {
                (_, "lora") => "transformers-peft",
                ("gpt-tiny", _) => "pytorch",
                _ => "transformers",
            };
            let peer_name = format!("{peer_name}-{}", if args.peer_compile { "compile" } else { "eager" });
            let extra = json!({
                "peer": peer_name, "peer_tokens_per_s": peer_tps,
                "peer_tokens_per_s_runs": peers.iter().map(|p| p["tokens_per_s"].clone()).collect::<Vec<_>>(),
                "peer_peak_mem_bytes": peers.last().map(|p| p["peak_mem_bytes"].clone()),
                "peer_device_mem_bytes": peers.last().map(|p| p["device_mem_bytes"].clone()),
                "peer_params": peers.last().map(|p| p["params"].clone()),
                "peer_trainable_params": peers.last().map(|p| p["trainable_params"].clone()),
                "ratio_vs_peer": ours_tps / peer_tps,
            });
            extend_report(&mut report, extra);
        }
        report
    }

    /// The human lines: troupe's tokens/s, its MFU or FLOP/s, and the peer's figures in `report`.
    fn print_lines(&self, args: &BenchTrainArgs, report: &Value) {
        let (ours_tps, achieved_tflops) = (self.tokens_per_s, self.achieved_tflops);
        println!(
            "troupe   {ours_tps:>9.0} tokens/s  ({} on {}, {} threads, peak RSS {:.0} MiB)",
            args.model,
            self.device_name,
            self.threads,
            self.peak_mem as f64 / 1048576.0
        );
        if let Some(bytes) = self.device_mem {
            println!(
                "GPU mem  {:>9.0} MiB  (held after training: context and cached blocks, NVML)",
                bytes as f64 / 1048576.0
            );
        }
        match self.peak_tflops {
            Some(peak) => {
                println!("MFU      {:>9.4}  ({achieved_tflops:.3} of {peak} TFLOP/s)", achieved_tflops / peak)
            }
            None => println!("achieved {achieved_tflops:>9.3} TFLOP/s (pass --peak-tflops for MFU)"),
        }
        if let Some(peer) = report.get("peer_tokens_per_s").and_then(Value::as_f64) {
            let peer_name = if args.model == "gpt-tiny" { "pytorch " } else { "transformers" };
            let how = if args.peer_compile { "torch.compile" } else { "eager" };
            println!("{peer_name} {peer:>9.0} tokens/s  ({how}, same model and batch)");
            println!("ratio    {:>9.3}", ours_tps / peer);
        }
    }
}

/// The preset `name` at `context` tokens per sample.
pub(crate) fn bench_model(name: &str, context: usize) -> anyhow::Result<ModelConfig> {
    let Some(model) = troupe_model::model::presets::preset(name) else {
        bail!("--model {name:?}: not a preset; one of {}", troupe_model::model::presets::names());
    };
    let model = ModelConfig { context, ..model };
    model.validate().with_context(|| format!("--model {name} --context {context}"))?;
    Ok(model)
}

/// The model troupe trains (with `base`, the fine-tuning config on it) and what the transformers peer
/// builds its model from (None: gpt-tiny, which the PyTorch peers define).
fn peer_model(
    model: ModelConfig,
    base: Option<&(tempfile::TempDir, ModelConfig)>,
) -> anyhow::Result<(ModelConfig, Option<PeerDir>)> {
    Ok(match base {
        Some((dir, config)) => (config.clone(), Some(PeerDir::Base(dir.path().to_owned()))),
        None => {
            let dir = hf_peer_config(&model)?.map(PeerDir::Config);
            (model, dir)
        }
    })
}

/// The peer's flags for `dir`'s model: the directory, and fine-tuning, its weights and LoRA's settings.
fn peer_model_flags(dir: &PeerDir, model: &ModelConfig) -> Vec<(&'static str, String)> {
    let mut flags = vec![("--config-dir", dir.path().display().to_string())];
    if let Some(peft) = &model.peft {
        flags.push(("--weights", "1".into()));
        flags.push(("--lora-r", peft.r.to_string()));
        flags.push(("--lora-alpha", peft.alpha.to_string()));
        flags.push(("--lora-targets", peft.targets(model.arch).join(",")));
    }
    flags
}

/// What the transformers peer builds its model from: a directory with the config.json troupe writes
/// (fresh weights), or the fine-tuning base's Hugging Face directory (its weights).
enum PeerDir {
    Config(tempfile::TempDir),
    Base(PathBuf),
}

impl PeerDir {
    fn path(&self) -> &std::path::Path {
        match self {
            Self::Config(dir) => dir.path(),
            Self::Base(dir) => dir,
        }
    }
}

/// With `--peft lora`: `model` drawn once and written as a Hugging Face directory (kept while the
/// benchmark runs), and the LoRA model config on it.
fn fine_tuning_base(
    args: &BenchTrainArgs,
    model: &ModelConfig,
) -> anyhow::Result<Option<(tempfile::TempDir, ModelConfig)>> {
    if args.peft == "none" {
        return Ok(None);
    }
    let targets: Vec<String> =
        args.lora_targets.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned).collect();
    let peft = troupe_model::model::PeftConfig {
        r: args.lora_r,
        alpha: 2.0 * args.lora_r as f64,
        targets,
        ..Default::default()
    };
    let dir = tempfile::tempdir().context("creating a directory for the fine-tuning base")?;
    let job = JobConfig { model: model.clone(), ..JobConfig::default() };
    let job = troupe_model::oracle::fine_tuning(job, peft, dir.path(), 1);
    job.model
        .validate()
        .with_context(|| format!("--peft lora --lora-r {} --lora-targets {:?}", args.lora_r, args.lora_targets))?;
    Ok(Some((dir, job.model)))
}

/// For a preset other than gpt-tiny, a temporary directory holding the config.json troupe writes for
/// `model`: the peers build transformers' own model from it. None for gpt-tiny, whose peers define it.
fn hf_peer_config(model: &ModelConfig) -> anyhow::Result<Option<tempfile::TempDir>> {
    if model.preset.as_deref() == Some("gpt-tiny") {
        return Ok(None);
    }
    let dir = tempfile::tempdir().context("creating a directory for the peer's config.json")?;
    let config_json = troupe_model::hf::write_config(model, "float32");
    std::fs::write(dir.path().join("config.json"), config_json.to_string())
        .with_context(|| format!("writing {}/config.json for the peer", dir.path().display()))?;
    Ok(Some(dir))
}

/// (tokens/s, final loss) of one timed run of `model`, `micro_batch` samples per step, on `device`.
fn measure_troupe(
    model: &ModelConfig,
    steps: u64,
    precision: &str,
    micro_batch: usize,
    device: tch::Device,
) -> anyhow::Result<(f64, f64)> {
    let mut config = JobConfig { model: model.clone(), ..JobConfig::default() };
    config.parallel.precision = precision.into();
    config.train.steps = steps + WARMUP_STEPS;
    config.train.global_batch = micro_batch;
    config.train.micro_batch = micro_batch;
    let mut trainer = Trainer::new_on(config, device)?;
    for _ in 0..WARMUP_STEPS {
        trainer.train_step();
    }
    let started = Instant::now();
    let mut tokens = 0;
    let mut loss = 0.0;
    for _ in 0..steps {
        let report = trainer.train_step();
        tokens += report.tokens;
        loss = report.loss;
    }
    Ok((tokens as f64 / started.elapsed().as_secs_f64(), loss))
}

/// Runs bench/peers/SCRIPT with the common flags (steps, warm-up) and `flags`; its last stdout line, parsed.
fn run_peer(args: &BenchTrainArgs, script: &str, flags: &[(&str, String)]) -> anyhow::Result<Value> {
    let mut all = vec!["--steps".to_string(), args.steps.to_string(), "--warmup".into(), WARMUP_STEPS.to_string()];
    for (flag, value) in flags {
        all.extend([flag.to_string(), value.clone()]);
    }
    run_peer_script(args.python.as_ref(), script, &all)
}

/// Runs bench/peers/SCRIPT with `args` under [`peer_python`]; its last stdout line, parsed as JSON.
pub(crate) fn run_peer_script(python: Option<&PathBuf>, script: &str, args: &[String]) -> anyhow::Result<Value> {
    let python = peer_python(python);
    let script = peer_script(script)?;
    let output = Command::new(&python).arg(&script).args(args).output().with_context(|| {
        format!("running the peer {} {}; pass --python with a torch-enabled python", python.display(), script.display())
    })?;
    if !output.status.success() {
        bail!("peer {} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("peer printed {line:?}, not JSON"))
}

/// The python that runs the peers: `explicit` (a --python flag), else $TROUPE_PYTHON, else the provisioned venv.
pub(crate) fn peer_python(explicit: Option<&PathBuf>) -> PathBuf {
    explicit.cloned().unwrap_or_else(troupe_model::oracle::venv_python)
}

/// bench/peers/NAME, found from the working directory or from the source tree this binary was built in.
pub(crate) fn peer_script(name: &str) -> anyhow::Result<PathBuf> {
    let candidates = [
        PathBuf::from("bench/peers").join(name),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/peers").join(name),
    ];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .with_context(|| format!("peer script bench/peers/{name} not found; run from the repository root"))
}

/// Adds `extra`'s fields to `report` (both JSON objects).
fn extend_report(report: &mut Value, extra: Value) {
    if let (Some(report), Value::Object(extra)) = (report.as_object_mut(), extra) {
        report.extend(extra);
    }
}

/// Resets this process's peak resident set (Linux: `5` into /proc/self/clear_refs), so the next reading
/// is the peak from now on; whether it could.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

pub(crate) use crate::telemetry::memory::{peak_rss_bytes, vm_hwm_bytes};
