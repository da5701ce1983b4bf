//! The kernel benchmark: each kernel's memory throughput beside a plain copy of the same buffer size
//! on the same device, measured in the same run (`troupe bench kernels`): a memcpy on the CPU, a
//! device-to-device copy on CUDA ([`cuda`]).
//!
//! Figures are *traffic* bandwidth: the bytes a kernel must read plus the bytes it must write per call,
//! divided by the median time of a call (a memcpy of B bytes counts 2·B).
//!
//! The baseline is a plain single-threaded `copy_from_slice` of the working buffer's size between two
//! buffers of its own. On shared machines throughput drifts by 2× within a minute, so every kernel is
//! timed *interleaved* with the memcpy (memcpy, kernel, memcpy, kernel, ...): `memcpy_gb_per_s` is the
//! memcpy measured in that same loop and `vs_memcpy` the ratio of the two medians. Every buffer is
//! touched before timing (no page faults in the figures).

use std::time::Instant;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::adamw::{adamw_step, AdamWConfig, AdamWShard};
use crate::cpu_parallel::threads_used;
use crate::reduce::{reduce_into, ReduceOp};
use crate::{cast, checksum, norm, unscale};

pub mod cuda;

/// One measured kernel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelFigure {
    /// What was measured, e.g. `reduce_sum_bf16`, `memcpy`, `device_copy`, `adamw_fused`.
    pub kernel: String,
    /// `cpu` or `cuda`; `libtorch-cpu` / `libtorch-cuda` for torch's own implementation beside ours.
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
    /// The plain copy's traffic bandwidth, timed interleaved with this kernel: a memcpy on the CPU, a
    /// device-to-device copy of the same bytes on CUDA.
    pub memcpy_gb_per_s: f64,
    /// `gb_per_s / memcpy_gb_per_s`.
    pub vs_memcpy: f64,
}

/// The memcpy baseline: two buffers of its own and the copy between them.
#[derive(Debug)]
pub struct MemcpyBaseline {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl MemcpyBaseline {
    /// A baseline copying `bytes` bytes (both buffers allocated and touched here).
    pub fn new(bytes: usize) -> Self {
        let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
        Self { src, dst: vec![1u8; bytes] }
    }

    fn copy(&mut self) {
        self.dst.copy_from_slice(&self.src);
    }

    fn bytes_moved(&self) -> u64 {
        2 * self.src.len() as u64
    }

    /// The memcpy alone, as a figure of its own (`vs_memcpy` = 1).
    pub fn measure_alone(&mut self, iters: usize) -> KernelFigure {
        let (elements, bytes_moved) = (self.src.len(), self.bytes_moved());
        let mut copy = || -> Result<(), std::convert::Infallible> {
            self.copy();
            Ok(())
        };
        let Ok(seconds) = (0..iters.max(1)).map(|_| host_seconds(&mut copy)).collect::<Result<Vec<f64>, _>>();
        figure("memcpy", "cpu", elements, bytes_moved, 1, &seconds, None)
    }

    /// Times `iters` calls of `call`, each right after one memcpy (one untimed warm-up of each first).
    #[allow(clippy::too_many_arguments)]
    pub fn measure_beside(
        &mut self,
        kernel: &str,
        backend: &str,
        elements: usize,
        bytes_moved: u64,
        threads: usize,
        iters: usize,
        mut call: impl FnMut(),
    ) -> KernelFigure {
        let (src, dst, copy_bytes) = (&self.src, &mut self.dst, self.src.len() as u64 * 2);
        let mut copy = || -> Result<(), std::convert::Infallible> {
            dst.copy_from_slice(src);
            Ok(())
        };
        let mut kernel_call = || -> Result<(), std::convert::Infallible> {
            call();
            Ok(())
        };
        let Ok((memcpy_seconds, kernel_seconds)) = interleave(iters, &mut copy, &mut kernel_call, host_seconds);
        let memcpy = figure("memcpy", "cpu", src.len(), copy_bytes, 1, &memcpy_seconds, None);
        figure(kernel, backend, elements, bytes_moved, threads, &kernel_seconds, Some(memcpy.gb_per_s))
    }
}

/// Seconds one call of `call` takes, by the host clock (`call` returns when its work is done).
fn host_seconds<E>(call: &mut dyn FnMut() -> Result<(), E>) -> Result<f64, E> {
    let start = Instant::now();
    call()?;
    Ok(start.elapsed().as_secs_f64())
}

/// Times `copy` and `call` alternately, `iters` times each, after one untimed warm-up of each, with
/// `time` (seconds of one call). Returns the copy's seconds and the call's.
fn interleave<E>(
    iters: usize,
    copy: &mut dyn FnMut() -> Result<(), E>,
    call: &mut dyn FnMut() -> Result<(), E>,
    mut time: impl FnMut(&mut dyn FnMut() -> Result<(), E>) -> Result<f64, E>,
) -> Result<(Vec<f64>, Vec<f64>), E> {
    copy()?;
    call()?;
    let (mut copy_seconds, mut call_seconds) = (Vec::new(), Vec::new());
    for _ in 0..iters.max(1) {
        copy_seconds.push(time(copy)?);
        call_seconds.push(time(call)?);
    }
    Ok((copy_seconds, call_seconds))
}

fn figure(
    kernel: &str,
    backend: &str,
    elements: usize,
    bytes_moved: u64,
    threads: usize,
    seconds: &[f64],
    memcpy_gb_per_s: Option<f64>,
) -> KernelFigure {
    let mut sorted = seconds.to_vec();
    sorted.sort_by(f64::total_cmp);
    let seconds_median = sorted[sorted.len() / 2];
    let gb_per_s = bytes_moved as f64 / seconds_median / 1e9;
    let memcpy_gb_per_s = memcpy_gb_per_s.unwrap_or(gb_per_s);
    KernelFigure {
        kernel: kernel.to_owned(),
        backend: backend.to_owned(),
        elements,
        bytes_moved,
        threads,
        iters: seconds.len(),
        seconds_median,
        seconds_best: sorted[0],
        gb_per_s,
        memcpy_gb_per_s,
        vs_memcpy: gb_per_s / memcpy_gb_per_s,
    }
}

/// Runs every CPU kernel on a working buffer of `bytes` bytes of f32 (`bytes / 4` elements), each
/// interleaved with a memcpy of `bytes` bytes; `iters` timed calls each.
pub fn run_cpu(bytes: usize, iters: usize) -> Vec<KernelFigure> {
    let n = (bytes / 4).max(1);
    let mut memcpy = MemcpyBaseline::new(n * 4);
    run_cpu_beside(&mut memcpy, n, iters)
}

fn run_cpu_beside(memcpy: &mut MemcpyBaseline, n: usize, iters: usize) -> Vec<KernelFigure> {
    let threads = threads_used(n);
    let b = |per_elem: u64| per_elem * n as u64;
    let f32_src: Vec<f32> = (0..n).map(|i| ((i % 1024) as f32 - 512.0) * 0.001).collect();
    let bf16_src: Vec<bf16> = f32_src.iter().map(|x| bf16::from_f32(*x)).collect();
    let f16_src: Vec<f16> = f32_src.iter().map(|x| f16::from_f32(*x)).collect();
    let mut acc = vec![0.5f32; n];
    let mut f32_dst = vec![0.0f32; n];
    let mut bf16_dst = vec![bf16::ZERO; n];
    let mut f16_dst = vec![f16::ZERO; n];
    let mut figures = vec![memcpy.measure_alone(iters)];
    let mut beside = |name: &str, elements: usize, bytes: u64, threads: usize, call: &mut dyn FnMut()| {
        figures.push(memcpy.measure_beside(name, "cpu", elements, bytes, threads, iters, call));
    };

    beside("reduce_sum_f32", n, b(12), threads, &mut || reduce_into(&mut acc, &f32_src, ReduceOp::Sum));
    beside("reduce_max_f32", n, b(12), threads, &mut || reduce_into(&mut acc, &f32_src, ReduceOp::Max));
    beside("reduce_sum_bf16", n, b(10), threads, &mut || reduce_into(&mut acc, &bf16_src, ReduceOp::Sum));
    beside("reduce_sum_f16", n, b(10), threads, &mut || reduce_into(&mut acc, &f16_src, ReduceOp::Sum));
    beside("cast_f32_to_bf16", n, b(6), threads, &mut || cast::f32_to_bf16(&f32_src, &mut bf16_dst));
    beside("cast_bf16_to_f32", n, b(6), threads, &mut || cast::bf16_to_f32(&bf16_src, &mut f32_dst));
    beside("cast_f32_to_f16", n, b(6), threads, &mut || cast::f32_to_f16(&f32_src, &mut f16_dst));
    beside("cast_f16_to_f32", n, b(6), threads, &mut || cast::f16_to_f32(&f16_src, &mut f32_dst));
    beside("unscale_grads", n, b(8), threads, &mut || {
        std::hint::black_box(unscale::unscale_grads(&mut f32_dst, 1.0));
    });
    beside("l2_norm", n, b(4), threads, &mut || {
        std::hint::black_box(norm::l2_norm(&[&f32_src]));
    });
    let src_bytes: Vec<u8> = f32_src.iter().flat_map(|x| x.to_le_bytes()).collect();
    beside("checksum64", n * 4, b(4), 1, &mut || {
        std::hint::black_box(checksum::checksum64(&src_bytes));
    });
    drop(src_bytes);

    let config = AdamWConfig::default();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect();
    let (mut p, mut m, mut v) = (vec![0.1f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let mut out = vec![bf16::ZERO; n];
    let mut step = 0;
    beside("adamw_fused", n, b(28), threads, &mut || {
        step += 1;
        let shard = AdamWShard { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v };
        adamw_step(shard, &grads, &config, step, None);
    });
    beside("adamw_fused_bf16_copy_out", n, b(30), threads, &mut || {
        step += 1;
        let shard = AdamWShard { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v };
        adamw_step(shard, &grads, &config, step, Some(&mut out));
    });
    figures
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_reports_a_positive_bandwidth_and_a_memcpy_ratio() {
        let figures = run_cpu(64 * 1024, 2);
        assert_eq!(figures.len(), 14, "{figures:?}");
        assert_eq!(figures[0].kernel, "memcpy");
        assert!((figures[0].vs_memcpy - 1.0).abs() < 1e-12);
        for f in &figures {
            assert!(f.gb_per_s.is_finite() && f.gb_per_s > 0.0, "{f:?}");
            assert!((f.vs_memcpy - f.gb_per_s / f.memcpy_gb_per_s).abs() < 1e-9, "{f:?}");
            assert_eq!(f.iters, 2);
        }
    }
}
