//! `troupe bench kernels`: troupe's CPU kernels beside a plain memcpy of the same bytes, and the fused
//! AdamW beside libtorch's AdamW on the same shard, all measured in this one run.
//!
//! Every kernel is timed interleaved with a plain memcpy of the working buffer's size (see
//! `troupe_kernels::bench`), so each ratio compares two figures taken in the same seconds.
//! With `--json`, one JSON object per line: a `KernelFigure` per kernel, then
//! `{"event":"summary", ...}` with the two target ratios and the CUDA status.

use anyhow::Context;
use tch::nn::{self, OptimizerConfig};
use troupe_kernels::bench::{run_cpu, KernelFigure, MemcpyBaseline};
use troupe_kernels::{AdamWConfig, Backend};

#[derive(Debug, clap::Args)]
pub struct KernelsArgs {
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Size of the f32 working buffer (and of the AdamW shard's param buffer), in MiB.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Timed calls per kernel (the median is reported).
    #[arg(long, default_value_t = 15)]
    pub iters: usize,
    /// Threads for troupe's kernels and for libtorch (default: all available cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Kernels that stream memory and are held to the ≥ 0.8× memcpy target.
const STREAMING_KERNELS: [&str; 10] = [
    "reduce_sum_f32",
    "reduce_max_f32",
    "reduce_sum_bf16",
    "reduce_sum_f16",
    "cast_f32_to_bf16",
    "cast_bf16_to_f32",
    "cast_f32_to_f16",
    "cast_f16_to_f32",
    "unscale_grads",
    "l2_norm",
];

pub fn run(args: KernelsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.mib > 0 && args.iters > 0, "--mib and --iters must be at least 1");
    let threads = args.threads.unwrap_or_else(troupe_kernels::cpu_threads).max(1);
    troupe_kernels::set_cpu_threads(threads);
    tch::set_num_threads(i32::try_from(threads).context("--threads is too large")?);

    let bytes = args.mib << 20;
    let mut figures = run_cpu(bytes, args.iters);
    figures.push(measure_libtorch_adamw(bytes, args.iters, threads)?);

    let gb_per_s = |kernel: &str| figures.iter().find(|f| f.kernel == kernel).map_or(f64::NAN, |f| f.gb_per_s);
    let adamw_speedup = gb_per_s("adamw_fused") / gb_per_s("adamw_libtorch");
    let (worst_streaming, worst_ratio) = figures
        .iter()
        .filter(|f| STREAMING_KERNELS.contains(&f.kernel.as_str()))
        .map(|f| (f.kernel.clone(), f.vs_memcpy))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or_default();
    let cuda = match Backend::cuda(0) {
        Ok(_) => "present (CUDA figures: run the CUDA benchmark on this machine)".to_owned(),
        Err(e) => e.to_string(),
    };

    if args.json {
        for figure in &figures {
            println!("{}", serde_json::to_string(figure)?);
        }
        let summary = serde_json::json!({
            "event": "summary",
            "threads": threads,
            "buffer_mib": args.mib,
            "adamw_speedup_vs_libtorch": adamw_speedup,
            "worst_streaming_kernel": worst_streaming,
            "worst_streaming_vs_memcpy": worst_ratio,
            "cuda": cuda,
        });
        println!("{summary}");
    } else {
        print_table(&figures);
        println!();
        println!("fused AdamW vs libtorch AdamW: {adamw_speedup:.2}x faster (target >= 1.5x)");
        println!("worst streaming kernel: {worst_streaming} at {worst_ratio:.2}x memcpy (target >= 0.8x)");
        println!("cuda: {cuda}");
    }
    Ok(())
}

/// libtorch's AdamW (`torch::optim::AdamW` through tch) stepping one f32 tensor of `bytes / 4` elements
/// whose gradient is already set: the same shard size, traffic count and hyper-parameters as
/// `adamw_fused`, timed interleaved with a memcpy of `bytes` bytes like every other kernel.
fn measure_libtorch_adamw(bytes: usize, iters: usize, threads: usize) -> anyhow::Result<KernelFigure> {
    let n = bytes / 4;
    let config = AdamWConfig::default();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let p = vs.root().var_copy("p", &tch::Tensor::full([n as i64], 0.1, (tch::Kind::Float, tch::Device::Cpu)));
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let mut opt = nn::AdamW {
        beta1: config.beta1,
        beta2: config.beta2,
        wd: config.weight_decay,
        eps: config.eps,
        amsgrad: false,
    }
    .build(&vs, config.lr)
    .context("building libtorch's AdamW")?;
    (&p * tch::Tensor::from_slice(&grads)).sum(tch::Kind::Float).backward();
    let mut memcpy = MemcpyBaseline::new(bytes);
    Ok(memcpy.measure_beside("adamw_libtorch", "libtorch-cpu", n, 28 * n as u64, threads, iters, || opt.step()))
}

fn print_table(figures: &[KernelFigure]) {
    println!(
        "{:<28} {:>13} {:>8} {:>10} {:>10} {:>12} {:>10}",
        "kernel", "backend", "threads", "ms", "GB/s", "memcpy GB/s", "vs memcpy"
    );
    for f in figures {
        println!(
            "{:<28} {:>13} {:>8} {:>10.3} {:>10.2} {:>12.2} {:>10.2}",
            f.kernel,
            f.backend,
            f.threads,
            f.seconds_median * 1e3,
            f.gb_per_s,
            f.memcpy_gb_per_s,
            f.vs_memcpy
        );
    }
}
