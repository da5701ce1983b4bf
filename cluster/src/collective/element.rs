//! Element types a collective moves: f32, bf16, f16. On the wire they are little-endian raw bytes of
//! their own type; reductions accumulate in f32 (`troupe_kernels::reduce`), and conversions to and
//! from f32 are troupe-kernels' casts (round to nearest, ties to even; bit-identical to `half`'s).

use bytes::BytesMut;
use half::{bf16, f16};
use troupe_kernels::reduce::ReduceInput;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

/// `NcclType` lets the NCCL backend move the same element types on the GPU.
pub trait Element:
    ReduceInput + bytemuck::Pod + cudarc::nccl::NcclType + Send + Sync + std::fmt::Debug + 'static
{
    const DTYPE: Dtype;
    const BYTES: usize = std::mem::size_of::<Self>();
    fn from_f32(v: f32) -> Self;

    /// `dst[i] = src[i]` rounded to this type.
    fn cast_from_f32(src: &[f32], dst: &mut [Self]);

    /// `dst[i] = src[i]` as f32 (exact for every type here).
    fn cast_to_f32(src: &[Self], dst: &mut [f32]);

    /// Appends the wire bytes of `values`, rounded to this type, to `out`.
    fn encode_into(values: &[f32], out: &mut BytesMut) {
        let start = out.len();
        out.resize(start + values.len() * Self::BYTES, 0);
        let dst = &mut out[start..];
        match bytemuck::try_cast_slice_mut::<u8, Self>(dst) {
            Ok(dst) => Self::cast_from_f32(values, dst),
            // Only an odd `start` gets here (buffers are allocated aligned).
            Err(_) => dst
                .chunks_exact_mut(Self::BYTES)
                .zip(values)
                .for_each(|(d, &v)| d.copy_from_slice(bytemuck::bytes_of(&Self::from_f32(v)))),
        }
    }
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn cast_from_f32(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn cast_to_f32(src: &[f32], dst: &mut [f32]) {
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
    fn cast_from_f32(src: &[f32], dst: &mut [bf16]) {
        troupe_kernels::f32_to_bf16(src, dst);
    }
    fn cast_to_f32(src: &[bf16], dst: &mut [f32]) {
        troupe_kernels::bf16_to_f32(src, dst);
    }
}

impl Element for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn cast_from_f32(src: &[f32], dst: &mut [f16]) {
        troupe_kernels::f32_to_f16(src, dst);
    }
    fn cast_to_f32(src: &[f16], dst: &mut [f32]) {
        troupe_kernels::f16_to_f32(src, dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that exercise rounding: ties, subnormals of both 16-bit types, overflow, NaN, ±0, ±inf.
    fn awkward() -> Vec<f32> {
        let mut v = vec![0.0, -0.0, 1.0, -1.5, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65_504.0, 65_520.0, 1e-8];
        v.extend([f32::MIN_POSITIVE, 1.0 + f32::EPSILON, f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)]);
        v.extend((0..1000).map(|i| (i as f32 * 0.37).sin() * 10f32.powi(i % 12 - 6)));
        v
    }

    fn check<E: Element>() {
        let values = awkward();
        let want: Vec<u8> = values.iter().flat_map(|&v| bytemuck::bytes_of(&E::from_f32(v)).to_vec()).collect();
        let mut out = BytesMut::new();
        E::encode_into(&values, &mut out);
        assert_eq!(&out[..], &want[..], "{:?} encode", E::DTYPE);
        // Appending at an odd offset takes the unaligned path and writes the same bytes.
        let mut odd = BytesMut::from(&[7u8][..]);
        E::encode_into(&values, &mut odd);
        assert_eq!(&odd[1..], &want[..], "{:?} encode at an odd offset", E::DTYPE);
        let typed: Vec<E> = values.iter().map(|&v| E::from_f32(v)).collect();
        let mut back = vec![0f32; typed.len()];
        E::cast_to_f32(&typed, &mut back);
        let exact: Vec<u32> = typed.iter().map(|v| v.to_f32().to_bits()).collect();
        assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), exact, "{:?} to f32", E::DTYPE);
    }

    #[test]
    fn kernels_casts_equal_the_element_by_element_conversion() {
        check::<f32>();
        check::<bf16>();
        check::<f16>();
    }
}
