//! Daemon slots on CUDA devices (issue 31), end to end through daemon processes: a DDP job on a GPU slot
//! sums its gradients over NCCL (and `troupe status` shows the GPU's memory in use from NVML), two
//! daemons sharing one GPU sum theirs through host memory, ZeRO-1/2 ranks do either, a tensor group of
//! two daemons sharing the GPU keeps its shards there, periodically synchronizing replicas step there,
//! and all follow the single-process reference. They need a GPU: elsewhere each says "skipped: no CUDA device"
//! and passes (scripts/gpu-check.sh runs them on a lent device, `TROUPE_BIN` pointing at the carried
//! `troupe`). Without a GPU the device path runs in `device_plane_oracle.rs` (fake NCCL), and the
//! refusal of `devices = "cuda"` in `daemons.rs`.

mod common;

use std::time::Duration;

use troupe_actors::api::{GradientPlane, Job, JobEvent, LocalCluster, LocalClusterOptions};
use troupe_actors::node_config::devices::Devices;
use troupe_model::config::JobConfig;
use troupe_model::oracle::worst_loss_diff;
use troupe_model::Trainer;

/// A GPU's fp32 sums differ from the CPU's in order: the CUDA trainer's own check uses the same bound.
const TOLERANCE: f64 = 1e-4;

/// Whether a CUDA device is visible; if not, says why the test is skipped.
fn cuda(test: &str) -> bool {
    match troupe_cluster::nccl::cuda_devices() {
        Ok(devices) if !devices.is_empty() => true,
        Ok(_) => {
            println!("{test}: skipped: no CUDA device (the driver reports none)");
            false
        }
        Err(e) => {
            println!("{test}: skipped: no CUDA device ({e})");
            false
        }
    }
}

fn reference(config: &JobConfig) -> Vec<f64> {
    let mut trainer = Trainer::new(config.clone()).unwrap();
    (0..config.train.steps).map(|_| trainer.train_step().loss).collect()
}

/// Runs `config` on `cluster`: the started event's plane and reason, each step's loss and MFU.
async fn run(cluster: &LocalCluster, config: &JobConfig) -> ((GradientPlane, String), Vec<f64>, Vec<Option<f64>>) {
    let mut job = cluster.client().await.unwrap().submit(Job::new(config.clone())).await.unwrap();
    let (mut plane, mut losses, mut mfus) = (None, Vec::new(), Vec::new());
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), job.next_event()).await.expect("progress").unwrap();
        match event {
            Some(JobEvent::Started { plane: p, plane_reason, .. }) => plane = Some((p, plane_reason)),
            Some(JobEvent::Step { loss, mfu, .. }) => {
                losses.push(loss);
                mfus.push(mfu);
            }
            Some(JobEvent::Finished { .. }) => break,
            Some(e) if e.is_terminal() => panic!("the job ended: {e:?}"),
            Some(_) => {}
            None => panic!("the event stream ended early"),
        }
    }
    (plane.expect("a started event"), losses, mfus)
}

/// The GPU slot's figures in `troupe status` (NVML, through the member's heartbeats), once there.
async fn gpu_load(cluster: &LocalCluster) -> troupe_actors::protocol::DeviceLoad {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let members = cluster.client().await.unwrap().status().await.unwrap().members;
        let load = members[0].load.clone();
        if let Some(why) = load.as_ref().and_then(|l| l.devices_unavailable.clone()) {
            panic!("no GPU figures in troupe status: {why}");
        }
        if let Some(device) = load.and_then(|l| l.devices.into_iter().next()) {
            return device;
        }
        assert!(std::time::Instant::now() < deadline, "no GPU figures in troupe status: {members:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn cluster(nodes: usize) -> LocalCluster {
    let mut options = LocalClusterOptions::new(nodes);
    options.torch_threads = 1;
    options.devices = Some(Devices::List(vec![0]));
    LocalCluster::processes(common::binary(), options).await.expect("local cluster starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ddp_rank_on_a_gpu_slot_sums_over_nccl_and_follows_the_reference() {
    if !cuda("a_ddp_rank_on_a_gpu_slot_sums_over_nccl_and_follows_the_reference") {
        return;
    }
    let config = common::two_block_job(10);
    let cluster = cluster(1).await;
    let ((plane, why), losses, mfus) = run(&cluster, &config).await;
    let load = gpu_load(&cluster).await;
    cluster.shutdown().await;
    assert_eq!(plane, GradientPlane::Nccl, "{why}");
    println!("troupe status on the GPU slot: {load:?}");
    assert!(load.memory_total_bytes > 0 && load.memory_used_bytes > 0, "NVML's figures: {load:?}");
    let diff = worst_loss_diff(&losses, &reference(&config));
    println!("1 GPU rank over NCCL: loss diff {diff:.1e}; MFU {:?}", mfus.last());
    assert!(diff <= TOLERANCE, "losses differ by {diff:e}");
    let name = troupe_cluster::nccl::cuda_devices().unwrap()[0].name.clone();
    if troupe_actors::telemetry::peak::known_peak_tflops(&name, "fp32").is_some() {
        assert!(mfus.iter().all(Option::is_some), "{name}'s peak is known: every step has an MFU");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_sharing_a_gpu_sum_through_host_memory_and_follow_the_reference() {
    if !cuda("two_daemons_sharing_a_gpu_sum_through_host_memory_and_follow_the_reference") {
        return;
    }
    let config = common::two_block_job(10);
    let cluster = cluster(2).await;
    let ((plane, why), losses, _) = run(&cluster, &config).await;
    cluster.shutdown().await;
    assert_eq!(plane, GradientPlane::Host, "{why}");
    assert!(why.contains("share cuda:0"), "{why}");
    let diff = worst_loss_diff(&losses, &reference(&config));
    println!("2 ranks sharing one GPU over the host plane: loss diff {diff:.1e}");
    assert!(diff <= TOLERANCE, "losses differ by {diff:e}");
}

/// ZeRO on GPU slots: ZeRO-2 on one slot reduce-scatters and all-gathers over NCCL (world 1: NCCL's
/// pointer calls on libtorch's tensors), then ZeRO-1 on two daemons sharing the GPU keeps the model on
/// it and reduces through host memory; ZeRO-3 the same two ways (its units gathered by grouped NCCL
/// broadcasts and reduced by grouped NCCL reductions on one slot, through host memory on two); all
/// follow the single-process reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_ranks_on_gpu_slots_reduce_over_nccl_or_host_memory_and_follow_the_reference() {
    if !cuda("zero_ranks_on_gpu_slots_reduce_over_nccl_or_host_memory_and_follow_the_reference") {
        return;
    }
    let mut config = common::two_block_job(10);
    let reference = reference(&config);
    for (shard, nodes, expected) in [
        ("zero2", 1, GradientPlane::Nccl),
        ("zero1", 2, GradientPlane::Host),
        ("zero3", 1, GradientPlane::Nccl),
        ("zero3", 2, GradientPlane::Host),
    ] {
        config.parallel.shard = shard.into();
        let cluster = cluster(nodes).await;
        let ((plane, why), losses, _) = run(&cluster, &config).await;
        cluster.shutdown().await;
        assert_eq!(plane, expected, "{shard} on {nodes} daemon(s): {why}");
        let diff = worst_loss_diff(&losses, &reference);
        println!("{shard} on {nodes} GPU slot(s) over the {plane} plane: loss diff {diff:.1e}");
        assert!(diff <= TOLERANCE, "{shard}: losses differ by {diff:e}");
    }
}

/// Tensor parallelism on GPU slots (issues 29 and 31): a tensor group of two daemons sharing the one GPU
/// computes its shards there and runs its collectives through host memory (NCCL needs a GPU per rank:
/// on a machine with two, the same job takes the NCCL plane, whose engine path `device_plane_oracle.rs`
/// runs on fake NCCL), for a Llama model with sequence parallelism; it follows the single-process
/// reference, and NVML sees the GPU's memory in use while the daemons hold their state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_group_sharing_a_gpu_computes_its_shards_there_and_follows_the_reference() {
    if !cuda("a_tensor_group_sharing_a_gpu_computes_its_shards_there_and_follows_the_reference") {
        return;
    }
    let mut config = JobConfig::small_llama(10);
    (config.parallel.tp, config.parallel.sp) = (2, true);
    let mut single = config.clone();
    single.parallel.tp = 1;
    let cluster = cluster(2).await;
    let ((plane, why), losses, mfus) = run(&cluster, &config).await;
    let load = gpu_load(&cluster).await;
    cluster.shutdown().await;
    assert_eq!(plane, GradientPlane::Host, "{why}");
    assert!(why.contains("share cuda:0"), "the host plane because the ranks share the GPU: {why}");
    assert!(load.memory_used_bytes > 0, "NVML's figures: {load:?}");
    let diff = worst_loss_diff(&losses, &reference(&single));
    println!("tp = 2 on one shared GPU over the host plane: loss diff {diff:.1e}; MFU {:?}", mfus.last());
    assert!(diff <= TOLERANCE, "losses differ by {diff:e}");
}

/// Periodic synchronization on GPU slots (issues 31 and 37): two daemons sharing the GPU each take their
/// local steps there (DiLoCo, H = 4) and synchronize through host memory, as the plane's reason says;
/// the losses follow the single-process reference of the same algorithm (two replicas in one process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_replicas_on_a_shared_gpu_step_there_and_follow_the_reference() {
    if !cuda("periodic_replicas_on_a_shared_gpu_step_there_and_follow_the_reference") {
        return;
    }
    let mut config = common::two_block_job(12);
    (config.parallel.sync, config.parallel.sync_every) = ("diloco".into(), 4);
    let mut reference = troupe_model::periodic::ReplicaSet::new(&config, 2).unwrap();
    let expected: Vec<f64> = (0..config.train.steps).map(|_| reference.train_step()).collect();
    let cluster = cluster(2).await;
    let ((plane, why), losses, mfus) = run(&cluster, &config).await;
    cluster.shutdown().await;
    assert_eq!(plane, GradientPlane::Host, "{why}");
    assert!(why.contains("local steps run on the GPUs"), "{why}");
    let diff = worst_loss_diff(&losses, &expected);
    println!("DiLoCo (H = 4) on one shared GPU: loss diff {diff:.1e}; MFU {:?}", mfus.last());
    assert!(diff <= TOLERANCE, "losses differ by {diff:e}");
}
