//! Moving between lists of tensors and one flat f32 buffer in canonical parameter order — what the
//! collectives send.

use tch::Tensor;

/// Appends the values of `tensors` (f32, contiguous) to `out`, in order.
pub fn append_flat(tensors: &[Tensor], out: &mut Vec<f32>) {
    for t in tensors {
        let offset = out.len();
        out.resize(offset + t.numel(), 0.0);
        t.copy_data(&mut out[offset..], t.numel());
    }
}

/// Overwrites `tensors`, in order, with consecutive values of `flat` (which must hold exactly their
/// elements). Works on parameters (leaves requiring grad) and on gradients alike.
pub fn copy_from_flat(tensors: &[Tensor], flat: &[f32]) {
    let total: usize = tensors.iter().map(Tensor::numel).sum();
    assert_eq!(total, flat.len(), "flat buffer length");
    let mut offset = 0;
    tch::no_grad(|| {
        for t in tensors {
            let n = t.numel();
            t.shallow_clone().copy_(&Tensor::from_slice(&flat[offset..offset + n]).view_as(t));
            offset += n;
        }
    });
}
