//! What a ZeRO-1/2/3 job shards ([`ShardMode`]), where the shards live and how a new attempt finds them —
//! pure (no tch, no IO).
//!
//! Rank `r` of `N` owns shard `r` (`balanced_range(P, N, r)` of the flat parameter order) and, with
//! `replicas = k`, also shadows the shards of its next `k` ranks, `(r + 1) mod N … (r + k) mod N` (its
//! *buddies*): the last committed copy of their masters and moments, updated in lockstep. So losing any
//! `k` consecutive ranks — in particular any one, with the default `k = 1` — loses no state.
//!
//! At the start of an attempt every rank describes what it holds (its committed step and the flat ranges
//! of its pieces); [`plan_restore`] picks, for every piece of the flat order, one rank that holds it at
//! the most advanced step. If some piece is held by nobody at that step, the state of that step is lost.

use std::ops::Range;

use troupe_kernels::balanced_range;

use super::flat::{counter_of, counter_words};

/// What is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardMode {
    /// Optimizer state sharded; gradients all-reduced in full.
    Zero1,
    /// Optimizer state and gradients sharded (gradients reduce-scattered).
    Zero2,
    /// Parameters sharded too: gathered per unit just in time, gradients reduced to their owners per
    /// unit (FSDP).
    Zero3,
}

impl ShardMode {
    /// The mode of a `parallel.shard` value; None for `none` (DDP) and modes this engine does not run.
    pub fn of_config(shard: &str) -> Option<Self> {
        match shard {
            "zero1" => Some(Self::Zero1),
            "zero2" => Some(Self::Zero2),
            "zero3" => Some(Self::Zero3),
            _ => None,
        }
    }

    /// How a checkpoint's manifest names it.
    pub fn layout(self) -> troupe_model::checkpoint::ShardMode {
        match self {
            Self::Zero1 => troupe_model::checkpoint::ShardMode::Zero1,
            Self::Zero2 => troupe_model::checkpoint::ShardMode::Zero2,
            Self::Zero3 => troupe_model::checkpoint::ShardMode::Zero3,
        }
    }
}

/// Most shadow copies per shard (`checkpoint.replicas`).
pub const REPLICAS_MAX: usize = 3;

/// The ranks whose shards rank `rank` shadows, nearest first.
pub fn buddies(rank: usize, world: usize, replicas: usize) -> Vec<usize> {
    (1..=replicas.min(world.saturating_sub(1))).map(|k| (rank + k) % world).collect()
}

/// The ranks that shadow rank `rank`'s shard (the inverse of [`buddies`]), nearest first.
pub fn shadow_holders(rank: usize, world: usize, replicas: usize) -> Vec<usize> {
    (1..=replicas.min(world.saturating_sub(1))).map(|k| (rank + world - k) % world).collect()
}

/// The flat ranges rank `rank` holds in a layout: its own shard first, then its buddies' shards.
pub fn held_ranges(total: usize, rank: usize, world: usize, replicas: usize) -> Vec<Range<usize>> {
    std::iter::once(rank).chain(buddies(rank, world, replicas)).map(|r| balanced_range(total, world, r)).collect()
}

/// The owners of a flat range and each one's part of it: `(rank, intersection of the range with the
/// rank's own shard)` in rank order, empty intersections left out. A ZeRO-3 unit's parameters are
/// gathered from, and its gradient reduced to, exactly these ranks.
pub fn owner_pieces(total: usize, world: usize, range: &Range<usize>) -> Vec<(usize, Range<usize>)> {
    (0..world)
        .filter_map(|rank| {
            let own = balanced_range(total, world, rank);
            let (start, end) = (own.start.max(range.start), own.end.min(range.end));
            (start < end).then_some((rank, start..end))
        })
        .collect()
}

/// What one rank holds when an attempt starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// Committed steps of the state it holds.
    pub step: u64,
    /// AdamW updates applied to it (the `t` of bias correction).
    pub optimizer_step: u64,
    /// Flat ranges it holds, each with masters and both moments.
    pub ranges: Vec<Range<usize>>,
}

impl Holding {
    /// Whether one of its pieces contains all of `range`.
    pub fn contains(&self, range: &Range<usize>) -> bool {
        self.ranges.iter().any(|r| r.start <= range.start && range.end <= r.end)
    }
}

/// Where every piece of the state of the most advanced step comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestorePlan {
    pub step: u64,
    pub optimizer_step: u64,
    /// Consecutive ranges tiling `0..total`, each with the lowest rank that holds it at `step`, inside one
    /// of that rank's pieces.
    pub sources: Vec<(Range<usize>, usize)>,
}

/// The piece of the flat order that no rank holds at the most advanced step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    pub step: u64,
    pub range: Range<usize>,
}

/// Plans how the state of the most advanced step among `holdings` (indexed by rank) is put together.
pub fn plan_restore(total: usize, holdings: &[Holding]) -> Result<RestorePlan, Missing> {
    let step = holdings.iter().map(|h| h.step).max().unwrap_or(0);
    let best: Vec<(usize, &Holding)> = holdings.iter().enumerate().filter(|(_, h)| h.step == step).collect();
    let optimizer_step = best.first().map_or(0, |(_, h)| h.optimizer_step);
    let mut cuts: Vec<usize> = vec![0, total];
    for (_, h) in &best {
        for r in &h.ranges {
            cuts.extend([r.start.min(total), r.end.min(total)]);
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut sources: Vec<(Range<usize>, usize)> = Vec::new();
    for w in cuts.windows(2) {
        let piece = w[0]..w[1];
        let Some(&(rank, _)) = best.iter().find(|(_, h)| h.contains(&piece)) else {
            return Err(Missing { step, range: piece });
        };
        // Not merged with a neighbour from the same rank: each source range lies inside one piece of its
        // provider, which is how the provider reads it.
        sources.push((piece, rank));
    }
    Ok(RestorePlan { step, optimizer_step, sources })
}

/// Whether every rank already holds, at the plan's step, every range it needs (`needed_of(rank)`):
/// then no state moves at the start of the attempt.
pub fn all_local(holdings: &[Holding], step: u64, needed_of: impl Fn(usize) -> Vec<Range<usize>>) -> bool {
    holdings.iter().enumerate().all(|(rank, h)| h.step == step && needed_of(rank).iter().all(|need| h.contains(need)))
}

/// Most ranges one [`Holding`] describes: a ZeRO rank's own shard and `REPLICAS_MAX` buddies', or a
/// pipeline device's chunks (one per virtual stage; `VIRTUAL_STAGES_MAX` is 16 too) and, on the head's
/// device of a tied model, its copy of the embedding matrix.
pub const HOLDING_RANGES_MAX: usize = 17;

/// f32 words of one encoded [`Holding`].
pub const HOLDING_WORDS: usize = 5 + 4 * HOLDING_RANGES_MAX;

/// Encodes a holding for an all-gather. At most [`HOLDING_RANGES_MAX`] ranges.
pub fn encode_holding(h: &Holding) -> [f32; HOLDING_WORDS] {
    assert!(h.ranges.len() <= HOLDING_RANGES_MAX, "{} pieces", h.ranges.len());
    let mut out = [0f32; HOLDING_WORDS];
    out[..2].copy_from_slice(&counter_words(h.step));
    out[2..4].copy_from_slice(&counter_words(h.optimizer_step));
    out[4] = h.ranges.len() as f32;
    for (i, r) in h.ranges.iter().enumerate() {
        let at = 5 + 4 * i;
        out[at..at + 2].copy_from_slice(&counter_words(r.start as u64));
        out[at + 2..at + 4].copy_from_slice(&counter_words(r.end as u64));
    }
    out
}

pub fn decode_holding(words: &[f32]) -> Holding {
    let count = (words[4] as usize).min(HOLDING_RANGES_MAX);
    let ranges = (0..count)
        .map(|i| {
            let at = 5 + 4 * i;
            counter_of(words[at], words[at + 1]) as usize..counter_of(words[at + 2], words[at + 3]) as usize
        })
        .collect();
    Holding { step: counter_of(words[0], words[1]), optimizer_step: counter_of(words[2], words[3]), ranges }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pieces_tile_a_range_with_its_owners_parts() {
        // 10 elements over 3 ranks: 0..4, 4..7, 7..10.
        let check = |range: Range<usize>, expected: &[(usize, Range<usize>)]| {
            assert_eq!(owner_pieces(10, 3, &range), expected, "range {range:?}");
        };
        check(0..10, &[(0, 0..4), (1, 4..7), (2, 7..10)]);
        check(3..5, &[(0, 3..4), (1, 4..5)]);
        check(4..7, &[(1, 4..7)]);
        check(9..10, &[(2, 9..10)]);
        check(5..5, &[]);
    }

    fn sharded(step: u64, total: usize, rank: usize, world: usize, replicas: usize) -> Holding {
        Holding { step, optimizer_step: step, ranges: held_ranges(total, rank, world, replicas) }
    }

    #[test]
    fn buddies_and_holders_are_inverse_rings() {
        assert_eq!(buddies(0, 3, 1), vec![1]);
        assert_eq!(buddies(2, 3, 1), vec![0]);
        assert_eq!(buddies(1, 4, 2), vec![2, 3]);
        assert_eq!(buddies(0, 1, 1), Vec::<usize>::new(), "one rank has no buddy");
        assert_eq!(buddies(0, 2, 3), vec![1], "at most world - 1 copies");
        for world in 1..6 {
            for replicas in 0..=REPLICAS_MAX {
                for r in 0..world {
                    for b in buddies(r, world, replicas) {
                        assert!(shadow_holders(b, world, replicas).contains(&r));
                    }
                }
            }
        }
    }

    #[test]
    fn losing_any_one_rank_of_a_buddy_ring_loses_nothing_and_losing_a_rank_and_its_shadow_does() {
        let total = 10;
        for world in 2..6 {
            let all: Vec<Holding> = (0..world).map(|r| sharded(7, total, r, world, 1)).collect();
            for lost in 0..world {
                let left: Vec<Holding> =
                    all.iter().enumerate().filter(|(r, _)| *r != lost).map(|(_, h)| h.clone()).collect();
                let plan = plan_restore(total, &left).unwrap_or_else(|m| panic!("world {world} lost {lost}: {m:?}"));
                assert_eq!(plan.step, 7);
                for (range, provider) in &plan.sources {
                    assert!(left[*provider].contains(range), "{range:?} lies inside one piece of rank {provider}");
                }
                let tiled: Vec<usize> = plan.sources.iter().flat_map(|(r, _)| r.clone()).collect();
                assert_eq!(tiled, (0..total).collect::<Vec<_>>());
            }
        }
        // Rank 1 and its shadow (rank 0) lost out of 3: shard 1 is gone.
        let left = vec![sharded(7, total, 2, 3, 1)];
        assert_eq!(plan_restore(total, &left), Err(Missing { step: 7, range: 4..7 }));
    }

    #[test]
    fn only_the_most_advanced_step_counts_and_a_full_copy_covers_everything() {
        let total = 9;
        let full_old = Holding { step: 3, optimizer_step: 3, ranges: std::iter::once(0..total).collect() };
        let holdings = vec![full_old.clone(), sharded(5, total, 0, 2, 1), sharded(5, total, 1, 2, 1)];
        let plan = plan_restore(total, &holdings).unwrap();
        assert_eq!(plan.step, 5);
        assert_eq!(
            plan.sources,
            vec![(0..5, 1), (5..9, 1)],
            "in a world of 2 a rank and its buddy copy hold everything"
        );
        assert!(!all_local(&holdings, 5, |r| held_ranges(total, r, holdings.len(), 1)), "rank 0 is behind");
        let fresh = vec![full_old.clone(), full_old];
        assert!(
            all_local(&fresh, 3, |r| held_ranges(total, r, fresh.len(), 1)),
            "full copies at one step: nothing moves"
        );
        let same = vec![sharded(5, total, 0, 3, 1), sharded(5, total, 1, 3, 1), sharded(5, total, 2, 3, 1)];
        assert!(all_local(&same, 5, |r| held_ranges(total, r, same.len(), 1)));
        assert!(
            !all_local(&same[..2], 5, |r| held_ranges(total, r, same[..2].len(), 1)),
            "a world of 2 needs bigger shards"
        );
    }

    #[test]
    fn holdings_survive_the_f32_encoding() {
        let h = Holding { step: (1 << 40) + 3, optimizer_step: 17, ranges: vec![0..3_323_392, 5..(1 << 30)] };
        assert_eq!(decode_holding(&encode_holding(&h)), h);
    }
}
