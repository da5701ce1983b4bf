//! Which pieces of which tensors a contiguous range of the flat order covers (pure).
//!
//! A shard of a DDP or ZeRO layout is a balanced range of the flat order (`troupe_kernels::partition::
//! balanced_range`, the split collectives and optimizer shards use); reading a target shard back is the
//! same computation over the saved pieces.

use std::ops::Range;

use troupe_kernels::partition::balanced_range;

/// Elements `elements` of tensor `tensor`, which sit at `flat` in the flat order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatPiece {
    pub tensor: usize,
    pub elements: Range<usize>,
    pub flat: Range<usize>,
}

/// The flat range of shard `index` of `shards` over `total` elements.
pub fn shard_range(total: usize, shards: usize, index: usize) -> Range<usize> {
    balanced_range(total, shards, index)
}

/// The pieces of tensors (given by `offsets`: tensor `i` is `offsets[i]..offsets[i + 1]`) that `range`
/// covers, in order; empty tensors and empty intersections are left out.
pub fn pieces_in(offsets: &[usize], range: Range<usize>) -> Vec<FlatPiece> {
    let mut pieces = Vec::new();
    for (tensor, bounds) in offsets.windows(2).enumerate() {
        let (start, end) = (bounds[0].max(range.start), bounds[1].min(range.end));
        if start < end {
            pieces.push(FlatPiece { tensor, elements: start - bounds[0]..end - bounds[0], flat: start..end });
        }
    }
    pieces
}

/// Intersection of two ranges (empty when they do not overlap).
pub fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once_whatever_the_count() {
        let offsets = [0, 5, 5, 12, 30];
        for shards in 1..=7 {
            let mut covered = vec![0u8; 30];
            for index in 0..shards {
                let range = shard_range(30, shards, index);
                for p in pieces_in(&offsets, range.clone()) {
                    assert_eq!(p.flat.len(), p.elements.len());
                    assert_eq!(p.flat.start, offsets[p.tensor] + p.elements.start);
                    assert!(p.flat.start >= range.start && p.flat.end <= range.end);
                    covered[p.flat.clone()].iter_mut().for_each(|c| *c += 1);
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{shards} shards: {covered:?}");
        }
    }

    #[test]
    fn a_range_inside_one_tensor_is_one_piece() {
        assert_eq!(pieces_in(&[0, 10, 20], 12..15), vec![FlatPiece { tensor: 1, elements: 2..5, flat: 12..15 }]);
        assert_eq!(intersect(&(0..4), &(6..9)).len(), 0);
        assert_eq!(intersect(&(0..7), &(6..9)), 6..7);
    }
}
