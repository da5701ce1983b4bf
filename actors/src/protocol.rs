//! What daemons and clients say to each other: one serde enum, JSON in the body of a control-plane
//! message whose frame header carries the sender's membership epoch (`troupe_cluster::control`).
//!
//! Directions, one type each: node → controller ([`ToController`]), controller → node ([`ToNode`]),
//! client → any daemon ([`Request`]) and back ([`Reply`]); [`Wire`] is whichever of them a body holds.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use troupe_cluster::membership::{Epoch, NodeId, View};
use troupe_cluster::transport::quic::PeerInfo;
use troupe_cluster::transport::tcp::TcpPayloads;
use troupe_model::config::JobConfig;

/// One span of a rank's step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PhaseSpan {
    /// What ran, e.g. "forward+backward", "all-reduce".
    pub name: String,
    /// The timeline category: compute, comm, idle, optimizer, checkpoint, recovery (and, from pipeline
    /// schedules, forward, backward, weight).
    pub cat: String,
    pub start_us: u64,
    pub dur_us: u64,
    /// A pipeline op's model chunk and micro-batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatch: Option<usize>,
}

/// What a rank reports of a reduced step when it votes (every rank reduced the same loss and norm).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepFigures {
    /// The global batch's mean loss.
    #[serde(with = "non_finite_as_null")]
    pub loss: f64,
    /// The global gradient norm before clipping, unscaled; not finite when fp16 overflowed.
    #[serde(with = "non_finite_as_null")]
    pub grad_norm: f64,
    /// fp16 overflowed: the step will be committed without an update.
    #[serde(default)]
    pub skipped: bool,
    /// The loss scale the backward ran at.
    #[serde(default = "unit_scale")]
    pub loss_scale: f64,
    /// Peak resident memory of the rank's process so far (VmHWM), in bytes.
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// A pipeline rank's schedule of the step: how long it ran and how much of it computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_time: Option<StageTime>,
    /// What the rank held and sent in the step (engines that count it: DDP, ZeRO, periodic
    /// synchronization and tensor parallelism; not yet a pipeline stage's device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<RankUsage>,
    /// The peak FLOP/s of the rank's device in the job's compute precision, when known
    /// (`telemetry::peak`): the denominator of the step's MFU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_flops: Option<f64>,
}

impl StepFigures {
    /// An fp32 step's figures (no loss scale, not skipped, no memory figure).
    pub fn new(loss: f64, grad_norm: f64) -> Self {
        Self {
            loss,
            grad_norm,
            skipped: false,
            loss_scale: 1.0,
            peak_rss_bytes: 0,
            stage_time: None,
            usage: None,
            peak_flops: None,
        }
    }
}

/// Which group a collective runs in (the planner's `plan::traffic` and the engines' measured traffic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    Tensor,
    Pipeline,
    Data,
}

/// What a collective does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    /// Point-to-point: a stage sending activations forward or gradients backward; a ZeRO owner's
    /// gradient shard to its buddies.
    Send,
    /// From one rank to all (a tree): ZeRO-3's owners handing out a unit's parameters.
    Broadcast,
    /// From all ranks to one (a tree): ZeRO-3's gradients summed onto their owner.
    Reduce,
}

impl GroupKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupKind::Tensor => "tensor",
            GroupKind::Pipeline => "pipeline",
            GroupKind::Data => "data",
        }
    }
}

impl CollectiveKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Send => "send",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Reduce => "reduce",
        }
    }
}

/// What one rank held and sent in one step, measured by its engine ([`JobEvent::Usage`]). Bytes are of
/// the tensors themselves (fp32 state; activations in the step's precision), not of the process.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankUsage {
    /// Its parameters during the step: its shards of its stage's parameters (under ZeRO-3 gathered for
    /// the step and dropped after it).
    pub param_bytes: u64,
    /// Its gradients after the backward (and under ZeRO its reduced range of them).
    pub grad_bytes: u64,
    /// Its optimizer state: AdamW's moments (under ZeRO its range of them and of the fp32 masters), or
    /// Adafactor's (its shard's first moment and vectors' second moment, the replicated statistics).
    pub optimizer_bytes: u64,
    /// Its buddy copy of a neighbour's shard: parameters, moments and gradients.
    pub buddy_bytes: u64,
    /// The most activation bytes it held for backwards at once (a pipeline's micro-batches in flight
    /// together), where the engine keeps them itself (tensor parallelism's tape). None where autograd
    /// holds them out of sight (DDP, ZeRO): the step's peak RSS is the process's figure there.
    pub activation_bytes: Option<u64>,
    /// How long the step's forward, backward and reductions took on the rank.
    pub step_seconds: f64,
    /// What it sent in the step, by group and collective.
    pub sent: Vec<SentBytes>,
}

impl RankUsage {
    /// Everything it holds: parameters, gradients, optimizer state, buddy copy and peak activations
    /// (where measured).
    pub fn memory_bytes(&self) -> u64 {
        let activations = self.activation_bytes.unwrap_or(0);
        self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buddy_bytes + activations
    }

    /// Bytes sent in the step, over every group.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.iter().map(|s| s.bytes).sum()
    }

    /// Seconds spent in collectives and sends (a receive's wait included) in the step.
    pub fn comm_seconds(&self) -> f64 {
        self.sent.iter().map(|s| s.seconds).sum()
    }

    /// Bytes sent in `group` by `collective` in the step.
    pub fn sent_by(&self, group: GroupKind, collective: CollectiveKind) -> u64 {
        self.sent.iter().filter(|s| s.group == group && s.collective == collective).map(|s| s.bytes).sum()
    }
}

/// One group's collective of one kind, over a step as one rank saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SentBytes {
    /// The tensor group; the pipeline (activations, gradients, a tied embedding's gradient, the
    /// replica's norm and loss); the data-parallel group.
    pub group: GroupKind,
    pub collective: CollectiveKind,
    pub calls: u64,
    /// Payload bytes this rank handed its transport (a receive sends none).
    pub bytes: u64,
    /// Seconds in those calls.
    pub seconds: f64,
}

/// Where a pipeline rank's time went in one step's schedule, measured from the step's start on the
/// rank (durations only: no clock is compared across hosts).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    /// From the step's start to the end of the rank's last op (F, B, W, send or receive); the flush
    /// after it is left out.
    pub span_s: f64,
    /// Of which computing: the F, B and W ops.
    pub busy_s: f64,
}

impl StageTime {
    /// The step's bubble over the ranks that report one: idle device time over device time, in the
    /// window of the slowest rank (ranks start a step together, when its commit reaches them, so the
    /// window is the step's schedule on every rank). None when a rank did not report (not a pipeline).
    pub fn bubble(times: &[Option<StageTime>]) -> Option<f64> {
        let times: Vec<StageTime> = times.iter().copied().collect::<Option<_>>()?;
        let window = times.iter().map(|t| t.span_s).fold(0.0, f64::max);
        if times.is_empty() || window <= 0.0 {
            return None;
        }
        let idle: f64 = times.iter().map(|t| (window - t.busy_s.min(window)).max(0.0)).sum();
        Some(idle / (window * times.len() as f64))
    }
}

/// What an evaluation of the validation loss measured (`troupe_model::generate::Evaluation`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalFigures {
    /// Mean next-token loss over the windows.
    #[serde(with = "non_finite_as_null")]
    pub loss: f64,
    pub windows: usize,
    /// Predicted tokens the mean is over.
    pub tokens: usize,
}

fn unit_scale() -> f64 {
    1.0
}

/// JSON has no NaN or infinity: a non-finite f64 (a diverged loss, an fp16 overflow's norm) travels as
/// `null` and comes back as NaN, instead of failing the whole message.
mod non_finite_as_null {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, s: S) -> Result<S::Ok, S::Error> {
        value.is_finite().then_some(*value).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// Events kept per job. A step event is ~150 bytes: 16k of them is ~2.5 MB per job. A watcher gone for
/// longer than that many events gets the oldest kept and a warning in the controller's log.
pub const EVENTS_KEPT: usize = 16_384;

pub type JobId = u64;

/// A job as submitted: the training config plus how it runs on the cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub config: JobConfig,
    /// A human name shown by `troupe status`.
    pub name: String,
    /// Rank 0 writes the final parameters here (a path on its machine).
    pub save_final: Option<PathBuf>,
    /// How ranks exchange gradients.
    #[serde(default)]
    pub data_plane: DataPlane,
    /// Every rank reports where the time of each step went (`JobEvent::Phases`): for `--run-dir`.
    #[serde(default)]
    pub trace: bool,
    /// Mixed into the OpenTelemetry ids of the job's steps, so every node's spans of one step share a
    /// trace and two runs' traces never collide (`telemetry::otel::step_ids`); drawn by the controller
    /// at submission when 0.
    #[serde(default)]
    pub trace_seed: u64,
}

/// The transport of an attempt's collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataPlane {
    /// The same-host transport (collectives in shared memory, messages over Unix sockets) when every
    /// rank is on one host; otherwise as `EncryptedTcp`: tensors between hosts over TCP with mutual TLS
    /// 1.3, which all-reduced 1.1–3× faster than QUIC between network namespaces (docs/benchmarks.md,
    /// "All-reduce between two hosts"). QUIC stays the control plane.
    #[default]
    Auto,
    /// Always the mutually-authenticated QUIC mesh (also the fallback where TCP between hosts is closed).
    Quic,
    /// For trusted fabrics: as `Auto`, but tensors between hosts go over plaintext TCP — set up and
    /// watched through the QUIC mesh, which authenticates every connection, but neither encrypted nor
    /// integrity-protected on the wire (as Gloo's and NCCL's are not). Opt-in only.
    PlaintextTcp,
    /// As `Auto`, but tensors between hosts go over TCP with mutual TLS 1.3 (the cluster's certificates,
    /// as on QUIC; connections arranged through the QUIC mesh): QUIC's protection, without its
    /// per-packet work in user space.
    EncryptedTcp,
}

impl DataPlane {
    /// Over TCP between hosts, how its payloads travel; `None` for QUIC.
    pub fn tcp_payloads(self) -> Option<TcpPayloads> {
        match self {
            DataPlane::PlaintextTcp => Some(TcpPayloads::Plaintext),
            DataPlane::Auto | DataPlane::EncryptedTcp => Some(TcpPayloads::Encrypted),
            DataPlane::Quic => None,
        }
    }
}

/// What a member's machine is using, sampled by its daemon at most once a second and carried by its
/// heartbeats (`MemberInfo::load`, `troupe status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLoad {
    /// The daemon process's resident memory: its CPU slots' models and state, its host buffers.
    pub rss_bytes: u64,
    /// The share of the machine's cores the daemon's process kept busy since the previous sample, in
    /// percent (none at the first sample).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_percent: Option<u32>,
    /// Each CUDA slot's device, in slot order (empty on a node of CPU slots).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceLoad>,
    /// Why the CUDA slots' figures are missing (NVML could not be loaded or asked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices_unavailable: Option<String>,
}

/// One GPU's figures, from NVML: memory in use by every process on it, and how busy it was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLoad {
    /// The CUDA ordinal.
    pub ordinal: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// The share of NVML's last sample period in which a kernel ran, in percent.
    pub busy_percent: u32,
}

/// What one slot of a node computes on (node.toml `devices`), as its `Join` announced it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SlotDevice {
    Cpu,
    Cuda {
        ordinal: u32,
        /// The driver's name for it (e.g. "NVIDIA H200").
        name: String,
        memory_bytes: u64,
        /// Why this node cannot run NCCL (None: it can).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nccl_missing: Option<String>,
    },
}

impl SlotDevice {
    /// `cpu` or `cuda:N`.
    pub fn label(&self) -> String {
        match self {
            SlotDevice::Cpu => "cpu".to_owned(),
            SlotDevice::Cuda { ordinal, .. } => format!("cuda:{ordinal}"),
        }
    }

    /// The libtorch device a rank on this slot computes on.
    pub fn torch(&self) -> tch::Device {
        match self {
            SlotDevice::Cpu => tch::Device::Cpu,
            SlotDevice::Cuda { ordinal, .. } => tch::Device::Cuda(*ordinal as usize),
        }
    }
}

/// The slot `slot` of a member that announced `devices` (empty: every slot is a CPU slot, as before
/// devices were announced).
pub fn slot_device(devices: &[SlotDevice], slot: u32) -> &SlotDevice {
    devices.get(slot as usize).unwrap_or(&SlotDevice::Cpu)
}

/// Where a collective group's gradients are summed, decided once per attempt by the controller
/// (`crate::plan::plane`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradientPlane {
    /// Staged through host memory over the attempt's data plane (arena, QUIC, TCP).
    #[default]
    Host,
    /// On the GPUs, by NCCL: every rank of the group has a GPU of its own.
    Nccl,
}

impl std::fmt::Display for GradientPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GradientPlane::Host => "host",
            GradientPlane::Nccl => "nccl",
        })
    }
}

/// The command line's spelling, as `troupe status` shows it.
impl std::fmt::Display for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataPlane::Auto => "auto",
            DataPlane::Quic => "quic",
            DataPlane::PlaintextTcp => "plaintext-tcp",
            DataPlane::EncryptedTcp => "encrypted-tcp",
        })
    }
}

impl std::str::FromStr for DataPlane {
    type Err = String;

    /// The command line's spelling (`--data-plane auto|quic|encrypted-tcp|plaintext-tcp`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DataPlane::Auto),
            "quic" => Ok(DataPlane::Quic),
            "encrypted-tcp" => Ok(DataPlane::EncryptedTcp),
            "plaintext-tcp" => Ok(DataPlane::PlaintextTcp),
            other => Err(format!("unknown data plane {other:?}: use auto, quic, encrypted-tcp or plaintext-tcp")),
        }
    }
}

/// One rank of an attempt: a slot of a node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RankSlot {
    pub node: NodeId,
    pub slot: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for enough ranks.
    Waiting,
    Running,
    Finished,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Finished | JobState::Failed | JobState::Cancelled)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobInfo {
    pub id: JobId,
    pub name: String,
    pub state: JobState,
    /// Committed steps.
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub world: usize,
    pub attempts: u64,
    pub last_loss: Option<f64>,
    pub reason: Option<String>,
    /// Events the job has streamed so far (set by the controller's node): a watcher that reconnects asks
    /// for those after the ones it saw.
    #[serde(default)]
    pub events: u64,
    /// Every slot the job uses or could use while it is not over: its attempt's ranks, then the spare
    /// slots of the view (none once it ended; absent from older controllers).
    #[serde(default)]
    pub ranks: Vec<RankInfo>,
    /// How the job's tensors travel between hosts (`auto` from older controllers).
    #[serde(default)]
    pub data_plane: DataPlane,
    /// Where the running (or last) attempt summed its gradients, and why.
    #[serde(default)]
    pub plane: GradientPlane,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub plane_reason: String,
}

/// A slot of a job as the controller sees it (`troupe status`, `/status`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankInfo {
    pub node: String,
    pub slot: u32,
    /// Its rank in the job's attempt; None for a spare or a slot waiting for the job to start.
    pub rank: Option<usize>,
    /// The pipeline stage it runs (pipeline jobs only).
    pub stage: Option<usize>,
    /// Its index in its tensor group (tensor-parallel jobs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<usize>,
    /// Which data-parallel replica it is: of the model (data-parallel jobs), of the pipeline, or of the
    /// tensor group (× pipeline).
    pub replica: Option<usize>,
    pub state: RankState,
    /// The last committed step it holds, as far as the controller knows (it said so when it last got
    /// ready, raised by every commit since while it is a rank); None: it never held the job's state.
    pub step: Option<u64>,
    /// What it holds (parameters, gradients, optimizer state, buddy copy, peak activations), in bytes,
    /// and what it sends per step, as its attempt's [`JobEvent::Usage`] said (engines that count it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_bytes_per_step: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankState {
    /// A rank of the job's first attempt, getting ready (data plane, state).
    Starting,
    /// A rank of a later attempt, from its preparation until the attempt's first commit (state copied or
    /// resharded, the data plane connected again).
    Recovering,
    /// A rank of an attempt that runs steps.
    Training,
    /// A slot of the view that the job does not use now (a cap, or a pipeline's whole stages); it keeps
    /// any state it held.
    Spare,
    /// A slot of the view while the job waits for enough nodes (`elastic.min_nodes`).
    Waiting,
}

impl RankState {
    pub fn name(self) -> &'static str {
        match self {
            RankState::Starting => "starting",
            RankState::Recovering => "recovering",
            RankState::Training => "training",
            RankState::Spare => "spare",
            RankState::Waiting => "waiting",
        }
    }
}

/// The typed events a job streams (`troupe train --json` prints them, the job API yields them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum JobEvent {
    /// An attempt started on `world` ranks at `epoch`, continuing after `from_step` committed steps.
    Started {
        world: usize,
        epoch: u64,
        from_step: u64,
        attempt: u64,
        /// How the job's tensors travel between hosts, as it was submitted (`auto` from older
        /// controllers).
        #[serde(default)]
        data_plane: DataPlane,
        /// Where the gradients are summed in this attempt, and why (`crate::plan::plane`).
        #[serde(default)]
        plane: GradientPlane,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        plane_reason: String,
    },
    /// Fewer than `min_nodes` members offer the job ranks: it holds its last committed step and waits
    /// for members, at most `wait_s` seconds (0: forever) before it fails.
    Waiting {
        nodes: usize,
        min_nodes: usize,
        wait_s: u64,
    },
    /// A step committed on every rank.
    Step {
        step: u64,
        #[serde(with = "non_finite_as_null")]
        loss: f64,
        lr: f64,
        /// Before clipping; NaN (null in JSON) or infinite when the step overflowed.
        #[serde(with = "non_finite_as_null")]
        grad_norm: f64,
        /// fp16: the gradients overflowed, so the step applied no update (its batch is consumed).
        #[serde(default)]
        skipped: bool,
        /// The loss scale the step's backward ran at (1 unless fp16).
        #[serde(default = "unit_scale")]
        loss_scale: f64,
        tokens_per_s: f64,
        epoch: u64,
        world: usize,
        /// Peak resident memory of each rank's process (VmHWM) when it voted for this step, in bytes,
        /// by rank.
        #[serde(default)]
        peak_rss_bytes: Vec<u64>,
        /// Pipeline jobs: the step's bubble, idle over all device time in its schedule
        /// ([`StageTime::bubble`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bubble: Option<f64>,
        /// Model FLOPs utilisation: the step's model FLOP/s (3 × the forward's per token) over the sum
        /// of its ranks' device peaks; absent unless every rank's peak is known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mfu: Option<f64>,
    },
    /// The cluster's membership changed under the job; the running attempt (if any) was aborted.
    Membership {
        epoch: u64,
        world: usize,
        changes: Vec<String>,
    },
    /// Where the ranks of an attempt of a tensor- or pipeline-parallel job run (after its `Started` or
    /// `Recovered`): its degrees and, by rank, the node and slot. Rank r is tensor rank r mod tp of
    /// replica (r div tp) mod dp of stage r div (tp × dp), so a tensor group is `tp` consecutive ranks.
    Placed {
        attempt: u64,
        tp: usize,
        pp: usize,
        dp: usize,
        ranks: Vec<RankSlot>,
    },
    /// What each rank of a tensor-parallel attempt held and sent in one of its steps (its second, the
    /// first that runs as every later one does; its first when that ends the job), by rank. Once per
    /// attempt.
    Usage {
        attempt: u64,
        step: u64,
        ranks: Vec<RankUsage>,
    },
    /// Training resumed after a membership change, from the last committed step.
    Recovered {
        step: u64,
        epoch: u64,
        world: usize,
    },
    /// The validation loss (`train.eval_every`) of the model after `step` committed steps — the model
    /// whose loss the step event `step + 1` reports — over `windows` held-out windows of `tokens`
    /// predicted tokens, computed data-parallel by the ranks of the attempt.
    Eval {
        step: u64,
        #[serde(with = "non_finite_as_null")]
        loss: f64,
        #[serde(with = "non_finite_as_null")]
        perplexity: f64,
        windows: usize,
        tokens: usize,
    },
    /// Rank 0 committed a durable checkpoint of step `step` (all state: parameters, optimizer, counters).
    Checkpoint {
        step: u64,
        path: PathBuf,
        seconds: f64,
        /// Bytes of the shard files written (0 when the step's directory already held it, and from
        /// older controllers).
        #[serde(default)]
        bytes: u64,
    },
    /// Every rank that held the last committed state is gone: the job continues from the latest durable
    /// checkpoint, redoing the steps after it (same samples, same trajectory).
    RolledBack {
        from_step: u64,
        to_step: u64,
    },
    /// Rank 0 saved the final parameters.
    Saved {
        path: PathBuf,
    },
    Finished {
        steps: u64,
        final_loss: Option<f64>,
    },
    Failed {
        reason: String,
    },
    Cancelled,
    /// Where rank `rank`'s time went up to and including `step` (only for jobs with `trace`).
    Phases {
        rank: usize,
        node: String,
        attempt: u64,
        step: u64,
        spans: Vec<PhaseSpan>,
        /// The pipeline stage the rank ran (pipeline jobs only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stage: Option<usize>,
    },
}

/// The rank order of every layout (the planner's `plan::placement`, the tensor-parallel engine,
/// [`JobEvent::Placed`]): rank = t + tp·(d + dp·p) for tensor index t, data-parallel replica d and
/// pipeline stage p. Gives (t, d, p) of `rank`; the inverse of [`rank_at`].
pub fn rank_coords(rank: usize, tp: usize, dp: usize) -> (usize, usize, usize) {
    (rank % tp, rank / tp % dp, rank / (tp * dp))
}

/// The rank at tensor index t, replica d, stage p ([`rank_coords`]' order).
pub fn rank_at((t, d, p): (usize, usize, usize), tp: usize, dp: usize) -> usize {
    t + tp * (d + dp * p)
}

/// A [`JobEvent::Usage`] in words: the ranks' memory and traffic per step (the range over ranks), rank
/// 0's memory by kind, and the communication's share of the step.
pub fn describe_usage(step: u64, ranks: &[RankUsage]) -> String {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let range = |values: Vec<u64>| {
        let (lo, hi) = (values.iter().copied().min().unwrap_or(0), values.iter().copied().max().unwrap_or(0));
        match lo == hi {
            true => format!("{:.1} MiB", mib(lo)),
            false => format!("{:.1}-{:.1} MiB", mib(lo), mib(hi)),
        }
    };
    let memory = range(ranks.iter().map(RankUsage::memory_bytes).collect());
    let sent = range(ranks.iter().map(RankUsage::sent_bytes).collect());
    let (comm, total) = ranks.iter().fold((0.0, 0.0), |(c, t), u| (c + u.comm_seconds(), t + u.step_seconds));
    let share =
        if total > 0.0 { format!(", communication {:.0}% of the step", 100.0 * comm / total) } else { String::new() };
    let first = ranks.first().map_or(String::new(), |u| {
        let activations = u.activation_bytes.map_or(String::new(), |a| format!(", activations {:.1}", mib(a)));
        format!(
            " (rank 0: parameters {:.1}, gradients {:.1}, optimizer {:.1}, buddy copy {:.1}{activations} MiB)",
            mib(u.param_bytes),
            mib(u.grad_bytes),
            mib(u.optimizer_bytes),
            mib(u.buddy_bytes),
        )
    });
    format!("step {step}: each rank holds {memory}{first} and sends {sent} per step{share}")
}

/// A [`JobEvent::Placed`] in words: the degrees, then each tensor group as its ranks and where they run
/// — `[0 1]@node-0:0-1` when the group is on one node, each rank's node otherwise.
pub fn describe_placement(tp: usize, pp: usize, dp: usize, ranks: &[RankSlot]) -> String {
    let groups: Vec<String> = ranks
        .chunks(tp.max(1))
        .enumerate()
        .map(|(g, group)| {
            let first = g * tp.max(1);
            let ids: Vec<String> = (first..first + group.len()).map(|r| r.to_string()).collect();
            let node = &group[0].node;
            if group.iter().all(|r| &r.node == node) {
                let (lo, hi) = (group[0].slot, group[group.len() - 1].slot);
                let slots = if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") };
                format!("[{}]@{}:{slots}", ids.join(" "), node.0)
            } else {
                let at: Vec<String> =
                    group.iter().zip(&ids).map(|(r, id)| format!("{id}@{}:{}", r.node.0, r.slot)).collect();
                format!("[{}]", at.join(" "))
            }
        })
        .collect();
    format!("placed tp {tp} × pp {pp} × dp {dp}; tensor groups (stage-major): {}", groups.join(" "))
}

impl JobEvent {
    pub fn is_terminal(&self) -> bool {
        matches!(self, JobEvent::Finished { .. } | JobEvent::Failed { .. } | JobEvent::Cancelled)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub name: String,
    pub addr: SocketAddr,
    pub slots: u32,
    /// The URL of the member's dashboard (`[telemetry] metrics_listen` in its node.toml), as its `Join`
    /// announced it. Absent when it serves none (and from daemons that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dashboard: Option<String>,
    /// Where the member's Raft endpoint listens if it may be made a controller at run time (its
    /// node.toml `raft_listen`), as its `Join` announced it: `troupe cluster controllers add NODE` uses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raft_listen: Option<SocketAddr>,
    /// What each slot computes on, by slot, as the member's `Join` announced it (empty: CPU slots).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<SlotDevice>,
    /// What the member's machine is using, as its last heartbeat said (none before its first, and from
    /// daemons that predate it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<NodeLoad>,
}

/// `troupe status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The daemon that answered.
    pub node: String,
    /// Whether it is the controller. (`leader` in the JSON of `troupe status --json` and `/status`, as
    /// before: the field names are a contract; the code says controller.)
    #[serde(rename = "leader")]
    pub controller: bool,
    /// The controller's control-plane address.
    #[serde(rename = "leader_addr")]
    pub controller_addr: Option<SocketAddr>,
    pub epoch: u64,
    pub members: Vec<MemberInfo>,
    /// Nodes waiting for a step boundary to be admitted.
    pub joining: Vec<String>,
    pub jobs: Vec<JobInfo>,
    /// Messages refused because they carried a stale epoch (fencing).
    pub refused_stale: u64,
    /// Membership changes so far, newest last (bounded).
    pub changes: Vec<String>,
}

/// `troupe cluster controllers`: the controller-eligible daemons as the one that answered sees them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControllersStatus {
    /// The daemon that answered.
    pub node: String,
    /// Whether the controller is replicated (a Raft group); false: one controller, no Raft.
    pub replicated: bool,
    /// Raft's term (0 with one controller): every election raises it.
    pub term: u64,
    /// The controller (the Raft leader), if one is known.
    pub leader: Option<String>,
    /// The index of the last entry of the answering daemon's Raft log.
    pub last_log_index: Option<u64>,
    /// The voting controllers, by name.
    pub controllers: Vec<ControllerInfo>,
    /// Controllers being added: learners catching up with the log before they vote.
    #[serde(default)]
    pub learners: Vec<ControllerInfo>,
}

/// `troupe cluster controllers add|remove`: a change of the Raft group's voters, made by the controller
/// (openraft's joint consensus) and committed in the Raft log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControllersChange {
    /// Make the member `node`, whose Raft endpoint listens at `raft_addr` (its node.toml `raft_listen`),
    /// a voting controller: it catches up as a learner first. Without `raft_addr`, the address the
    /// member's `Join` announced ([`MemberInfo::raft_listen`]).
    Add {
        node: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raft_addr: Option<SocketAddr>,
    },
    /// Remove the controller `node` from the voters (the leader itself included: another takes over).
    Remove { node: String },
}

/// One controller of [`ControllersStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControllerInfo {
    pub name: String,
    /// Where its Raft endpoint listens (none with one controller).
    pub raft_addr: Option<String>,
    /// The index of the last entry the leader knows this controller holds (answered by the leader).
    pub matched: Option<u64>,
}

/// Outcome of one rank's part in an attempt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum AttemptOutcome {
    /// Ran every step of the job; `saved` if this rank wrote the final parameters.
    Completed { step: u64, saved: Option<PathBuf> },
    /// Stopped by an abort from the controller (normal during recovery).
    Aborted { step: u64 },
    /// Failed on its own (a lost peer, a panic, a bad config on this machine).
    Failed { step: u64, reason: String },
    /// The ranks together no longer hold the state of step `step` whole (a rank and every buddy copy of
    /// its shard were lost): no rank may offer a state of `step` or later again.
    StateLost { step: u64, reason: String },
}

/// What crosses the control plane, by direction. On the wire each is the JSON of its inner message
/// (`{"type": "join", …}`): the four directions share one namespace of message types, so a body names
/// its direction by its type alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Wire {
    ToController(ToController),
    ToNode(ToNode),
    Request(Request),
    Reply(Reply),
}

/// A node's message for the controller: membership and its ranks' part in attempts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToController {
    /// Ask to become a member (first start, restart, or after a fence). A node asks again every heartbeat
    /// interval until a view admits it.
    Join {
        slots: u32,
        addr: SocketAddr,
        /// This membership of the node (`MemberState::incarnation`): a join from a member carrying the
        /// incarnation it was admitted with is a duplicate, any other a restart. Absent from a node that
        /// does not send it: every join of a member is then a restart, as before.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        incarnation: Option<u64>,
        /// The URL of the node's dashboard, if it serves one (`MemberInfo::dashboard`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dashboard: Option<String>,
        /// The controller-eligible nodes the joiner's node.toml `controllers` lists, by name: a controller
        /// that lists others refuses the join (`ToNode::Refused`). Absent from older nodes: not compared.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        controllers: Option<Vec<String>>,
        /// The node's node.toml `raft_listen`, if it may be made a controller at run time
        /// (`MemberInfo::raft_listen`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raft_listen: Option<SocketAddr>,
        /// What each slot computes on (`MemberInfo::devices`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        devices: Vec<SlotDevice>,
    },
    /// The node is alive, with what its machine is using (older daemons send none).
    Heartbeat {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        load: Option<NodeLoad>,
    },
    /// Clean departure (SIGTERM drain).
    Leave,
    /// A worker is ready for `attempt`: its data-plane address and the step its state has committed
    /// (None: no state for this job yet).
    Ready { job: JobId, attempt: u64, slot: u32, data_addr: SocketAddr, committed: Option<u64> },
    /// A rank finished the compute and all-reduce of `step` and votes to commit it.
    Vote { job: JobId, attempt: u64, slot: u32, step: u64, figures: StepFigures, seconds: f64 },
    /// A rank's part of an attempt ended.
    Ended { job: JobId, attempt: u64, slot: u32, outcome: AttemptOutcome },
    /// Rank 0 committed a durable checkpoint.
    Checkpointed {
        job: JobId,
        attempt: u64,
        step: u64,
        path: PathBuf,
        seconds: f64,
        /// Bytes written (0 from an older node).
        #[serde(default)]
        bytes: u64,
    },
    /// Rank 0's validation loss of the model after `step` committed steps (every rank reduced the same).
    Evaluated { job: JobId, attempt: u64, step: u64, figures: EvalFigures },
    /// Where a rank's time went in `step` (jobs with `trace` only).
    Phases {
        job: JobId,
        attempt: u64,
        slot: u32,
        rank: usize,
        step: u64,
        spans: Vec<PhaseSpan>,
        /// The pipeline stage the rank runs (pipeline jobs only; absent from older nodes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stage: Option<usize>,
    },
}

/// The controller's message for a node: views, fencing and attempts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToNode {
    /// The answer to a member's heartbeat: the controller is alive.
    Alive,
    /// The current view and where its members listen, and the jobs the controller runs: a member drops
    /// the committed state of every other job (one that ended while its `Release` could not reach it).
    View {
        view: View,
        members: Vec<MemberInfo>,
        #[serde(default)]
        jobs: Vec<JobId>,
    },
    /// You are not a member of the view of epoch `current`: abort your attempts and rejoin. Keep the
    /// committed state of `jobs` (the jobs the controller still runs, offered to their next attempts) and
    /// drop every other job's (ended while you were away: its `Release` may never have reached you).
    Fenced {
        current: Epoch,
        #[serde(default)]
        jobs: Vec<JobId>,
    },
    /// Your join is refused for good: your config does not match the cluster's (e.g. node.toml
    /// `controllers` lists other controllers than the controller's). The node stops, saying `reason`.
    Refused { reason: String },
    /// Get ready for an attempt of `job` on `ranks` (this node's workers find their own slots).
    Prepare {
        job: JobId,
        attempt: u64,
        spec: Box<JobSpec>,
        ranks: Vec<RankSlot>,
        /// Drop a committed state of this step or later (incomplete: see `AttemptOutcome::StateLost`)
        /// and restore from the checkpoint instead.
        #[serde(default)]
        discard_from: Option<u64>,
    },
    /// Every rank is ready: connect the data plane over `roster`, make state equal to rank `source`'s
    /// (None: every rank already holds the same committed step), train.
    Start {
        job: JobId,
        attempt: u64,
        roster: Vec<PeerInfo>,
        source: Option<usize>,
        /// Where the attempt sums its gradients (`host` from older controllers).
        #[serde(default)]
        plane: GradientPlane,
    },
    /// Apply step `step`: every rank voted.
    Commit { job: JobId, attempt: u64, step: u64, lr_hint: f64 },
    /// Abandon the attempt; keep the committed state.
    Abort { job: JobId, attempt: u64, reason: String },
    /// The job is over (finished, failed or cancelled): drop its state.
    Release { job: JobId },
}

/// A client's request: any daemon answers status, the controller the rest (others redirect).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    StatusRequest,
    /// `troupe cluster controllers`: answered by a controller-eligible daemon (others redirect).
    ControllersRequest,
    /// `troupe cluster controllers add|remove`: answered by the controller (others redirect) with
    /// `Reply::Controllers` once the change is committed, or an error naming what was refused.
    ChangeControllers {
        change: ControllersChange,
    },
    /// The live part of the controller's dashboard page (answered by the controller, others redirect):
    /// what a member's daemon asks over its connection to the controller to show the cluster on its own
    /// page.
    DashboardRequest,
    Submit {
        spec: Box<JobSpec>,
    },
    JobStatusRequest {
        job: JobId,
    },
    Cancel {
        job: JobId,
    },
    /// Stream the events of `job` to this client: those numbered `since` and later first (replayed
    /// from the controller's log, see `event_log`), or with `since: None` only those from now on.
    Watch {
        job: JobId,
        #[serde(default)]
        since: Option<u64>,
    },
}

/// A daemon's answer to a client, and a job's events to its watchers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    Status(Box<ClusterStatus>),
    Controllers(Box<ControllersStatus>),
    Submitted {
        job: JobId,
    },
    JobStatus(Box<JobInfo>),
    /// Event number `seq` of the job (numbered from 0 in the order streamed): a watcher that reconnects
    /// drops what it already has and an early live event its replay repeats.
    Event {
        job: JobId,
        seq: u64,
        event: JobEvent,
    },
    /// This daemon is not the controller; ask it instead (`leader` on the wire).
    Redirect {
        #[serde(rename = "leader")]
        controller: SocketAddr,
    },
    Error {
        message: String,
    },
    /// The answer to `DashboardRequest`: the controller's page fragment (HTML), as its own page shows it.
    Dashboard {
        fragment: String,
    },
}

impl From<ToController> for Wire {
    fn from(msg: ToController) -> Self {
        Wire::ToController(msg)
    }
}

impl From<ToNode> for Wire {
    fn from(msg: ToNode) -> Self {
        Wire::ToNode(msg)
    }
}

impl From<Request> for Wire {
    fn from(msg: Request) -> Self {
        Wire::Request(msg)
    }
}

impl From<Reply> for Wire {
    fn from(msg: Reply) -> Self {
        Wire::Reply(msg)
    }
}

impl Wire {
    pub fn encode(&self) -> bytes::Bytes {
        bytes::Bytes::from(serde_json::to_vec(self).expect("wire messages always serialize"))
    }

    pub fn decode(body: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(body).map_err(|e| format!("undecodable control message: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPipe on 2 stages and 2 micro-batches of F = B = 1: each stage computes 4 of a 6-unit schedule
    /// (stage 0 ends last), so 2 × 2 of 12 device-units idle: (p−1)/(m+p−1) = 1/3. A rank without a
    /// report (not a pipeline) gives no bubble.
    #[test]
    fn the_bubble_is_idle_over_device_time_in_the_slowest_ranks_window() {
        let t = |span_s, busy_s| Some(StageTime { span_s, busy_s });
        let bubble = StageTime::bubble(&[t(6.0, 4.0), t(5.0, 4.0)]).unwrap();
        assert!((bubble - 1.0 / 3.0).abs() < 1e-12, "{bubble}");
        assert_eq!(StageTime::bubble(&[t(2.0, 2.0), t(2.0, 2.0)]), Some(0.0));
        assert_eq!(StageTime::bubble(&[t(6.0, 4.0), None]), None);
        assert_eq!(StageTime::bubble(&[]), None);
        let old = br#"{"loss":1.0,"grad_norm":2.0}"#;
        assert_eq!(serde_json::from_slice::<StepFigures>(old).unwrap(), StepFigures::new(1.0, 2.0));
    }

    /// A `Join` names the node's incarnation; one from a node that does not (an older version) still
    /// decodes, with none (the controller then takes any join of a member for a restart, as before).
    #[test]
    fn a_join_without_an_incarnation_still_decodes() {
        let addr: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let join = |incarnation| {
            let (dashboard, controllers, raft_listen) = (None, None, None);
            let devices = Vec::new();
            Wire::ToController(ToController::Join {
                slots: 2,
                addr,
                incarnation,
                dashboard,
                controllers,
                raft_listen,
                devices,
            })
        };
        assert_eq!(Wire::decode(&join(Some(7)).encode()), Ok(join(Some(7))));
        let old = br#"{"type":"join","slots":2,"addr":"10.0.0.1:7000"}"#;
        assert_eq!(Wire::decode(old), Ok(join(None)));
        assert_eq!(&join(None).encode()[..], &old[..], "an unknown incarnation is left out");
    }

    /// A member's dashboard URL travels in its `Join` and in `troupe status --json`; a status or join
    /// without one (an older daemon's) still decodes, and none is written when there is none.
    #[test]
    fn a_members_dashboard_is_optional_on_the_wire() {
        let addr: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let url = Some("http://10.0.0.1:9400/".to_owned());
        let join = Wire::ToController(ToController::Join {
            slots: 1,
            addr,
            incarnation: None,
            dashboard: url.clone(),
            controllers: None,
            raft_listen: None,
            devices: Vec::new(),
        });
        assert_eq!(Wire::decode(&join.encode()), Ok(join));
        let member = MemberInfo {
            name: "node-1".into(),
            addr,
            slots: 1,
            dashboard: url,
            raft_listen: None,
            devices: Vec::new(),
            load: None,
        };
        let json = serde_json::to_value(&member).unwrap();
        assert_eq!(json["dashboard"], "http://10.0.0.1:9400/");
        let old: MemberInfo = serde_json::from_str(r#"{"name":"node-1","addr":"10.0.0.1:7000","slots":1}"#).unwrap();
        assert_eq!(old, MemberInfo { dashboard: None, ..member });
        assert!(!serde_json::to_string(&old).unwrap().contains("dashboard"));
    }

    /// A heartbeat carries its node's load; an older daemon's heartbeat (no load) still decodes, and an
    /// older controller, which knew a heartbeat without fields, still reads a newer one.
    #[test]
    fn a_heartbeats_load_is_optional_on_the_wire() {
        let load = NodeLoad {
            rss_bytes: 5 << 30,
            cpu_percent: Some(40),
            devices: vec![DeviceLoad { ordinal: 1, memory_used_bytes: 7, memory_total_bytes: 9, busy_percent: 93 }],
            devices_unavailable: None,
        };
        let beat = Wire::ToController(ToController::Heartbeat { load: Some(load) });
        assert_eq!(Wire::decode(&beat.encode()), Ok(beat.clone()));
        let old = br#"{"type":"heartbeat"}"#;
        assert_eq!(Wire::decode(old), Ok(Wire::ToController(ToController::Heartbeat { load: None })));
        assert_eq!(&Wire::ToController(ToController::Heartbeat { load: None }).encode()[..], &old[..]);
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum OlderToController {
            Heartbeat,
        }
        let read: OlderToController = serde_json::from_slice(&beat.encode()).unwrap();
        assert_eq!(read, OlderToController::Heartbeat);
    }

    /// A member's slot devices travel in its `Join` and in `troupe status --json` (each GPU's ordinal,
    /// name, memory and a missing NCCL); an older daemon's join or member, without them, decodes as CPU
    /// slots, and a CPU node writes none.
    #[test]
    fn a_members_devices_are_optional_on_the_wire() {
        let addr: SocketAddr = "10.0.0.5:7000".parse().unwrap();
        let gpu = SlotDevice::Cuda {
            ordinal: 1,
            name: "NVIDIA H200".into(),
            memory_bytes: 150_000_000_000,
            nccl_missing: Some("no libnccl".into()),
        };
        let join = Wire::ToController(ToController::Join {
            slots: 1,
            addr,
            incarnation: None,
            dashboard: None,
            controllers: None,
            raft_listen: None,
            devices: vec![gpu.clone()],
        });
        assert_eq!(Wire::decode(&join.encode()), Ok(join));
        let member = MemberInfo {
            name: "g".into(),
            addr,
            slots: 1,
            dashboard: None,
            raft_listen: None,
            devices: vec![gpu],
            load: None,
        };
        let json = serde_json::to_value(&member).unwrap();
        assert_eq!(json["devices"][0]["kind"], "cuda");
        assert_eq!(json["devices"][0]["ordinal"], 1);
        assert_eq!(json["devices"][0]["nccl_missing"], "no libnccl");
        let old: MemberInfo = serde_json::from_str(r#"{"name":"g","addr":"10.0.0.5:7000","slots":1}"#).unwrap();
        assert!(old.devices.is_empty());
        assert_eq!(slot_device(&old.devices, 0), &SlotDevice::Cpu);
        assert!(!serde_json::to_string(&old).unwrap().contains("devices"));
        let start: ToNode =
            serde_json::from_str(r#"{"type":"start","job":1,"attempt":2,"roster":[],"source":null}"#).unwrap();
        assert!(matches!(start, ToNode::Start { plane: GradientPlane::Host, .. }), "an older controller's Start");
    }

    /// A joiner that may be made a controller announces its Raft address, which `controllers add`
    /// uses when none is given; a join, member or change without one (an older daemon's or client's)
    /// still decodes, and none is written when there is none.
    #[test]
    fn a_members_raft_address_is_optional_on_the_wire() {
        let addr: SocketAddr = "10.0.0.4:7000".parse().unwrap();
        let raft: SocketAddr = "10.0.0.4:7401".parse().unwrap();
        let join = Wire::ToController(ToController::Join {
            slots: 1,
            addr,
            incarnation: None,
            dashboard: None,
            controllers: None,
            raft_listen: Some(raft),
            devices: Vec::new(),
        });
        assert_eq!(Wire::decode(&join.encode()), Ok(join));
        let member = MemberInfo {
            name: "node-d".into(),
            addr,
            slots: 1,
            dashboard: None,
            raft_listen: Some(raft),
            devices: Vec::new(),
            load: None,
        };
        assert_eq!(serde_json::to_value(&member).unwrap()["raft_listen"], "10.0.0.4:7401");
        let old: MemberInfo = serde_json::from_str(r#"{"name":"node-d","addr":"10.0.0.4:7000","slots":1}"#).unwrap();
        assert_eq!(old, MemberInfo { raft_listen: None, ..member });
        let change = |raft_addr| {
            Wire::Request(Request::ChangeControllers {
                change: ControllersChange::Add { node: "node-d".into(), raft_addr },
            })
        };
        for given in [Some(raft), None] {
            assert_eq!(Wire::decode(&change(given).encode()), Ok(change(given)));
        }
        let older =
            br#"{"type":"change_controllers","change":{"op":"add","node":"node-d","raft_addr":"10.0.0.4:7401"}}"#;
        assert_eq!(Wire::decode(older), Ok(change(Some(raft))));
        assert!(!String::from_utf8_lossy(&change(None).encode()).contains("raft_addr"));
    }

    /// A body's type names its direction: each message comes back as the direction it was sent as,
    /// the client's `status_request` and the daemon's `status` answer alike.
    #[test]
    fn every_message_decodes_to_its_own_direction() {
        let status = ClusterStatus {
            node: "node-0".into(),
            controller: true,
            controller_addr: None,
            epoch: 3,
            members: Vec::new(),
            joining: Vec::new(),
            jobs: Vec::new(),
            refused_stale: 0,
            changes: Vec::new(),
        };
        let messages = [
            Wire::ToController(ToController::Heartbeat { load: None }),
            Wire::ToNode(ToNode::Alive),
            Wire::ToNode(ToNode::Release { job: 4 }),
            Wire::Request(Request::StatusRequest),
            Wire::Request(Request::Cancel { job: 4 }),
            Wire::Reply(Reply::Status(Box::new(status))),
            Wire::Reply(Reply::Error { message: "no job 4".into() }),
            Wire::Request(Request::DashboardRequest),
            Wire::Reply(Reply::Dashboard { fragment: "<section>…</section>".into() }),
        ];
        for msg in messages {
            assert_eq!(Wire::decode(&msg.encode()), Ok(msg));
        }
        assert!(Wire::decode(br#"{"type":"no_such_message"}"#).is_err());
    }
}
