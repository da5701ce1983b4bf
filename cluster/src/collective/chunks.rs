//! How a buffer of `len` elements is cut into `n` chunks when `len` is not divisible by `n`: the first
//! `len % n` chunks get one element more.

use std::ops::Range;

pub fn chunk_range(len: usize, n: usize, i: usize) -> Range<usize> {
    assert!(n > 0 && i < n, "chunk {i} of {n}");
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

#[cfg(test)]
mod tests {
    use super::chunk_range;

    #[test]
    fn chunks_tile_the_buffer() {
        for len in 0..20 {
            for n in 1..9 {
                let mut next = 0;
                for i in 0..n {
                    let r = chunk_range(len, n, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / n || r.len() == len / n + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
