//! Lending a tch tensor's own storage, without a copy, so troupe-kernels' flat-buffer kernels (which
//! know nothing of libtorch) can run on parameters, gradients and optimizer moments in place: CPU
//! storage as slices of `f32`, `bf16` or `f16` ([`lend`], [`lend_f32`]); CUDA storage as troupe-kernels
//! device buffers for its CUDA backend ([`lend_cuda`]).
//!
//! This is the one module of troupe-model with `unsafe`: turning libtorch's data pointer into a Rust
//! slice or a borrowed device buffer. Everything else about the lend is checked before the pointer is
//! touched:
//!
//! - the tensor is defined, strided (not sparse or MKL-DNN), on the lend's device (the CPU, or the CUDA
//!   backend's device), of the element type asked for, and contiguous — so its `numel` elements are
//!   exactly the `numel` consecutive elements from its data pointer;
//! - no tensor lent mutably overlaps, in memory, any other tensor of the same lend (shared ones may
//!   overlap each other), so a mutable slice or buffer aliases nothing else the lend hands out.
//!
//! **Device and stream rules.** CPU: libtorch's CPU ops are synchronous — when an op returns, its writes
//! are done — so a CPU tensor's storage is quiescent between ops on the calling thread and no
//! synchronisation is needed. CUDA: tch 0.24 exposes no handle to libtorch's current stream, so a
//! CUDA lend **synchronises the device** (`torch.cuda.synchronize`) before it hands the buffers out —
//! whatever libtorch queued on the tensors, on any stream, is done — and **synchronises troupe's stream**
//! when it ends, so libtorch's later work, on any stream, sees the kernels' writes. Both contexts are the
//! device's primary context (libtorch's runtime and cudarc both use it), so the device addresses are
//! valid for troupe's kernels. The cost is two synchronisations per lend: lend every tensor of a step
//! at once.
//!
//! **What the caller keeps true.** tch's `Tensor` is a handle: `shallow_clone`, views and `.grad()` give
//! other handles to the same storage, which the borrow checker cannot see. While a lend is alive, no
//! libtorch op may write (or, for the mutable ones, read) that storage through another handle, on any
//! thread, nor resize it. In troupe the lenders are the optimizer's step and tests, which run between a
//! step's backward and the next forward on the thread that owns the tensors. Writes through a lend do
//! not bump autograd's version counter: lend only tensors that no live autograd graph has saved (true
//! after `backward()` freed the graph, or under `no_grad`). Aliasing is checked within one lend, not
//! between two lends alive at once.

use std::marker::PhantomData;

use half::{bf16, f16};
use tch::{Device, Kind, Tensor};
use troupe_kernels::{BorrowedDeviceBuffer, Buffer, CudaBackend, DeviceDtype};

/// Why a tensor's storage could not be lent. `operand` is the caller's label for it.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StorageError {
    #[error("{operand}: the tensor is undefined (e.g. a gradient before any backward); nothing to lend")]
    Undefined { operand: String },
    #[error("{operand}: the tensor is not strided (sparse or MKL-DNN); convert it with .to_dense() first")]
    NotStrided { operand: String },
    #[error(
        "{operand}: the tensor is on {device:?}, the lend is on {wanted:?} (copy it with .to_device(..), \
         or lend it with the other function: lend for the CPU, lend_cuda for a CUDA device)"
    )]
    WrongDevice { operand: String, device: Device, wanted: Device },
    #[error("{operand}: the tensor holds {kind}, not {expected}; convert it with .to_kind({fix}) first")]
    WrongKind { operand: String, kind: String, expected: &'static str, fix: &'static str },
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

/// An element type whose storage can be lent as a slice: f32, bf16, f16.
pub trait LendElement: Copy + 'static {
    const KIND: Kind;
    /// As error messages name it, and as `.to_kind(..)` fixes it.
    const NAME: &'static str;
    const FIX: &'static str;
}

impl LendElement for f32 {
    const KIND: Kind = Kind::Float;
    const NAME: &'static str = "f32";
    const FIX: &'static str = "Kind::Float";
}

impl LendElement for bf16 {
    const KIND: Kind = Kind::BFloat16;
    const NAME: &'static str = "bf16";
    const FIX: &'static str = "Kind::BFloat16";
}

impl LendElement for f16 {
    const KIND: Kind = Kind::Half;
    const NAME: &'static str = "f16";
    const FIX: &'static str = "Kind::Half";
}

/// One tensor's checked storage: the address of its first element, its length and element kind.
#[derive(Clone, Copy, Debug)]
struct Region {
    addr: usize,
    len: usize,
    kind: Kind,
}

impl Region {
    const EMPTY: Region = Region { addr: 0, len: 0, kind: Kind::Float };

    fn bytes(&self) -> std::ops::Range<usize> {
        self.addr..self.addr + self.len * self.kind.elt_size_in_bytes()
    }

    fn overlaps(&self, other: &Region) -> bool {
        let (a, b) = (self.bytes(), other.bytes());
        !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
    }
}

/// Checks everything a lend promises about one tensor on `device` of kind `kind` and returns its
/// region (address 0 for an empty tensor: nothing is ever read there).
fn region(
    operand: &str,
    tensor: &Tensor,
    device: Device,
    kind: Kind,
    name: &'static str,
    fix: &'static str,
) -> Result<Region, StorageError> {
    let operand = || operand.to_owned();
    if !tensor.defined() {
        return Err(StorageError::Undefined { operand: operand() });
    }
    if tensor.is_sparse() || tensor.is_mkldnn() {
        return Err(StorageError::NotStrided { operand: operand() });
    }
    if tensor.device() != device {
        return Err(StorageError::WrongDevice { operand: operand(), device: tensor.device(), wanted: device });
    }
    match tensor.f_kind() {
        Ok(k) if k == kind => {}
        Ok(k) => {
            return Err(StorageError::WrongKind { operand: operand(), kind: format!("{k:?}"), expected: name, fix })
        }
        Err(e) => return Err(StorageError::WrongKind { operand: operand(), kind: e.to_string(), expected: name, fix }),
    }
    if !tensor.is_contiguous() {
        return Err(StorageError::NotContiguous { operand: operand(), size: tensor.size(), stride: tensor.stride() });
    }
    let len = tensor.numel();
    if len == 0 {
        return Ok(Region { addr: 0, len: 0, kind });
    }
    Ok(Region { addr: tensor.data_ptr() as usize, len, kind })
}

/// The regions of a lend's mutable and shared tensors (each checked), refusing a mutable one that
/// overlaps any other.
fn regions<const M: usize, const S: usize>(
    mutable: &[(&str, &mut Tensor); M],
    shared: &[(&str, &Tensor); S],
    check: &impl Fn(&str, &Tensor) -> Result<Region, StorageError>,
) -> Result<([Region; M], [Region; S]), StorageError> {
    let mut mutable_regions = [Region::EMPTY; M];
    for (slot, (operand, tensor)) in mutable_regions.iter_mut().zip(mutable) {
        *slot = check(operand, tensor)?;
    }
    let mut shared_regions = [Region::EMPTY; S];
    for (slot, (operand, tensor)) in shared_regions.iter_mut().zip(shared) {
        *slot = check(operand, tensor)?;
    }
    for (i, a) in mutable_regions.iter().enumerate() {
        let later_mutable = mutable_regions.iter().zip(mutable).skip(i + 1).map(|(r, (name, _))| (r, *name));
        let all_shared = shared_regions.iter().zip(shared).map(|(r, (name, _))| (r, *name));
        if let Some((_, other)) = later_mutable.chain(all_shared).find(|(b, _)| a.overlaps(b)) {
            return Err(StorageError::Aliased { mutable: mutable[i].0.to_owned(), other: other.to_owned() });
        }
    }
    Ok((mutable_regions, shared_regions))
}

/// The slices of one lend: the mutable ones, then the shared ones, in the order asked for.
pub type Lent<'a, T, const M: usize, const S: usize> = ([&'a mut [T]; M], [&'a [T]; S]);

/// Lends the storage of CPU `mutable` tensors as `&mut [T]` and of `shared` tensors as `&[T]` (T is
/// f32, bf16 or f16), each labelled for error messages, for as long as the tensor borrows last. Each
/// slice has the tensor's `numel` elements in its (row-major, contiguous) order.
///
/// Refuses — touching no storage — any tensor that is undefined, not strided, not on the CPU, not of
/// kind T or not contiguous, and any mutable tensor whose memory overlaps another tensor of the lend.
/// See the module documentation for what the caller keeps true while the slices live.
pub fn lend<'a, T: LendElement, const M: usize, const S: usize>(
    mutable: [(&str, &'a mut Tensor); M],
    shared: [(&str, &'a Tensor); S],
) -> Result<Lent<'a, T, M, S>, StorageError> {
    let check = |operand: &str, tensor: &Tensor| region(operand, tensor, Device::Cpu, T::KIND, T::NAME, T::FIX);
    let (mutable_regions, shared_regions) = regions(&mutable, &shared, &check)?;
    let slice = |r: Region| if r.len == 0 { std::ptr::NonNull::<T>::dangling().as_ptr() } else { r.addr as *mut T };
    // SAFETY: each region was checked above to be a defined, strided, contiguous CPU tensor of kind T,
    // so its address points to `len` initialised, properly aligned T in host memory (libtorch allocates
    // CPU storage 64-byte aligned; a view's offset is a whole number of elements), or `len` is 0 and
    // the pointer is dangling, aligned and non-null. The storage stays allocated while the tensor handle
    // lives, which the `'a` borrow of the handle guarantees; the `&mut` borrow of each mutable handle
    // keeps this handle from being used meanwhile, and the overlap check guarantees no mutable slice
    // aliases any other slice handed out here. That no *other* handle to the storage is used meanwhile
    // is the caller's part (module docs).
    let mutable_slices = mutable_regions.map(|r| unsafe { std::slice::from_raw_parts_mut(slice(r), r.len) });
    // SAFETY: as above; shared slices may alias each other but no mutable one (checked above).
    let shared_slices = shared_regions.map(|r| unsafe { std::slice::from_raw_parts(slice(r) as *const T, r.len) });
    Ok((mutable_slices, shared_slices))
}

/// [`lend`] of f32 tensors.
pub fn lend_f32<'a, const M: usize, const S: usize>(
    mutable: [(&str, &'a mut Tensor); M],
    shared: [(&str, &'a Tensor); S],
) -> Result<Lent<'a, f32, M, S>, StorageError> {
    lend::<f32, M, S>(mutable, shared)
}

/// One group of a lend: its mutable tensors and its shared ones, each labelled for error messages.
pub type LendGroup<'a, const M: usize, const S: usize> = ([(&'a str, &'a mut Tensor); M], [(&'a str, &'a Tensor); S]);

/// CUDA tensors' storage lent to troupe-kernels' CUDA backend as device buffers (see [`lend_cuda`],
/// [`lend_cuda_groups`]). Ending the lend (dropping it) synchronises the backend's stream, so
/// libtorch's later work sees every write the kernels made.
pub struct CudaLent<'a, const M: usize, const S: usize> {
    backend: &'a CudaBackend,
    groups: Vec<([BorrowedDeviceBuffer; M], [BorrowedDeviceBuffer; S])>,
    _tensors: PhantomData<&'a mut Tensor>,
}

impl<const M: usize, const S: usize> CudaLent<'_, M, S> {
    /// The buffers of the first group: the mutable ones (written in place), then the shared ones, in
    /// the order asked for — what `Backend::Cuda(..)`'s kernels take.
    pub fn buffers(&mut self) -> ([&mut Buffer; M], [&Buffer; S]) {
        self.group(0)
    }

    /// The buffers of group `i`, as [`Self::buffers`].
    ///
    /// # Panics
    /// If the lend has no group `i`.
    pub fn group(&mut self, i: usize) -> ([&mut Buffer; M], [&Buffer; S]) {
        let (mutable, shared) = &mut self.groups[i];
        (mutable.each_mut().map(|b| b.buffer_mut()), shared.each_ref().map(|b| b.buffer()))
    }

    /// How many groups the lend holds.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

impl<const M: usize, const S: usize> Drop for CudaLent<'_, M, S> {
    fn drop(&mut self) {
        if let Err(e) = self.backend.synchronize() {
            tracing::error!(error = %e, "ending a CUDA lend: synchronising troupe's stream failed");
        }
    }
}

/// The device buffer type of a tensor kind a CUDA lend takes.
fn device_dtype(kind: Kind) -> DeviceDtype {
    match kind {
        Kind::BFloat16 => DeviceDtype::Bf16,
        Kind::Half => DeviceDtype::F16,
        _ => DeviceDtype::F32,
    }
}

/// Checks one tensor of a CUDA lend: the CPU lend's checks, on `device`, of kind f32, bf16 or f16.
fn cuda_region(operand: &str, tensor: &Tensor, device: Device) -> Result<Region, StorageError> {
    let kind = match tensor.f_kind() {
        Ok(kind @ (Kind::Float | Kind::BFloat16 | Kind::Half)) => kind,
        _ => Kind::Float,
    };
    region(operand, tensor, device, kind, "f32, bf16 or f16", "Kind::Float")
}

/// Lends the storage of CUDA `mutable` and `shared` tensors (f32, bf16 or f16; any mix) on
/// `backend`'s device as device buffers its kernels run on in place. The checks are [`lend`]'s, on
/// the backend's device. Before handing the buffers out it synchronises the device, so libtorch's
/// queued work on the tensors, on any stream, is done; dropping the lend synchronises troupe's stream
/// (module docs: tch exposes no handle to libtorch's current stream).
pub fn lend_cuda<'a, const M: usize, const S: usize>(
    backend: &'a CudaBackend,
    mutable: [(&'a str, &'a mut Tensor); M],
    shared: [(&'a str, &'a Tensor); S],
) -> Result<CudaLent<'a, M, S>, StorageError> {
    lend_cuda_groups(backend, vec![(mutable, shared)])
}

/// [`lend_cuda`] of many groups at once — e.g. each parameter with its gradient and moments — for
/// the price of one lend: one device synchronisation before, one of troupe's stream after. Every
/// tensor is checked as [`lend_cuda`] checks it, and a mutable tensor may overlap no other tensor of
/// any group.
pub fn lend_cuda_groups<'a, const M: usize, const S: usize>(
    backend: &'a CudaBackend,
    groups: Vec<LendGroup<'a, M, S>>,
) -> Result<CudaLent<'a, M, S>, StorageError> {
    let device = Device::Cuda(backend.ordinal());
    let checked = group_regions(&groups, |o, t| cuda_region(o, t, device))?;
    tch::Cuda::synchronize(backend.ordinal() as i64);
    let borrow = |r: Region| {
        // SAFETY: the region was checked to be a defined, strided, contiguous tensor of its kind on the
        // backend's device, allocated by libtorch in the device's primary context: `len` aligned
        // elements from `addr` (address 0 only when `len` is 0, which no kernel reads). The `'a`
        // borrows keep the tensors, and so their storage, alive and unused through these handles for
        // the lend; mutable regions overlap nothing else of the lend (checked); the device was just
        // synchronised, so libtorch has no work left on them; other handles are the caller's part
        // (module docs).
        unsafe { backend.borrow_device_memory(device_dtype(r.kind), r.addr as u64, r.len) }
    };
    let groups = checked.into_iter().map(|(mutable, shared)| (mutable.map(borrow), shared.map(borrow))).collect();
    Ok(CudaLent { backend, groups, _tensors: PhantomData })
}

/// The regions of every group (each checked with `check`, each group as [`regions`] checks it),
/// refusing a mutable region that overlaps any region of another group too.
#[allow(clippy::type_complexity)]
fn group_regions<const M: usize, const S: usize>(
    groups: &[LendGroup<'_, M, S>],
    check: impl Fn(&str, &Tensor) -> Result<Region, StorageError>,
) -> Result<Vec<([Region; M], [Region; S])>, StorageError> {
    let checked: Vec<([Region; M], [Region; S])> =
        groups.iter().map(|(mutable, shared)| regions(mutable, shared, &check)).collect::<Result<_, _>>()?;
    // Across groups: sweep the regions in address order, each against those still open.
    let mut all: Vec<(Region, &str, bool)> = Vec::new();
    for ((mutable, shared), (m, s)) in checked.iter().zip(groups) {
        all.extend(mutable.iter().zip(m).map(|(r, (name, _))| (*r, *name, true)));
        all.extend(shared.iter().zip(s).map(|(r, (name, _))| (*r, *name, false)));
    }
    all.retain(|(r, _, _)| r.len > 0);
    all.sort_by_key(|(r, _, _)| r.addr);
    let mut open: Vec<(Region, &str, bool)> = Vec::new();
    for (r, name, mutable) in all {
        open.retain(|(o, _, _)| o.bytes().end > r.addr);
        if let Some((_, other, other_mutable)) = open.iter().find(|(o, _, m)| (*m || mutable) && o.overlaps(&r)) {
            let (mutable, other) = if *other_mutable { (*other, name) } else { (name, *other) };
            return Err(StorageError::Aliased { mutable: mutable.to_owned(), other: other.to_owned() });
        }
        open.push((r, name, mutable));
    }
    Ok(checked)
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

    /// The checks of a grouped lend (what `lend_cuda_groups` runs before touching any storage), on
    /// CPU tensors: groups of separate tensors pass; a tensor shared read-only by two groups passes; a
    /// mutable tensor of one group that another group's tensor overlaps is refused, both named.
    #[test]
    fn a_grouped_lend_refuses_a_mutable_tensor_another_group_overlaps() {
        let cpu = |o: &str, t: &Tensor| region(o, t, Device::Cpu, Kind::Float, "f32", "Kind::Float");
        let zeros = |n: i64| Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let (mut a, mut b, shared) = (zeros(4), zeros(4), zeros(4));
        let groups: Vec<LendGroup<1, 1>> =
            vec![([("a", &mut a)], [("lr", &shared)]), ([("b", &mut b)], [("lr", &shared)])];
        assert_eq!(group_regions(&groups, cpu).unwrap().len(), 2);

        let flat = zeros(8);
        let (mut head, tail) = (flat.narrow(0, 0, 4), flat.narrow(0, 2, 6));
        let mut other = zeros(3);
        let groups: Vec<LendGroup<1, 1>> =
            vec![([("head", &mut head)], [("lr", &shared)]), ([("other", &mut other)], [("tail", &tail)])];
        let err = group_regions(&groups, cpu).unwrap_err();
        assert_eq!(err, StorageError::Aliased { mutable: "head".into(), other: "tail".into() });
        let mut apart = flat.narrow(0, 4, 4);
        let groups: Vec<LendGroup<1, 0>> = vec![([("low", &mut head)], []), ([("high", &mut apart)], [])];
        assert!(group_regions(&groups, cpu).is_ok(), "views of one storage that do not overlap");
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
            assert!(matches!(err, StorageError::WrongKind { .. }), "{kind:?}: {err:?}");
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

    #[test]
    fn bf16_and_f16_storage_is_lent_in_place_and_rounds_like_libtorch() {
        let values: Vec<f32> =
            (0..37).map(|i| (i as f32 - 18.0) * 1.37e-3).chain([f32::NAN, f32::INFINITY, 1e-40]).collect();
        let source = Tensor::from_slice(&values);
        let mut halves = Tensor::zeros([values.len() as i64], (Kind::BFloat16, Device::Cpu));
        let ptr = halves.data_ptr();
        let ([h], []) = lend::<bf16, 1, 0>([("bf16 copy", &mut halves)], []).unwrap();
        assert_eq!(h.as_ptr() as *mut std::ffi::c_void, ptr);
        troupe_kernels::f32_to_bf16(&values, h);
        let libtorch = source.to_kind(Kind::BFloat16);
        assert!(bool::try_from(
            halves.eq_tensor(&libtorch).logical_or(&halves.isnan().logical_and(&libtorch.isnan())).all()
        )
        .unwrap());

        let mut f16s = Tensor::zeros([values.len() as i64], (Kind::Half, Device::Cpu));
        let ([h], []) = lend::<f16, 1, 0>([("f16 copy", &mut f16s)], []).unwrap();
        troupe_kernels::f32_to_f16(&values, h);
        let libtorch = source.to_kind(Kind::Half);
        assert!(bool::try_from(
            f16s.eq_tensor(&libtorch).logical_or(&f16s.isnan().logical_and(&libtorch.isnan())).all()
        )
        .unwrap());
        let ([], [back]) = lend::<f16, 0, 1>([], [("f16 copy", &f16s)]).unwrap();
        assert_eq!(back[0].to_f32(), f16::from_f32(values[0]).to_f32());
    }

    #[test]
    fn a_16_bit_lend_refuses_other_kinds_and_names_the_fix() {
        let mut t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let err = lend::<bf16, 1, 0>([("w", &mut t)], []).unwrap_err();
        assert!(err.to_string().contains("not bf16") && err.to_string().contains("to_kind(Kind::BFloat16)"), "{err}");
        let err = lend::<f16, 0, 1>([], [("w", &t)]).unwrap_err();
        assert!(err.to_string().contains("to_kind(Kind::Half)"), "{err}");
    }

    #[test]
    fn a_cuda_lend_refuses_cpu_tensors_and_other_kinds_before_touching_a_device() {
        let cpu = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let err = cuda_region("grad of wte", &cpu, Device::Cuda(0)).unwrap_err();
        assert!(
            matches!(err, StorageError::WrongDevice { device: Device::Cpu, wanted: Device::Cuda(0), .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("lend_cuda"), "{err}");
        let ints = Tensor::zeros([4], (Kind::Int64, Device::Cpu));
        let err = cuda_region("step counts", &ints, Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("not f32, bf16 or f16"), "{err}");
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let t = Tensor::zeros([3], (kind, Device::Cpu));
            let r = cuda_region("t", &t, Device::Cpu).unwrap();
            assert_eq!((r.len, r.kind), (3, kind));
        }
    }
}
