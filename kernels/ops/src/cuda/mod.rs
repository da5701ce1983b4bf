//! The CUDA backend: cudarc with the driver and NVRTC loaded dynamically, so this compiles and links on
//! machines without CUDA and answers [`KernelError::NoCudaDevice`] at run time.
//!
//! Invariant: this module is the only place in the crate with `unsafe` (checking that the CUDA libraries
//! are present before cudarc's first call, and kernel launches).
//!
//! The CUDA C in `kernels.cu` is compiled with NVRTC on the first use on a device and the loaded module is
//! cached per device ordinal for the life of the process. Every kernel runs on the backend's stream,
//! the context's default (legacy NULL) stream; methods that return a host value (`unscale`'s flag, the
//! norm, the checksum) synchronise that stream before returning, the others only enqueue.
//!
//! Ordering with libtorch: libtorch's current stream is also the legacy default stream unless the caller
//! installed another one, and the legacy default stream orders itself against every blocking stream of
//! the context, so kernels enqueued here run after libtorch's queued work and before its later work.
//! A caller that runs libtorch on a non-default, non-blocking stream must synchronise that stream first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::adamw::{AdamWConfig, AdamWStepScalars};
use crate::backend::Buffer;
use crate::error::KernelError;
use crate::reduce::ReduceOp;

const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// Threads per block; the sum-of-squares kernels size their shared memory for exactly this.
const THREADS_PER_BLOCK: u32 = 256;
/// Upper bound on blocks per launch (the kernels loop grid-stride over the rest).
const BLOCKS_MAX: u64 = 8192;
/// Virtual architecture NVRTC compiles for; the driver JIT-compiles it for the actual device.
/// compute_75 (Turing) is the oldest CUDA 13 accepts.
const PTX_ARCH: &str = "compute_75";
/// Bytes copied back to the host per piece by [`CudaBackend::checksum64`].
const CHECKSUM_PIECE_BYTES: usize = 8 << 20;

/// A flat buffer in device memory. 16-bit floats are stored as their bit patterns.
#[derive(Debug)]
pub enum DeviceBuffer {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
    F16(CudaSlice<u16>),
}

impl DeviceBuffer {
    pub fn len(&self) -> usize {
        match self {
            DeviceBuffer::F32(s) => s.len(),
            DeviceBuffer::Bf16(s) | DeviceBuffer::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The element type of device memory lent by another library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceDtype {
    F32,
    Bf16,
    F16,
}

/// Device memory owned by another library (a libtorch tensor's storage), seen as a [`Buffer`] so that
/// every [`crate::Backend`] kernel runs on it in place, without a copy. It is never freed here: dropping
/// it gives the memory back untouched (cudarc makes the stream wait for the work queued on it first).
/// Made only by the unsafe [`CudaBackend::borrow_device_memory`], whose caller vouches for the memory.
#[derive(Debug)]
pub struct BorrowedDeviceBuffer {
    /// Always `Some(Buffer::Cuda(_))` until dropped.
    buffer: Option<Buffer>,
}

impl BorrowedDeviceBuffer {
    pub fn buffer(&self) -> &Buffer {
        self.buffer.as_ref().expect("a borrowed buffer is present until dropped")
    }

    pub fn buffer_mut(&mut self) -> &mut Buffer {
        self.buffer.as_mut().expect("a borrowed buffer is present until dropped")
    }
}

impl Drop for BorrowedDeviceBuffer {
    fn drop(&mut self) {
        // `leak` hands the pointer back without freeing it (the owner frees it).
        match self.buffer.take() {
            Some(Buffer::Cuda(DeviceBuffer::F32(s))) => drop(s.leak()),
            Some(Buffer::Cuda(DeviceBuffer::Bf16(s) | DeviceBuffer::F16(s))) => drop(s.leak()),
            Some(Buffer::Cpu(_)) | None => {}
        }
    }
}

/// One CUDA device and the stream troupe's kernels run on.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    ordinal: usize,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
}

/// Whether CUDA can be used at all on this machine: the driver and NVRTC libraries load and at least one
/// device is visible. The error says plainly which part is missing.
pub fn cuda_device_count() -> Result<usize, KernelError> {
    // SAFETY: these only try to dlopen the libraries; cudarc's wrappers panic on first use when a library
    // is missing, so this check must come before any other cudarc call.
    let driver_present = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver_present {
        return Err(no_device("the CUDA driver library (libcuda) is not installed"));
    }
    // SAFETY: as above.
    let nvrtc_present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc_present {
        return Err(no_device("the NVRTC library is not installed"));
    }
    match CudaContext::device_count() {
        Ok(0) => Err(no_device("the driver reports 0 devices")),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(no_device(&format!("the driver failed to initialise ({e})"))),
    }
}

fn no_device(reason: &str) -> KernelError {
    KernelError::NoCudaDevice { reason: reason.to_owned() }
}

fn driver(op: &'static str) -> impl FnOnce(DriverError) -> KernelError {
    move |e| KernelError::CudaDriver { op, message: e.to_string() }
}

/// NVRTC output, compiled once per process (the PTX is device-independent).
fn compiled_ptx() -> Result<Ptx, KernelError> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    let source = PTX.get_or_init(|| {
        let options = CompileOptions { fmad: Some(false), arch: Some(PTX_ARCH), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(KERNELS_SOURCE, options).map(|ptx| ptx.to_src()).map_err(|e| e.to_string())
    });
    match source {
        Ok(src) => Ok(Ptx::from_src(src.clone())),
        Err(message) => Err(KernelError::CudaCompile { message: message.clone() }),
    }
}

/// The loaded module for a device, loaded at first use on that device and cached.
fn module_for(ctx: &Arc<CudaContext>) -> Result<Arc<CudaModule>, KernelError> {
    static MODULES: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>> = OnceLock::new();
    let mut modules = MODULES.get_or_init(Default::default).lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(module) = modules.get(&ctx.ordinal()) {
        return Ok(module.clone());
    }
    let module = ctx.load_module(compiled_ptx()?).map_err(driver("load troupe kernels module"))?;
    modules.insert(ctx.ordinal(), module.clone());
    Ok(module)
}

fn launch_config(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(u64::from(THREADS_PER_BLOCK)).clamp(1, BLOCKS_MAX) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn reduce_op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

fn same_len(op: &'static str, left: usize, right: usize) -> Result<(), KernelError> {
    if left == right {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { op, left, right })
    }
}

impl CudaBackend {
    /// Opens device `ordinal`, compiling (first time in the process) and loading troupe's kernels.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        let count = cuda_device_count()?;
        if ordinal >= count {
            return Err(no_device(&format!("device {ordinal} requested, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("create context"))?;
        let module = module_for(&ctx)?;
        Ok(Self { ordinal, stream: ctx.default_stream(), module })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it (e.g. "NVIDIA H100 80GB HBM3").
    pub fn device_name(&self) -> Result<String, KernelError> {
        self.stream.context().name().map_err(driver("device name"))
    }

    /// The stream every kernel of this backend is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// `len` elements of `dtype` at device address `ptr`, owned by someone else, as a buffer the
    /// kernels run on in place; see [`BorrowedDeviceBuffer`].
    ///
    /// # Safety
    /// `ptr` must be the first of `len` properly aligned elements of `dtype` in memory of this
    /// backend's device, allocated in its primary context (libtorch's allocations are), and stay
    /// allocated while the returned value lives; nothing else may read or write it meanwhile unless
    /// ordered with this backend's stream; two live borrows must not overlap unless neither is written.
    pub unsafe fn borrow_device_memory(&self, dtype: DeviceDtype, ptr: u64, len: usize) -> BorrowedDeviceBuffer {
        // SAFETY: the caller's contract above is what `upgrade_device_ptr` requires; the slice is
        // leaked, never freed, when the borrow ends.
        let device = unsafe {
            match dtype {
                DeviceDtype::F32 => DeviceBuffer::F32(self.stream.upgrade_device_ptr(ptr, len)),
                DeviceDtype::Bf16 => DeviceBuffer::Bf16(self.stream.upgrade_device_ptr(ptr, len)),
                DeviceDtype::F16 => DeviceBuffer::F16(self.stream.upgrade_device_ptr(ptr, len)),
            }
        };
        BorrowedDeviceBuffer { buffer: Some(Buffer::Cuda(device)) }
    }

    pub fn upload_f32(&self, host: &[f32]) -> Result<DeviceBuffer, KernelError> {
        self.stream.clone_htod(host).map(DeviceBuffer::F32).map_err(driver("copy to device"))
    }

    pub fn upload_bf16(&self, host: &[half::bf16]) -> Result<DeviceBuffer, KernelError> {
        let bits: Vec<u16> = host.iter().map(|x| x.to_bits()).collect();
        self.stream.clone_htod(&bits).map(DeviceBuffer::Bf16).map_err(driver("copy to device"))
    }

    pub fn upload_f16(&self, host: &[half::f16]) -> Result<DeviceBuffer, KernelError> {
        let bits: Vec<u16> = host.iter().map(|x| x.to_bits()).collect();
        self.stream.clone_htod(&bits).map(DeviceBuffer::F16).map_err(driver("copy to device"))
    }

    pub fn download_f32(&self, buffer: &DeviceBuffer) -> Result<Vec<f32>, KernelError> {
        match buffer {
            DeviceBuffer::F32(s) => self.stream.clone_dtoh(s).map_err(driver("copy to host")),
            other => Err(dtype_mismatch("download_f32", "f32", other)),
        }
    }

    /// The 16-bit bit patterns of a bf16 or f16 buffer.
    pub fn download_bits16(&self, buffer: &DeviceBuffer) -> Result<Vec<u16>, KernelError> {
        match buffer {
            DeviceBuffer::Bf16(s) | DeviceBuffer::F16(s) => self.stream.clone_dtoh(s).map_err(driver("copy to host")),
            other => Err(dtype_mismatch("download_bits16", "bf16 or f16", other)),
        }
    }

    /// A zeroed buffer of `len` elements of the same type as `like`.
    pub fn zeros_like(&self, like: &DeviceBuffer, len: usize) -> Result<DeviceBuffer, KernelError> {
        let alloc = driver("allocate");
        Ok(match like {
            DeviceBuffer::F32(_) => DeviceBuffer::F32(self.stream.alloc_zeros(len).map_err(alloc)?),
            DeviceBuffer::Bf16(_) => DeviceBuffer::Bf16(self.stream.alloc_zeros(len).map_err(alloc)?),
            DeviceBuffer::F16(_) => DeviceBuffer::F16(self.stream.alloc_zeros(len).map_err(alloc)?),
        })
    }

    fn function(&self, name: &'static str) -> Result<cudarc::driver::CudaFunction, KernelError> {
        self.module.load_function(name).map_err(driver("load kernel function"))
    }

    /// `acc[i] = op(acc[i], src[i])`, as [`crate::reduce_into`].
    pub fn reduce_into(&self, acc: &mut DeviceBuffer, src: &DeviceBuffer, op: ReduceOp) -> Result<(), KernelError> {
        let DeviceBuffer::F32(acc) = acc else {
            return Err(dtype_mismatch("reduce_into (accumulator)", "f32", acc));
        };
        same_len("reduce_into", acc.len(), src.len())?;
        let n = acc.len() as u64;
        let op_code = reduce_op_code(op);
        if n == 0 {
            return Ok(());
        }
        let cfg = launch_config(acc.len());
        macro_rules! launch {
            ($name:literal, $src:expr) => {{
                let f = self.function($name)?;
                let mut args = self.stream.launch_builder(&f);
                args.arg(&mut *acc).arg($src).arg(&n).arg(&op_code);
                // SAFETY: the kernel reads n elements of src and reads/writes n of acc; both hold n.
                unsafe { args.launch(cfg) }.map(drop).map_err(driver($name))
            }};
        }
        match src {
            DeviceBuffer::F32(s) => launch!("reduce_f32", s),
            DeviceBuffer::Bf16(s) => launch!("reduce_bf16", s),
            DeviceBuffer::F16(s) => launch!("reduce_f16", s),
        }
    }

    /// Multiplies an `Avg` accumulator by `1/contributions`, as [`crate::finish_avg`].
    pub fn finish_avg(&self, acc: &mut DeviceBuffer, contributions: usize) -> Result<(), KernelError> {
        let DeviceBuffer::F32(acc) = acc else {
            return Err(dtype_mismatch("finish_avg", "f32", acc));
        };
        let (n, factor) = (acc.len() as u64, 1.0 / contributions as f32);
        if n == 0 {
            return Ok(());
        }
        let f = self.function("scale_f32")?;
        let cfg = launch_config(acc.len());
        let mut args = self.stream.launch_builder(&f);
        args.arg(&mut *acc).arg(&n).arg(&factor);
        // SAFETY: the kernel reads and writes n elements of acc, which holds n.
        unsafe { args.launch(cfg) }.map(drop).map_err(driver("scale_f32"))
    }

    /// Casts between f32 and bf16/f16 (either direction), round to nearest even.
    pub fn cast(&self, src: &DeviceBuffer, dst: &mut DeviceBuffer) -> Result<(), KernelError> {
        same_len("cast", src.len(), dst.len())?;
        let n = src.len() as u64;
        if n == 0 {
            return Ok(());
        }
        let cfg = launch_config(src.len());
        macro_rules! launch {
            ($name:literal, $src:expr, $dst:expr) => {{
                let f = self.function($name)?;
                let mut args = self.stream.launch_builder(&f);
                args.arg($src).arg($dst).arg(&n);
                // SAFETY: the kernel reads n elements of src and writes n of dst; both hold n.
                unsafe { args.launch(cfg) }.map(drop).map_err(driver($name))
            }};
        }
        match (src, dst) {
            (DeviceBuffer::F32(s), DeviceBuffer::Bf16(d)) => launch!("cast_f32_to_bf16", s, d),
            (DeviceBuffer::F32(s), DeviceBuffer::F16(d)) => launch!("cast_f32_to_f16", s, d),
            (DeviceBuffer::Bf16(s), DeviceBuffer::F32(d)) => launch!("cast_bf16_to_f32", s, d),
            (DeviceBuffer::F16(s), DeviceBuffer::F32(d)) => launch!("cast_f16_to_f32", s, d),
            (src, _) => Err(dtype_mismatch("cast (one side must be f32, the other bf16 or f16)", "f32", src)),
        }
    }

    /// Fused AdamW step `step` on f32 buffers, with an optional bf16 copy-out, as [`crate::adamw_step`].
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_step(
        &self,
        params: &mut DeviceBuffer,
        grads: &DeviceBuffer,
        exp_avg: &mut DeviceBuffer,
        exp_avg_sq: &mut DeviceBuffer,
        params_bf16: Option<&mut DeviceBuffer>,
        config: &AdamWConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        let (DeviceBuffer::F32(p), DeviceBuffer::F32(g), DeviceBuffer::F32(m), DeviceBuffer::F32(v)) =
            (params, grads, exp_avg, exp_avg_sq)
        else {
            return Err(KernelError::DTypeMismatch { op: "adamw_step", expected: "f32", got: "a 16-bit float" });
        };
        for other in [g.len(), m.len(), v.len()] {
            same_len("adamw_step", p.len(), other)?;
        }
        let len = p.len();
        let n = len as u64;
        let s = AdamWStepScalars::new(config, step);
        if n == 0 {
            return Ok(());
        }
        let cfg = launch_config(len);
        let name = if params_bf16.is_some() { "adamw_f32_copy_out_bf16" } else { "adamw_f32" };
        let f = self.function(name)?;
        let mut args = self.stream.launch_builder(&f);
        args.arg(&mut *p).arg(g).arg(&mut *m).arg(&mut *v);
        match params_bf16 {
            Some(DeviceBuffer::Bf16(out)) => {
                same_len("adamw_step (bf16 copy-out)", len, out.len())?;
                args.arg(&mut *out);
            }
            Some(other) => return Err(dtype_mismatch("adamw_step (copy-out)", "bf16", other)),
            None => {}
        }
        args.arg(&n)
            .arg(&s.decay)
            .arg(&s.one_minus_beta1)
            .arg(&s.beta2)
            .arg(&s.one_minus_beta2)
            .arg(&s.neg_step_size)
            .arg(&s.bias_correction2_sqrt)
            .arg(&s.eps);
        // SAFETY: the kernel touches n elements of each buffer; all hold n (checked above).
        unsafe { args.launch(cfg) }.map(drop).map_err(driver("adamw"))
    }

    /// Unscales gradients and reports whether any input was inf or NaN; synchronises the stream.
    pub fn unscale_grads(&self, grads: &mut DeviceBuffer, inv_scale: f32) -> Result<bool, KernelError> {
        let DeviceBuffer::F32(g) = grads else {
            return Err(dtype_mismatch("unscale_grads", "f32", grads));
        };
        let n = g.len() as u64;
        if n == 0 {
            return Ok(false);
        }
        let mut found: CudaSlice<i32> = self.stream.alloc_zeros(1).map_err(driver("allocate"))?;
        let f = self.function("unscale_f32")?;
        let cfg = launch_config(g.len());
        let mut args = self.stream.launch_builder(&f);
        args.arg(&mut *g).arg(&n).arg(&inv_scale).arg(&mut found);
        // SAFETY: the kernel touches n elements of g and the one element of found.
        unsafe { args.launch(cfg) }.map_err(driver("unscale_f32"))?;
        let found = self.stream.clone_dtoh(&found).map_err(driver("copy to host"))?;
        Ok(found[0] != 0)
    }

    /// `Σ x_i²` over an f32 buffer, accumulated in f64 (per thread, then a fixed tree per block, then
    /// the blocks' partials in a fixed order: the same bits on every call for a given length);
    /// synchronises the stream.
    pub fn sum_of_squares(&self, buffer: &DeviceBuffer) -> Result<f64, KernelError> {
        let DeviceBuffer::F32(x) = buffer else {
            return Err(dtype_mismatch("sum_of_squares", "f32", buffer));
        };
        let n = x.len() as u64;
        if n == 0 {
            return Ok(0.0);
        }
        let cfg = launch_config(x.len());
        let blocks = u64::from(cfg.grid_dim.0);
        let mut partials: CudaSlice<f64> = self.stream.alloc_zeros(blocks as usize).map_err(driver("allocate"))?;
        let mut out: CudaSlice<f64> = self.stream.alloc_zeros(1).map_err(driver("allocate"))?;
        let f = self.function("sum_of_squares_partials_f32")?;
        let mut args = self.stream.launch_builder(&f);
        args.arg(x).arg(&n).arg(&mut partials);
        // SAFETY: the kernel reads n elements of x and writes one partial per block, `blocks` in all,
        // which `partials` holds; blocks are THREADS_PER_BLOCK threads, the size of its shared array.
        unsafe { args.launch(cfg) }.map_err(driver("sum_of_squares_partials_f32"))?;
        let f = self.function("sum_partials_f64")?;
        let one_block = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (THREADS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 };
        let mut args = self.stream.launch_builder(&f);
        args.arg(&partials).arg(&blocks).arg(&mut out);
        // SAFETY: one block reads the `blocks` partials and writes the one element of out.
        unsafe { args.launch(one_block) }.map_err(driver("sum_partials_f64"))?;
        Ok(self.stream.clone_dtoh(&out).map_err(driver("copy to host"))?[0])
    }

    /// XXH3-64 (seed 0) of the buffer's bytes — its elements little-endian, as a file of them holds
    /// them — i.e. [`crate::checksum64`] of the same bytes on the host. Computed by copying the buffer
    /// back in pieces of [`CHECKSUM_PIECE_BYTES`] and streaming them into [`crate::Checksum64Stream`]:
    /// XXH3 is one sequential hash, so a GPU could only compute a different (tree) definition, while
    /// checkpoint files are checked with this one. Bound by the device-to-host copy and one CPU core.
    pub fn checksum64(&self, buffer: &DeviceBuffer) -> Result<u64, KernelError> {
        match buffer {
            DeviceBuffer::F32(s) => self.checksum_pieces(s),
            DeviceBuffer::Bf16(s) | DeviceBuffer::F16(s) => self.checksum_pieces(s),
        }
    }

    fn checksum_pieces<T>(&self, slice: &CudaSlice<T>) -> Result<u64, KernelError>
    where
        T: cudarc::driver::DeviceRepr + bytemuck::Pod,
    {
        let per_piece = (CHECKSUM_PIECE_BYTES / std::mem::size_of::<T>()).max(1);
        let mut host = vec![T::zeroed(); per_piece.min(slice.len())];
        let mut checksum = crate::Checksum64Stream::new();
        let mut at = 0;
        while at < slice.len() {
            let end = (at + per_piece).min(slice.len());
            let piece = &mut host[..end - at];
            self.stream.memcpy_dtoh(&slice.slice(at..end), piece).map_err(driver("copy to host"))?;
            self.stream.synchronize().map_err(driver("synchronize"))?;
            checksum.update(bytemuck::cast_slice(piece));
            at = end;
        }
        Ok(checksum.finish())
    }
}

fn dtype_name(buffer: &DeviceBuffer) -> &'static str {
    match buffer {
        DeviceBuffer::F32(_) => "f32",
        DeviceBuffer::Bf16(_) => "bf16",
        DeviceBuffer::F16(_) => "f16",
    }
}

fn dtype_mismatch(op: &'static str, expected: &'static str, got: &DeviceBuffer) -> KernelError {
    KernelError::DTypeMismatch { op, expected, got: dtype_name(got) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the backend launches by name.
    const KERNELS: [&str; 13] = [
        "reduce_f32",
        "reduce_bf16",
        "reduce_f16",
        "scale_f32",
        "cast_f32_to_bf16",
        "cast_bf16_to_f32",
        "cast_f32_to_f16",
        "cast_f16_to_f32",
        "adamw_f32",
        "adamw_f32_copy_out_bf16",
        "unscale_f32",
        "sum_of_squares_partials_f32",
        "sum_partials_f64",
    ];

    /// NVRTC needs no device: wherever its library is installed (a CUDA toolkit, or the
    /// `nvidia-cuda-nvrtc` wheel that comes with torch on `LD_LIBRARY_PATH`), the CUDA C compiles and
    /// defines every kernel, so a typo in `kernels.cu` fails here rather than on the first GPU.
    #[test]
    fn the_kernel_source_compiles_with_nvrtc_and_defines_every_kernel() {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("the_kernel_source_compiles_with_nvrtc_and_defines_every_kernel: skipped, no NVRTC library");
            return;
        }
        let ptx = compiled_ptx().unwrap_or_else(|e| panic!("{e}")).to_src();
        for kernel in KERNELS {
            assert!(ptx.contains(&format!(".entry {kernel}(")), "{kernel} missing from the PTX");
        }
    }
}
