//! The CPU kernel benchmark: each kernel's memory throughput beside a plain memcpy of the same buffer
//! size, measured in the same run (`troupe bench kernels`).
//!
//! Figures are *traffic* bandwidth: the bytes a kernel must read plus the bytes it must write per call,
//! divided by the median time of a call (memcpy of B bytes counts 2·B). `vs_memcpy` is a kernel's
//! bandwidth over the single-threaded `copy_from_slice` baseline; `memcpy_threaded` (the same copy split
//! over [`crate::cpu_threads`] threads) is reported beside it so that a reader can tell how much of a ratio
//! above 1 comes from threads. Every buffer is touched before timing (no page faults in the figures).

use std::time::Instant;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::adamw::{adamw_step, AdamWConfig, AdamWShard};
use crate::cpu_parallel::{chunk_elems, for_each_part, threads_used};
use crate::reduce::{reduce_into, ReduceOp};
use crate::{cast, checksum, norm, unscale};

/// One measured kernel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelFigure {
    /// What was measured, e.g. `reduce_sum_bf16`, `memcpy`, `adamw_fused`.
    pub kernel: String,
    /// `cpu` or `cuda`; `libtorch-cpu` for torch's own implementation measured beside ours.
    pub backend: String,
    /// Elements per call (f32 elements of the working buffer; bytes for `checksum64` and `memcpy`).
    pub elements: usize,
    /// Bytes read plus bytes written per call.
    pub bytes_moved: u64,
    /// Threads the kernel used.
    pub threads: usize,
    pub iters: usize,
    pub seconds_median: f64,
    pub seconds_best: f64,
    /// `bytes_moved / seconds_median`, in GB/s (10⁹ bytes).
    pub gb_per_s: f64,
    /// `gb_per_s` over the plain memcpy's, measured in the same run.
    pub vs_memcpy: f64,
}

/// Times `iters` calls of `call` (after one untimed warm-up call) and returns the figure with
/// `vs_memcpy` left at 0 (see [`with_memcpy_ratio`]).
pub fn measure(
    kernel: &str,
    backend: &str,
    elements: usize,
    bytes_moved: u64,
    threads: usize,
    iters: usize,
    mut call: impl FnMut(),
) -> KernelFigure {
    let iters = iters.max(1);
    call();
    let mut seconds: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            call();
            start.elapsed().as_secs_f64()
        })
        .collect();
    seconds.sort_by(f64::total_cmp);
    let seconds_median = seconds[seconds.len() / 2];
    KernelFigure {
        kernel: kernel.to_owned(),
        backend: backend.to_owned(),
        elements,
        bytes_moved,
        threads,
        iters,
        seconds_median,
        seconds_best: seconds[0],
        gb_per_s: bytes_moved as f64 / seconds_median / 1e9,
        vs_memcpy: 0.0,
    }
}

/// Fills `vs_memcpy` of every figure from the figure named `memcpy` among them.
pub fn with_memcpy_ratio(mut figures: Vec<KernelFigure>) -> Vec<KernelFigure> {
    let memcpy = figures
        .iter()
        .find(|f| f.kernel == "memcpy")
        .map_or(f64::NAN, |f| f.gb_per_s);
    for figure in &mut figures {
        figure.vs_memcpy = figure.gb_per_s / memcpy;
    }
    figures
}

/// Runs every CPU kernel on a working buffer of `bytes` bytes of f32 (`bytes / 4` elements) and the
/// memcpy baselines of the same size; `iters` timed calls each.
pub fn run_cpu(bytes: usize, iters: usize) -> Vec<KernelFigure> {
    let n = (bytes / 4).max(1);
    let threads = threads_used(n);
    let b = |per_elem: u64| per_elem * n as u64;
    let f32_src: Vec<f32> = (0..n)
        .map(|i| ((i % 1024) as f32 - 512.0) * 0.001)
        .collect();
    let bf16_src: Vec<bf16> = f32_src.iter().map(|x| bf16::from_f32(*x)).collect();
    let f16_src: Vec<f16> = f32_src.iter().map(|x| f16::from_f32(*x)).collect();
    let mut acc = vec![0.5f32; n];
    let mut f32_dst = vec![0.0f32; n];
    let mut bf16_dst = vec![bf16::ZERO; n];
    let mut f16_dst = vec![f16::ZERO; n];
    let mut figures = Vec::new();

    figures.push(measure("memcpy", "cpu", n * 4, b(8), 1, iters, || {
        f32_dst.copy_from_slice(&f32_src)
    }));
    figures.push(measure(
        "memcpy_threaded",
        "cpu",
        n * 4,
        b(8),
        threads,
        iters,
        || {
            let chunk = chunk_elems(n);
            for_each_part(
                f32_dst.chunks_mut(chunk).zip(f32_src.chunks(chunk)),
                |(d, s)| d.copy_from_slice(s),
            );
        },
    ));
    for (name, op) in [
        ("reduce_sum_f32", ReduceOp::Sum),
        ("reduce_max_f32", ReduceOp::Max),
    ] {
        figures.push(measure(name, "cpu", n, b(12), threads, iters, || {
            reduce_into(&mut acc, &f32_src, op)
        }));
    }
    figures.push(measure(
        "reduce_sum_bf16",
        "cpu",
        n,
        b(10),
        threads,
        iters,
        || reduce_into(&mut acc, &bf16_src, ReduceOp::Sum),
    ));
    figures.push(measure(
        "reduce_sum_f16",
        "cpu",
        n,
        b(10),
        threads,
        iters,
        || reduce_into(&mut acc, &f16_src, ReduceOp::Sum),
    ));
    figures.push(measure(
        "cast_f32_to_bf16",
        "cpu",
        n,
        b(6),
        threads,
        iters,
        || cast::f32_to_bf16(&f32_src, &mut bf16_dst),
    ));
    figures.push(measure(
        "cast_bf16_to_f32",
        "cpu",
        n,
        b(6),
        threads,
        iters,
        || cast::bf16_to_f32(&bf16_src, &mut f32_dst),
    ));
    figures.push(measure(
        "cast_f32_to_f16",
        "cpu",
        n,
        b(6),
        threads,
        iters,
        || cast::f32_to_f16(&f32_src, &mut f16_dst),
    ));
    figures.push(measure(
        "cast_f16_to_f32",
        "cpu",
        n,
        b(6),
        threads,
        iters,
        || cast::f16_to_f32(&f16_src, &mut f32_dst),
    ));
    figures.push(measure(
        "unscale_grads",
        "cpu",
        n,
        b(8),
        threads,
        iters,
        || {
            std::hint::black_box(unscale::unscale_grads(&mut f32_dst, 1.0));
        },
    ));
    figures.push(measure("l2_norm", "cpu", n, b(4), threads, iters, || {
        std::hint::black_box(norm::l2_norm(&[&f32_src]));
    }));
    let src_bytes: Vec<u8> = f32_src.iter().flat_map(|x| x.to_le_bytes()).collect();
    figures.push(measure("checksum64", "cpu", n * 4, b(4), 1, iters, || {
        std::hint::black_box(checksum::checksum64(&src_bytes));
    }));
    drop(src_bytes);
    figures.extend(run_cpu_adamw(n, iters));
    with_memcpy_ratio(figures)
}

/// The fused AdamW on a shard of `n` f32 params, without and with the bf16 copy-out.
fn run_cpu_adamw(n: usize, iters: usize) -> Vec<KernelFigure> {
    let threads = threads_used(n);
    let config = AdamWConfig::default();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let (mut p, mut m, mut v) = (vec![0.1f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let mut out = vec![bf16::ZERO; n];
    let mut step = 0;
    let mut figures = vec![measure(
        "adamw_fused",
        "cpu",
        n,
        28 * n as u64,
        threads,
        iters,
        || {
            step += 1;
            adamw_step(
                AdamWShard {
                    params: &mut p,
                    exp_avg: &mut m,
                    exp_avg_sq: &mut v,
                },
                &grads,
                &config,
                step,
                None,
            );
        },
    )];
    figures.push(measure(
        "adamw_fused_bf16_copy_out",
        "cpu",
        n,
        30 * n as u64,
        threads,
        iters,
        || {
            step += 1;
            let shard = AdamWShard {
                params: &mut p,
                exp_avg: &mut m,
                exp_avg_sq: &mut v,
            };
            adamw_step(shard, &grads, &config, step, Some(&mut out));
        },
    ));
    figures
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_reports_a_positive_bandwidth_and_a_memcpy_ratio() {
        let figures = run_cpu(64 * 1024, 2);
        assert!(figures.len() >= 14, "{figures:?}");
        let memcpy = figures.iter().find(|f| f.kernel == "memcpy").unwrap();
        assert!((memcpy.vs_memcpy - 1.0).abs() < 1e-12);
        for f in &figures {
            assert!(f.gb_per_s.is_finite() && f.gb_per_s > 0.0, "{f:?}");
            assert!(f.vs_memcpy > 0.0, "{f:?}");
        }
    }
}
