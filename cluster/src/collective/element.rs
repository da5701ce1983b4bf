//! Element types a collective moves: f32, bf16, f16. On the wire they are little-endian raw bytes of
//! their own type; reductions accumulate in f32 (`troupe_kernels::reduce`).
//!
//! Every conversion between the f32 working buffer and the element type — encoding a send, widening a
//! received chunk, rounding a partial result to what travels, handing the result back — is a slice
//! conversion through troupe-kernels' cast kernels (SIMD where the CPU has it), which round exactly as
//! `half`'s `from_f32` does, element for element (tested below over every 16-bit pattern).

use bytes::BytesMut;
use half::{bf16, f16};
use troupe_kernels::cast;
use troupe_kernels::reduce::ReduceInput;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

/// Elements rounded per block by [`Element::round_in_place`] (an L1-resident scratch).
const ROUND_BLOCK_ELEMS: usize = 1024;

/// `NcclType` lets the NCCL backend move the same element types on the GPU.
pub trait Element:
    ReduceInput + bytemuck::Pod + cudarc::nccl::NcclType + Send + Sync + std::fmt::Debug + 'static
{
    const DTYPE: Dtype;
    const BYTES: usize = std::mem::size_of::<Self>();
    fn from_f32(v: f32) -> Self;

    /// `dst[i] = Self::from_f32(src[i])` (round to nearest even), as one slice conversion.
    ///
    /// # Panics
    /// If the lengths differ.
    fn narrow(src: &[f32], dst: &mut [Self]);

    /// `dst[i] = src[i].to_f32()` (exact), as one slice conversion.
    ///
    /// # Panics
    /// If the lengths differ.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Appends the wire bytes of `values`, rounded to this type, to `out`.
    fn encode_into(values: &[f32], out: &mut BytesMut) {
        let start = out.len();
        out.resize(start + values.len() * Self::BYTES, 0);
        let dst = &mut out[start..];
        match bytemuck::try_cast_slice_mut::<u8, Self>(dst) {
            Ok(dst) => Self::narrow(values, dst),
            // Only an odd `start` gets here (buffers are allocated aligned).
            Err(_) => dst
                .chunks_exact_mut(Self::BYTES)
                .zip(values)
                .for_each(|(d, &v)| d.copy_from_slice(bytemuck::bytes_of(&Self::from_f32(v)))),
        }
    }

    /// Rounds every value to this type and back — what it becomes on the wire — in place.
    fn round_in_place(values: &mut [f32]) {
        if Self::DTYPE == Dtype::F32 {
            return;
        }
        let mut scratch = [Self::zeroed(); ROUND_BLOCK_ELEMS];
        for block in values.chunks_mut(ROUND_BLOCK_ELEMS) {
            let scratch = &mut scratch[..block.len()];
            Self::narrow(block, scratch);
            Self::widen(scratch, block);
        }
    }
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn encode_into(values: &[f32], out: &mut BytesMut) {
        out.extend_from_slice(bytemuck::cast_slice(values));
    }
}

impl Element for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        cast::f32_to_bf16(src, dst);
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        cast::bf16_to_f32(src, dst);
    }
}

impl Element for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        cast::f32_to_f16(src, dst);
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        cast::f16_to_f32(src, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 inputs that hit every rounding case of both 16-bit types: every 16-bit pattern as the top
    /// half of an f32, each with low halves below, at and above the tie, plus f16's boundaries.
    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..=u16::MAX)
            .flat_map(|b| {
                let top = u32::from(b) << 16;
                [top, top | 0x7fff, top | 0x8000, top | 0x8001, top | 0xffff]
            })
            .map(f32::from_bits)
            .collect();
        xs.extend((0..=u16::MAX).flat_map(|b| {
            let x = f16::from_bits(b).to_f32().to_bits();
            [x.wrapping_add(0xfff), x.wrapping_add(0x1000), x.wrapping_add(0x1001)].map(f32::from_bits)
        }));
        xs
    }

    /// What the collectives computed element by element before they used the cast kernels.
    fn check_against_element_wise<E: Element>() {
        let xs = inputs();
        let bits = |b: &[u8]| b.to_vec();
        let want: Vec<E> = xs.iter().map(|x| E::from_f32(*x)).collect();
        let mut encoded = BytesMut::new();
        E::encode_into(&xs, &mut encoded);
        assert_eq!(bits(&encoded), bits(bytemuck::cast_slice(&want)), "{:?} encode", E::DTYPE);
        // Appended at an odd offset (the unaligned path): the same bytes.
        let mut odd = BytesMut::from(&[7u8][..]);
        E::encode_into(&xs, &mut odd);
        assert_eq!(bits(&odd[1..]), bits(bytemuck::cast_slice(&want)), "{:?} encode at an odd offset", E::DTYPE);
        let mut widened = vec![0f32; want.len()];
        E::widen(&want, &mut widened);
        let want_wide: Vec<u32> = want.iter().map(|v| v.to_f32().to_bits()).collect();
        assert_eq!(widened.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_wide, "{:?} widen", E::DTYPE);
        let mut rounded = xs.clone();
        E::round_in_place(&mut rounded);
        assert_eq!(rounded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_wide, "{:?} round", E::DTYPE);
        for len in [0, 1, 17, 1023, 1024, 1025] {
            let mut r = xs[..len].to_vec();
            E::round_in_place(&mut r);
            assert_eq!(r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_wide[..len], "length {len}");
        }
    }

    #[test]
    fn slice_conversions_equal_the_element_wise_ones_bit_for_bit() {
        check_against_element_wise::<f32>();
        check_against_element_wise::<bf16>();
        check_against_element_wise::<f16>();
    }
}
