//! How `len` elements (or samples) are cut into `parts` contiguous pieces when `len` is not divisible by
//! `parts`: the first `len % parts` pieces get one more. Collectives chunk buffers this way, shards split
//! the flat parameter vector this way, and data-parallel ranks split a global batch this way.

use std::ops::Range;

/// Piece `index` of `len` cut into `parts` balanced contiguous pieces.
///
/// # Panics
/// If `parts` is 0 or `index >= parts`.
pub fn balanced_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    assert!(parts > 0 && index < parts, "piece {index} of {parts}");
    let (base, extra) = (len / parts, len % parts);
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

#[cfg(test)]
mod tests {
    use super::balanced_range;

    #[test]
    fn pieces_tile_the_range_and_differ_by_at_most_one() {
        for len in 0..40 {
            for parts in 1..9 {
                let mut next = 0;
                for i in 0..parts {
                    let r = balanced_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / parts || r.len() == len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(balanced_range(8, 3, 2), 6..8);
    }
}
