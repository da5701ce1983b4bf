//! Element types a collective moves: f32, bf16, f16. On the wire they are little-endian raw bytes of
//! their own type; reductions accumulate in f32 (`troupe_kernels::reduce`).

use bytes::Bytes;
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

    /// The wire bytes of `values` rounded to this type.
    fn encode(values: &[f32]) -> Bytes {
        let converted: Vec<Self> = values.iter().map(|&v| Self::from_f32(v)).collect();
        Bytes::copy_from_slice(bytemuck::cast_slice(&converted))
    }
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn encode(values: &[f32]) -> Bytes {
        Bytes::copy_from_slice(bytemuck::cast_slice(values))
    }
}

impl Element for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Element for f16 {
    const DTYPE: Dtype = Dtype::F16;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
