//! The NCCL backend. On a machine without CUDA or NCCL: the probe says so as a typed error (never a
//! panic or a build failure) and the GPU test skips with that message. On a machine with them: a
//! one-rank NCCL communicator built from a unique id exchanged over the epoch's communicator (the
//! in-memory transport), every collective of the `Collective` trait on CUDA buffers, grouped broadcasts
//! and reductions of a buffer's pieces by device address, abort (later
//! calls fail, a second abort is harmless), and a rebuild for the next epoch that works again.

use std::sync::Arc;

use cudarc::driver::{CudaContext, DevicePtr};
use half::bf16;
use troupe_cluster::collective::{Collective, CollectiveConfig, Communicator, Dtype, ReduceOp};
use troupe_cluster::nccl::{nccl_available, NcclCommunicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::ClusterError;

#[test]
fn probe_reports_what_is_missing_or_counts_devices() {
    match nccl_available() {
        Ok(devices) => assert!(devices > 0),
        Err(e @ ClusterError::NoCuda(_)) => assert!(e.to_string().starts_with("no CUDA device: "), "{e}"),
        Err(ClusterError::Nccl(reason)) => assert!(reason.contains("NCCL"), "{reason}"),
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

fn config() -> CollectiveConfig {
    CollectiveConfig { small_message_bytes_max: 4 << 10, pipeline_slice_bytes: 16 << 10, collective_timeout_ms: 30_000 }
}

#[test]
fn one_rank_communicator_runs_every_collective_aborts_and_rebuilds() {
    if let Err(e) = nccl_available() {
        println!("one_rank_communicator_runs_every_collective_aborts_and_rebuilds: skipped, {e}");
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(async {
        let transport = Arc::new(MemoryTransport::mesh(1, 16).remove(0));
        let mut control = Communicator::new(transport, 5, 1, config());
        let mut nccl = NcclCommunicator::connect(&mut control, 0).await.expect("connect");
        assert_eq!((nccl.rank(), nccl.world(), nccl.epoch()), (0, 1, 1));
        let stream = CudaContext::new(0).unwrap().default_stream();

        // One rank: every reduction is the identity, gather and scatter copy.
        let values: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5 - 100.0).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut buf = stream.clone_htod(&values).unwrap();
            nccl.all_reduce(&mut buf, op).await.expect("all_reduce");
            assert_eq!(stream.clone_dtoh(&buf).unwrap(), values, "{op:?}");
        }
        let halves: Vec<bf16> = values.iter().map(|v| bf16::from_f32(*v)).collect();
        let mut buf = stream.clone_htod(&halves).unwrap();
        nccl.all_reduce(&mut buf, ReduceOp::Sum).await.expect("all_reduce bf16");
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), halves);
        let mut buf = stream.clone_htod(&values).unwrap();
        nccl.broadcast(&mut buf, 0).await.expect("broadcast");
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), values);
        assert!(matches!(nccl.broadcast(&mut buf, 1).await, Err(ClusterError::InvalidArgument { .. })));

        let input = stream.clone_htod(&values).unwrap();
        let mut output = stream.alloc_zeros::<f32>(values.len()).unwrap();
        nccl.all_gather(&input, &mut output).await.expect("all_gather");
        assert_eq!(stream.clone_dtoh(&output).unwrap(), values);
        let mut output = stream.alloc_zeros::<f32>(values.len()).unwrap();
        nccl.reduce_scatter(&input, &mut output, ReduceOp::Sum).await.expect("reduce_scatter");
        assert_eq!(stream.clone_dtoh(&output).unwrap(), values);
        let mut short = stream.alloc_zeros::<f32>(3).unwrap();
        let err = nccl.all_gather(&input, &mut short).await.unwrap_err();
        assert!(err.to_string().contains("equal pieces"), "{err}");
        nccl.barrier().await.expect("barrier");

        // Grouped broadcasts and reductions of pieces of one buffer (ZeRO-3's gathers and reductions on
        // libtorch's memory), by device address: one rank, so each is the identity; a piece outside the
        // buffer or a root outside the world is refused before anything is enqueued.
        let whole = stream.clone_htod(&values).unwrap();
        let (ptr, len) = (whole.device_ptr(&stream).0, values.len());
        let pieces = [(0, 400, 0), (400, 601, 0)];
        for reduce in [None, Some(ReduceOp::Sum)] {
            // SAFETY: `whole` holds `len` f32 on device 0 and outlives the call.
            unsafe { nccl.rooted_in_place((ptr, len), &pieces, Dtype::F32, reduce) }.await.expect("rooted");
            assert_eq!(stream.clone_dtoh(&whole).unwrap(), values, "{reduce:?}");
        }
        for bad in [[(900, 200, 0)], [(0, 10, 1)]] {
            // SAFETY: as above; refused before NCCL is called.
            let err = unsafe { nccl.rooted_in_place((ptr, len), &bad, Dtype::F32, None) }.await.unwrap_err();
            assert!(matches!(err, ClusterError::InvalidArgument { .. }), "{err}");
        }

        nccl.abort().expect("abort");
        assert!(nccl.is_aborted());
        nccl.abort().expect("a second abort does nothing");
        let err = nccl.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap_err();
        assert!(err.to_string().contains("aborted"), "{err}");

        // The same epoch cannot be rebuilt; the next one can, from a fresh unique id.
        let err = nccl.rebuild(&mut control).await.unwrap_err();
        assert!(matches!(err, ClusterError::InvalidArgument { .. }), "{err}");
        control.set_epoch(2);
        nccl.rebuild(&mut control).await.expect("rebuild");
        assert_eq!((nccl.epoch(), nccl.is_aborted()), (2, false));
        let mut buf = stream.clone_htod(&values).unwrap();
        nccl.all_reduce(&mut buf, ReduceOp::Max).await.expect("all_reduce after rebuild");
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), values);
    });
}
