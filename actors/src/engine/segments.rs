//! A flat range of the parameter order as the pieces of parameters it covers ([`ShardSegment`]: weight
//! decay or not), and the AdamW update of a range's masters and moments piece by piece — what a ZeRO
//! rank's shard owner and a pipeline stage's sharded group apply to the ranges they own.

use std::ops::Range;

use troupe_cluster::collective::chunk_range;
use troupe_kernels::adamw::{adamw_step, AdamWConfig, AdamWShard};
use troupe_model::config::TrainConfig;

/// The part of one parameter that falls in this rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSegment {
    pub param: usize,
    /// Positions within this rank's shard.
    pub in_shard: Range<usize>,
    pub decays: bool,
}

/// This rank's shard of the flat parameter vector and the parameter pieces it covers.
pub fn plan_shard(numels: &[usize], decays: &[bool], rank: usize, world: usize) -> (Range<usize>, Vec<ShardSegment>) {
    let total = numels.iter().sum();
    let own = chunk_range(total, world, rank);
    let segments = plan_segments(numels, decays, &own);
    (own, segments)
}

/// The parameter pieces a flat range covers, positions relative to the range's start.
pub fn plan_segments(numels: &[usize], decays: &[bool], range: &Range<usize>) -> Vec<ShardSegment> {
    let mut segments = Vec::new();
    let mut offset = 0;
    for (param, (&n, &decays)) in numels.iter().zip(decays).enumerate() {
        let (start, end) = (offset.max(range.start), (offset + n).min(range.end));
        if start < end {
            segments.push(ShardSegment { param, in_shard: start - range.start..end - range.start, decays });
        }
        offset += n;
    }
    segments
}

/// AdamW update `t` at learning rate `lr` on a flat range's masters and moments (`state`), parameter
/// piece by parameter piece (`segments`: weight decay or not), with the fused kernel.
pub(crate) fn adamw_on_segments(
    state: [&mut Vec<f32>; 3],
    segments: &[ShardSegment],
    grad: &[f32],
    train: &TrainConfig,
    lr: f64,
    t: u64,
) {
    let [master, exp_avg, exp_avg_sq] = state;
    for segment in segments {
        let r = segment.in_shard.clone();
        let config = AdamWConfig {
            lr,
            beta1: train.beta1,
            beta2: train.beta2,
            eps: train.eps,
            weight_decay: if segment.decays { train.weight_decay } else { 0.0 },
        };
        let shard = AdamWShard {
            params: &mut master[r.clone()],
            exp_avg: &mut exp_avg[r.clone()],
            exp_avg_sq: &mut exp_avg_sq[r.clone()],
        };
        adamw_step(shard, &grad[r], &config, t, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_parameters_and_segments_know_their_decay() {
        let numels = [4, 6, 2];
        let decays = [true, false, true];
        let mut covered = 0;
        for rank in 0..3 {
            let (own, segments) = plan_shard(&numels, &decays, rank, 3);
            assert_eq!(own.start, covered);
            covered = own.end;
            let len: usize = segments.iter().map(|s| s.in_shard.len()).sum();
            assert_eq!(len, own.len());
        }
        assert_eq!(covered, 12);
        // Rank 1 holds elements 4..8: all of them inside parameter 1 (no decay).
        let (_, segments) = plan_shard(&numels, &decays, 1, 3);
        assert_eq!(segments, vec![ShardSegment { param: 1, in_shard: 0..4, decays: false }]);
    }
}
