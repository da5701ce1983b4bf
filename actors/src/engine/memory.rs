//! What a rank keeps between steps, counted in elements — the persistent model state whose size ZeRO
//! divides by the world (activations, gathered units and other buffers of a step in flight are not
//! counted: they are freed when the step ends) — and, for a step's [`RankUsage`], what a rank's
//! communicators sent.

use tch::Tensor;
use troupe_cluster::collective::CallTally;
use troupe_model::Trainer;

use crate::protocol::{CollectiveKind, GroupKind, RankUsage, SentBytes};

/// Elements (fp32) a rank holds between steps, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PersistentState {
    /// Model parameters kept for compute (DDP and ZeRO-1/2: the whole model; ZeRO-3: none).
    pub params: usize,
    /// Gradients kept: the model's `.grad` tensors and gradient shards (own and buddy copies).
    pub grads: usize,
    /// Sharded fp32 master parameters (own shard and buddy copies); DDP's masters are its `params`.
    pub masters: usize,
    /// The optimizer's state: AdamW's two moments (sharded or whole) or Adafactor's statistics.
    pub moments: usize,
    /// Flat communication buffers kept allocated between steps.
    pub buffers: usize,
}

impl PersistentState {
    /// What a trainer's model and optimizer hold: parameters, their defined gradients, the optimizer's
    /// state tensors — a DDP rank's whole persistent state (its flat buckets aside).
    pub fn of_model(trainer: &Trainer) -> Self {
        let params = trainer.model.params();
        let grads = params.iter().map(|p| p.grad()).filter(|g| g.defined()).map(|g| g.numel()).sum();
        let moments = trainer.optimizer.state_numel();
        Self { params: params.iter().map(|p| p.numel()).sum(), grads, masters: 0, moments, buffers: 0 }
    }

    pub fn total(&self) -> usize {
        self.params + self.grads + self.masters + self.moments + self.buffers
    }
}

/// Bytes of `tensors`, and of their defined gradients.
pub(super) fn tensor_and_grad_bytes(tensors: &[Tensor]) -> (u64, u64) {
    let bytes = |t: &Tensor| troupe_model::tensor_bytes(t) as u64;
    let grads = tensors.iter().map(Tensor::grad).filter(Tensor::defined).map(|g| bytes(&g)).sum();
    (tensors.iter().map(bytes).sum(), grads)
}

/// A replica holding the whole model and optimizer (DDP, a periodically synchronizing replica): its
/// parameters, gradients and optimizer state as the tensors are, `extra_state` elements beside them
/// (an outer optimizer's), and what its communicator sent in the step (`calls`).
pub(super) fn whole_replica_usage(trainer: &Trainer, extra_state: usize, calls: Vec<CallTally>) -> RankUsage {
    let (param_bytes, grad_bytes) = tensor_and_grad_bytes(trainer.model.params());
    RankUsage {
        param_bytes,
        grad_bytes,
        optimizer_bytes: ((trainer.optimizer.state_numel() + extra_state) * std::mem::size_of::<f32>()) as u64,
        buddy_bytes: 0,
        activation_bytes: None,
        step_seconds: 0.0,
        sent: group_sent(GroupKind::Data, calls),
    }
}

/// A step's calls of a `group`'s communicator as [`RankUsage`] lines: one per collective (a receive's
/// wait with the sends; a barrier moves nothing worth a line).
pub(super) fn group_sent(group: GroupKind, calls: Vec<CallTally>) -> Vec<SentBytes> {
    let mut lines: Vec<SentBytes> = Vec::new();
    for call in calls {
        let collective = match call.op {
            "all_reduce" => CollectiveKind::AllReduce,
            "all_gather" => CollectiveKind::AllGather,
            "reduce_scatter" => CollectiveKind::ReduceScatter,
            "broadcast" => CollectiveKind::Broadcast,
            "reduce" => CollectiveKind::Reduce,
            "send" | "recv" => CollectiveKind::Send,
            _ => continue,
        };
        match lines.iter_mut().find(|l| l.collective == collective) {
            Some(line) => {
                line.calls += call.calls;
                line.bytes += call.bytes;
                line.seconds += call.seconds;
            }
            None => {
                lines.push(SentBytes { group, collective, calls: call.calls, bytes: call.bytes, seconds: call.seconds })
            }
        }
    }
    lines.sort_by_key(|l| l.collective);
    lines
}
