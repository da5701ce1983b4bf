//! Where an attempt's gradients are summed — on the GPUs by NCCL, or staged through host memory over
//! the attempt's data plane — decided once per attempt by the controller from what each rank's slot
//! computes on (`MemberInfo::devices`), and sent with `Start` to every rank, so all ranks of the group
//! take the same path. Pure: the same inputs give the same choice on any controller.
//!
//! NCCL is chosen when the job's engine keeps its model on the slot's device (DDP, ZeRO-1/2/3 and
//! tensor parallelism: [`runs_on_device`]), every rank computes on a CUDA device, every rank's node can
//! load NCCL, and no two ranks share a GPU (NCCL refuses two ranks of one communicator on one device).
//! Otherwise the host plane, with the first reason found. A job one of whose ranks could not start
//! NCCL at all (the library or the device failed, [`nccl_unusable`]) takes the host plane for its later
//! attempts.

use std::net::IpAddr;

use troupe_model::config::JobConfig;

use crate::engine::tensor_parallel_on_device;
use crate::protocol::{GradientPlane, SlotDevice};

/// Whether the engine `config` selects keeps a rank's model and gradients on its slot's device: DDP (its
/// optimizer state there too, unless `parallel.offload = "host"`), ZeRO-1/2/3 (their shard owners keep
/// the masters, moments and the update in host memory; ZeRO-3 gathers each unit's parameters on the
/// device), tensor parallelism with AdamW and data parallelism over its groups
/// ([`tensor_parallel_on_device`]), and periodic synchronization's replicas without offload (their local
/// steps on the device; the synchronization, every `sync_every` steps, through host memory:
/// [`reduces_on_device`] is false). Pipelines (with or without tensor parallelism) and ZeRO or Adafactor
/// under tensor parallelism compute on the host for now, whatever the slot.
pub fn runs_on_device(config: &JobConfig) -> bool {
    let p = &config.parallel;
    if p.pp > 1 {
        return false;
    }
    if p.periodic_sync() {
        return p.tp <= 1 && p.shard == "none" && p.offload == "none";
    }
    if p.tp > 1 {
        return tensor_parallel_on_device(config);
    }
    matches!(p.shard.as_str(), "none" | "zero1" | "zero2" | "zero3")
}

/// Whether the engine also reduces on the device, so that NCCL can carry its collectives: every engine
/// that [`runs_on_device`] but periodic synchronization, which moves whole parameters only every
/// `sync_every` steps and does it through host memory.
pub fn reduces_on_device(config: &JobConfig) -> bool {
    runs_on_device(config) && !config.parallel.periodic_sync()
}

/// How a rank's failed attempt begins when NCCL itself could not start on its GPU: the library, the
/// driver or `ncclCommInitRank` failed (a peer lost while the unique id travels over the attempt's
/// transport, or one that never joins — `NcclJoinTimeout` — is a plain failure; an error
/// `ncclCommInitRank` itself returns reads as NCCL failing).
pub const NCCL_UNUSABLE: &str = "NCCL could not start on this rank's GPU";

/// Whether a failed attempt's `reason` says NCCL could not start ([`NCCL_UNUSABLE`]).
pub fn nccl_unusable(reason: &str) -> bool {
    reason.starts_with(NCCL_UNUSABLE)
}

/// One rank of the attempt as the controller knows it.
#[derive(Clone, Debug)]
pub struct RankDevice<'a> {
    pub node: &'a str,
    pub slot: u32,
    /// The host it runs on (its data-plane address's IP): ranks of one host may share a GPU ordinal only
    /// if they are on different hosts.
    pub host: IpAddr,
    pub device: &'a SlotDevice,
}

/// The plane of an attempt of `config` on `ranks`, and why.
pub fn choose(config: &JobConfig, ranks: &[RankDevice]) -> (GradientPlane, String) {
    let host = |why: String| (GradientPlane::Host, why);
    if let Some(r) = ranks.iter().find(|r| matches!(r.device, SlotDevice::Cpu)) {
        return host(format!("rank on {} slot {} computes on the CPU", r.node, r.slot));
    }
    if !runs_on_device(config) {
        return host(format!(
            "ranks on CUDA slots, but this engine ({}) computes on the host; DDP, ZeRO-1/2/3, tensor parallelism with AdamW and periodic sync without offload (no pp, or ZeRO under tp) run on the GPUs",
            engine_name(config)
        ));
    }
    if !reduces_on_device(config) {
        return host(format!(
            "the local steps run on the GPUs; periodic synchronization ({}) averages whole parameters every {} steps through host memory",
            engine_name(config),
            config.parallel.sync_every
        ));
    }
    for r in ranks {
        if let SlotDevice::Cuda { nccl_missing: Some(why), .. } = r.device {
            return host(format!("node {} cannot run NCCL: {why}", r.node));
        }
    }
    for (i, a) in ranks.iter().enumerate() {
        if let Some(b) = ranks[i + 1..].iter().find(|b| b.host == a.host && b.device.label() == a.device.label()) {
            return host(format!(
                "ranks on {} slot {} and {} slot {} share {} of host {}: NCCL needs a GPU per rank",
                a.node,
                a.slot,
                b.node,
                b.slot,
                a.device.label(),
                a.host
            ));
        }
    }
    if ranks.is_empty() {
        return host("no ranks".into());
    }
    (GradientPlane::Nccl, format!("every rank of the {} has a GPU of its own", plural(ranks.len())))
}

fn plural(n: usize) -> String {
    if n == 1 {
        "1 rank".into()
    } else {
        format!("{n} ranks")
    }
}

fn engine_name(config: &JobConfig) -> String {
    let p = &config.parallel;
    let mut parts = Vec::new();
    if p.tp > 1 {
        parts.push(format!("tp = {}", p.tp));
    }
    if p.pp > 1 {
        parts.push(format!("pp = {}", p.pp));
    }
    if p.shard != "none" {
        parts.push(format!("shard = {:?}", p.shard));
    }
    if p.periodic_sync() {
        parts.push(format!("sync = {:?}", p.sync));
        if p.offload != "none" {
            parts.push(format!("offload = {:?}", p.offload));
        }
    }
    if p.tp > 1 && config.train.optimizer != "adamw" {
        parts.push(format!("optimizer = {:?}", config.train.optimizer));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordinal: u32) -> SlotDevice {
        SlotDevice::Cuda { ordinal, name: "NVIDIA H100 80GB HBM3".into(), memory_bytes: 80 << 30, nccl_missing: None }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn ddp() -> JobConfig {
        JobConfig::default()
    }

    /// Node "a"'s slots 0 and 1 on `g0` and `g1`.
    fn two_gpus_of_one_host<'a>(g0: &'a SlotDevice, g1: &'a SlotDevice) -> [RankDevice<'a>; 2] {
        [
            RankDevice { node: "a", slot: 0, host: ip(1), device: g0 },
            RankDevice { node: "a", slot: 1, host: ip(1), device: g1 },
        ]
    }

    #[test]
    fn nccl_when_every_rank_has_a_gpu_of_its_own() {
        let (g0, g1) = (gpu(0), gpu(1));
        let ranks = [
            RankDevice { node: "a", slot: 0, host: ip(1), device: &g0 },
            RankDevice { node: "a", slot: 1, host: ip(1), device: &g1 },
            RankDevice { node: "b", slot: 0, host: ip(2), device: &g0 },
        ];
        let (plane, why) = choose(&ddp(), &ranks);
        assert_eq!(plane, GradientPlane::Nccl, "{why}");
        assert!(why.contains("3 ranks"), "{why}");
        assert_eq!(choose(&ddp(), &ranks[..1]).0, GradientPlane::Nccl, "one rank: a world-1 communicator");
    }

    #[test]
    fn the_host_plane_says_which_rank_or_node_forced_it() {
        let (g0, cpu) = (gpu(0), SlotDevice::Cpu);
        let mixed = [
            RankDevice { node: "a", slot: 0, host: ip(1), device: &g0 },
            RankDevice { node: "b", slot: 2, host: ip(2), device: &cpu },
        ];
        let (plane, why) = choose(&ddp(), &mixed);
        assert_eq!(plane, GradientPlane::Host);
        assert!(why.contains("b slot 2 computes on the CPU"), "{why}");

        let shared = [
            RankDevice { node: "a", slot: 0, host: ip(1), device: &g0 },
            RankDevice { node: "a2", slot: 0, host: ip(1), device: &g0 },
        ];
        let (plane, why) = choose(&ddp(), &shared);
        assert_eq!(plane, GradientPlane::Host);
        assert!(why.contains("share cuda:0 of host 10.0.0.1"), "{why}");

        let no_nccl = SlotDevice::Cuda {
            ordinal: 1,
            name: "NVIDIA H100".into(),
            memory_bytes: 1,
            nccl_missing: Some("NCCL is installed only as /x/libnccl.so.2".into()),
        };
        let missing = [
            RankDevice { node: "a", slot: 0, host: ip(1), device: &g0 },
            RankDevice { node: "c", slot: 0, host: ip(3), device: &no_nccl },
        ];
        let (plane, why) = choose(&ddp(), &missing);
        assert_eq!(plane, GradientPlane::Host);
        assert!(why.starts_with("node c cannot run NCCL") && why.contains("libnccl.so.2"), "{why}");
    }

    #[test]
    fn engines_that_compute_on_the_host_keep_the_host_plane() {
        let g0 = gpu(0);
        let ranks = [RankDevice { node: "a", slot: 0, host: ip(1), device: &g0 }];
        let mut pipeline = ddp();
        pipeline.parallel.pp = 2;
        assert!(!runs_on_device(&pipeline) && runs_on_device(&ddp()));
        let (plane, why) = choose(&pipeline, &ranks);
        assert_eq!(plane, GradientPlane::Host);
        assert!(why.contains("computes on the host"), "{why}");
        for shard in ["zero1", "zero2", "zero3"] {
            let mut zero = ddp();
            zero.parallel.shard = shard.into();
            assert_eq!(choose(&zero, &ranks).0, GradientPlane::Nccl, "{shard} reduces on the GPUs");
            zero.parallel.pp = 2;
            assert_eq!(choose(&zero, &ranks).0, GradientPlane::Host, "{shard} under a pipeline");
        }
    }

    #[test]
    fn tensor_parallelism_runs_on_the_gpus_without_a_pipeline_zero_or_adafactor() {
        let (g0, g1) = (gpu(0), gpu(1));
        let ranks = two_gpus_of_one_host(&g0, &g1);
        let mut tp = ddp();
        tp.parallel.tp = 2;
        assert!(runs_on_device(&tp) && tensor_parallel_on_device(&tp));
        let (plane, why) = choose(&tp, &ranks);
        assert_eq!(plane, GradientPlane::Nccl, "{why}");
        let host = |config: &JobConfig, says: &str| {
            assert!(!runs_on_device(config) && !tensor_parallel_on_device(config), "{says}");
            let (plane, why) = choose(config, &ranks);
            assert_eq!(plane, GradientPlane::Host, "{why}");
            assert!(why.contains("computes on the host") && why.contains(says), "{why}");
        };
        let mut piped = tp.clone();
        piped.parallel.pp = 2;
        host(&piped, "tp = 2, pp = 2");
        let mut zero = tp.clone();
        zero.parallel.shard = "zero1".into();
        host(&zero, "shard = \"zero1\"");
        let mut adafactor = tp.clone();
        adafactor.train.optimizer = "adafactor".into();
        host(&adafactor, "optimizer = \"adafactor\"");
        assert!(!tensor_parallel_on_device(&ddp()), "tp = 1 is not tensor parallelism");
    }

    #[test]
    fn periodic_sync_steps_on_the_gpus_and_synchronizes_through_host_memory() {
        let (g0, g1) = (gpu(0), gpu(1));
        let ranks = two_gpus_of_one_host(&g0, &g1);
        let mut diloco = ddp();
        (diloco.parallel.sync, diloco.parallel.sync_every) = ("diloco".into(), 8);
        assert!(runs_on_device(&diloco) && !reduces_on_device(&diloco));
        let (plane, why) = choose(&diloco, &ranks);
        assert_eq!(plane, GradientPlane::Host, "{why}");
        assert!(why.contains("local steps run on the GPUs") && why.contains("every 8 steps"), "{why}");
        let mut offloaded = diloco.clone();
        offloaded.parallel.offload = "host".into();
        assert!(!runs_on_device(&offloaded));
        let (_, why) = choose(&offloaded, &ranks);
        assert!(why.contains("computes on the host") && why.contains("offload = \"host\""), "{why}");
        assert!(reduces_on_device(&ddp()), "DDP reduces on the GPUs");
    }
}
