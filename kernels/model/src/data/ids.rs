//! A token stream's ids in memory, each held in 16 bits while every id fits (a byte or GPT-2 vocabulary:
//! half the memory) and in 32 bits once one does not.

use std::ops::Range;
use std::sync::Arc;

use crate::rng::hash_words;

/// The ids of a corpus, read-only and shared.
#[derive(Clone, Debug)]
pub(crate) enum Ids {
    U16(Arc<[u16]>),
    U32(Arc<[u32]>),
}

impl Ids {
    /// The narrowest form that holds `ids`.
    pub(crate) fn from_u32(ids: Vec<u32>) -> Self {
        if ids.iter().all(|&t| t <= u32::from(u16::MAX)) {
            Ids::U16(ids.iter().map(|&t| t as u16).collect())
        } else {
            Ids::U32(ids.into())
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Ids::U16(ids) => ids.len(),
            Ids::U32(ids) => ids.len(),
        }
    }

    pub(crate) fn get(&self, position: usize) -> u32 {
        match self {
            Ids::U16(ids) => u32::from(ids[position]),
            Ids::U32(ids) => ids[position],
        }
    }

    /// Appends the ids of `range`, as libtorch's int64.
    pub(crate) fn extend_i64(&self, range: Range<usize>, out: &mut Vec<i64>) {
        match self {
            Ids::U16(ids) => out.extend(ids[range].iter().map(|&t| i64::from(t))),
            Ids::U32(ids) => out.extend(ids[range].iter().map(|&t| i64::from(t))),
        }
    }

    /// The ids of `range`, copied, in the narrowest form that holds them (so the fingerprint stays a
    /// function of the ids alone).
    pub(crate) fn slice(&self, range: Range<usize>) -> Self {
        match self {
            Ids::U16(ids) => Ids::U16(ids[range].into()),
            Ids::U32(ids) => Ids::from_u32(ids[range].to_vec()),
        }
    }

    /// The first id that is `bound` or more, and its position.
    pub(crate) fn first_at_least(&self, bound: usize) -> Option<(usize, u32)> {
        match self {
            Ids::U16(ids) => ids.iter().position(|&t| usize::from(t) >= bound).map(|p| (p, u32::from(ids[p]))),
            Ids::U32(ids) => ids.iter().position(|&t| t as usize >= bound).map(|p| (p, ids[p])),
        }
    }

    /// A function of the ids alone (not of how they are held): 16-bit streams hash as they always have, so
    /// checkpoints written before 32-bit ids existed still match their corpus.
    pub(crate) fn fingerprint(&self) -> u64 {
        match self {
            Ids::U16(ids) => {
                let words: Vec<u64> =
                    ids.chunks(4).map(|c| c.iter().fold(0u64, |acc, &t| (acc << 16) | u64::from(t))).collect();
                hash_words(&[hash_words(&words), ids.len() as u64])
            }
            // Only a stream with an id above 65535 is held so, so the two forms never describe one stream.
            Ids::U32(ids) => {
                let words: Vec<u64> =
                    ids.chunks(2).map(|c| c.iter().fold(0u64, |acc, &t| (acc << 32) | u64::from(t))).collect();
                hash_words(&[hash_words(&words), ids.len() as u64, 32])
            }
        }
    }
}

/// Collects a stream of ids in 16 bits, widening to 32 at the first id above 65535.
#[derive(Debug)]
pub(crate) enum IdsBuilder {
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl Default for IdsBuilder {
    fn default() -> Self {
        IdsBuilder::U16(Vec::new())
    }
}

impl IdsBuilder {
    pub(crate) fn extend(&mut self, ids: &[u32]) {
        if let IdsBuilder::U16(narrow) = self {
            if ids.iter().all(|&t| t <= u32::from(u16::MAX)) {
                narrow.extend(ids.iter().map(|&t| t as u16));
                return;
            }
            *self = IdsBuilder::U32(narrow.iter().map(|&t| u32::from(t)).collect());
        }
        if let IdsBuilder::U32(wide) = self {
            wide.extend_from_slice(ids);
        }
    }

    pub(crate) fn finish(self) -> Ids {
        match self {
            IdsBuilder::U16(ids) => Ids::U16(ids.into()),
            IdsBuilder::U32(ids) => Ids::U32(ids.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_stay_narrow_until_one_needs_32_bits_and_read_the_same_either_way() {
        let narrow: Vec<u32> = vec![0, 7, 65535, 3];
        let ids = Ids::from_u32(narrow.clone());
        assert!(matches!(ids, Ids::U16(_)));
        let mut builder = IdsBuilder::default();
        builder.extend(&narrow[..2]);
        builder.extend(&[70_000, 1]);
        let wide = builder.finish();
        assert_eq!(wide.len(), 4);
        assert!(matches!(wide, Ids::U32(_)));
        assert_eq!((0..4).map(|i| wide.get(i)).collect::<Vec<_>>(), [0, 7, 70_000, 1]);
        let mut out = Vec::new();
        wide.extend_i64(1..3, &mut out);
        ids.extend_i64(1..3, &mut out);
        assert_eq!(out, [7, 70_000, 7, 65535]);
        assert_eq!(wide.first_at_least(65_536), Some((2, 70_000)));
        assert_eq!(ids.first_at_least(65_535), Some((2, 65_535)));
        assert_eq!(ids.first_at_least(65_536), None);
    }

    #[test]
    fn fingerprints_tell_streams_apart() {
        let a = Ids::from_u32(vec![1, 2, 3, 4, 5]);
        assert_eq!(a.fingerprint(), Ids::from_u32(vec![1, 2, 3, 4, 5]).fingerprint());
        assert_ne!(a.fingerprint(), Ids::from_u32(vec![1, 2, 3, 4, 6]).fingerprint());
        assert_ne!(a.fingerprint(), Ids::from_u32(vec![1, 2, 3, 4, 5, 0]).fingerprint());
        let wide = Ids::from_u32(vec![1, 2, 3, 4, 70_000]);
        assert_ne!(wide.fingerprint(), Ids::from_u32(vec![1, 2, 3, 4, 70_001]).fingerprint());
    }
}
