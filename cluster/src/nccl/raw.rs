//! One NCCL communicator handle and the NCCL calls on it, through cudarc's `result`/`sys` layers (the
//! safe `cudarc::nccl::Comm` hides its handle, so it cannot be aborted on demand or polled for
//! asynchronous errors, and it panics if the abort in its `Drop` fails).
//!
//! Invariant: this is the only module of the NCCL backend with `unsafe`. Every call passes the live
//! handle (abort consumes the `RawComm`, so no call can follow it) and device pointers taken from
//! `CudaSlice`s through cudarc's `DevicePtr`/`DevicePtrMut`, whose guards make later users of the buffer
//! wait for the operation on `stream` (cudarc's event tracking), so a buffer freed or reused after a
//! call is freed or reused after the operation ran.

use std::mem::MaybeUninit;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys, NcclType};

/// The 128 bytes of an `ncclUniqueId`: what rank 0 creates and every rank needs to join.
pub(crate) type UniqueId = [u8; 128];

/// A live NCCL communicator (the raw handle makes it neither `Send` nor `Sync`, like cudarc's `Comm`).
pub(super) struct RawComm {
    comm: sys::ncclComm_t,
}

/// A communicator just joined on a helper thread, on its way to the thread that will use it.
pub(super) struct Joined(pub(super) RawComm);

// SAFETY: NCCL lets a communicator be used from any thread as long as no two use it at once; `Joined`
// moves the only handle (nothing else refers to it), so the joining thread no longer can.
unsafe impl Send for Joined {}

fn describe(e: result::NcclError) -> String {
    format!("{:?}", e.0)
}

/// A fresh unique id (NCCL opens rank 0's bootstrap listener for it).
pub(super) fn unique_id() -> Result<UniqueId, String> {
    let id = result::get_uniqueid().map_err(describe)?;
    Ok(id.internal.map(|c| c as u8))
}

impl RawComm {
    /// Joins the communicator of `id` as `rank` of `world`, on the device whose context is current on
    /// this thread. Blocks until every rank has joined (NCCL's bootstrap over its own sockets).
    pub(super) fn init_rank(id: UniqueId, rank: usize, world: usize) -> Result<Self, String> {
        let id = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let (rank, world) =
            (i32::try_from(rank).map_err(|e| e.to_string())?, i32::try_from(world).map_err(|e| e.to_string())?);
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is a valid place for NCCL to write the handle; the id is passed by value.
        unsafe { result::comm_init_rank(comm.as_mut_ptr(), world, id, rank) }.map_err(describe)?;
        // SAFETY: ncclCommInitRank returned success, so it wrote the handle.
        Ok(RawComm { comm: unsafe { comm.assume_init() } })
    }

    /// Enqueues an in-place all-reduce of `buf` on `stream`.
    pub(super) fn all_reduce<E: NcclType>(
        &self,
        buf: &mut CudaSlice<E>,
        op: sys::ncclRedOp_t,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let count = buf.len();
        let (ptr, _written) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` addresses `count` elements of E (NCCL allows send == receive buffer); the
        // handle is live; `_written` records the write for later users of `buf` (module docs).
        let status = unsafe {
            result::all_reduce(ptr as _, ptr as _, count, E::as_nccl_type(), op, self.comm, stream.cu_stream() as _)
        };
        status.map(drop).map_err(describe)
    }

    /// Enqueues an in-place broadcast of `root`'s `buf` on `stream`.
    pub(super) fn broadcast<E: NcclType>(
        &self,
        buf: &mut CudaSlice<E>,
        root: i32,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let count = buf.len();
        let (ptr, _written) = buf.device_ptr_mut(stream);
        // SAFETY: as in `all_reduce`.
        let status = unsafe {
            result::broadcast(ptr as _, ptr as _, count, E::as_nccl_type(), root, self.comm, stream.cu_stream() as _)
        };
        status.map(drop).map_err(describe)
    }

    /// Enqueues an all-gather: every rank's `input` (equal lengths) into `output`, rank r's at
    /// `r * input.len()`. The caller checked `output.len() == world * input.len()`.
    pub(super) fn all_gather<E: NcclType>(
        &self,
        input: &CudaSlice<E>,
        output: &mut CudaSlice<E>,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let count = input.len();
        let (src, _read) = input.device_ptr(stream);
        let (dst, _written) = output.device_ptr_mut(stream);
        // SAFETY: `src` addresses `count` elements and `dst` world × `count` (checked by the caller);
        // distinct slices, so they do not overlap; the handle is live.
        let status = unsafe {
            result::all_gather(src as _, dst as _, count, E::as_nccl_type(), self.comm, stream.cu_stream() as _)
        };
        status.map(drop).map_err(describe)
    }

    /// Enqueues a reduce-scatter: `input` (world × `output.len()` elements) reduced over the ranks,
    /// rank r keeping piece r in `output`. The caller checked the lengths.
    pub(super) fn reduce_scatter<E: NcclType>(
        &self,
        input: &CudaSlice<E>,
        output: &mut CudaSlice<E>,
        op: sys::ncclRedOp_t,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let count = output.len();
        let (src, _read) = input.device_ptr(stream);
        let (dst, _written) = output.device_ptr_mut(stream);
        // SAFETY: `dst` addresses `count` elements and `src` world × `count` (checked by the caller);
        // distinct slices; the handle is live.
        let status = unsafe {
            result::reduce_scatter(src as _, dst as _, count, E::as_nccl_type(), op, self.comm, stream.cu_stream() as _)
        };
        status.map(drop).map_err(describe)
    }

    /// Enqueues an in-place all-reduce of `count` elements of `datatype` at device address `ptr` on
    /// `stream` (memory another allocator owns: a libtorch tensor's).
    ///
    /// # Safety
    /// `ptr` must address `count` contiguous elements of `datatype` on this communicator's device, and
    /// stay allocated until the operation completed on `stream` (or was aborted).
    pub(super) unsafe fn all_reduce_ptr(
        &self,
        ptr: u64,
        count: usize,
        datatype: sys::ncclDataType_t,
        op: sys::ncclRedOp_t,
        stream: &CudaStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract covers the buffer; the handle is live.
        let status =
            unsafe { result::all_reduce(ptr as _, ptr as _, count, datatype, op, self.comm, stream.cu_stream() as _) };
        status.map(drop).map_err(describe)
    }

    /// Enqueues a reduce-scatter from device address `send` (world × `recv_count` elements of
    /// `datatype`) into `recv` (`recv_count`), rank r keeping piece r, on `stream` (memory another
    /// allocator owns).
    ///
    /// # Safety
    /// `send` and `recv` must address that many contiguous elements on this communicator's device,
    /// not overlap, and stay allocated until the operation completed on `stream` (or was aborted).
    pub(super) unsafe fn reduce_scatter_ptr(
        &self,
        (send, recv): (u64, u64),
        recv_count: usize,
        datatype: sys::ncclDataType_t,
        op: sys::ncclRedOp_t,
        stream: &CudaStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract covers both buffers; the handle is live.
        let status = unsafe {
            result::reduce_scatter(send as _, recv as _, recv_count, datatype, op, self.comm, stream.cu_stream() as _)
        };
        status.map(drop).map_err(describe)
    }

    /// Enqueues an all-gather from device address `send` (`send_count` elements of `datatype`) into
    /// `recv` (world × `send_count`), rank r's at r × `send_count`, on `stream`.
    ///
    /// # Safety
    /// As [`RawComm::reduce_scatter_ptr`]'s.
    pub(super) unsafe fn all_gather_ptr(
        &self,
        (send, recv): (u64, u64),
        send_count: usize,
        datatype: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract covers both buffers; the handle is live.
        let status = unsafe {
            result::all_gather(send as _, recv as _, send_count, datatype, self.comm, stream.cu_stream() as _)
        };
        status.map(drop).map_err(describe)
    }

    /// Enqueues, as one NCCL group, an in-place broadcast (`reduce` None) or reduction onto the root
    /// (`reduce` Some(op)) of each piece `(offset, count, root)` of the buffer at device address `ptr`
    /// (offsets and counts in elements of `datatype`, `elem_bytes` each), on `stream` (memory another
    /// allocator owns). The group is closed even when a piece fails to enqueue.
    ///
    /// # Safety
    /// `ptr` must address, for every piece, `offset + count` contiguous elements of `datatype` on this
    /// communicator's device, staying allocated until the operations completed on `stream` (or were
    /// aborted); every root must be a rank of the communicator.
    pub(super) unsafe fn rooted_ptr(
        &self,
        (ptr, elem_bytes): (u64, usize),
        pieces: &[(usize, usize, usize)],
        datatype: sys::ncclDataType_t,
        reduce: Option<sys::ncclRedOp_t>,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let roots: Vec<i32> =
            pieces.iter().map(|p| i32::try_from(p.2).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
        result::group_start().map_err(describe)?;
        let mut enqueued = Ok(());
        for (&(offset, count, _), &root) in pieces.iter().zip(&roots) {
            let at = (ptr + (offset * elem_bytes) as u64) as *mut std::ffi::c_void;
            let cu = stream.cu_stream() as _;
            // SAFETY: the caller's contract covers each piece (in place: send == receive buffer, which
            // NCCL allows for both operations); the handle is live.
            let status = unsafe {
                match reduce {
                    None => result::broadcast(at, at, count, datatype, root, self.comm, cu),
                    Some(op) => result::reduce(at, at, count, datatype, op, root, self.comm, cu),
                }
            };
            if let Err(e) = status {
                enqueued = Err(describe(e));
                break;
            }
        }
        let closed = result::group_end().map(drop).map_err(describe);
        enqueued.and(closed)
    }

    /// An error NCCL's background threads found (a lost peer, a network error), if any.
    pub(super) fn async_error(&self) -> Result<(), String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the handle is live; `state` is a valid place for NCCL to write the result.
        unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) }.result().map_err(describe)?;
        state.result().map(drop).map_err(describe)
    }

    /// `ncclCommAbort`: frees the communicator without waiting for peers and makes any of its
    /// operations still queued or running return. Consumes the handle.
    pub(super) fn abort(self) -> Result<(), String> {
        let comm = self.comm;
        std::mem::forget(self);
        // SAFETY: the handle is live and, `self` being forgotten, used by nothing after this call.
        unsafe { result::comm_abort(comm) }.map(drop).map_err(describe)
    }
}

impl Drop for RawComm {
    /// Aborts rather than destroys: destroying waits for the peers, which hangs when one is gone.
    fn drop(&mut self) {
        // SAFETY: the handle is live (an explicit abort forgets the value) and unused after this call.
        if let Err(e) = unsafe { result::comm_abort(self.comm) } {
            tracing::warn!(error = ?e.0, "ncclCommAbort failed while dropping a communicator");
        }
    }
}

/// The file NCCL is loaded from under its soname `libnccl.so.2` (what NCCL's packages and its pip wheel
/// install), when the dynamic linker finds it; None when it does not.
pub(super) fn nccl_soname_path() -> Option<String> {
    const SONAME: &std::ffi::CStr = c"libnccl.so.2";
    const SYMBOL: &std::ffi::CStr = c"ncclGetVersion";
    // SAFETY: dlopen/dlsym/dladdr with valid NUL-terminated names; the handle is closed once the path
    // is copied out, and nothing of the library is called.
    unsafe {
        let handle = libc::dlopen(SONAME.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        let symbol = libc::dlsym(handle, SYMBOL.as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        let path = if !symbol.is_null() && libc::dladdr(symbol, &mut info) != 0 && !info.dli_fname.is_null() {
            std::ffi::CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned()
        } else {
            "libnccl.so.2".to_owned()
        };
        libc::dlclose(handle);
        Some(path)
    }
}
