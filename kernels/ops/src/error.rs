//! The one error type at this crate's boundary.

/// What can go wrong in a kernel call that is not a broken invariant (mismatched lengths are broken
/// plans and panic; these are conditions of the machine or of the caller's choice of backend).
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No CUDA driver library, no device, or the device index is out of range.
    #[error("no CUDA device: {reason}")]
    NoCudaDevice { reason: String },
    /// The CUDA driver returned an error during `op`.
    #[error("CUDA driver error during {op}: {message}")]
    CudaDriver { op: &'static str, message: String },
    /// NVRTC failed to compile troupe's CUDA C source (a bug in the source or an unsupported device).
    #[error("NVRTC failed to compile the troupe kernels: {message}")]
    CudaCompile { message: String },
    /// Two buffers given to one kernel live on different backends (e.g. one on the CPU, one on CUDA).
    #[error("{op}: buffers live on different backends ({left} and {right}); move them to one backend first")]
    BackendMismatch { op: &'static str, left: &'static str, right: &'static str },
    /// A buffer has a different element type than the kernel needs.
    #[error("{op}: expected a {expected} buffer, got {got}")]
    DTypeMismatch { op: &'static str, expected: &'static str, got: &'static str },
    /// Two buffers given to one kernel have different lengths.
    #[error("{op}: buffer lengths differ ({left} and {right} elements)")]
    LengthMismatch { op: &'static str, left: usize, right: usize },
}
