//! Uploads of host tensors (a step's batch, a dropout mask's salts) to the device they are used on,
//! without making the host wait for the device.
//!
//! A plain `to_device` from ordinary (pageable) host memory synchronises libtorch's stream: the host
//! waits until every kernel queued before the copy has run, so the next kernels are launched onto an
//! idle GPU. Done once per micro-batch, or once per LoRA layer, that stalls a step many times over.
//! [`upload`] stages the values in pinned memory from libtorch's caching host allocator and copies them
//! asynchronously on the current stream: kernels queued later see them in stream order, and the
//! allocator keeps the pinned block until the copy has run (it records an event on the copy), so the
//! staging memory is never reused early. This is PyTorch's `t.pin_memory().to(device, non_blocking=True)`.

use tch::{Device, Tensor};

/// `t` on `device`: an asynchronous copy through pinned memory from the host to a GPU (see the module
/// documentation); otherwise (already there, CPU to CPU, or pinning refused) `t.to_device(device)`.
pub fn upload(t: &Tensor, device: Device) -> Tensor {
    if !device.is_cuda() || t.device() != Device::Cpu {
        return t.to_device(device);
    }
    // `_pin_memory` rather than `pin_memory`: the latter warns that its device argument is deprecated.
    let staged =
        t.f_internal_pin_memory(device).and_then(|pinned| pinned.f_to_device_(device, pinned.kind(), true, false));
    match staged {
        Ok(on_device) => on_device,
        Err(e) => {
            tracing::debug!(error = %e, "pinned upload refused; a synchronous copy instead");
            t.to_device(device)
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::Kind;

    use super::*;

    #[test]
    fn an_upload_to_the_host_is_the_tensor_itself_and_keeps_its_values() {
        let t = Tensor::arange(6, (Kind::Int64, Device::Cpu)).view([2, 3]);
        let up = upload(&t, Device::Cpu);
        assert_eq!(up.size(), [2, 3]);
        assert_eq!(Vec::<i64>::try_from(up.view([-1])).unwrap(), [0, 1, 2, 3, 4, 5]);
    }
}
