//! Ranks to coordinates and coordinates to hosts.
//!
//! The rank order is tp innermost, then dp, then pp outermost: rank = tp + T·(dp + D·pp), so the T ranks
//! of a tensor group are consecutive, the D replicas of one stage follow each other, and the stages are
//! the outermost blocks — the order Megatron-LM and torchtitan use, and the one the pipeline engine
//! already uses with T = 1 (rank r runs stage r div D of replica r mod D). Hosts are filled with whole
//! tensor groups in rank order, so a tensor group shares a host's memory and consecutive stages land on
//! different hosts as soon as one host cannot hold a whole stage.

use serde::{Deserialize, Serialize};

use super::error::LayoutError;
use super::request::{Degrees, Host};

/// A rank's place in the three groups it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// The coordinates of `rank`; the inverse of [`rank_of`].
pub fn coords_of(degrees: Degrees, rank: usize) -> Coords {
    assert!(rank < degrees.world(), "rank {rank} of a world of {}", degrees.world());
    let (tp, dp, pp) = crate::protocol::rank_coords(rank, degrees.tp, degrees.dp);
    Coords { tp, dp, pp }
}

/// The rank at `coords`; the inverse of [`coords_of`].
pub fn rank_of(degrees: Degrees, coords: Coords) -> usize {
    assert!(coords.tp < degrees.tp && coords.dp < degrees.dp && coords.pp < degrees.pp, "{coords:?} in {degrees:?}");
    crate::protocol::rank_at((coords.tp, coords.dp, coords.pp), degrees.tp, degrees.dp)
}

/// The process groups as lists of ranks, each sorted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Groups {
    /// One per (dp, pp): the T ranks that split each layer's matrices.
    pub tensor: Vec<Vec<usize>>,
    /// One per (dp, tp): the P stages of one replica's pipeline.
    pub pipeline: Vec<Vec<usize>>,
    /// One per (pp, tp): the D replicas that average their gradients.
    pub data: Vec<Vec<usize>>,
}

pub fn groups(d: Degrees) -> Groups {
    let rank = |dp, pp, tp| rank_of(d, Coords { dp, pp, tp });
    let mut out = Groups { tensor: Vec::new(), pipeline: Vec::new(), data: Vec::new() };
    for pp in 0..d.pp {
        for dp in 0..d.dp {
            out.tensor.push((0..d.tp).map(|tp| rank(dp, pp, tp)).collect());
        }
    }
    for dp in 0..d.dp {
        for tp in 0..d.tp {
            out.pipeline.push((0..d.pp).map(|pp| rank(dp, pp, tp)).collect());
        }
    }
    for pp in 0..d.pp {
        for tp in 0..d.tp {
            out.data.push((0..d.dp).map(|dp| rank(dp, pp, tp)).collect());
        }
    }
    out
}

/// Where a rank runs: the host's index in the request and the slot on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seat {
    pub host: usize,
    pub slot: usize,
}

/// The seat of every rank: ranks fill each host's slots in host order. As the slots equal the world
/// (checked before), every tensor group lies inside one host exactly when every host's slots are a
/// multiple of T; otherwise some span two hosts, refused with `within_host`.
pub fn seats(d: Degrees, hosts: &[Host], within_host: bool) -> Result<Vec<Seat>, LayoutError> {
    let fit: usize = hosts.iter().map(|h| h.slots / d.tp).sum();
    let needed = d.pp * d.dp;
    if within_host && fit < needed {
        let slots = hosts.iter().map(|h| format!("{}: {}", h.name, h.slots)).collect::<Vec<_>>().join(", ");
        return Err(LayoutError::TensorGroupsDoNotFit { tp: d.tp, slots, fit, needed });
    }
    Ok(fill_in_order(hosts))
}

/// Ranks fill each host's slots in host order.
fn fill_in_order(hosts: &[Host]) -> Vec<Seat> {
    hosts.iter().enumerate().flat_map(|(host, h)| (0..h.slots).map(move |slot| Seat { host, slot })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_count_tp_then_dp_then_pp() {
        let d = Degrees { tp: 2, pp: 2, dp: 2 };
        let order: Vec<(usize, usize, usize)> = (0..8).map(|r| coords_of(d, r)).map(|c| (c.pp, c.dp, c.tp)).collect();
        assert_eq!(order, [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]);
        assert!((0..8).all(|r| rank_of(d, coords_of(d, r)) == r));
    }

    #[test]
    fn without_tensor_parallelism_stages_are_the_pipeline_engines() {
        // The engine runs stage r div D of replica r mod D.
        let d = Degrees { tp: 1, pp: 3, dp: 2 };
        assert!((0..6).all(|r| coords_of(d, r) == Coords { dp: r % 2, pp: r / 2, tp: 0 }));
    }

    #[test]
    fn groups_are_the_ranks_that_differ_in_one_coordinate() {
        let g = groups(Degrees { tp: 2, pp: 2, dp: 2 });
        assert_eq!(g.tensor, [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(g.pipeline, [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(g.data, [[0, 2], [1, 3], [4, 6], [5, 7]]);
    }

    #[test]
    fn hosts_whose_slots_split_a_tensor_group_are_refused_unless_allowed() {
        let d = Degrees { tp: 2, pp: 2, dp: 1 };
        let hosts = [Host { name: "a".into(), slots: 3 }, Host { name: "b".into(), slots: 1 }];
        let err = seats(d, &hosts, true).unwrap_err();
        assert!(matches!(err, LayoutError::TensorGroupsDoNotFit { fit: 1, needed: 2, .. }), "{err}");
        let seated = seats(d, &hosts, false).unwrap();
        assert_eq!(seated.iter().map(|s| s.host).collect::<Vec<_>>(), [0, 0, 0, 1]);
    }
}
