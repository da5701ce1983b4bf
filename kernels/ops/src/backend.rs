//! One enum dispatch over the backends (like candle's `Device`/`Storage`): the caller holds a
//! [`Backend`] and [`Buffer`]s, and every kernel runs where its buffers live.
//!
//! The CPU kernels are also plain functions at the crate root (`reduce_into`, `adamw_step`, ...), which
//! is what CPU-only callers such as the collectives use; this layer exists for code that must run the
//! same step on either backend.

use half::{bf16, f16};

use crate::adamw::{adamw_step, AdamWConfig, AdamWShard};
use crate::checksum::checksum64;
use crate::cuda::{CudaBackend, DeviceBuffer};
use crate::error::KernelError;
use crate::reduce::{finish_avg, reduce_into, ReduceOp};
use crate::{cast, norm, unscale};

/// Where kernels run.
#[derive(Debug, Clone)]
pub enum Backend {
    Cpu,
    Cuda(CudaBackend),
}

/// A flat buffer in host memory.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

/// A flat buffer on some backend.
#[derive(Debug)]
pub enum Buffer {
    Cpu(HostBuffer),
    Cuda(DeviceBuffer),
}

impl HostBuffer {
    pub fn len(&self) -> usize {
        match self {
            HostBuffer::F32(v) => v.len(),
            HostBuffer::Bf16(v) => v.len(),
            HostBuffer::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn dtype_name(&self) -> &'static str {
        match self {
            HostBuffer::F32(_) => "f32",
            HostBuffer::Bf16(_) => "bf16",
            HostBuffer::F16(_) => "f16",
        }
    }
}

impl Buffer {
    fn backend_name(&self) -> &'static str {
        match self {
            Buffer::Cpu(_) => "cpu",
            Buffer::Cuda(_) => "cuda",
        }
    }
}

fn host_f32<'a>(op: &'static str, b: &'a HostBuffer) -> Result<&'a [f32], KernelError> {
    match b {
        HostBuffer::F32(v) => Ok(v),
        other => Err(KernelError::DTypeMismatch { op, expected: "f32", got: other.dtype_name() }),
    }
}

fn host_f32_mut<'a>(op: &'static str, b: &'a mut HostBuffer) -> Result<&'a mut [f32], KernelError> {
    match b {
        HostBuffer::F32(v) => Ok(v),
        other => Err(KernelError::DTypeMismatch { op, expected: "f32", got: other.dtype_name() }),
    }
}

fn same_len(op: &'static str, left: usize, right: usize) -> Result<(), KernelError> {
    if left == right {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { op, left, right })
    }
}

fn mismatch(op: &'static str, left: &Buffer, right: &Buffer) -> KernelError {
    KernelError::BackendMismatch { op, left: left.backend_name(), right: right.backend_name() }
}

impl Backend {
    /// CUDA device 0 when one is usable, else the CPU.
    pub fn best_available() -> Self {
        CudaBackend::new(0).map_or(Backend::Cpu, Backend::Cuda)
    }

    pub fn cuda(ordinal: usize) -> Result<Self, KernelError> {
        CudaBackend::new(ordinal).map(Backend::Cuda)
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda(_) => "cuda",
        }
    }

    /// Puts a host buffer on this backend (a move on the CPU, a copy to the device on CUDA).
    pub fn upload(&self, host: HostBuffer) -> Result<Buffer, KernelError> {
        match self {
            Backend::Cpu => Ok(Buffer::Cpu(host)),
            Backend::Cuda(cuda) => Ok(Buffer::Cuda(match &host {
                HostBuffer::F32(v) => cuda.upload_f32(v)?,
                HostBuffer::Bf16(v) => cuda.upload_bf16(v)?,
                HostBuffer::F16(v) => cuda.upload_f16(v)?,
            })),
        }
    }

    /// A host copy of a buffer (waits for the backend's queued work on it).
    pub fn download(&self, buffer: &Buffer) -> Result<HostBuffer, KernelError> {
        match (self, buffer) {
            (_, Buffer::Cpu(host)) => Ok(host.clone()),
            (Backend::Cuda(cuda), Buffer::Cuda(device)) => Ok(match device {
                DeviceBuffer::F32(_) => HostBuffer::F32(cuda.download_f32(device)?),
                DeviceBuffer::Bf16(_) => {
                    HostBuffer::Bf16(cuda.download_bits16(device)?.into_iter().map(bf16::from_bits).collect())
                }
                DeviceBuffer::F16(_) => {
                    HostBuffer::F16(cuda.download_bits16(device)?.into_iter().map(f16::from_bits).collect())
                }
            }),
            (Backend::Cpu, Buffer::Cuda(_)) => {
                Err(KernelError::BackendMismatch { op: "download", left: "cpu", right: "cuda" })
            }
        }
    }

    /// `acc[i] = op(acc[i], src[i])` with an f32 accumulator and an f32, bf16 or f16 source.
    pub fn reduce_into(&self, acc: &mut Buffer, src: &Buffer, op: ReduceOp) -> Result<(), KernelError> {
        match (self, &mut *acc, src) {
            (Backend::Cpu, Buffer::Cpu(acc), Buffer::Cpu(src)) => {
                let acc = host_f32_mut("reduce_into (accumulator)", acc)?;
                same_len("reduce_into", acc.len(), src.len())?;
                match src {
                    HostBuffer::F32(s) => reduce_into(acc, s, op),
                    HostBuffer::Bf16(s) => reduce_into(acc, s, op),
                    HostBuffer::F16(s) => reduce_into(acc, s, op),
                }
                Ok(())
            }
            (Backend::Cuda(cuda), Buffer::Cuda(acc), Buffer::Cuda(src)) => cuda.reduce_into(acc, src, op),
            _ => Err(mismatch("reduce_into", acc, src)),
        }
    }

    pub fn finish_avg(&self, acc: &mut Buffer, contributions: usize) -> Result<(), KernelError> {
        match (self, acc) {
            (Backend::Cpu, Buffer::Cpu(acc)) => {
                finish_avg(host_f32_mut("finish_avg", acc)?, contributions);
                Ok(())
            }
            (Backend::Cuda(cuda), Buffer::Cuda(acc)) => cuda.finish_avg(acc, contributions),
            (_, acc) => {
                Err(KernelError::BackendMismatch { op: "finish_avg", left: self.name(), right: acc.backend_name() })
            }
        }
    }

    /// Casts f32 → bf16/f16 or bf16/f16 → f32 into `dst` (round to nearest even).
    pub fn cast(&self, src: &Buffer, dst: &mut Buffer) -> Result<(), KernelError> {
        match (self, src, &mut *dst) {
            (Backend::Cpu, Buffer::Cpu(src), Buffer::Cpu(dst)) => {
                same_len("cast", src.len(), dst.len())?;
                match (src, dst) {
                    (HostBuffer::F32(s), HostBuffer::Bf16(d)) => cast::f32_to_bf16(s, d),
                    (HostBuffer::F32(s), HostBuffer::F16(d)) => cast::f32_to_f16(s, d),
                    (HostBuffer::Bf16(s), HostBuffer::F32(d)) => cast::bf16_to_f32(s, d),
                    (HostBuffer::F16(s), HostBuffer::F32(d)) => cast::f16_to_f32(s, d),
                    (s, _) => {
                        return Err(KernelError::DTypeMismatch {
                            op: "cast (one side must be f32, the other bf16 or f16)",
                            expected: "f32",
                            got: s.dtype_name(),
                        })
                    }
                }
                Ok(())
            }
            (Backend::Cuda(cuda), Buffer::Cuda(src), Buffer::Cuda(dst)) => cuda.cast(src, dst),
            _ => Err(mismatch("cast", src, dst)),
        }
    }

    /// Fused AdamW step `step` (from 1) on f32 buffers, optionally writing the params as bf16 too.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_step(
        &self,
        params: &mut Buffer,
        grads: &Buffer,
        exp_avg: &mut Buffer,
        exp_avg_sq: &mut Buffer,
        params_bf16: Option<&mut Buffer>,
        config: &AdamWConfig,
        step: u64,
    ) -> Result<(), KernelError> {
        match (self, params, grads, exp_avg, exp_avg_sq) {
            (Backend::Cpu, Buffer::Cpu(p), Buffer::Cpu(g), Buffer::Cpu(m), Buffer::Cpu(v)) => {
                let (p, g) = (host_f32_mut("adamw_step", p)?, host_f32("adamw_step", g)?);
                let (m, v) = (host_f32_mut("adamw_step", m)?, host_f32_mut("adamw_step", v)?);
                for other in [g.len(), m.len(), v.len()] {
                    same_len("adamw_step", p.len(), other)?;
                }
                let out = match params_bf16 {
                    None => None,
                    Some(Buffer::Cpu(HostBuffer::Bf16(out))) => {
                        same_len("adamw_step (bf16 copy-out)", p.len(), out.len())?;
                        Some(out.as_mut_slice())
                    }
                    Some(Buffer::Cpu(other)) => {
                        let got = other.dtype_name();
                        return Err(KernelError::DTypeMismatch { op: "adamw_step (copy-out)", expected: "bf16", got });
                    }
                    Some(Buffer::Cuda(_)) => {
                        return Err(KernelError::BackendMismatch { op: "adamw_step", left: "cpu", right: "cuda" })
                    }
                };
                adamw_step(AdamWShard { params: p, exp_avg: m, exp_avg_sq: v }, g, config, step, out);
                Ok(())
            }
            (Backend::Cuda(cuda), Buffer::Cuda(p), Buffer::Cuda(g), Buffer::Cuda(m), Buffer::Cuda(v)) => {
                let out = match params_bf16 {
                    None => None,
                    Some(Buffer::Cuda(out)) => Some(out),
                    Some(Buffer::Cpu(_)) => {
                        return Err(KernelError::BackendMismatch { op: "adamw_step", left: "cuda", right: "cpu" })
                    }
                };
                cuda.adamw_step(p, g, m, v, out, config, step)
            }
            (backend, ..) => Err(KernelError::BackendMismatch {
                op: "adamw_step",
                left: backend.name(),
                right: "a buffer on another backend",
            }),
        }
    }

    /// Multiplies by `inv_scale`; returns whether any input was inf or NaN.
    pub fn unscale_grads(&self, grads: &mut Buffer, inv_scale: f32) -> Result<bool, KernelError> {
        match (self, grads) {
            (Backend::Cpu, Buffer::Cpu(g)) => Ok(unscale::unscale_grads(host_f32_mut("unscale_grads", g)?, inv_scale)),
            (Backend::Cuda(cuda), Buffer::Cuda(g)) => cuda.unscale_grads(g, inv_scale),
            (_, g) => {
                Err(KernelError::BackendMismatch { op: "unscale_grads", left: self.name(), right: g.backend_name() })
            }
        }
    }

    /// XXH3-64 (seed 0) of the buffer's element bytes (native order: little-endian on every platform
    /// troupe runs on) — the checkpoint files' checksum. On CUDA the buffer is copied back and hashed
    /// on the host (see [`CudaBackend::checksum64`]).
    pub fn checksum64(&self, buffer: &Buffer) -> Result<u64, KernelError> {
        match (self, buffer) {
            (Backend::Cpu, Buffer::Cpu(HostBuffer::F32(v))) => Ok(checksum64(bytemuck::cast_slice(v))),
            (Backend::Cpu, Buffer::Cpu(HostBuffer::Bf16(v))) => Ok(checksum64(bytemuck::cast_slice(v))),
            (Backend::Cpu, Buffer::Cpu(HostBuffer::F16(v))) => Ok(checksum64(bytemuck::cast_slice(v))),
            (Backend::Cuda(cuda), Buffer::Cuda(b)) => cuda.checksum64(b),
            (_, b) => {
                Err(KernelError::BackendMismatch { op: "checksum64", left: self.name(), right: b.backend_name() })
            }
        }
    }

    /// The L2 norm over several f32 buffers, accumulated in f64.
    pub fn l2_norm(&self, buffers: &[&Buffer]) -> Result<f64, KernelError> {
        let mut sum = 0.0f64;
        for buffer in buffers {
            sum += match (self, buffer) {
                (Backend::Cpu, Buffer::Cpu(b)) => norm::sum_of_squares(host_f32("l2_norm", b)?),
                (Backend::Cuda(cuda), Buffer::Cuda(b)) => cuda.sum_of_squares(b)?,
                (_, b) => {
                    return Err(KernelError::BackendMismatch {
                        op: "l2_norm",
                        left: self.name(),
                        right: b.backend_name(),
                    })
                }
            };
        }
        Ok(sum.sqrt())
    }
}
