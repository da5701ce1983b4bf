//! A tensor-parallel rank's collectives on device planes (NCCL on GPUs of their own; `FakeNccl` in
//! CI): its tensor group's all-reduces, all-gathers and reduce-scatters, and the data-parallel sum of
//! its gradient shards, without staging through host memory.
//!
//! The model's tensor-parallel code is synchronous and runs on a blocking thread (see the engine's
//! `blocking`), while a plane — an NCCL communicator, which is neither `Send` nor `Sync` — stays on the
//! attempt's thread that built it. So the blocking thread hands each call to the attempt's thread over
//! a channel ([`PlaneClient::call`]: a flat contiguous f32 tensor on the device, and the operation) and
//! waits for the result; the attempt's thread serves the calls ([`DevicePlanes::serve`]) for as long
//! as it awaits the computation. Both threads enqueue on the device's legacy default stream (libtorch's
//! and the communicator's), so a call runs after the kernels that made its input and before those that
//! read its output.
//!
//! Each call is metered as the host collectives are (`Meter`), under its group and collective, with
//! the bytes a ring moves per rank for it (2(n−1)/n of the buffer for an all-reduce, (n−1)/n of the
//! whole for an all-gather or reduce-scatter): NCCL does not report what it sent, so this is the
//! algorithm's volume, not a count.

use std::convert::Infallible;
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use tokio::sync::{mpsc, oneshot};
use troupe_cluster::ClusterError;
use troupe_model::tensor_parallel::TpError;

use super::meter::Meter;
use crate::engine::device_plane::DevicePlane;
use crate::protocol::{CollectiveKind, GroupKind};

/// Which of the rank's two device planes a call runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Which {
    Tensor,
    Data,
}

struct Request {
    which: Which,
    op: CollectiveKind,
    /// Flat, contiguous f32 on the plane's device; an all-reduce sums it in place.
    input: Tensor,
    reply: oneshot::Sender<Result<Tensor, ClusterError>>,
}

/// The rank's device planes for one attempt: its tensor group's and, with several model replicas, its
/// data-parallel group's; served on the attempt's thread.
pub(super) struct DevicePlanes {
    tensor: Box<dyn DevicePlane>,
    data: Option<Box<dyn DevicePlane>>,
    requests: mpsc::UnboundedReceiver<Request>,
    sender: mpsc::UnboundedSender<Request>,
    meter: Meter,
    /// Where the planes' buffers live (the rank's model's device).
    device: Device,
}

impl DevicePlanes {
    /// The planes of a rank whose model is on `device`.
    pub fn new(
        tensor: Box<dyn DevicePlane>,
        data: Option<Box<dyn DevicePlane>>,
        device: Device,
        meter: &Meter,
    ) -> Self {
        let (sender, requests) = mpsc::unbounded_channel();
        Self { tensor, data, requests, sender, meter: meter.clone(), device }
    }

    /// The plane's name (`nccl` or `fake-nccl`).
    pub fn name(&self) -> &'static str {
        self.tensor.name()
    }

    /// What the blocking thread calls plane `which` through; None when the rank has no such plane.
    pub fn client(&self, which: Which) -> Option<PlaneClient> {
        let plane = match which {
            Which::Tensor => Some(&self.tensor),
            Which::Data => self.data.as_ref(),
        }?;
        Some(PlaneClient { which, world: plane.world(), device: self.device, sender: self.sender.clone() })
    }

    /// Runs the calls the blocking thread makes, one at a time in the order made, until dropped.
    pub async fn serve(&mut self) -> Infallible {
        loop {
            // `self.sender` keeps the channel open: `recv` only ever gives a request.
            let Some(request) = self.requests.recv().await else { return std::future::pending().await };
            let Request { which, op, input, reply } = request;
            let (plane, group) = match which {
                Which::Tensor => (&mut self.tensor, GroupKind::Tensor),
                Which::Data => match self.data.as_mut() {
                    Some(plane) => (plane, GroupKind::Data),
                    None => {
                        let reason = "this rank has no data-parallel device plane".to_string();
                        let _ = reply.send(Err(ClusterError::InvalidArgument { rank: 0, op: op.as_str(), reason }));
                        continue;
                    }
                },
            };
            let (started, world, bytes) = (Instant::now(), plane.world(), 4 * input.numel());
            let result = run(plane.as_mut(), op, input).await;
            if result.is_ok() {
                let moved = ring_bytes(op, bytes, world);
                self.meter.add(group, op, moved as u64, started.elapsed().as_secs_f64());
            }
            let _ = reply.send(result);
        }
    }

    /// Fails every call in flight and every later one (the attempt is over).
    pub fn abort(&mut self) {
        self.tensor.abort();
        if let Some(data) = self.data.as_mut() {
            data.abort();
        }
    }
}

/// What a ring moves per rank for `op` on a buffer of `bytes` (the input) among `world` ranks.
fn ring_bytes(op: CollectiveKind, bytes: usize, world: usize) -> usize {
    let others = world.saturating_sub(1);
    match op {
        CollectiveKind::AllReduce => 2 * bytes * others / world.max(1),
        // The whole gathered buffer is world × the input.
        CollectiveKind::AllGather => bytes * others,
        // The input is the whole buffer.
        CollectiveKind::ReduceScatter => bytes * others / world.max(1),
        _ => 0,
    }
}

async fn run(plane: &mut dyn DevicePlane, op: CollectiveKind, input: Tensor) -> Result<Tensor, ClusterError> {
    let world = plane.world();
    let (n, options) = (input.numel(), (Kind::Float, input.device()));
    match op {
        CollectiveKind::AllReduce => {
            let mut flat = input;
            plane.all_reduce_sum(&mut flat).await?;
            Ok(flat)
        }
        CollectiveKind::AllGather => {
            let mut out = Tensor::empty([(n * world) as i64], options);
            plane.all_gather_equal(&input, &mut out).await?;
            Ok(out)
        }
        CollectiveKind::ReduceScatter if n % world == 0 => {
            let mut out = Tensor::empty([(n / world) as i64], options);
            plane.reduce_scatter_equal(&input, &mut out).await?;
            Ok(out)
        }
        _ => {
            let reason = format!("{n} elements cannot be cut into {world} equal pieces");
            Err(ClusterError::InvalidArgument { rank: plane.rank(), op: op.as_str(), reason })
        }
    }
}

/// One device plane as the blocking thread calls it.
#[derive(Clone)]
pub(super) struct PlaneClient {
    which: Which,
    world: usize,
    device: Device,
    sender: mpsc::UnboundedSender<Request>,
}

impl PlaneClient {
    /// Runs `op` on `input` (made flat, contiguous f32 on the planes' device here: a host scalar, the
    /// norm's sum of squares, goes up) and waits for the result: the sum for an all-reduce, every rank's
    /// input in rank order for an all-gather, this rank's piece of the sum for a reduce-scatter (all flat,
    /// on the device).
    pub fn call(&self, op: CollectiveKind, input: &Tensor) -> Result<Tensor, ClusterError> {
        // A fresh buffer: the all-reduce sums in place, and `input` may be a value the model still reads.
        let input = input.detach().to_device(self.device).to_kind(Kind::Float).reshape([-1]).copy();
        let (reply, result) = oneshot::channel();
        let gone = || ClusterError::InvalidArgument {
            rank: 0,
            op: op.as_str(),
            reason: "the attempt stopped serving its device plane".into(),
        };
        self.sender.send(Request { which: self.which, op, input, reply }).map_err(|_| gone())?;
        result.blocking_recv().map_err(|_| gone())?
    }

    /// The sum over the group of `t`, its shape and kind kept.
    pub fn all_reduce(&self, t: &Tensor) -> Result<Tensor, TpError> {
        let summed = self.call(CollectiveKind::AllReduce, t).map_err(failed)?;
        Ok(summed.view(t.size().as_slice()).to_kind(t.kind()))
    }

    /// The group's `t` concatenated in rank order along `dim`.
    pub fn all_gather(&self, t: &Tensor, dim: i64) -> Result<Tensor, TpError> {
        let moved = t.transpose(0, dim).contiguous();
        let mut shape = moved.size();
        shape[0] *= self.world as i64;
        let out = self.call(CollectiveKind::AllGather, &moved).map_err(failed)?;
        Ok(out.view(shape.as_slice()).to_kind(t.kind()).transpose(0, dim).contiguous())
    }

    /// This rank's piece, along `dim`, of the sum over the group of `t`.
    pub fn reduce_scatter(&self, t: &Tensor, dim: i64) -> Result<Tensor, TpError> {
        let moved = t.transpose(0, dim).contiguous();
        let mut shape = moved.size();
        shape[0] /= self.world as i64;
        let out = self.call(CollectiveKind::ReduceScatter, &moved).map_err(failed)?;
        Ok(out.view(shape.as_slice()).to_kind(t.kind()).transpose(0, dim).contiguous())
    }
}

fn failed(e: ClusterError) -> TpError {
    TpError::Comm(e.to_string())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::device_plane::FakeNccl;

    /// Two ranks, each a blocking thread calling through a client while its attempt thread serves a
    /// fake-NCCL plane: the results are the group's (shapes and kinds kept, a dim other than 0 cut and
    /// joined along that dim), the caller's tensor is left as it was, and each call is metered with a
    /// ring's volume.
    #[test]
    fn a_blocking_threads_calls_run_on_the_attempts_plane() {
        let planes = FakeNccl::group(2, Duration::from_secs(10));
        let threads: Vec<_> = planes
            .into_iter()
            .enumerate()
            .map(|(rank, plane)| {
                std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                    let meter = Meter::default();
                    let mut planes = DevicePlanes::new(Box::new(plane), None, Device::Cpu, &meter);
                    assert!(planes.client(Which::Data).is_none(), "no data-parallel plane was given");
                    let client = planes.client(Which::Tensor).unwrap();
                    let work = runtime.spawn_blocking(move || {
                        let t = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]) + (rank as f64) * 10.0;
                        let before = t.copy();
                        let summed = client.all_reduce(&t).unwrap();
                        assert!(t.equal(&before), "the caller's tensor is untouched");
                        let gathered = client.all_gather(&t, 1).unwrap();
                        let piece = client.reduce_scatter(&t.to_kind(Kind::Double).repeat([1, 2]), 1).unwrap();
                        (summed, gathered, piece)
                    });
                    let (summed, gathered, piece) = runtime.block_on(async {
                        tokio::select! {
                            done = work => done.unwrap(),
                            never = planes.serve() => match never {},
                        }
                    });
                    (rank, summed, gathered, piece, meter.take())
                })
            })
            .collect();
        for thread in threads {
            let (rank, summed, gathered, piece, lines) = thread.join().unwrap();
            let t = |r: f64| Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]) + r * 10.0;
            assert!(summed.equal(&(t(0.0) + t(1.0))), "rank {rank}: {summed}");
            assert!(gathered.equal(&Tensor::cat(&[t(0.0), t(1.0)], 1)), "rank {rank}: {gathered}");
            assert_eq!(piece.kind(), Kind::Double, "the kind is kept");
            assert!(piece.to_kind(Kind::Float).equal(&(t(0.0) + t(1.0))), "rank {rank}'s piece: {piece}");
            let line = |c| lines.iter().find(|l| l.collective == c).map(|l| (l.group, l.calls, l.bytes));
            assert_eq!(line(CollectiveKind::AllReduce), Some((GroupKind::Tensor, 1, 24)), "2(n-1)/n × 24 bytes");
            assert_eq!(line(CollectiveKind::AllGather), Some((GroupKind::Tensor, 1, 24)));
            assert_eq!(line(CollectiveKind::ReduceScatter), Some((GroupKind::Tensor, 1, 24)), "(n-1)/n × 48 bytes");
        }
    }
}
