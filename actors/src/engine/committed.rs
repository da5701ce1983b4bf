//! What a rank keeps of a job between attempts: the state of its last committed step.

use std::ops::Range;

use troupe_model::Trainer;

/// A contiguous range of the flat parameter order with its fp32 master values and AdamW moments — a
/// rank's own shard, or its copy of a buddy's.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPiece {
    pub range: Range<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

impl ShardPiece {
    pub fn zeros(range: Range<usize>) -> Self {
        let n = range.len();
        Self { range, master: vec![0.0; n], exp_avg: vec![0.0; n], exp_avg_sq: vec![0.0; n] }
    }

    /// Copies `range` (which this piece must contain) into the three outputs.
    pub fn read(&self, range: &Range<usize>, out: [&mut [f32]; 3]) {
        let at = range.start - self.range.start..range.end - self.range.start;
        for (dst, src) in out.into_iter().zip([&self.master, &self.exp_avg, &self.exp_avg_sq]) {
            dst.copy_from_slice(&src[at.clone()]);
        }
    }
}

/// The committed state of one rank.
#[derive(Debug)]
pub enum CommittedState {
    /// The whole state in a trainer: a DDP rank, or any rank fresh from step 0 or a checkpoint.
    Full(Box<Trainer>),
    /// A ZeRO-1/2/3 rank: its own shard and its buddies' shards (masters and moments) are the state; the
    /// trainer carries the step counters, the config and the sampler, and its parameters are only a cache
    /// of the masters (ZeRO-1/2: refreshed by an all-gather before they are used; ZeRO-3: empty tensors)
    /// — its own AdamW moments are emptied.
    Sharded { trainer: Box<Trainer>, pieces: Vec<ShardPiece> },
}

impl CommittedState {
    /// Committed steps (the next step to run).
    pub fn step(&self) -> u64 {
        match self {
            CommittedState::Full(t) | CommittedState::Sharded { trainer: t, .. } => t.step,
        }
    }
}
