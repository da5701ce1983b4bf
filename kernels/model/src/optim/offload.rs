//! Optimizer offload (`parallel.offload = "host"`, ZeRO-Offload's split): a device rank keeps its
//! parameters (fp32, what the forward and backward read) and gradients on the device, and the fp32
//! masters the update reads and writes, the optimizer's state (AdamW's moments, Adafactor's statistics)
//! and the update itself on the host — the fused CPU kernels, on host tensors, pinned for a CUDA device
//! so the copies run asynchronously.
//!
//! One committed update ([`HostOffload::apply`], called by the trainer only once the step is
//! committed, so nothing here runs ahead of the commit vote): every gradient is copied device → host
//! into its master's gradient, then the optimizer updates the masters one parameter after the other,
//! and each updated master is copied host → device as soon as it is done (on CUDA, non-blocking from
//! pinned memory: the copy of parameter i runs while parameter i + 1 is updated, and the last copies
//! while the rank prepares the next step; the next forward is queued on the same stream, behind them).
//! A step that is not committed never reaches this: its gradients are dropped with the masters and the
//! state untouched. The result is the same bits as the update on the parameters themselves when both run
//! the CPU kernel (it moves where the update runs, not what it computes); a CUDA update without offload
//! runs libtorch's ops instead, equal within float rounding.
//!
//! The masters are current for one committed step ([`HostOffload::current_for`]); when the trainer's
//! state was replaced behind them (a rank synced from another, a checkpoint restored) the next update
//! first reads them back from the device parameters, which are always the committed values.
//!
//! [`Staging`] is the seam the tests use: [`Staging::Emulated`] keeps the "device" parameters in CPU
//! memory apart from the host masters and runs the same copies in the same order, so the staging and
//! the ordering are tested without a GPU.

use tch::{Device, Kind, Tensor};

use super::Optimizer;

/// Where the parameters the forward reads live, apart from the host masters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// An accelerator (CUDA): masters pinned, copies non-blocking.
    Device(Device),
    /// CPU memory standing in for a device, for tests: the same copies, synchronous.
    Emulated,
}

impl Staging {
    /// The staging for a rank computing on `device` with `parallel.offload = offload`: None when
    /// nothing is offloaded — `"none"`, or a CPU rank, whose state is on the host already.
    pub fn of(offload: &str, device: Device) -> Option<Self> {
        (offload == "host" && device != Device::Cpu).then_some(Self::Device(device))
    }
}

/// The line a CPU rank logs when its job asks for offload (nothing to move: its state is on the host).
pub const CPU_RANK_NOTE: &str =
    "parallel.offload = \"host\" on a CPU rank: the optimizer state and update are on the host already, nothing is offloaded";

/// A device rank's host side of the update: the masters, with gradient buffers.
#[derive(Debug)]
pub struct HostOffload {
    staging: Staging,
    /// One fp32 host tensor per parameter (pinned for a CUDA device), a leaf whose `.grad()` receives the
    /// device gradient; frozen parameters' masters have no gradient, like theirs.
    masters: Vec<Tensor>,
    /// The committed step the masters hold the parameters of (None: read them from the device first).
    current_for: Option<u64>,
}

impl HostOffload {
    /// Host masters for the device parameters `params` (of the trainer at committed step `step`).
    pub fn new(staging: Staging, params: &[Tensor], step: u64) -> Self {
        let masters = params
            .iter()
            .map(|p| {
                let host = p.detach().to_device(Device::Cpu).to_kind(Kind::Float).contiguous();
                let host = match staging {
                    Staging::Device(device @ Device::Cuda(_)) => host.pin_memory(device),
                    _ => host.copy(),
                };
                host.set_requires_grad(p.requires_grad())
            })
            .collect::<Vec<_>>();
        let trainable: Vec<&Tensor> = masters.iter().filter(|m| m.requires_grad()).collect();
        if !trainable.is_empty() {
            let zero: Tensor = trainable.iter().map(|m| m.sum(Kind::Float) * 0.0).sum();
            zero.backward();
        }
        Self { staging, masters, current_for: Some(step) }
    }

    pub fn staging(&self) -> Staging {
        self.staging
    }

    /// The host masters (their values are the committed parameters' when [`Self::current_for`] the
    /// trainer's step).
    pub fn masters(&self) -> &[Tensor] {
        &self.masters
    }

    /// The committed step whose parameters the masters hold; None when they must be read back first.
    pub fn current_for(&self) -> Option<u64> {
        self.current_for
    }

    /// The device parameters were replaced (a sync, a restore): read them back before the next update.
    pub fn invalidate(&mut self) {
        self.current_for = None;
    }

    /// Step `step` was committed without an update (fp16 overflow): the masters stay current.
    pub fn carry_over(&mut self, step: u64) {
        if self.current_for == Some(step) {
            self.current_for = Some(step + 1);
        }
    }

    /// Bytes of fp32 masters held on the host.
    pub fn master_bytes(&self) -> usize {
        self.masters.iter().map(|m| m.numel() * 4).sum()
    }

    /// The update of committed step `step` at rate `lr`: the device gradients of `params` to the host,
    /// `optimizer` on the masters, each updated master back into its device parameter.
    pub fn apply(&mut self, optimizer: &mut Optimizer, params: &mut [Tensor], lr: f64, step: u64) {
        assert_eq!(params.len(), self.masters.len(), "offload: one master per parameter");
        let non_blocking = matches!(self.staging, Staging::Device(Device::Cuda(_)));
        tch::no_grad(|| {
            if self.current_for != Some(step) {
                for (master, param) in self.masters.iter_mut().zip(params.iter()) {
                    master.detach().copy_(&param.detach());
                }
            }
            for (master, param) in self.masters.iter().zip(params.iter()) {
                let grad = param.grad();
                if master.requires_grad() {
                    assert!(grad.defined(), "offload: a trainable parameter without a gradient at the update");
                    master.grad().copy_(&grad);
                }
            }
        });
        let mut copy_back = |i: usize, master: &Tensor| {
            tch::no_grad(|| {
                let mut device = params[i].detach();
                if non_blocking {
                    let staged = master.to_device_(device.device(), Kind::Float, true, false);
                    device.copy_(&staged);
                } else {
                    device.copy_(master);
                }
            })
        };
        optimizer.apply_then(&mut self.masters, lr, &mut copy_back);
        self.current_for = Some(step + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamW, AdamWConfig};

    fn leaf(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    fn set_grads(params: &[Tensor], grads: &[&[f32]]) {
        for (p, g) in params.iter().zip(grads) {
            let mut p = p.shallow_clone();
            p.zero_grad();
            (&p * Tensor::from_slice(g)).sum(Kind::Float).backward();
        }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::try_from(t.detach()).unwrap()
    }

    #[test]
    fn an_emulated_offloaded_update_equals_the_update_in_place_bit_for_bit() {
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let start: [&[f32]; 2] = [&[1.0, -2.0, 3.0], &[0.5, 0.25]];
        let mut direct: Vec<Tensor> = start.iter().map(|v| leaf(v)).collect();
        let mut device: Vec<Tensor> = start.iter().map(|v| leaf(v)).collect();
        let mut a = Optimizer::AdamW(AdamW::new(config, &direct, vec![true, false]));
        let mut offload = HostOffload::new(Staging::Emulated, &device, 0);
        let mut b = Optimizer::AdamW(AdamW::new(config, offload.masters(), vec![true, false]));
        for step in 0..4u64 {
            let grads: [&[f32]; 2] = [&[0.5, -4.0, 0.125 * step as f32], &[1.0, -1.0]];
            set_grads(&direct, &grads);
            set_grads(&device, &grads);
            a.apply(&mut direct, 0.1);
            offload.apply(&mut b, &mut device, 0.1, step);
            for (d, o) in direct.iter().zip(&device) {
                assert_eq!(values(d), values(o));
            }
            // The masters are the host copy, apart from the device parameters, and equal them.
            for (m, o) in offload.masters().iter().zip(&device) {
                assert_ne!(m.data_ptr(), o.data_ptr());
                assert_eq!(values(m), values(o));
            }
        }
        assert_eq!(offload.current_for(), Some(4));
    }

    #[test]
    fn masters_are_read_back_after_the_device_parameters_were_replaced() {
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 };
        let mut device = vec![leaf(&[1.0, 2.0])];
        let mut offload = HostOffload::new(Staging::Emulated, &device, 0);
        let mut opt = Optimizer::AdamW(AdamW::new(config, offload.masters(), vec![true]));
        tch::no_grad(|| device[0].detach().copy_(&Tensor::from_slice(&[10.0f32, 20.0])));
        offload.invalidate();
        set_grads(&device, &[&[1.0, -1.0]]);
        offload.apply(&mut opt, &mut device, 0.5, 7);
        assert_eq!(values(&device[0]), vec![9.5, 20.5]);
        assert_eq!(offload.current_for(), Some(8));
        offload.carry_over(8);
        assert_eq!(offload.current_for(), Some(9));
        offload.carry_over(3);
        assert_eq!(offload.current_for(), Some(9));
    }

    #[test]
    fn only_a_device_rank_offloads() {
        assert_eq!(Staging::of("host", Device::Cpu), None);
        assert_eq!(Staging::of("none", Device::Cuda(0)), None);
        assert_eq!(Staging::of("host", Device::Cuda(1)), Some(Staging::Device(Device::Cuda(1))));
    }
}
