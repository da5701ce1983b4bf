//! The CUDA kernel benchmark: every CUDA kernel beside a device-to-device copy of the same bytes, timed
//! alternately in the same run with CUDA events on the backend's stream (`troupe bench kernels
//! --device cuda`). Figures are traffic bandwidth as on the CPU (bytes read plus written per call; the
//! copy of B bytes counts 2·B). The two calls that return a host value (the unscale's flag, the norm)
//! include their small copy back; the checksum is the copy back plus the host's XXH3, so its ratio
//! says how far it is from the device's own bandwidth, not a kernel's efficiency.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};

use super::{figure, interleave, KernelFigure};
use crate::adamw::AdamWConfig;
use crate::backend::{Backend, Buffer, HostBuffer};
use crate::cuda::CudaBackend;
use crate::error::KernelError;
use crate::reduce::ReduceOp;

fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::CudaDriver { op, message: e.to_string() }
}

/// Seconds of one call on `stream`, between two CUDA events recorded around it.
fn event_seconds(
    stream: &Arc<CudaStream>,
    call: &mut dyn FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    let ctx = stream.context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver("create event"))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver("create event"))?;
    start.record(stream).map_err(driver("record event"))?;
    call()?;
    end.record(stream).map_err(driver("record event"))?;
    Ok(f64::from(start.elapsed_ms(&end).map_err(driver("event elapsed time"))?) / 1e3)
}

/// The baseline: a device-to-device copy of the working buffer's bytes between two buffers of its own.
pub struct DeviceCopyBaseline {
    stream: Arc<CudaStream>,
    src: CudaSlice<u8>,
    dst: CudaSlice<u8>,
}

impl std::fmt::Debug for DeviceCopyBaseline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCopyBaseline").field("bytes", &self.src.len()).finish()
    }
}

impl DeviceCopyBaseline {
    /// A baseline copying `bytes` bytes on `cuda`'s device (both buffers allocated and written here).
    pub fn new(cuda: &CudaBackend, bytes: usize) -> Result<Self, KernelError> {
        let stream = cuda.stream().clone();
        let src =
            stream.clone_htod(&(0..bytes).map(|i| i as u8).collect::<Vec<u8>>()).map_err(driver("copy to device"))?;
        let dst = stream.alloc_zeros::<u8>(bytes).map_err(driver("allocate"))?;
        Ok(Self { stream, src, dst })
    }

    fn bytes_moved(&self) -> u64 {
        2 * self.src.len() as u64
    }

    /// The copy alone, as a figure of its own (`vs_memcpy` = 1).
    pub fn measure_alone(&mut self, iters: usize) -> Result<KernelFigure, KernelError> {
        let (stream, src, dst) = (self.stream.clone(), &self.src, &mut self.dst);
        let mut copy = || stream.memcpy_dtod(src, dst).map_err(driver("device-to-device copy"));
        let seconds = (0..iters.max(1)).map(|_| event_seconds(&stream, &mut copy)).collect::<Result<Vec<f64>, _>>()?;
        Ok(figure("device_copy", "cuda", src.len(), self.bytes_moved(), 1, &seconds, None))
    }

    /// Times `iters` calls of `call` (work enqueued on the backend's stream), each right after one copy.
    pub fn measure_beside(
        &mut self,
        kernel: &str,
        backend: &str,
        elements: usize,
        bytes_moved: u64,
        iters: usize,
        call: &mut dyn FnMut() -> Result<(), KernelError>,
    ) -> Result<KernelFigure, KernelError> {
        let copy_bytes = self.bytes_moved();
        let (stream, src, dst) = (self.stream.clone(), &self.src, &mut self.dst);
        let mut copy = || stream.memcpy_dtod(src, dst).map_err(driver("device-to-device copy"));
        let (copy_seconds, call_seconds) = interleave(iters, &mut copy, call, |c| event_seconds(&stream, c))?;
        let baseline = figure("device_copy", "cuda", src.len(), copy_bytes, 1, &copy_seconds, None);
        Ok(figure(kernel, backend, elements, bytes_moved, 1, &call_seconds, Some(baseline.gb_per_s)))
    }
}

/// Every CUDA kernel on a working buffer of `bytes` bytes of f32 (`bytes / 4` elements), each
/// interleaved with a device-to-device copy of `bytes` bytes; `iters` timed calls each.
pub fn run_cuda(cuda: &CudaBackend, bytes: usize, iters: usize) -> Result<Vec<KernelFigure>, KernelError> {
    let n = (bytes / 4).max(1);
    let backend = Backend::Cuda(cuda.clone());
    let up = |h: HostBuffer| backend.upload(h);
    let b = |per_elem: u64| per_elem * n as u64;
    let f32_host: Vec<f32> = (0..n).map(|i| ((i % 1024) as f32 - 512.0) * 0.001).collect();
    let f32_src = up(HostBuffer::F32(f32_host.clone()))?;
    let bf16_src = up(HostBuffer::Bf16(f32_host.iter().map(|x| bf16::from_f32(*x)).collect()))?;
    let f16_src = up(HostBuffer::F16(f32_host.iter().map(|x| f16::from_f32(*x)).collect()))?;
    let mut acc = up(HostBuffer::F32(vec![0.5; n]))?;
    let mut f32_dst = up(HostBuffer::F32(vec![0.0; n]))?;
    let mut bf16_dst = up(HostBuffer::Bf16(vec![bf16::ZERO; n]))?;
    let mut f16_dst = up(HostBuffer::F16(vec![f16::ZERO; n]))?;
    drop(f32_host);

    let mut copy = DeviceCopyBaseline::new(cuda, n * 4)?;
    let mut figures = vec![copy.measure_alone(iters)?];
    let mut beside = |name: &str, elements: usize, bytes: u64, call: &mut dyn FnMut() -> Result<(), KernelError>| {
        figures.push(copy.measure_beside(name, "cuda", elements, bytes, iters, call)?);
        Ok::<(), KernelError>(())
    };
    beside("reduce_sum_f32", n, b(12), &mut || backend.reduce_into(&mut acc, &f32_src, ReduceOp::Sum))?;
    beside("reduce_max_f32", n, b(12), &mut || backend.reduce_into(&mut acc, &f32_src, ReduceOp::Max))?;
    beside("reduce_sum_bf16", n, b(10), &mut || backend.reduce_into(&mut acc, &bf16_src, ReduceOp::Sum))?;
    beside("reduce_sum_f16", n, b(10), &mut || backend.reduce_into(&mut acc, &f16_src, ReduceOp::Sum))?;
    beside("cast_f32_to_bf16", n, b(6), &mut || backend.cast(&f32_src, &mut bf16_dst))?;
    beside("cast_bf16_to_f32", n, b(6), &mut || backend.cast(&bf16_src, &mut f32_dst))?;
    beside("cast_f32_to_f16", n, b(6), &mut || backend.cast(&f32_src, &mut f16_dst))?;
    beside("cast_f16_to_f32", n, b(6), &mut || backend.cast(&f16_src, &mut f32_dst))?;
    beside("unscale_grads", n, b(8), &mut || backend.unscale_grads(&mut f32_dst, 1.0).map(drop))?;
    beside("l2_norm", n, b(4), &mut || backend.l2_norm(&[&f32_src]).map(drop))?;
    beside("checksum64", n * 4, b(4), &mut || backend.checksum64(&f32_src).map(drop))?;
    drop((acc, f32_dst, bf16_dst, f16_dst, bf16_src, f16_src));

    let config = AdamWConfig::default();
    let grads = up(HostBuffer::F32((0..n).map(|i| ((i % 777) as f32 - 388.0) * 1e-4).collect()))?;
    let (mut p, mut m, mut v) =
        (up(HostBuffer::F32(vec![0.1; n]))?, up(HostBuffer::F32(vec![0.0; n]))?, up(HostBuffer::F32(vec![0.0; n]))?);
    let mut out: Buffer = up(HostBuffer::Bf16(vec![bf16::ZERO; n]))?;
    let mut step = 0;
    beside("adamw_fused", n, b(28), &mut || {
        step += 1;
        backend.adamw_step(&mut p, &grads, &mut m, &mut v, None, &config, step)
    })?;
    beside("adamw_fused_bf16_copy_out", n, b(30), &mut || {
        step += 1;
        backend.adamw_step(&mut p, &grads, &mut m, &mut v, Some(&mut out), &config, step)
    })?;
    drop(f32_src);
    Ok(figures)
}
