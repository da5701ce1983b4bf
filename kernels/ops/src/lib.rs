//! troupe-kernels: compute on flat buffers, the leaf of the workspace.
//!
//! These are troupe's own hot paths — reducing received gradient chunks, casting between precisions,
//! the sharded optimizer step, overflow checks, checksums — on CPU always and on CUDA (cudarc, dynamic
//! loading) when a device is present.
//!
//! Invariant: this crate never links libtorch; it builds and tests without it.

pub mod reduce;

pub use reduce::{reduce_into, ReduceOp};
