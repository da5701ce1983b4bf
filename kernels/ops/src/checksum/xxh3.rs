//! XXH3-64's long-input loop (inputs over [`MID_SIZE_MAX`] bytes), seed 0 and the default secret, as the
//! xxHash specification defines it (`xxhash.h`, `XXH3_hashLong_64b`):
//!
//! - 8 lanes of u64 start at [`INITIAL_ACC`].
//! - Every 64-byte *stripe* but the last is accumulated with the 64 bytes of the secret at offset 8·k, k
//!   being the stripe's index in its *block* of 16: lane i gets `lo32(d ^ s) · hi32(d ^ s)` of its own
//!   data word (d) and secret word (s), plus the data word of lane i ^ 1.
//! - After the 16th stripe of each block the lanes are *scrambled* with the last 64 bytes of the secret.
//! - The last stripe is the input's last 64 bytes (overlapping the stripes before it when the length is
//!   not a multiple of 64), accumulated with the secret at offset 121 and never scrambled; the lanes are
//!   then merged with the secret at offset 11 and the length.
//!
//! The loop over stripes is where the time goes; [`crate::simd`] has it in AVX2 and AVX-512, and the
//! portable code here is its fallback and its reference (tests hold each to the other and both to
//! `xxhash-rust`, bit for bit).

use crate::simd::{self, Isa};

/// Inputs up to this length are hashed by the short-input paths (`xxhash-rust`), not by this loop.
pub(crate) const MID_SIZE_MAX: usize = 240;
pub(crate) const STRIPE_LEN: usize = 64;
pub(crate) const STRIPES_PER_BLOCK: usize = 16;
/// Offset of the secret advanced per stripe.
const SECRET_CONSUME_RATE: usize = 8;
const SECRET_LASTACC_START: usize = 7;
const SECRET_MERGEACCS_START: usize = 11;

/// XXH3's default secret (`XXH3_kSecret`), 192 bytes.
pub(crate) const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, //
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, //
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, //
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, //
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, //
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, //
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, //
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, //
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, //
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, //
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, //
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e, //
];

/// Offset of the 64 secret bytes that scramble the lanes after each block.
pub(crate) const SECRET_SCRAMBLE_START: usize = SECRET.len() - STRIPE_LEN;

pub(crate) const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

const INITIAL_ACC: [u64; 8] = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];

/// The 8 lanes and where the next stripe falls in its block: the whole state of the loop.
#[derive(Clone, Debug)]
pub(crate) struct Lanes {
    pub(crate) acc: [u64; 8],
    /// Stripes accumulated since the last scramble, 0..16.
    pub(crate) stripes_in_block: usize,
}

impl Default for Lanes {
    fn default() -> Self {
        Self { acc: INITIAL_ACC, stripes_in_block: 0 }
    }
}

impl Lanes {
    /// Accumulates every stripe of `stripes` (a whole number of them), scrambling after each block's
    /// 16th, with the instructions `isa` allows.
    pub(crate) fn consume(&mut self, isa: Isa, stripes: &[u8]) {
        assert_eq!(stripes.len() % STRIPE_LEN, 0);
        if !simd::xxh3_consume(isa, self, stripes) {
            self.consume_portable(stripes);
        }
    }

    /// [`Lanes::consume`] without SIMD: the reference the SIMD paths are held to.
    pub(crate) fn consume_portable(&mut self, stripes: &[u8]) {
        for stripe in stripes.as_chunks::<STRIPE_LEN>().0 {
            accumulate(&mut self.acc, stripe, self.stripes_in_block * SECRET_CONSUME_RATE);
            self.stripes_in_block += 1;
            if self.stripes_in_block == STRIPES_PER_BLOCK {
                scramble(&mut self.acc);
                self.stripes_in_block = 0;
            }
        }
    }

    /// The hash of an input of `total_len` bytes (over [`MID_SIZE_MAX`]) whose stripes before the last
    /// are in these lanes and whose last 64 bytes are `last_stripe`.
    pub(crate) fn finish(mut self, last_stripe: &[u8; STRIPE_LEN], total_len: u64) -> u64 {
        debug_assert!(total_len > MID_SIZE_MAX as u64);
        accumulate(&mut self.acc, last_stripe, SECRET.len() - STRIPE_LEN - SECRET_LASTACC_START);
        let mut result = total_len.wrapping_mul(PRIME64_1);
        for (i, pair) in self.acc.as_chunks::<2>().0.iter().enumerate() {
            let at = SECRET_MERGEACCS_START + 16 * i;
            result = result.wrapping_add(mul128_fold64(pair[0] ^ secret_word(at), pair[1] ^ secret_word(at + 8)));
        }
        avalanche(result)
    }
}

/// XXH3-64 (seed 0) of `bytes`, which must be longer than [`MID_SIZE_MAX`].
pub(crate) fn hash_long(isa: Isa, bytes: &[u8]) -> u64 {
    assert!(bytes.len() > MID_SIZE_MAX);
    // Every stripe that ends before the last byte; the last 64 bytes are the last stripe.
    let stripes = (bytes.len() - 1) / STRIPE_LEN * STRIPE_LEN;
    let mut lanes = Lanes::default();
    lanes.consume(isa, &bytes[..stripes]);
    lanes.finish(bytes.last_chunk().expect("longer than a stripe"), bytes.len() as u64)
}

fn secret_word(at: usize) -> u64 {
    u64::from_le_bytes(SECRET[at..at + 8].try_into().expect("8 bytes"))
}

/// One stripe into the lanes with the secret's 64 bytes at `secret_at`.
fn accumulate(acc: &mut [u64; 8], stripe: &[u8; STRIPE_LEN], secret_at: usize) {
    let key = &SECRET[secret_at..secret_at + STRIPE_LEN];
    let data: [u64; 8] = std::array::from_fn(|i| u64::from_le_bytes(stripe.as_chunks::<8>().0[i]));
    let key: [u64; 8] = std::array::from_fn(|i| u64::from_le_bytes(key.as_chunks::<8>().0[i]));
    // Written lane by lane (each lane's new value from its own terms), which LLVM vectorizes.
    for (i, lane) in acc.iter_mut().enumerate() {
        let mixed = data[i] ^ key[i];
        *lane = lane.wrapping_add(data[i ^ 1]).wrapping_add((mixed & 0xFFFF_FFFF).wrapping_mul(mixed >> 32));
    }
}

fn scramble(acc: &mut [u64; 8]) {
    for (i, lane) in acc.iter_mut().enumerate() {
        let key = secret_word(SECRET_SCRAMBLE_START + 8 * i);
        *lane = (*lane ^ (*lane >> 47) ^ key).wrapping_mul(PRIME32_1);
    }
}

fn mul128_fold64(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    product as u64 ^ (product >> 64) as u64
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}
