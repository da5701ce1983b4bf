//! The theoretical communication of one optimizer step, per rank of a pipeline stage, by collective.
//!
//! A = b·s·d elements: the activations of the b = global_batch / dp samples one replica runs in a step,
//! s = model.context, d = model.d_model. Tensor parallelism (Megatron) without SP: per block 2
//! all-reduces of A forward and 2 backward; with SP each all-reduce is an all-gather and a reduce-scatter
//! (4 of each per block, forward and backward together). Bytes per rank are a ring's: an all-reduce of N
//! elements sends 2(n−1)/n·N·4 bytes from each of n ranks, an all-gather or reduce-scatter (n−1)/n·N·4.

use serde::{Deserialize, Serialize};

use super::memory::FP32_BYTES;

pub use crate::protocol::{CollectiveKind, GroupKind};

/// One kind of traffic of one step, seen from one rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    pub group: GroupKind,
    pub collective: CollectiveKind,
    /// What moves (`blocks forward+backward`, `gradients`, …).
    pub what: String,
    /// Calls per step (micro-batches × calls per micro-batch; data-parallel ones count 1, bucketed).
    pub calls: u64,
    /// Elements the calls cover in all (the whole tensor of each call, not this rank's share).
    pub elements: u64,
    /// Bytes this rank sends for them (fp32), by the ring formulas above.
    pub bytes_per_rank: u64,
}

/// The shape of one stage's step, for [`stage_traffic`].
#[derive(Clone, Copy, Debug)]
pub struct StageStep {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
    pub stage: usize,
    pub sp: bool,
    pub zero: u8,
    /// Blocks the stage runs.
    pub layers: u64,
    /// Samples per replica per step, micro-batches per step, sequence, width.
    pub samples: u64,
    pub microbatches: u64,
    pub context: u64,
    pub d_model: u64,
    /// Gradient elements this rank holds (its tensor share of the stage's parameters).
    pub grad_elements: u64,
    /// Of them, those every tensor rank holds whole (norms, biases of row-parallel layers, GPT-2's
    /// positions): under SP each rank's backward gives its positions' share, summed over the group.
    pub replicated_elements: u64,
    /// The tied head's embedding share, summed between the first and last stage (0 when not tied).
    pub tied_elements: u64,
}

/// Bytes one of `n` ranks sends for a collective over `elements` elements.
pub fn ring_bytes(kind: CollectiveKind, n: usize, elements: u64) -> u64 {
    let n64 = n as u64;
    let bytes = elements * FP32_BYTES;
    match kind {
        _ if n <= 1 && kind != CollectiveKind::Send => 0,
        CollectiveKind::AllReduce => 2 * (n64 - 1) * bytes / n64,
        CollectiveKind::AllGather | CollectiveKind::ReduceScatter => (n64 - 1) * bytes / n64,
        CollectiveKind::Send => bytes,
        // A tree's sends vary with the rank's place in it; each byte reaches (or leaves) each of the
        // n − 1 others once, so this is the mean over ranks.
        CollectiveKind::Broadcast | CollectiveKind::Reduce => (n64 - 1) * bytes / n64,
    }
}

/// The traffic of one rank of stage `s.stage` in one step; lines with nothing to move are left out.
pub fn stage_traffic(s: &StageStep) -> Vec<Traffic> {
    let mut out = Vec::new();
    let mut push = |group, collective, what: &str, calls: u64, elements: u64, n: usize| {
        if calls > 0 && n > 1 {
            let bytes_per_rank = ring_bytes(collective, n, elements);
            out.push(Traffic { group, collective, what: what.into(), calls, elements, bytes_per_rank });
        }
    };
    let act = s.samples * s.context * s.d_model;
    let m = s.microbatches;
    let (first, last) = (s.stage == 0, s.stage + 1 == s.pp);
    use CollectiveKind::*;
    use GroupKind::*;
    if s.sp {
        push(Tensor, AllGather, "blocks (2 forward, 2 backward per block)", 4 * s.layers * m, 4 * s.layers * act, s.tp);
        push(
            Tensor,
            ReduceScatter,
            "blocks (2 forward, 2 backward per block)",
            4 * s.layers * m,
            4 * s.layers * act,
            s.tp,
        );
        if first {
            push(Tensor, ReduceScatter, "embedding output (forward)", m, act, s.tp);
            push(Tensor, AllGather, "embedding output (backward)", m, act, s.tp);
        }
        if last {
            push(Tensor, AllGather, "head input (forward)", m, act, s.tp);
            push(Tensor, ReduceScatter, "head input (backward)", m, act, s.tp);
        }
        if s.replicated_elements > 0 {
            let what = "replicated parameters' gradients (SP: each rank's positions)";
            push(Tensor, AllReduce, what, m, m * s.replicated_elements, s.tp);
        }
    } else {
        push(Tensor, AllReduce, "blocks (2 forward, 2 backward per block)", 4 * s.layers * m, 4 * s.layers * act, s.tp);
        if first {
            push(Tensor, AllReduce, "embedding output (forward)", m, act, s.tp);
        }
        if last {
            push(Tensor, AllReduce, "head input (backward)", m, act, s.tp);
        }
    }
    if last {
        // Vocab-parallel cross-entropy: every rank's maximum per token gathered (a max over them is the
        // shift), then the sum of exponentials and the target's logit per token summed.
        let tokens = s.samples * s.context;
        push(Tensor, AllGather, "vocab-parallel cross-entropy (maxima)", m, tokens * s.tp as u64, s.tp);
        push(Tensor, AllReduce, "vocab-parallel cross-entropy (sums)", 2 * m, 2 * tokens, s.tp);
    }
    pipeline_traffic(s, act, &mut push);
    data_traffic(s, &mut push);
    out
}

type Push<'a> = dyn FnMut(GroupKind, CollectiveKind, &str, u64, u64, usize) + 'a;

fn pipeline_traffic(s: &StageStep, act: u64, push: &mut Push) {
    let (first, last) = (s.stage == 0, s.stage + 1 == s.pp);
    // With SP a tensor rank holds (and sends) 1/T of the sequence; without, the whole activation.
    let sent = if s.sp { act / s.tp as u64 } else { act };
    let m = s.microbatches;
    if !last {
        push(GroupKind::Pipeline, CollectiveKind::Send, "activations to the next stage", m, sent, s.pp);
    }
    if !first {
        push(GroupKind::Pipeline, CollectiveKind::Send, "gradients to the previous stage", m, sent, s.pp);
    }
    if (first || last) && s.tied_elements > 0 {
        push(
            GroupKind::Pipeline,
            CollectiveKind::AllReduce,
            "tied embedding gradient (first ↔ last stage)",
            1,
            s.tied_elements,
            2,
        );
    }
}

fn data_traffic(s: &StageStep, push: &mut Push) {
    use CollectiveKind::*;
    let g = s.grad_elements;
    match s.zero {
        0 => push(GroupKind::Data, AllReduce, "gradients", 1, g, s.dp),
        1 | 2 => {
            push(GroupKind::Data, ReduceScatter, "gradients", 1, g, s.dp);
            push(GroupKind::Data, AllGather, "updated parameters", 1, g, s.dp);
        }
        _ => {
            push(GroupKind::Data, ReduceScatter, "gradients", 1, g, s.dp);
            push(GroupKind::Data, AllGather, "parameters (forward and backward)", 2, 2 * g, s.dp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(sp: bool) -> StageStep {
        StageStep {
            tp: 2,
            dp: 1,
            pp: 1,
            stage: 0,
            sp,
            zero: 0,
            layers: 4,
            samples: 8,
            microbatches: 2,
            context: 128,
            d_model: 256,
            grad_elements: 1000,
            replicated_elements: 0,
            tied_elements: 0,
        }
    }

    /// The tensor group's bytes of `kind`, the cross-entropy's left out.
    fn bytes(lines: &[Traffic], kind: CollectiveKind) -> u64 {
        lines
            .iter()
            .filter(|t| t.group == GroupKind::Tensor && t.collective == kind && !t.what.contains("cross-entropy"))
            .map(|t| t.bytes_per_rank)
            .sum()
    }

    #[test]
    fn megatron_without_sp_is_four_all_reduces_per_block() {
        let lines = stage_traffic(&step(false));
        let blocks = &lines[0];
        let act = 8 * 128 * 256;
        assert_eq!(
            (blocks.collective, blocks.calls, blocks.elements),
            (CollectiveKind::AllReduce, 4 * 4 * 2, 4 * 4 * act)
        );
        assert_eq!(blocks.bytes_per_rank, 4 * 4 * act * 4); // 2(n−1)/n = 1 at n = 2
        assert!(lines.iter().all(|t| t.group != GroupKind::Data), "dp = 1 moves no gradients");
    }

    #[test]
    fn sequence_parallelism_moves_the_same_bytes_as_gather_scatter_pairs() {
        let (plain, sp) = (stage_traffic(&step(false)), stage_traffic(&step(true)));
        let gathered = bytes(&sp, CollectiveKind::AllGather);
        assert_eq!(gathered, bytes(&sp, CollectiveKind::ReduceScatter), "one all-gather per reduce-scatter");
        assert_eq!(bytes(&sp, CollectiveKind::AllReduce), 0);
        assert_eq!(2 * gathered, bytes(&plain, CollectiveKind::AllReduce));
        // With SP a replicated parameter's gradient is each rank's positions' share: summed per micro-batch.
        let norms = stage_traffic(&StageStep { replicated_elements: 100, ..step(true) });
        assert_eq!(bytes(&norms, CollectiveKind::AllReduce), 2 * 100 * 4, "2 micro-batches, 2(n−1)/n = 1");
        let plain = stage_traffic(&StageStep { replicated_elements: 100, ..step(false) });
        assert_eq!(bytes(&plain, CollectiveKind::AllReduce), 2 * gathered, "without SP they are whole");
        // The cross-entropy is the same with and without SP: the maxima gathered (T per token), two sums.
        let loss = |lines: &[Traffic]| -> Vec<(CollectiveKind, u64)> {
            lines
                .iter()
                .filter(|t| t.what.contains("cross-entropy"))
                .map(|t| (t.collective, t.bytes_per_rank))
                .collect()
        };
        let tokens = 8 * 128;
        assert_eq!(loss(&sp), [(CollectiveKind::AllGather, tokens * 4), (CollectiveKind::AllReduce, 2 * tokens * 4)]);
        assert_eq!(loss(&sp), loss(&plain));
    }
}
