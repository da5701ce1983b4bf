//! Lending a tch tensor's own storage as an `f32` slice, without a copy, so troupe-kernels' flat-buffer
//! kernels (which know nothing of libtorch) can run on parameters, gradients and optimizer moments in
//! place.
//!
//! This is the one module of troupe-model with `unsafe`: turning libtorch's data pointer into a Rust
//! slice. Everything else about the lend is checked before the pointer is touched:
//!
//! - the tensor is defined, strided (not sparse or MKL-DNN), on the CPU, of kind `f32`, and contiguous —
//!   so its `numel` elements are exactly the `numel` consecutive `f32` from its data pointer;
//! - no tensor lent mutably overlaps, in memory, any other tensor of the same lend (shared ones may
//!   overlap each other), so the `&mut` slices alias nothing the lend hands out.
//!
//! **Device and stream rules.** CPU only: a CUDA tensor is refused with [`StorageError::NotCpu`] (its
//! pointer is device memory, not dereferenceable from the host). libtorch's CPU ops are synchronous —
//! when an op returns, its writes are done — so a CPU tensor's storage is quiescent between ops on the
//! calling thread and no synchronisation is needed. A CUDA lend (for troupe-kernels' CUDA kernels) would
//! have to run on libtorch's current stream or synchronise it first; it does not exist yet.
//!
//! **What the caller keeps true.** tch's `Tensor` is a handle: `shallow_clone`, views and `.grad()` give
//! other handles to the same storage, which the borrow checker cannot see. While slices from a lend are
//! alive, no libtorch op may write (or, for the mutable ones, read) that storage through another handle,
//! on any thread, nor resize it. In troupe the lenders are the optimizer's step and tests, which run
//! between a step's backward and the next forward on the thread that owns the tensors. Writes through a
//! lent slice do not bump autograd's version counter: lend only tensors that no live autograd graph has
//! saved (true after `backward()` freed the graph, or under `no_grad`).

use tch::{Device, Kind, Tensor};

/// Why a tensor's storage could not be lent as an `f32` slice. `operand` is the caller's label for it.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StorageError {
    #[error("{operand}: the tensor is undefined (e.g. a gradient before any backward); nothing to lend")]
    Undefined { operand: String },
    #[error("{operand}: the tensor is not strided (sparse or MKL-DNN); convert it with .to_dense() first")]
    NotStrided { operand: String },
    #[error(
        "{operand}: the tensor is on {device:?}; only CPU storage can be lent as a host slice \
         (copy it with .to_device(Device::Cpu), or use a CUDA kernel on it)"
    )]
    NotCpu { operand: String, device: Device },
    #[error("{operand}: the tensor holds {kind}, not f32; convert it with .to_kind(Kind::Float) first")]
    NotF32 { operand: String, kind: String },
    #[error(
        "{operand}: the tensor is not contiguous (size {size:?}, stride {stride:?}); \
         its elements are not one run of memory — lend .contiguous() instead"
    )]
    NotContiguous { operand: String, size: Vec<i64>, stride: Vec<i64> },
    #[error(
        "{mutable} is lent mutably but shares memory with {other}; a mutable slice must alias nothing \
         else in the same lend (lend copies, or separate storages)"
    )]
    Aliased { mutable: String, other: String },
}

/// One tensor's checked storage: its first element and its length.
#[derive(Clone, Copy)]
struct Region {
    ptr: *mut f32,
    len: usize,
}

impl Region {
    fn bytes(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.len * std::mem::size_of::<f32>()
    }

    fn overlaps(&self, other: &Region) -> bool {
        let (a, b) = (self.bytes(), other.bytes());
        !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
    }
}

/// Checks everything [`lend_f32`] promises about one tensor and returns its region.
fn region(operand: &str, tensor: &Tensor) -> Result<Region, StorageError> {
    let operand = || operand.to_owned();
    if !tensor.defined() {
        return Err(StorageError::Undefined { operand: operand() });
    }
    if tensor.is_sparse() || tensor.is_mkldnn() {
        return Err(StorageError::NotStrided { operand: operand() });
    }
    let device = tensor.device();
    if device != Device::Cpu {
        return Err(StorageError::NotCpu { operand: operand(), device });
    }
    match tensor.f_kind() {
        Ok(Kind::Float) => {}
        Ok(kind) => return Err(StorageError::NotF32 { operand: operand(), kind: format!("{kind:?}") }),
        Err(e) => return Err(StorageError::NotF32 { operand: operand(), kind: e.to_string() }),
    }
    if !tensor.is_contiguous() {
        return Err(StorageError::NotContiguous { operand: operand(), size: tensor.size(), stride: tensor.stride() });
    }
    let len = tensor.numel();
    if len == 0 {
        return Ok(Region { ptr: std::ptr::NonNull::dangling().as_ptr(), len: 0 });
    }
    Ok(Region { ptr: tensor.data_ptr().cast::<f32>(), len })
}

/// The slices of one lend: the mutable ones, then the shared ones, in the order asked for.
pub type Lent<'a, const M: usize, const S: usize> = ([&'a mut [f32]; M], [&'a [f32]; S]);

/// Lends the storage of `mutable` tensors as `&mut [f32]` and of `shared` tensors as `&[f32]`, each
/// labelled for error messages, for as long as the tensor borrows last. Each slice has the tensor's
/// `numel` elements in its (row-major, contiguous) order.
///
/// Refuses — touching no storage — any tensor that is undefined, not strided, not on the CPU, not `f32`
/// or not contiguous, and any mutable tensor whose memory overlaps another tensor of the lend. See the
/// module documentation for what the caller keeps true while the slices live.
pub fn lend_f32<'a, const M: usize, const S: usize>(
    mutable: [(&str, &'a mut Tensor); M],
    shared: [(&str, &'a Tensor); S],
) -> Result<Lent<'a, M, S>, StorageError> {
    let mut mutable_regions = [Region { ptr: std::ptr::null_mut(), len: 0 }; M];
    for (slot, (operand, tensor)) in mutable_regions.iter_mut().zip(&mutable) {
        *slot = region(operand, tensor)?;
    }
    let mut shared_regions = [Region { ptr: std::ptr::null_mut(), len: 0 }; S];
    for (slot, (operand, tensor)) in shared_regions.iter_mut().zip(&shared) {
        *slot = region(operand, tensor)?;
    }
    for (i, a) in mutable_regions.iter().enumerate() {
        let later_mutable = mutable_regions.iter().zip(&mutable).skip(i + 1).map(|(r, (name, _))| (r, *name));
        let all_shared = shared_regions.iter().zip(&shared).map(|(r, (name, _))| (r, *name));
        if let Some((_, other)) = later_mutable.chain(all_shared).find(|(b, _)| a.overlaps(b)) {
            return Err(StorageError::Aliased { mutable: mutable[i].0.to_owned(), other: other.to_owned() });
        }
    }
    // SAFETY: each region was checked above to be a defined, strided, contiguous CPU tensor of kind
    // f32, so `ptr` points to `len` initialised, properly aligned f32 values in host memory (libtorch
    // allocates CPU storage 64-byte aligned), or `len` is 0 and `ptr` is a dangling, aligned non-null
    // pointer. The storage stays allocated while the tensor handle lives, which the `'a` borrow of the
    // handle guarantees; the `&mut` borrow of each mutable handle keeps this handle from being used
    // meanwhile, and the overlap check guarantees no mutable slice aliases any other slice handed out
    // here. That no *other* handle to the storage is used meanwhile is the caller's part (module docs).
    let mutable_slices = mutable_regions.map(|r| unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) });
    // SAFETY: as above; shared slices may alias each other but no mutable one (checked above).
    let shared_slices = shared_regions.map(|r| unsafe { std::slice::from_raw_parts(r.ptr as *const f32, r.len) });
    Ok((mutable_slices, shared_slices))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::try_from(t.flatten(0, -1)).unwrap()
    }

    #[test]
    fn writes_through_the_slice_land_in_the_tensor_without_a_copy() {
        let mut param = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]);
        let grad = Tensor::from_slice(&[0.5f32, 0.5, 0.5, 1.0, 1.0, 1.0]).view([2, 3]);
        let ptr = param.data_ptr();
        let ([p], [g]) = lend_f32([("param", &mut param)], [("grad", &grad)]).unwrap();
        assert_eq!(p.as_ptr() as *mut std::ffi::c_void, ptr, "the slice is the tensor's own storage");
        assert_eq!(g, &[0.5, 0.5, 0.5, 1.0, 1.0, 1.0]);
        for (p, g) in p.iter_mut().zip(g) {
            *p -= g;
        }
        assert_eq!(values(&param), vec![0.5, 1.5, 2.5, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn a_contiguous_view_at_an_offset_lends_its_own_elements() {
        let mut flat = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let mut tail = flat.narrow(0, 3, 3);
        let ([t], []) = lend_f32([("tail", &mut tail)], []).unwrap();
        assert_eq!(t, &[3.0, 4.0, 5.0]);
        t[0] = 30.0;
        let ([f], []) = lend_f32([("flat", &mut flat)], []).unwrap();
        assert_eq!(f, &[0.0, 1.0, 2.0, 30.0, 4.0, 5.0]);
    }

    #[test]
    fn empty_tensors_lend_empty_slices() {
        let mut empty = Tensor::zeros([0], (Kind::Float, Device::Cpu));
        let other = Tensor::zeros([0], (Kind::Float, Device::Cpu));
        let ([e], [o]) = lend_f32([("empty", &mut empty)], [("other", &other)]).unwrap();
        assert!(e.is_empty() && o.is_empty());
    }

    #[test]
    fn a_non_contiguous_tensor_is_refused_by_name() {
        let mut transposed = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]).tr();
        let err = lend_f32([("exp_avg of h.0.mlp.c_fc.weight", &mut transposed)], []).unwrap_err();
        assert!(matches!(err, StorageError::NotContiguous { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains("exp_avg of h.0.mlp.c_fc.weight") && message.contains(".contiguous()"), "{message}");
        let strided = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).slice(0, 0, 4, 2);
        let err = lend_f32([], [("every other", &strided)]).unwrap_err();
        assert!(matches!(err, StorageError::NotContiguous { .. }), "{err:?}");
    }

    #[test]
    fn tensors_of_other_kinds_are_refused() {
        for kind in [Kind::Double, Kind::BFloat16, Kind::Half, Kind::Int64] {
            let mut t = Tensor::zeros([4], (kind, Device::Cpu));
            let err = lend_f32([("w", &mut t)], []).unwrap_err();
            assert!(matches!(err, StorageError::NotF32 { .. }), "{kind:?}: {err:?}");
            assert!(err.to_string().contains("to_kind(Kind::Float)"), "{err}");
        }
    }

    #[test]
    fn undefined_tensors_are_refused() {
        let p = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let grad = p.grad();
        let err = lend_f32([], [("grad of wte", &grad)]).unwrap_err();
        assert_eq!(err, StorageError::Undefined { operand: "grad of wte".into() });
    }

    #[test]
    fn a_mutable_lend_that_aliases_another_operand_is_refused() {
        let flat = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        let (mut head, mut overlapping) = (flat.narrow(0, 0, 5), flat.narrow(0, 4, 4));
        let err = lend_f32([("head", &mut head), ("overlapping", &mut overlapping)], []).unwrap_err();
        assert_eq!(err, StorageError::Aliased { mutable: "head".into(), other: "overlapping".into() });
        let same = flat.shallow_clone();
        let err = lend_f32([("head", &mut head)], [("same storage", &same)]).unwrap_err();
        assert!(matches!(err, StorageError::Aliased { .. }), "{err:?}");
        // Adjacent, disjoint views are fine, and shared operands may alias each other.
        let mut tail = flat.narrow(0, 5, 3);
        let grad = Tensor::ones([3], (Kind::Float, Device::Cpu));
        let grad_again = grad.shallow_clone();
        let ([h, t], [a, b]) =
            lend_f32([("head", &mut head), ("tail", &mut tail)], [("grad", &grad), ("grad again", &grad_again)])
                .unwrap();
        h.fill(1.0);
        t.copy_from_slice(a);
        assert_eq!(a, b);
        assert_eq!(values(&flat), vec![1.0; 8]);
    }
}
