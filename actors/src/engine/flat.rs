//! Moving between lists of tensors and one flat f32 buffer in canonical parameter order — what the
//! collectives send — and the two things every engine does to a replica's parameters through it: take
//! rank 0's, and give them gradients to reduce.

use tch::{Kind, Tensor};
use troupe_cluster::collective::Communicator;
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::precision::LossScale;
use troupe_model::Trainer;

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

/// `tensors` (f32) as one flat tensor on their device, in order: what a device plane reduces.
pub fn flatten_on_device(tensors: &[Tensor]) -> Tensor {
    let flat: Vec<Tensor> = tensors.iter().map(|t| t.reshape([-1])).collect();
    Tensor::cat(&flat, 0)
}

/// Overwrites `tensors`, in order, with consecutive values of `flat` (on their device, holding exactly
/// their elements): [`copy_from_flat`] without leaving the device.
pub fn copy_from_device_flat(tensors: &[Tensor], flat: &Tensor) {
    let total: usize = tensors.iter().map(Tensor::numel).sum();
    assert_eq!(total, flat.numel(), "flat tensor length");
    let mut offset = 0;
    tch::no_grad(|| {
        for t in tensors {
            let n = t.numel() as i64;
            t.shallow_clone().copy_(&flat.narrow(0, offset, n).view_as(t));
            offset += n;
        }
    });
}

/// Overwrites every rank's parameters with rank 0's, one tensor at a time.
pub(crate) async fn broadcast_params<T: Transport>(
    trainer: &Trainer,
    comm: &mut Communicator<T>,
    flat: &mut Vec<f32>,
) -> Result<(), ClusterError> {
    for param in trainer.model.params() {
        flat.clear();
        append_flat(std::slice::from_ref(&param.detach()), flat);
        comm.broadcast(&mut flat[..], 0).await?;
        copy_from_flat(std::slice::from_ref(param), flat);
    }
    Ok(())
}

/// A counter as two 24-bit halves, each exact in an f32, to travel through an f32 collective.
pub(crate) fn counter_words(v: u64) -> [f32; 2] {
    [(v >> 24) as f32, (v & 0xFF_FFFF) as f32]
}

/// The counter [`counter_words`] split.
pub(crate) fn counter_of(hi: f32, lo: f32) -> u64 {
    ((hi as u64) << 24) | lo as u64
}

/// Makes this rank's whole training state — parameters, the optimizer's state tensors (AdamW's moments or
/// Adafactor's statistics: the same list on every rank of a job), step counters and the loss scaler —
/// rank `source`'s, one tensor at a time through `flat`.
pub(crate) async fn broadcast_state<T: Transport>(
    comm: &mut Communicator<T>,
    trainer: &mut Trainer,
    flat: &mut Vec<f32>,
    source: usize,
) -> Result<(), ClusterError> {
    let (step, opt) = (counter_words(trainer.step), counter_words(trainer.optimizer.step()));
    let s = trainer.loss_scale.to_words();
    let mut counters = [step[0], step[1], opt[0], opt[1], s[0], s[1], s[2], s[3], s[4]];
    comm.broadcast(&mut counters[..], source).await?;
    let state = trainer.optimizer.state_tensors().into_iter().map(|(_, t)| t);
    let tensors: Vec<Tensor> = trainer.model.params().iter().map(Tensor::shallow_clone).chain(state).collect();
    for tensor in tensors {
        flat.clear();
        append_flat(std::slice::from_ref(&tensor.detach()), flat);
        comm.broadcast(&mut flat[..], source).await?;
        copy_from_flat(std::slice::from_ref(&tensor), flat);
    }
    trainer.step = counter_of(counters[0], counters[1]);
    trainer.optimizer.set_step(counter_of(counters[2], counters[3]));
    let [_, _, _, _, scaler @ ..] = counters;
    trainer.loss_scale = LossScale::from_words(scaler);
    trainer.state_replaced();
    Ok(())
}

/// Gives every parameter a (zero) gradient tensor, so ranks whose slice of a batch is empty still take
/// part in every collective with zeros.
pub(crate) fn materialise_grads(params: &[Tensor]) {
    if params.is_empty() {
        return; // a stage whose layers are all frozen (`[peft]`)
    }
    let zero: Tensor = params.iter().map(|p| p.sum(Kind::Float) * 0.0).sum();
    zero.backward();
}
