//! troupe-kernels: compute on flat buffers, the leaf of the workspace.
//!
//! These are troupe's own hot paths — reducing received gradient chunks, casting between precisions,
//! the sharded optimizer step, overflow checks, checksums — on CPU always and on CUDA (cudarc, dynamic
//! loading) when a device is present.
//!
//! Code map: one concept per file — [`reduce`], [`cast`], [`adamw`], [`unscale`], [`norm`],
//! [`checksum`] are the CPU kernels (plain functions on slices); [`simd`] holds their AVX2/AVX-512 paths,
//! chosen at run time; [`cuda`] is the CUDA backend;
//! [`backend`] is the enum dispatch over both; [`bench`](mod@bench) measures the CPU kernels against memcpy.
//!
//! Invariant: this crate never links libtorch; it builds and tests without it.
//! Invariant: `unsafe` appears only in [`cuda`] (cudarc: the driver, NVRTC, kernel launches) and [`simd`]
//! (`std::arch` intrinsics behind run-time feature detection).

#![deny(unsafe_code)]

pub mod adamw;
pub mod backend;
pub mod bench;
pub mod cast;
pub mod checksum;
pub mod cpu_parallel;
#[allow(unsafe_code)]
pub mod cuda;
pub mod error;
pub mod norm;
pub mod partition;
pub mod reduce;
#[allow(unsafe_code)]
pub mod simd;
pub mod unscale;

pub use adamw::{adamw_step, AdamWConfig, AdamWShard};
pub use backend::{Backend, Buffer, HostBuffer};
pub use cast::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use checksum::{checksum64, Checksum64Stream};
pub use cpu_parallel::{cpu_threads, set_cpu_threads};
pub use cuda::{BorrowedDeviceBuffer, CudaBackend, DeviceDtype};
pub use error::KernelError;
pub use norm::l2_norm;
pub use partition::balanced_range;
pub use reduce::{finish_avg, reduce_into, ReduceInput, ReduceOp};
pub use unscale::unscale_grads;
