//! The checksum of checkpoint files and frames: **XXH3-64 with seed 0**.
//!
//! Why XXH3: tens of GB/s on one core (faster than any disk it guards), 64 bits, and a frozen output —
//! the XXH3 algorithm has been stable since xxHash 0.8.0 (2020), so a value written today verifies with
//! any conforming implementation tomorrow: e.g. Python's `xxhash.xxh3_64_intdigest(data)` or the `xxhsum -H3`
//! command line tool. It detects corruption, not tampering (it is not a cryptographic hash).
//!
//! Inputs up to 240 bytes go through `xxhash-rust`'s short-input paths. Longer ones through our own
//! long-input loop ([`xxh3`]), whose stripe loop runs in AVX-512 or AVX2 when the CPU has them
//! ([`crate::simd`], chosen at run time): `xxhash-rust` picks its SIMD at *compile* time, which for the
//! x86-64 baseline is SSE2, and this loop is the checksum's whole cost on checkpoint-sized inputs. The
//! tests hold every instruction set to `xxhash-rust`, one-shot and streaming, and golden values pin the
//! output so that a change of either would fail the build's tests.

pub(crate) mod xxh3;

use crate::simd::Isa;
use xxh3::{Lanes, MID_SIZE_MAX, STRIPE_LEN};

/// XXH3-64 (seed 0) of `bytes`.
pub fn checksum64(bytes: &[u8]) -> u64 {
    checksum64_with(Isa::detected(), bytes)
}

fn checksum64_with(isa: Isa, bytes: &[u8]) -> u64 {
    if bytes.len() <= MID_SIZE_MAX {
        xxhash_rust::xxh3::xxh3_64(bytes)
    } else {
        xxh3::hash_long(isa, bytes)
    }
}

/// Bytes a stream holds before hashing them: more than [`MID_SIZE_MAX`], whose inputs are hashed whole.
const STREAM_BUFFER_LEN: usize = 4 * STRIPE_LEN;

/// The same checksum fed in pieces (for files written or read in chunks):
/// `Checksum64Stream` over any split of the bytes equals [`checksum64`] of the whole.
#[derive(Clone)]
pub struct Checksum64Stream {
    isa: Isa,
    lanes: Lanes,
    total_len: u64,
    /// Bytes not yet accumulated: at least one once any are (the last stripe is only known at the end),
    /// all of them while the total is at most [`MID_SIZE_MAX`].
    buffer: [u8; STREAM_BUFFER_LEN],
    buffered: usize,
    /// The last 64 bytes accumulated: the start of the last stripe when fewer are buffered.
    last_accumulated: [u8; STRIPE_LEN],
}

impl Default for Checksum64Stream {
    fn default() -> Self {
        Self::with_isa(Isa::detected())
    }
}

impl std::fmt::Debug for Checksum64Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checksum64Stream").field("total_len", &self.total_len).finish_non_exhaustive()
    }
}

impl Checksum64Stream {
    pub fn new() -> Self {
        Self::default()
    }

    fn with_isa(isa: Isa) -> Self {
        Self {
            isa,
            lanes: Lanes::default(),
            total_len: 0,
            buffer: [0; STREAM_BUFFER_LEN],
            buffered: 0,
            last_accumulated: [0; STRIPE_LEN],
        }
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total_len += bytes.len() as u64;
        if self.buffered + bytes.len() <= STREAM_BUFFER_LEN {
            self.buffer[self.buffered..][..bytes.len()].copy_from_slice(bytes);
            self.buffered += bytes.len();
            return;
        }
        // More bytes follow the buffer's, so all its stripes can be accumulated.
        if self.buffered > 0 {
            let (fill, rest) = bytes.split_at(STREAM_BUFFER_LEN - self.buffered);
            self.buffer[self.buffered..].copy_from_slice(fill);
            self.lanes.consume(self.isa, &self.buffer);
            self.last_accumulated = *self.buffer.last_chunk().expect("a whole buffer");
            (bytes, self.buffered) = (rest, 0);
        }
        // Every stripe of `bytes` that ends before its last byte; the rest (1 to 64 bytes) is buffered.
        let stripes = (bytes.len() - 1) / STRIPE_LEN * STRIPE_LEN;
        let (whole, rest) = bytes.split_at(stripes);
        if let Some(last) = whole.last_chunk() {
            self.lanes.consume(self.isa, whole);
            self.last_accumulated = *last;
        }
        self.buffer[..rest.len()].copy_from_slice(rest);
        self.buffered = rest.len();
    }

    pub fn finish(&self) -> u64 {
        let pending = &self.buffer[..self.buffered];
        if self.total_len <= MID_SIZE_MAX as u64 {
            return xxhash_rust::xxh3::xxh3_64(pending);
        }
        let mut lanes = self.lanes.clone();
        let stripes = (pending.len() - 1) / STRIPE_LEN * STRIPE_LEN;
        lanes.consume(self.isa, &pending[..stripes]);
        let last_stripe = match pending.last_chunk() {
            Some(last) => *last,
            None => {
                let mut last = [0; STRIPE_LEN];
                let (earlier, now) = last.split_at_mut(STRIPE_LEN - pending.len());
                earlier.copy_from_slice(&self.last_accumulated[pending.len()..]);
                now.copy_from_slice(pending);
                last
            }
        };
        lanes.finish(&last_stripe, self.total_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What every path must equal: `xxhash-rust`'s one-shot XXH3-64.
    fn reference(bytes: &[u8]) -> u64 {
        xxhash_rust::xxh3::xxh3_64(bytes)
    }

    /// Deterministic pseudo-random numbers (splitmix64), so that a failure replays.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn bytes(&mut self, len: usize) -> Vec<u8> {
            (0..len).map(|_| self.next() as u8).collect()
        }
    }

    /// `bytes` through a stream of `isa`, in pieces of the given lengths (the rest as one last piece).
    fn streamed(isa: Isa, bytes: &[u8], pieces: impl IntoIterator<Item = usize>) -> u64 {
        let mut stream = Checksum64Stream::with_isa(isa);
        let mut rest = bytes;
        for len in pieces {
            let (piece, after) = rest.split_at(len.min(rest.len()));
            stream.update(piece);
            rest = after;
        }
        stream.update(rest);
        stream.finish()
    }

    fn check(isa: Isa, bytes: &[u8], what: &str) {
        let want = reference(bytes);
        let (name, len) = (isa.name(), bytes.len());
        assert_eq!(checksum64_with(isa, bytes), want, "{name}: one-shot of {len} bytes ({what})");
        assert_eq!(streamed(isa, bytes, []), want, "{name}: one update of {len} bytes ({what})");
    }

    #[test]
    fn golden_values_from_the_xxh3_specification() {
        // XXH3_64bits("") from the reference implementation's test vectors.
        assert_eq!(checksum64(b""), 0x2D06_8005_38D3_94C2);
    }

    /// Values computed by the reference C library (libxxhash 0.8.1, `XXH3_64bits`), on every
    /// instruction set this CPU has, one-shot and streamed.
    #[test]
    fn golden_values_pin_the_output_across_versions() {
        let pattern = |len: u32| -> Vec<u8> { (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect() };
        let goldens = [
            (b"troupe".to_vec(), GOLDEN_TROUPE),
            (pattern(100_000), GOLDEN_PATTERN),
            (pattern(3 << 20 | 37), GOLDEN_PATTERN_3_MIB),
        ];
        for isa in Isa::available() {
            for (bytes, golden) in &goldens {
                assert_eq!(checksum64_with(isa, bytes), *golden, "{}: {} bytes", isa.name(), bytes.len());
                assert_eq!(streamed(isa, bytes, [1000, 7, 4096]), *golden, "{}: {} bytes", isa.name(), bytes.len());
            }
        }
        assert_eq!(checksum64(&goldens[1].0), GOLDEN_PATTERN);
    }

    const GOLDEN_TROUPE: u64 = 0xEC21_D174_FEBE_C525;
    const GOLDEN_PATTERN: u64 = 0x9200_5691_5640_359F;
    const GOLDEN_PATTERN_3_MIB: u64 = 0x28C4_8DF4_B09E_0022;

    #[test]
    fn every_length_up_to_2048_equals_xxhash_rust_on_every_isa() {
        let bytes = Rng(1).bytes(2048);
        let ones = vec![0xFFu8; 2048];
        for isa in Isa::available() {
            for len in 0..=bytes.len() {
                check(isa, &bytes[..len], "random");
                check(isa, &ones[..len], "all ones");
                let want = reference(&bytes[..len]);
                assert_eq!(
                    streamed(isa, &bytes[..len], vec![1; len]),
                    want,
                    "{}: {len} bytes one at a time",
                    isa.name()
                );
                let thirds = [len / 3, len / 3];
                assert_eq!(streamed(isa, &bytes[..len], thirds), want, "{}: {len} bytes in thirds", isa.name());
            }
        }
    }

    #[test]
    fn every_alignment_of_the_input_equals_xxhash_rust() {
        let bytes = Rng(2).bytes(70_000);
        for isa in Isa::available() {
            for start in 0..128 {
                for len in [241, 1024 + 17, 4096 + 63, 65_536] {
                    check(isa, &bytes[start..start + len], &format!("from offset {start}"));
                }
            }
        }
    }

    #[test]
    fn random_lengths_up_to_several_mib_in_random_pieces_equal_xxhash_rust() {
        let mut rng = Rng(3);
        let bytes = rng.bytes(6 << 20);
        for case in 0..24 {
            // Half the lengths just around the end of a block (1 KiB), where the scrambles fall.
            let len = match case % 2 {
                0 => rng.below(bytes.len() + 1),
                _ => ((rng.below(bytes.len() >> 10) + 1) << 10) - 1 + rng.below(3) + 64 * rng.below(2),
            }
            .min(bytes.len() - 64);
            let start = rng.below(64);
            let input = &bytes[start..start + len];
            let want = reference(input);
            let max_piece = [7, 300, 70_000, 3 << 20][case % 4];
            let (mut pieces, mut covered) = (Vec::new(), 0);
            while covered < len {
                pieces.push(rng.below(max_piece) + 1);
                covered += pieces[pieces.len() - 1];
            }
            for isa in Isa::available() {
                assert_eq!(checksum64_with(isa, input), want, "{}: case {case}, {len} bytes", isa.name());
                let (name, count) = (isa.name(), pieces.len());
                assert_eq!(
                    streamed(isa, input, pieces.clone()),
                    want,
                    "{name}: case {case}, {len} bytes in {count} pieces"
                );
            }
        }
    }

    #[test]
    fn a_stream_can_be_finished_at_any_point_and_go_on() {
        let bytes = Rng(4).bytes(20_000);
        for isa in Isa::available() {
            let mut stream = Checksum64Stream::with_isa(isa);
            let mut at = 0;
            for piece in [0, 1, 100, 139, 16, 1, 63, 64, 65, 1024, 3000, 15_527] {
                stream.update(&bytes[at..at + piece]);
                at += piece;
                assert_eq!(stream.finish(), reference(&bytes[..at]), "{}: after {at} bytes", isa.name());
            }
            assert_eq!(at, bytes.len());
        }
    }

    /// The kernels alone: from every position in a block, over every stripe count up to three blocks,
    /// each instruction set leaves the same lanes as the portable loop.
    #[test]
    fn every_isa_accumulates_the_same_lanes_as_the_portable_loop() {
        let mut rng = Rng(5);
        let stripes = rng.bytes(48 * STRIPE_LEN);
        for isa in Isa::available() {
            for start in 0..xxh3::STRIPES_PER_BLOCK {
                for count in 0..=48 {
                    let mut lanes = Lanes::default();
                    lanes.acc.iter_mut().for_each(|lane| *lane = rng.next());
                    lanes.stripes_in_block = start;
                    let mut want = lanes.clone();
                    want.consume_portable(&stripes[..count * STRIPE_LEN]);
                    lanes.consume(isa, &stripes[..count * STRIPE_LEN]);
                    assert_eq!(
                        (lanes.acc, lanes.stripes_in_block),
                        (want.acc, want.stripes_in_block),
                        "{}: {count} stripes from {start}",
                        isa.name()
                    );
                }
            }
        }
    }

    #[test]
    fn a_flipped_bit_changes_the_checksum() {
        let mut bytes = vec![7u8; 4096];
        let before = checksum64(&bytes);
        bytes[2049] ^= 0x10;
        assert_ne!(before, checksum64(&bytes));
    }

    proptest! {
        #[test]
        fn streaming_over_any_split_equals_one_shot(bytes in prop::collection::vec(any::<u8>(), 0..5000), cut in 0usize..5000) {
            let cut = cut.min(bytes.len());
            let mut stream = Checksum64Stream::new();
            stream.update(&bytes[..cut]);
            stream.update(&bytes[cut..]);
            prop_assert_eq!(stream.finish(), checksum64(&bytes));
        }
    }
}
