//! `troupe bench kernels`: troupe's kernels beside a plain copy of the same bytes on the same device,
//! and the fused AdamW beside libtorch's AdamW on the same shard, all measured in this one run.
//!
//! `--device cpu` (default): every kernel timed interleaved with a memcpy of the working buffer's size
//! (see `troupe_kernels::bench`). `--device cuda`: every CUDA kernel interleaved with a device-to-device
//! copy of the same bytes, timed with CUDA events (`troupe_kernels::bench::cuda`), and libtorch's AdamW
//! on a CUDA tensor; without a usable GPU it fails with `no CUDA device: ...` — no figures are made up.
//! With `--json`, one JSON object per line: a `KernelFigure` per kernel, then `{"event":"summary", ...}`
//! with the target ratios.

use anyhow::Context;
use tch::nn::{self, OptimizerConfig};
use troupe_kernels::bench::cuda::{run_cuda, DeviceCopyBaseline};
use troupe_kernels::bench::{run_cpu, KernelFigure, MemcpyBaseline};
use troupe_kernels::simd::Isa;
use troupe_kernels::{AdamWConfig, CudaBackend, KernelError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchDevice {
    Cpu,
    Cuda,
}

#[derive(Debug, clap::Args)]
pub struct KernelsArgs {
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Where the kernels run: the CPU, or CUDA device 0 (fails plainly without one).
    #[arg(long, value_enum, default_value_t = BenchDevice::Cpu)]
    pub device: BenchDevice,
    /// Size of the f32 working buffer (and of the AdamW shard's param buffer), in MiB
    /// (default: 64 on the CPU, 1024 on CUDA).
    #[arg(long)]
    pub mib: Option<usize>,
    /// Timed calls per kernel (the median is reported).
    #[arg(long, default_value_t = 15)]
    pub iters: usize,
    /// Threads for troupe's CPU kernels and for libtorch (default: all available cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Kernels that stream memory and are held to the ≥ 0.8× memcpy target on the CPU and ≥ 0.85× the
/// device-to-device copy on CUDA.
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
    let mib = args.mib.unwrap_or(match args.device {
        BenchDevice::Cpu => 64,
        BenchDevice::Cuda => 1024,
    });
    anyhow::ensure!(mib > 0 && args.iters > 0, "--mib and --iters must be at least 1");
    let threads = args.threads.unwrap_or_else(troupe_kernels::cpu_threads).max(1);
    troupe_kernels::set_cpu_threads(threads);
    tch::set_num_threads(i32::try_from(threads).context("--threads is too large")?);

    let bytes = mib << 20;
    let (figures, baseline, target, device) = match args.device {
        BenchDevice::Cpu => {
            let mut figures = run_cpu(bytes, args.iters);
            figures.push(measure_libtorch_adamw_cpu(bytes, args.iters, threads)?);
            (figures, "memcpy", 0.8, format!("cpu ({} SIMD)", Isa::detected().name()))
        }
        BenchDevice::Cuda => {
            let cuda = cuda_or_fail()?;
            let mut figures = run_cuda(&cuda, bytes, args.iters).context("running the CUDA kernels")?;
            figures.push(measure_libtorch_adamw_cuda(&cuda, bytes, args.iters)?);
            (figures, "device_copy", 0.85, format!("cuda:{}", cuda.ordinal()))
        }
    };

    let gb_per_s = |kernel: &str| figures.iter().find(|f| f.kernel == kernel).map_or(f64::NAN, |f| f.gb_per_s);
    let adamw_speedup = gb_per_s("adamw_fused") / gb_per_s("adamw_libtorch");
    let (worst_streaming, worst_ratio) = figures
        .iter()
        .filter(|f| STREAMING_KERNELS.contains(&f.kernel.as_str()))
        .map(|f| (f.kernel.clone(), f.vs_memcpy))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or_default();
    let cuda = match (args.device, CudaBackend::new(0)) {
        (BenchDevice::Cuda, _) => "measured".to_owned(),
        (BenchDevice::Cpu, Ok(_)) => "present (run with --device cuda for its figures)".to_owned(),
        (BenchDevice::Cpu, Err(e)) => e.to_string(),
    };

    if args.json {
        for figure in &figures {
            println!("{}", serde_json::to_string(figure)?);
        }
        let summary = serde_json::json!({
            "event": "summary",
            "device": device,
            "threads": threads,
            "buffer_mib": mib,
            "baseline": baseline,
            "adamw_speedup_vs_libtorch": adamw_speedup,
            "worst_streaming_kernel": worst_streaming,
            "worst_streaming_vs_memcpy": worst_ratio,
            "streaming_target": target,
            "cuda": cuda,
        });
        println!("{summary}");
    } else {
        print_table(&figures);
        println!();
        println!("device: {device}");
        println!("fused AdamW vs libtorch AdamW: {adamw_speedup:.2}x faster");
        println!("worst streaming kernel: {worst_streaming} at {worst_ratio:.2}x {baseline} (target >= {target}x)");
        println!("cuda: {cuda}");
    }
    Ok(())
}

/// CUDA device 0 for troupe's kernels and for libtorch, or the plain reason there is none.
fn cuda_or_fail() -> anyhow::Result<CudaBackend> {
    let cuda = CudaBackend::new(0)?;
    if !tch::Cuda::is_available() {
        return Err(KernelError::NoCudaDevice { reason: "libtorch sees no CUDA device".into() }.into());
    }
    Ok(cuda)
}

/// libtorch's AdamW (`torch::optim::AdamW` through tch) stepping one f32 tensor of `bytes / 4` elements
/// on `device` whose gradient is already set: the same shard size, traffic count and hyper-parameters
/// as `adamw_fused`.
fn libtorch_adamw(bytes: usize, device: tch::Device) -> anyhow::Result<(nn::Optimizer, nn::VarStore)> {
    let n = bytes / 4;
    let config = AdamWConfig::default();
    let vs = nn::VarStore::new(device);
    let p = vs.root().var_copy("p", &tch::Tensor::full([n as i64], 0.1, (tch::Kind::Float, device)));
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let opt = nn::AdamW {
        beta1: config.beta1,
        beta2: config.beta2,
        wd: config.weight_decay,
        eps: config.eps,
        amsgrad: false,
    }
    .build(&vs, config.lr)
    .context("building libtorch's AdamW")?;
    (&p * tch::Tensor::from_slice(&grads).to_device(device)).sum(tch::Kind::Float).backward();
    Ok((opt, vs))
}

/// libtorch's AdamW on the CPU, timed interleaved with a memcpy of `bytes` bytes like every kernel.
fn measure_libtorch_adamw_cpu(bytes: usize, iters: usize, threads: usize) -> anyhow::Result<KernelFigure> {
    let (mut opt, _vs) = libtorch_adamw(bytes, tch::Device::Cpu)?;
    let n = bytes / 4;
    let mut memcpy = MemcpyBaseline::new(bytes);
    Ok(memcpy.measure_beside("adamw_libtorch", "libtorch-cpu", n, 28 * n as u64, threads, iters, || opt.step()))
}

/// libtorch's AdamW on CUDA device 0, timed with CUDA events interleaved with a device-to-device copy.
/// libtorch runs on the device's default stream (tch sets no other), the stream the events are on.
fn measure_libtorch_adamw_cuda(cuda: &CudaBackend, bytes: usize, iters: usize) -> anyhow::Result<KernelFigure> {
    let (mut opt, _vs) = libtorch_adamw(bytes, tch::Device::Cuda(cuda.ordinal()))?;
    let n = bytes / 4;
    tch::Cuda::synchronize(cuda.ordinal() as i64);
    let mut copy = DeviceCopyBaseline::new(cuda, bytes)?;
    let mut step = || {
        opt.step();
        Ok(())
    };
    Ok(copy.measure_beside("adamw_libtorch", "libtorch-cuda", n, 28 * n as u64, iters, &mut step)?)
}

fn print_table(figures: &[KernelFigure]) {
    println!(
        "{:<28} {:>13} {:>8} {:>10} {:>10} {:>12} {:>10}",
        "kernel", "backend", "threads", "ms", "GB/s", "copy GB/s", "vs copy"
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
