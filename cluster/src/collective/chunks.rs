//! How a buffer of `len` elements is cut into `n` chunks when `len` is not divisible by `n`: the first
//! `len % n` chunks get one element more.

use std::ops::Range;

/// Chunk `i` of a buffer of `len` elements cut into `n` chunks (troupe_kernels::balanced_range).
pub fn chunk_range(len: usize, n: usize, i: usize) -> Range<usize> {
    troupe_kernels::balanced_range(len, n, i)
}
