//! NCCL backend: the [`Collective`] operations on CUDA buffers through NCCL (cudarc, loaded at run
//! time). Compiled everywhere; [`nccl_available`] says plainly what is missing on a machine without
//! CUDA or NCCL.
//!
//! # Semantics
//!
//! - **Creation.** [`NcclCommunicator::connect`] takes the epoch's data-plane [`Communicator`] (same
//!   ranks, same order): rank 0 creates a fresh NCCL unique id and sends its 128 bytes to every other
//!   rank point-to-point on that communicator, so the id travels tagged with the epoch and a stale
//!   epoch's id can never be used; then every rank joins with `ncclCommInitRank`, which blocks until
//!   all ranks have joined (NCCL's own bootstrap) — on a helper thread, the caller waiting at most the
//!   collective timeout without blocking its own thread ([`ClusterError::NcclJoinTimeout`]). Why not the control plane
//!   (`crate::control`): it connects daemons by node name and has no notion of a job's ranks; carrying
//!   the id there would need the controller to relay rank 0's id to each member as a new message kind,
//!   where the epoch's communicator already holds exactly these ranks, fenced by exactly this epoch.
//! - **Calls.** Each collective is enqueued on the communicator's stream (the device context's
//!   default stream, the one troupe-kernels' CUDA backend uses) and then awaited without blocking the
//!   thread: the call polls an event recorded after it, NCCL's asynchronous error state
//!   (`ncclCommGetAsyncError`: a lost peer, a network error) and `collective_timeout_ms` (the data-plane
//!   communicator's). An error or the timeout **aborts** the communicator (`ncclCommAbort`, which makes
//!   the queued work return) and fails the call; every later call fails until a rebuild.
//!   All-gather and reduce-scatter need equal pieces (NCCL's layout): the long buffer is `world` times
//!   the short one, rank r's piece at `r × short.len()` — the transport communicator's `chunk_range`
//!   layout whenever the length divides evenly.
//! - **Epoch change.** [`NcclCommunicator::abort`] may be called at any time (idempotent);
//!   [`NcclCommunicator::rebuild`] aborts the old communicator if it is still live and builds a new one
//!   from a fresh unique id exchanged over the new epoch's communicator, taking that communicator's
//!   rank and world (re-ranking may have shrunk it). Rebuilding for an epoch not newer than the current
//!   one is refused.

mod raw;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::sys::ncclRedOp_t;
use troupe_kernels::reduce::ReduceOp;

use crate::collective::{Collective, Communicator, Element};
use crate::error::Rank;
use crate::transport::Transport;
use crate::ClusterError;
use raw::{RawComm, UniqueId};

/// Completion checks that yield to the runtime before a call starts sleeping between checks.
const POLL_SPINS: u32 = 200;
/// Sleep between completion checks once the spins are used up.
const POLL_SLEEP_MS: u64 = 1;
/// What every call on an aborted communicator fails with.
const ABORTED: &str = "the communicator was aborted; rebuild it for the next epoch";

/// Number of CUDA devices usable with NCCL, or why there are none.
pub fn nccl_available() -> Result<usize, ClusterError> {
    // SAFETY: these only try to dlopen the libraries; cudarc panics on first use of a missing library,
    // so this check comes before any other cudarc call.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ClusterError::NoCuda("the CUDA driver library (libcuda) is not installed".into()));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(ClusterError::Nccl(missing_nccl(raw::nccl_soname_path())));
    }
    match CudaContext::device_count() {
        Ok(0) => Err(ClusterError::NoCuda("the driver reports 0 devices".into())),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(ClusterError::NoCuda(format!("the driver failed to initialise ({e})"))),
    }
}

/// Why NCCL cannot be used when cudarc finds no NCCL library, given where the dynamic linker finds
/// `libnccl.so.2` (if it does). cudarc 0.19 looks for `libnccl.so` and `libnccl.so.<CUDA major>`, never
/// the soname `libnccl.so.2` that NCCL's packages and pip wheel (torch's dependency) install alone.
pub fn missing_nccl(soname_path: Option<String>) -> String {
    match soname_path {
        Some(path) => {
            let dir = std::path::Path::new(&path).parent().map_or(".".to_owned(), |d| d.display().to_string());
            format!(
                "NCCL is installed only as {path} (its soname libnccl.so.2), a name the NCCL loader (cudarc) does not try; \
                 give it the name it looks for: `ln -s {path} DIR/libnccl.so` in a directory DIR of your choice (or {dir}), \
                 and start the daemon with DIR on LD_LIBRARY_PATH"
            )
        }
        None => "the NCCL library (libnccl.so.2) is not installed: install NCCL (e.g. `pip install nvidia-nccl-cu12` \
                 or the libnccl2 package) and put its lib directory on LD_LIBRARY_PATH"
            .to_owned(),
    }
}

/// One CUDA device as the driver reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaDeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub memory_bytes: u64,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and `nvidia-smi` name the device (CUDA's
    /// ordinals and NVML's indices may differ); None if the driver would not say.
    pub uuid: Option<String>,
}

/// The CUDA devices this process sees (`CUDA_VISIBLE_DEVICES` applies), without creating a context on
/// any; an error says why there are none to see.
pub fn cuda_devices() -> Result<Vec<CudaDeviceInfo>, ClusterError> {
    use cudarc::driver::result;
    // SAFETY: only tries to dlopen the driver library (see `nccl_available`).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ClusterError::NoCuda("the CUDA driver library (libcuda) is not installed".into()));
    }
    let failed = |what: &str, e: cudarc::driver::DriverError| ClusterError::NoCuda(format!("{what}: {e}"));
    result::init().map_err(|e| failed("the driver failed to initialise", e))?;
    let count = result::device::get_count().map_err(|e| failed("counting devices", e))?;
    (0..count)
        .map(|ordinal| {
            let device = result::device::get(ordinal).map_err(|e| failed(&format!("device {ordinal}"), e))?;
            let name = result::device::get_name(device).map_err(|e| failed(&format!("device {ordinal}'s name"), e))?;
            // SAFETY: `device` is a handle the driver just returned.
            let memory = unsafe { result::device::total_mem(device) }
                .map_err(|e| failed(&format!("device {ordinal}'s memory"), e))?;
            let uuid = result::device::get_uuid(device).ok().map(|id| uuid_text(&id.bytes.map(|b| b as u8)));
            Ok(CudaDeviceInfo { ordinal: ordinal as usize, name, memory_bytes: memory as u64, uuid })
        })
        .collect()
}

/// A device's 16-byte UUID as NVML writes it: `GPU-` and hex digits grouped 8-4-4-4-12.
fn uuid_text(bytes: &[u8; 16]) -> String {
    let hex = |range: std::ops::Range<usize>| bytes[range].iter().map(|b| format!("{b:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

fn nccl_dtype(dtype: crate::collective::Dtype) -> cudarc::nccl::sys::ncclDataType_t {
    use crate::collective::Dtype;
    use cudarc::nccl::sys::ncclDataType_t;
    match dtype {
        Dtype::F32 => ncclDataType_t::ncclFloat32,
        Dtype::Bf16 => ncclDataType_t::ncclBfloat16,
        Dtype::F16 => ncclDataType_t::ncclFloat16,
    }
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

/// The unique id of the communicator being built: made by rank 0 with `make`, sent to every other
/// rank over `control` point-to-point (bytes as they are), received by the others.
pub(crate) async fn exchange_unique_id<T: Transport>(
    control: &mut Communicator<T>,
    make: impl FnOnce() -> Result<UniqueId, ClusterError>,
) -> Result<UniqueId, ClusterError> {
    let (rank, world) = (control.transport().rank(), control.transport().world());
    // Point-to-point messages carry an element slice's bytes unchanged: 32 f32 "words" here, never
    // read as numbers.
    if rank == 0 {
        let id = make()?;
        let words: [f32; 32] = bytemuck::cast(id);
        for peer in 1..world {
            control.send(peer, &words).await?;
        }
        Ok(id)
    } else {
        let mut words = [0f32; 32];
        control.recv(0, &mut words).await?;
        Ok(bytemuck::cast(words))
    }
}

/// One rank's NCCL communicator for one epoch at a time (see the module docs).
pub struct NcclCommunicator {
    /// `None` once aborted.
    comm: Option<RawComm>,
    stream: Arc<CudaStream>,
    rank: Rank,
    world: usize,
    epoch: u64,
    timeout_ms: u64,
    /// One element all-reduced by `barrier`.
    token: CudaSlice<f32>,
}

impl NcclCommunicator {
    /// Creates this rank's NCCL communicator on device `ordinal`, for the ranks and epoch of `control`.
    pub async fn connect<T: Transport>(control: &mut Communicator<T>, ordinal: usize) -> Result<Self, ClusterError> {
        nccl_available()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| ClusterError::NoCuda(format!("opening device {ordinal}: {e}")))?;
        let stream = ctx.default_stream();
        let token = stream.alloc_zeros::<f32>(1).map_err(|e| ClusterError::Nccl(format!("allocating: {e}")))?;
        let mut me = NcclCommunicator {
            comm: None,
            stream,
            rank: control.transport().rank(),
            world: control.transport().world(),
            epoch: control.epoch(),
            timeout_ms: control.config().collective_timeout_ms,
            token,
        };
        me.join(control).await?;
        Ok(me)
    }

    /// Exchanges a fresh unique id over `control` and joins its communicator.
    ///
    /// `ncclCommInitRank` blocks its thread until every rank has joined, so it runs on a helper
    /// thread: the calling task waits without blocking its own thread, at most the collective timeout
    /// (then [`ClusterError::NcclJoinTimeout`]), and can be dropped meanwhile (an aborted attempt). A
    /// join that completes after its waiter gave up is aborted on the helper thread; one that never
    /// completes keeps only that thread, until NCCL's bootstrap gives up.
    async fn join<T: Transport>(&mut self, control: &mut Communicator<T>) -> Result<(), ClusterError> {
        let (rank, world, epoch) = (self.rank, self.world, self.epoch);
        let make = || raw::unique_id().map_err(|e| self.error("ncclGetUniqueId", &e));
        let id = exchange_unique_id(control, make).await?;
        // The calls come from this thread: the device's context current here too, as before the join.
        self.stream.context().bind_to_thread().map_err(|e| self.error("binding the device", &e.to_string()))?;
        let context = self.stream.context().clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new().name(format!("troupe-nccl-join-{rank}")).spawn(move || {
            let joined = match context.bind_to_thread() {
                Ok(()) => RawComm::init_rank(id, rank, world).map(raw::Joined),
                Err(e) => Err(format!("binding the device: {e}")),
            };
            // A waiter that gave up dropped `rx`: the communicator comes back and is dropped (aborted).
            let _ = tx.send(joined);
        });
        spawned.map_err(|e| self.error("ncclCommInitRank", &format!("starting its thread: {e}")))?;
        let waited_ms = self.timeout_ms;
        let joined = match tokio::time::timeout(Duration::from_millis(waited_ms), rx).await {
            Ok(Ok(joined)) => joined,
            Ok(Err(_)) => Err("its thread ended without an answer".to_owned()),
            Err(_) => return Err(ClusterError::NcclJoinTimeout { rank, world, epoch, waited_ms }),
        };
        let raw::Joined(comm) = joined.map_err(|e| {
            ClusterError::Nccl(format!("rank {rank} of {world} (epoch {epoch}): ncclCommInitRank: {e}"))
        })?;
        self.comm = Some(comm);
        Ok(())
    }

    /// Aborts the communicator (`ncclCommAbort`): queued and running operations return, every later
    /// call fails until [`NcclCommunicator::rebuild`]. Does nothing if already aborted.
    pub fn abort(&mut self) -> Result<(), ClusterError> {
        match self.comm.take() {
            Some(comm) => comm.abort().map_err(|e| self.error("ncclCommAbort", &e)),
            None => Ok(()),
        }
    }

    pub fn is_aborted(&self) -> bool {
        self.comm.is_none()
    }

    /// Replaces the communicator with one for `control`'s newer epoch, ranks and world, from a fresh
    /// unique id exchanged over `control`; aborts the old one first if it is still live.
    pub async fn rebuild<T: Transport>(&mut self, control: &mut Communicator<T>) -> Result<(), ClusterError> {
        if control.epoch() <= self.epoch {
            return Err(ClusterError::InvalidArgument {
                rank: self.rank,
                op: "nccl rebuild",
                reason: format!("epoch {} is not newer than the communicator's epoch {}", control.epoch(), self.epoch),
            });
        }
        if let Err(e) = self.abort() {
            tracing::warn!(rank = self.rank, epoch = self.epoch, error = %e, "aborting the old NCCL communicator failed; rebuilding anyway");
        }
        self.rank = control.transport().rank();
        self.world = control.transport().world();
        self.epoch = control.epoch();
        self.timeout_ms = control.config().collective_timeout_ms;
        self.join(control).await
    }

    /// The membership epoch this communicator was built for.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn error(&self, op: &str, reason: &str) -> ClusterError {
        ClusterError::Nccl(format!("rank {} of {} (epoch {}): {op}: {reason}", self.rank, self.world, self.epoch))
    }

    /// The live communicator, or the error every call after an abort gets.
    fn live(&self, op: &str) -> Result<&RawComm, ClusterError> {
        self.comm.as_ref().ok_or_else(|| self.error(op, ABORTED))
    }

    /// Waits, without blocking the thread, for the operation just enqueued (`enqueued` says whether
    /// enqueuing worked); on an error or the timeout, aborts the communicator.
    async fn wait(&mut self, op: &'static str, enqueued: Result<(), String>) -> Result<(), ClusterError> {
        if let Err(e) = enqueued {
            return Err(self.fail(op, &e));
        }
        let done = match self.stream.record_event(None) {
            Ok(event) => event,
            Err(e) => return Err(self.fail(op, &format!("recording its completion event: {e}"))),
        };
        let started = tokio::time::Instant::now();
        let timeout = Duration::from_millis(self.timeout_ms);
        let mut polls = 0u32;
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fail(op, &format!("CUDA error: {e}"))),
            }
            if let Err(e) = self.live(op)?.async_error() {
                return Err(self.fail(op, &format!("NCCL reported {e}")));
            }
            if started.elapsed() >= timeout {
                return Err(self.fail(op, &format!("not complete after {} ms", self.timeout_ms)));
            }
            if polls < POLL_SPINS {
                polls += 1;
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_millis(POLL_SLEEP_MS)).await;
            }
        }
    }

    /// Sums `count` f32, bf16 or f16 elements (`dtype`) at device address `ptr` over the ranks, in
    /// place — a buffer another allocator owns (a libtorch tensor's), enqueued on the communicator's
    /// stream (the device's legacy default stream, which libtorch computes on unless told otherwise, so
    /// the operation runs after what wrote the buffer and before what reads it). Waits like every call.
    ///
    /// # Safety
    /// `ptr` must address `count` contiguous elements of `dtype` on this communicator's device, and
    /// stay allocated until the call returns (or, if its future is dropped, until the communicator is
    /// aborted or its stream has passed the operation).
    pub async unsafe fn all_reduce_in_place(
        &mut self,
        ptr: u64,
        count: usize,
        dtype: crate::collective::Dtype,
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        // SAFETY: the caller's contract is `all_reduce_ptr`'s.
        let enqueued = unsafe {
            self.live("all_reduce")?.all_reduce_ptr(ptr, count, nccl_dtype(dtype), nccl_op(op), &self.stream)
        };
        self.wait("all_reduce", enqueued).await
    }

    /// Reduce-scatter between buffers another allocator owns (libtorch tensors'): `send` holds world ×
    /// `recv_count` elements of `dtype`, reduced over the ranks; rank r's piece (the r-th of equal
    /// pieces) lands in `recv`. Enqueued and waited for as [`NcclCommunicator::all_reduce_in_place`].
    ///
    /// # Safety
    /// `send` and `recv` must address that many contiguous elements of `dtype` on this communicator's
    /// device, must not overlap, and must stay allocated as `all_reduce_in_place` requires.
    pub async unsafe fn reduce_scatter_ptrs(
        &mut self,
        (send, recv): (u64, u64),
        recv_count: usize,
        dtype: crate::collective::Dtype,
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        let (datatype, op) = (nccl_dtype(dtype), nccl_op(op));
        // SAFETY: the caller's contract is `reduce_scatter_ptr`'s.
        let enqueued = unsafe {
            self.live("reduce_scatter")?.reduce_scatter_ptr((send, recv), recv_count, datatype, op, &self.stream)
        };
        self.wait("reduce_scatter", enqueued).await
    }

    /// All-gather between buffers another allocator owns: every rank's `send` (`send_count` elements of
    /// `dtype`) into `recv` (world × `send_count`), rank r's at r × `send_count`.
    ///
    /// # Safety
    /// As [`NcclCommunicator::reduce_scatter_ptrs`]'s.
    pub async unsafe fn all_gather_ptrs(
        &mut self,
        (send, recv): (u64, u64),
        send_count: usize,
        dtype: crate::collective::Dtype,
    ) -> Result<(), ClusterError> {
        // SAFETY: the caller's contract is `all_gather_ptr`'s.
        let enqueued = unsafe {
            self.live("all_gather")?.all_gather_ptr((send, recv), send_count, nccl_dtype(dtype), &self.stream)
        };
        self.wait("all_gather", enqueued).await
    }

    /// Broadcasts from their roots (`reduce` None) or reduces onto their roots (`reduce` Some(op)) pieces
    /// of one buffer another allocator owns, in place, as one NCCL group (one launch, one wait): piece
    /// `(offset, count, root)` covers elements `offset..offset + count` of the `len` elements of `dtype`
    /// at device address `ptr`. Every rank passes the same pieces. A reduction leaves the buffer of a
    /// rank that is not a piece's root as it was there (NCCL writes only the root's). Enqueued and waited
    /// for as [`NcclCommunicator::all_reduce_in_place`].
    ///
    /// # Safety
    /// `ptr` must address `len` contiguous elements of `dtype` on this communicator's device and stay
    /// allocated as `all_reduce_in_place` requires.
    pub async unsafe fn rooted_in_place(
        &mut self,
        (ptr, len): (u64, usize),
        pieces: &[(usize, usize, usize)],
        dtype: crate::collective::Dtype,
        reduce: Option<ReduceOp>,
    ) -> Result<(), ClusterError> {
        let op = if reduce.is_some() { "reduce" } else { "broadcast" };
        let bad = pieces.iter().find(|&&(offset, count, root)| offset + count > len || root >= self.world);
        if let Some((offset, count, root)) = bad {
            let reason = format!(
                "piece {offset}..{} from root {root}: the buffer holds {len} elements, the world is {}",
                offset + count,
                self.world
            );
            return Err(ClusterError::InvalidArgument { rank: self.rank, op, reason });
        }
        let elem_bytes = match dtype {
            crate::collective::Dtype::F32 => 4,
            crate::collective::Dtype::Bf16 | crate::collective::Dtype::F16 => 2,
        };
        let (datatype, reduce) = (nccl_dtype(dtype), reduce.map(nccl_op));
        // SAFETY: the caller's contract is `rooted_ptr`'s; every piece lies inside the buffer and every
        // root inside the world (checked above).
        let enqueued = unsafe { self.live(op)?.rooted_ptr((ptr, elem_bytes), pieces, datatype, reduce, &self.stream) };
        self.wait(op, enqueued).await
    }

    /// Aborts after a failed call and returns the call's error.
    fn fail(&mut self, op: &'static str, reason: &str) -> ClusterError {
        let aborted = match self.abort() {
            Ok(()) => "communicator aborted".to_owned(),
            Err(e) => format!("and aborting failed too: {e}"),
        };
        self.error(op, &format!("{reason}; {aborted}"))
    }

    fn check_pieces(&self, op: &'static str, long: usize, short: usize) -> Result<(), ClusterError> {
        if long == short * self.world {
            return Ok(());
        }
        Err(ClusterError::InvalidArgument {
            rank: self.rank,
            op,
            reason: format!(
                "NCCL needs equal pieces: the long buffer must hold world ({}) × the short one ({short}) = {} elements, it holds {long}",
                self.world,
                short * self.world
            ),
        })
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
        let enqueued = self.live("all_reduce")?.all_reduce(buf, nccl_op(op), &self.stream);
        self.wait("all_reduce", enqueued).await
    }

    async fn broadcast<E: Element>(&mut self, buf: &mut CudaSlice<E>, root: Rank) -> Result<(), ClusterError> {
        if root >= self.world {
            let reason = format!("root {root} outside world of {}", self.world);
            return Err(ClusterError::InvalidArgument { rank: self.rank, op: "broadcast", reason });
        }
        let enqueued = self.live("broadcast")?.broadcast(buf, root as i32, &self.stream);
        self.wait("broadcast", enqueued).await
    }

    async fn all_gather<E: Element>(
        &mut self,
        input: &CudaSlice<E>,
        output: &mut CudaSlice<E>,
    ) -> Result<(), ClusterError> {
        self.check_pieces("all_gather", output.len(), input.len())?;
        let enqueued = self.live("all_gather")?.all_gather(input, output, &self.stream);
        self.wait("all_gather", enqueued).await
    }

    async fn reduce_scatter<E: Element>(
        &mut self,
        input: &CudaSlice<E>,
        output: &mut CudaSlice<E>,
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        self.check_pieces("reduce_scatter", input.len(), output.len())?;
        let enqueued = self.live("reduce_scatter")?.reduce_scatter(input, output, nccl_op(op), &self.stream);
        self.wait("reduce_scatter", enqueued).await
    }

    async fn barrier(&mut self) -> Result<(), ClusterError> {
        let Some(comm) = &self.comm else {
            return Err(self.error("barrier", ABORTED));
        };
        let enqueued = comm.all_reduce(&mut self.token, ncclRedOp_t::ncclSum, &self.stream);
        self.wait("barrier", enqueued).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::collective::CollectiveConfig;
    use crate::transport::memory::MemoryTransport;

    fn config() -> CollectiveConfig {
        CollectiveConfig {
            small_message_bytes_max: 4 << 10,
            pipeline_slice_bytes: 16 << 10,
            collective_timeout_ms: 10_000,
        }
    }

    #[test]
    fn a_device_uuid_reads_as_nvml_and_nvidia_smi_write_it() {
        let bytes: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(uuid_text(&bytes), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    /// Rank 0's id reaches every rank byte for byte (every byte value, NaN-like f32 patterns included),
    /// and rank 0 alone makes one.
    #[test]
    fn the_unique_id_reaches_every_rank_unchanged() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        for world in 1..=4 {
            let id: UniqueId = std::array::from_fn(|i| (i * 2 + 255) as u8);
            let got = rt.block_on(futures::future::join_all(MemoryTransport::mesh(world, 64).into_iter().map(
                |t| async move {
                    let rank = t.rank();
                    let mut control = Communicator::new(Arc::new(t), 3, 1, config());
                    exchange_unique_id(&mut control, || {
                        assert_eq!(rank, 0, "only rank 0 makes the id");
                        Ok(id)
                    })
                    .await
                },
            )));
            for (rank, got) in got.into_iter().enumerate() {
                assert_eq!(got.unwrap(), id, "world {world}, rank {rank}");
            }
        }
    }

    /// NCCL found only under its soname: the message names the file and the link that fixes it; not
    /// found at all: how to install it.
    #[test]
    fn a_missing_nccl_is_explained_with_the_fix() {
        let only_soname = missing_nccl(Some("/venv/nvidia/nccl/lib/libnccl.so.2".into()));
        assert!(only_soname.contains("installed only as /venv/nvidia/nccl/lib/libnccl.so.2"), "{only_soname}");
        assert!(only_soname.contains("ln -s /venv/nvidia/nccl/lib/libnccl.so.2 DIR/libnccl.so"), "{only_soname}");
        assert!(only_soname.contains("LD_LIBRARY_PATH"), "{only_soname}");
        let absent = missing_nccl(None);
        assert!(absent.contains("not installed") && absent.contains("nvidia-nccl-cu12"), "{absent}");
    }

    #[test]
    fn rank_0_failing_to_make_an_id_fails_its_call() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let mut control = Communicator::new(Arc::new(MemoryTransport::mesh(1, 4).remove(0)), 3, 1, config());
        let got = rt.block_on(exchange_unique_id(&mut control, || Err(ClusterError::Nccl("no bootstrap".into()))));
        assert!(matches!(got, Err(ClusterError::Nccl(reason)) if reason == "no bootstrap"));
    }
}
