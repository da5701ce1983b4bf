//! The gradient all-reduce of a rank whose model lives on a GPU of its own: each bucket is flattened on
//! the device and summed there, never staged through host memory — by NCCL ([`NcclPlane`]) on GPUs.
//! [`FakeNccl`], an in-memory stand-in with NCCL's contract, runs the same engine path on CPU tensors
//! in CI: every rank of a group calls in the same order, a call completes when every rank has made it,
//! every rank gets the same bits (summed in rank order), an abort by any rank fails every call in flight
//! and every later one at once, and a call that waits longer than the timeout aborts the group.
//!
//! Which plane an attempt uses is the controller's choice (`crate::plan::plane`); the worker builds
//! the plane for the epoch and hands it to the engine (`DataParallelReplica::with_device_plane`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::LocalBoxFuture;
use tch::{Device, Kind, Tensor};
use troupe_cluster::collective::{Collective as _, Dtype, ReduceOp};
use troupe_cluster::nccl::NcclCommunicator;
use troupe_cluster::ClusterError;

/// A collective group's all-reduce on device tensors.
pub trait DevicePlane {
    /// `nccl` or `fake-nccl` (logs and the step's collective span).
    fn name(&self) -> &'static str;
    /// Sums `flat` (contiguous f32 on the plane's device) over the group's ranks, in place.
    fn all_reduce_sum<'a>(&'a mut self, flat: &'a mut Tensor) -> LocalBoxFuture<'a, Result<(), ClusterError>>;
    /// Fails every call in flight and every later call (the attempt is over). Idempotent.
    fn abort(&mut self);
}

/// NCCL on the rank's GPU, for one epoch (`NcclCommunicator`: its unique id exchanged over the epoch's
/// host communicator, its calls polled for NCCL's asynchronous errors and the collective timeout, and
/// aborted — `ncclCommAbort` — on an error, a timeout, or when dropped with the attempt).
pub struct NcclPlane {
    comm: NcclCommunicator,
    ordinal: usize,
}

impl NcclPlane {
    pub fn new(comm: NcclCommunicator) -> Self {
        let ordinal = comm.stream().context().ordinal();
        NcclPlane { comm, ordinal }
    }
}

impl DevicePlane for NcclPlane {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce_sum<'a>(&'a mut self, flat: &'a mut Tensor) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let (rank, ordinal) = (self.comm.rank(), self.ordinal);
            if flat.device() != Device::Cuda(ordinal) || flat.kind() != Kind::Float || !flat.is_contiguous() {
                let reason = format!(
                    "a bucket on {:?} ({:?}, contiguous: {}); NCCL sums contiguous f32 on cuda:{ordinal}",
                    flat.device(),
                    flat.kind(),
                    flat.is_contiguous()
                );
                return Err(ClusterError::InvalidArgument { rank, op: "all_reduce", reason });
            }
            let (ptr, count) = (flat.data_ptr() as u64, flat.numel());
            // SAFETY: `flat` is a contiguous f32 tensor of `count` elements on the communicator's device
            // (checked above), borrowed mutably until the call returns; libtorch computes on the same
            // legacy default stream the call is enqueued on, so the tensor's memory is neither reused
            // nor freed before the operation ran, even if this future is dropped (the communicator is
            // then aborted with the attempt).
            unsafe { self.comm.all_reduce_in_place(ptr, count, Dtype::F32, ReduceOp::Sum).await }
        })
    }

    fn abort(&mut self) {
        if let Err(e) = self.comm.abort() {
            tracing::warn!(error = %e, "aborting the NCCL communicator failed");
        }
    }
}

/// One call of a [`FakeNccl`] group: each rank's contribution, then the sum every rank copies out.
#[derive(Default)]
struct FakeCall {
    parts: BTreeMap<usize, Vec<f32>>,
    sum: Option<Arc<Result<Vec<f32>, String>>>,
    taken: usize,
}

#[derive(Default)]
struct FakeGroupState {
    /// Calls by sequence number (each rank's n-th call joins call n).
    calls: BTreeMap<u64, FakeCall>,
    aborted: Option<String>,
}

struct FakeGroup {
    world: usize,
    state: Mutex<FakeGroupState>,
    changed: tokio::sync::Notify,
}

impl FakeGroup {
    fn lock(&self) -> std::sync::MutexGuard<'_, FakeGroupState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn abort(&self, why: String) {
        self.lock().aborted.get_or_insert(why);
        self.changed.notify_waiters();
    }
}

/// One rank of an in-memory NCCL stand-in (module docs): what lets CI run the engine's "every rank has
/// its own device" path. Dropping a rank aborts its group, as a killed process's peers see NCCL fail.
pub struct FakeNccl {
    rank: usize,
    group: Arc<FakeGroup>,
    calls: u64,
    timeout: Duration,
}

impl FakeNccl {
    /// The ranks of a fresh group of `world` (one epoch's communicator), each call bounded by `timeout`.
    pub fn group(world: usize, timeout: Duration) -> Vec<FakeNccl> {
        let group = Arc::new(FakeGroup { world, state: Mutex::default(), changed: tokio::sync::Notify::new() });
        (0..world).map(|rank| FakeNccl { rank, group: group.clone(), calls: 0, timeout }).collect()
    }

    fn error(&self, reason: String) -> ClusterError {
        ClusterError::Nccl(format!("rank {} of {} (fake NCCL): all_reduce: {reason}", self.rank, self.group.world))
    }

    /// Posts this rank's part of call `seq`; sums the call when it is the last part.
    fn post(&self, seq: u64, part: Vec<f32>) {
        let mut state = self.group.lock();
        let world = self.group.world;
        let call = state.calls.entry(seq).or_default();
        call.parts.insert(self.rank, part);
        if call.parts.len() == world {
            let len = call.parts[&0].len();
            let sum = if let Some((rank, p)) = call.parts.iter().find(|(_, p)| p.len() != len) {
                Err(format!("rank {rank} gave {} elements where rank 0 gave {len}", p.len()))
            } else {
                let mut sum = vec![0f32; len];
                for part in call.parts.values() {
                    sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
                }
                Ok(sum)
            };
            call.sum = Some(Arc::new(sum));
            call.parts.clear();
            drop(state);
            self.group.changed.notify_waiters();
        }
    }

    /// Waits for call `seq`'s sum (or the group's abort, or the timeout, which aborts the group).
    async fn wait_sum(&self, seq: u64) -> Result<Arc<Result<Vec<f32>, String>>, ClusterError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let notified = self.group.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                // A call every rank made completes on every rank, even if one is gone since.
                let mut state = self.group.lock();
                let world = self.group.world;
                if let Some(call) = state.calls.get_mut(&seq) {
                    if let Some(sum) = call.sum.clone() {
                        call.taken += 1;
                        if call.taken == world {
                            state.calls.remove(&seq);
                        }
                        return Ok(sum);
                    }
                }
                if let Some(why) = &state.aborted {
                    return Err(self.error(format!("the communicator was aborted ({why})")));
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let why = format!("rank {} waited {} ms for its peers", self.rank, self.timeout.as_millis());
                self.group.abort(why.clone());
                return Err(
                    self.error(format!("not complete after {} ms; communicator aborted", self.timeout.as_millis()))
                );
            }
        }
    }
}

impl DevicePlane for FakeNccl {
    fn name(&self) -> &'static str {
        "fake-nccl"
    }

    fn all_reduce_sum<'a>(&'a mut self, flat: &'a mut Tensor) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            if let Some(why) = &self.group.lock().aborted {
                return Err(self.error(format!("the communicator was aborted ({why})")));
            }
            let seq = self.calls;
            self.calls += 1;
            let n = flat.numel();
            let mut part = vec![0f32; n];
            flat.to_kind(Kind::Float).copy_data(&mut part, n);
            self.post(seq, part);
            let sum = self.wait_sum(seq).await?;
            let sum = sum.as_ref().as_ref().map_err(|e| self.error(e.clone()))?;
            let summed = Tensor::from_slice(sum).to_device(flat.device()).view_as(flat);
            tch::no_grad(|| flat.copy_(&summed));
            Ok(())
        })
    }

    fn abort(&mut self) {
        self.group.abort(format!("rank {} aborted", self.rank));
    }
}

impl Drop for FakeNccl {
    fn drop(&mut self) {
        self.group.abort(format!("rank {} is gone", self.rank));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_ranks<F, R>(ranks: Vec<FakeNccl>, body: F) -> Vec<R>
    where
        F: Fn(usize, FakeNccl) -> LocalBoxFuture<'static, R> + Send + Sync + Clone + 'static,
        R: Send + 'static,
    {
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, plane)| {
                let body = body.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                    rt.block_on(body(rank, plane))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_same_sum_call_after_call() {
        let got = run_ranks(FakeNccl::group(3, Duration::from_secs(10)), |rank, mut plane| {
            Box::pin(async move {
                let mut sums = Vec::new();
                for call in 0..4 {
                    let mut t = Tensor::from_slice(&[rank as f32, 1.0, call as f32 * 0.5]);
                    plane.all_reduce_sum(&mut t).await.unwrap();
                    sums.push(Vec::<f32>::try_from(&t).unwrap());
                }
                sums
            })
        });
        for sums in &got {
            for (call, sum) in sums.iter().enumerate() {
                assert_eq!(sum, &vec![3.0, 3.0, 1.5 * call as f32], "call {call}");
            }
        }
    }

    #[test]
    fn a_rank_that_is_gone_fails_its_peers_at_once_not_after_the_timeout() {
        let started = std::time::Instant::now();
        let got = run_ranks(FakeNccl::group(2, Duration::from_secs(60)), |rank, mut plane| {
            Box::pin(async move {
                if rank == 1 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    drop(plane); // a killed rank: its communicator is gone
                    return Ok(());
                }
                let mut t = Tensor::from_slice(&[1f32]);
                plane.all_reduce_sum(&mut t).await
            })
        });
        let err = got[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("aborted") && err.contains("rank 1 is gone"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "failed promptly, not after the 60 s timeout");
    }

    #[test]
    fn a_silent_peer_times_the_call_out_and_aborts_the_group_for_later_calls() {
        let mut ranks = FakeNccl::group(2, Duration::from_millis(100));
        let silent = ranks.pop().unwrap();
        let mut plane = ranks.pop().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut t = Tensor::from_slice(&[1f32]);
        let err = rt.block_on(plane.all_reduce_sum(&mut t)).unwrap_err().to_string();
        assert!(err.contains("not complete after 100 ms"), "{err}");
        let mut u = Tensor::from_slice(&[1f32]);
        let err = rt.block_on(plane.all_reduce_sum(&mut u)).unwrap_err().to_string();
        assert!(err.contains("aborted"), "every later call fails: {err}");
        drop(silent);
        // The next epoch builds a fresh group: it works.
        let mut fresh = FakeNccl::group(1, Duration::from_millis(100));
        let mut v = Tensor::from_slice(&[2f32]);
        rt.block_on(fresh[0].all_reduce_sum(&mut v)).unwrap();
        assert_eq!(Vec::<f32>::try_from(&v).unwrap(), vec![2.0]);
    }
}
