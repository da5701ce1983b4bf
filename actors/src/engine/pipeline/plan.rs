//! What a pipeline schedule is: for every device, the ordered list of operations it runs in one step.
//!
//! The model is cut into `stages × virtual_stages` *chunks* in model order; chunk `c` lives on device
//! `c % stages` (Megatron's interleaving: device `d` holds chunks `d, d + P, d + 2P, …`; without
//! interleaving chunk = device). A plan names, per device, every forward (F), backward (B: both gradients,
//! or for zero-bubble schedules B = input gradient and W = weight gradient) and every send and receive of
//! an activation or a gradient between devices. Peers are implied by the chunk: the activation produced by
//! chunk `c` goes to the device of `c + 1`, the input gradient produced by chunk `c` to the device of
//! `c − 1`. Nothing here runs anything; [`super::check`] validates a plan and [`super::simulate`] times it.

use std::fmt;

/// The four schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019): M activations in flight.
    GPipe,
    /// PipeDream-flush: warm-up forwards, then one forward one backward, then cool-down backwards; at most
    /// P activations in flight.
    OneFOneB,
    /// Megatron's interleaved 1F1B over V virtual stages per device: a bubble V times smaller for more
    /// messages.
    Interleaved,
    /// Zero bubble, handcrafted schedule 1 (Qi et al. 2023): the backward split into B (input gradient, on
    /// the critical path) and W (weight gradient, deferred into the bubbles); 1F1B's activation memory.
    ZbH1,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 4] =
        [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved, ScheduleKind::ZbH1];

    /// The CLI name (`--schedule`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
        }
    }

    /// Parses a CLI name; the error says which names exist.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| format!("unknown schedule `{name}`: use one of gpipe, 1f1b, interleaved, zb-h1"))
    }

    /// Whether the backward is split into B (input gradient) and W (weight gradient).
    pub fn splits_backward(self) -> bool {
        self == ScheduleKind::ZbH1
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The size of a pipeline: P devices (stages), M micro-batches per step, V virtual stages per device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanShape {
    pub stages: usize,
    pub microbatches: usize,
    pub virtual_stages: usize,
}

impl PlanShape {
    /// The schedule and shape of `config`'s pipeline for `replicas` replicas: its micro-batches
    /// (`parallel.microbatches`, or the default from the batch) bounded by the smallest replica's samples
    /// — an explicit count too, the world may have grown since the config was checked.
    pub fn of(config: &troupe_model::config::JobConfig, replicas: usize) -> Result<(ScheduleKind, Self), String> {
        let parallel = &config.parallel;
        let kind = ScheduleKind::parse(&parallel.schedule).map_err(|e| format!("parallel.schedule: {e}"))?;
        let samples = config.train.global_batch / replicas.max(1);
        let mut sized = parallel.clone();
        sized.dp = replicas;
        let microbatches = sized.pipeline_microbatches(&config.train).min(samples).max(1);
        Ok((kind, Self::new(parallel.pp, microbatches, parallel.virtual_stages)))
    }

    pub fn new(stages: usize, microbatches: usize, virtual_stages: usize) -> Self {
        Self { stages, microbatches, virtual_stages }
    }

    /// Model chunks in all: P × V.
    pub fn chunks(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// The device that holds chunk `chunk`.
    pub fn device_of(&self, chunk: usize) -> usize {
        chunk % self.stages
    }

    /// Chunk `chunk`'s position among its device's chunks (its virtual stage).
    pub fn virtual_of(&self, chunk: usize) -> usize {
        chunk / self.stages
    }

    /// The chunk at virtual stage `virtual_stage` of device `device`.
    pub fn chunk_at(&self, device: usize, virtual_stage: usize) -> usize {
        virtual_stage * self.stages + device
    }
}

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// Forward of the chunk on the micro-batch.
    Forward,
    /// Full backward: input gradient and weight gradient together.
    Backward,
    /// The input-gradient half of the backward (zero-bubble B).
    BackwardInput,
    /// The weight-gradient half of the backward (zero-bubble W).
    BackwardWeight,
    /// Send the chunk's output activation to the next chunk's device.
    SendActivation,
    /// Receive the activation produced by the (previous) chunk named in the op.
    RecvActivation,
    /// Send the gradient of the chunk's input to the previous chunk's device.
    SendGradient,
    /// Receive the input gradient produced by the (next) chunk named in the op.
    RecvGradient,
}

impl OpKind {
    pub fn is_compute(self) -> bool {
        matches!(self, OpKind::Forward | OpKind::Backward | OpKind::BackwardInput | OpKind::BackwardWeight)
    }

    /// One-letter name used in traces and diagrams: F, B, W, and S/R for the messages.
    pub fn letter(self) -> &'static str {
        match self {
            OpKind::Forward => "F",
            OpKind::Backward | OpKind::BackwardInput => "B",
            OpKind::BackwardWeight => "W",
            OpKind::SendActivation | OpKind::SendGradient => "S",
            OpKind::RecvActivation | OpKind::RecvGradient => "R",
        }
    }
}

/// One operation of a device's list. For sends the chunk is the producer, and for receives too: a
/// `RecvActivation` of chunk `c` waits for what chunk `c`'s forward sent (to be consumed by `c + 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Op {
    pub kind: OpKind,
    pub chunk: usize,
    pub microbatch: usize,
}

impl Op {
    pub fn new(kind: OpKind, chunk: usize, microbatch: usize) -> Self {
        Self { kind, chunk, microbatch }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}(chunk {}, mb {})", self.kind, self.chunk, self.microbatch)
    }
}

/// A whole schedule: one ordered op list per device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub kind: ScheduleKind,
    pub shape: PlanShape,
    pub devices: Vec<Vec<Op>>,
}

impl Plan {
    /// The most activations (chunk, micro-batch pairs whose forward ran and whose backward has not
    /// finished) a device of this schedule may hold: GPipe M·V, 1F1B and ZB-H1 min(P, M), interleaved
    /// Megatron's warm-up count + 1, plus P when M is not a multiple of P (the short last micro-batch
    /// group needs a longer warm-up; measured over P ≤ 8, M ≤ 16, V ≤ 3, never more than P longer).
    pub fn activation_bound(&self) -> usize {
        let PlanShape { stages: p, microbatches: m, virtual_stages: v } = self.shape;
        match self.kind {
            ScheduleKind::GPipe => m * v,
            ScheduleKind::OneFOneB | ScheduleKind::ZbH1 => p.min(m),
            ScheduleKind::Interleaved => {
                let megatron = (p - 1) * 2 + (v - 1) * p + 1;
                let short_group = if m % p == 0 { 0 } else { p };
                (megatron + short_group).min(m * v)
            }
        }
    }
}
