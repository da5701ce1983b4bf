//! NCCL backend: the [`Collective`] operations on CUDA buffers through cudarc's NCCL bindings (loaded
//! at run time). Compiled everywhere; [`nccl_available`] says plainly what is missing on a machine
//! without CUDA or NCCL. The NCCL unique id travels over an existing (QUIC) [`Communicator`].
//!
//! Not yet: stream-ordered (async) use, comm split, and polling `ncclCommGetAsyncError` so a lost peer
//! aborts the communicator instead of hanging — until then every call synchronizes its stream.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use troupe_kernels::reduce::ReduceOp;

use crate::collective::{Collective, Communicator, Element};
use crate::error::Rank;
use crate::transport::Transport;
use crate::ClusterError;

/// Number of CUDA devices usable with NCCL, or why there are none.
pub fn nccl_available() -> Result<usize, ClusterError> {
    // SAFETY: these only try to dlopen the libraries; cudarc panics on first use of a missing library,
    // so this check comes before any other cudarc call.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ClusterError::NoCuda("the CUDA driver library (libcuda) is not installed".into()));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(ClusterError::Nccl("the NCCL library (libnccl) is not installed".into()));
    }
    match CudaContext::device_count() {
        Ok(0) => Err(ClusterError::NoCuda("the driver reports 0 devices".into())),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(ClusterError::NoCuda(format!("the driver failed to initialise ({e})"))),
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> ClusterError {
    ClusterError::Nccl(format!("{what}: {e:?}"))
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Min => NcclOp::Min,
    }
}

pub struct NcclCommunicator {
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: Rank,
    world: usize,
    /// One element all-reduced by `barrier`.
    token: CudaSlice<f32>,
}

impl NcclCommunicator {
    /// Creates this rank's NCCL communicator on device `ordinal`. Rank 0 creates the unique id and
    /// broadcasts it over `control` (same group and ranks).
    pub async fn connect<T: Transport>(control: &mut Communicator<T>, ordinal: usize) -> Result<Self, ClusterError> {
        nccl_available()?;
        let (rank, world) = (control.transport().rank(), control.transport().world());
        let ctx = CudaContext::new(ordinal).map_err(|e| nccl_err("opening device", e))?;
        let stream = ctx.default_stream();
        // 128 id bytes as 32 f32 bit patterns (broadcast copies bits unchanged).
        let mut words = [0f32; 32];
        if rank == 0 {
            let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
            for (w, c) in words.iter_mut().zip(id.internal().chunks_exact(4)) {
                *w = f32::from_bits(u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8]));
            }
        }
        control.broadcast(&mut words, 0).await?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, w) in internal.chunks_exact_mut(4).zip(words) {
            for (dst, b) in c.iter_mut().zip(w.to_bits().to_le_bytes()) {
                *dst = b as std::ffi::c_char;
            }
        }
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        let token = stream.alloc_zeros::<f32>(1).map_err(|e| nccl_err("alloc", e))?;
        Ok(NcclCommunicator { comm, stream, rank, world, token })
    }

    fn sync(&self) -> Result<(), ClusterError> {
        self.stream.synchronize().map_err(|e| nccl_err("stream synchronize", e))
    }
}

impl Collective for NcclCommunicator {
    type Buffer<E: Element> = CudaSlice<E>;

    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    async fn all_reduce<E: Element>(&mut self, buf: &mut CudaSlice<E>, op: ReduceOp) -> Result<(), ClusterError> {
        self.comm.all_reduce_in_place(buf, &nccl_op(op)).map_err(|e| nccl_err("all_reduce", e))?;
        self.sync()
    }

    async fn broadcast<E: Element>(&mut self, buf: &mut CudaSlice<E>, root: Rank) -> Result<(), ClusterError> {
        self.comm.broadcast_in_place(buf, root as i32).map_err(|e| nccl_err("broadcast", e))?;
        self.sync()
    }

    async fn barrier(&mut self) -> Result<(), ClusterError> {
        self.comm.all_reduce_in_place(&mut self.token, &NcclOp::Sum).map_err(|e| nccl_err("barrier", e))?;
        self.sync()
    }
}
