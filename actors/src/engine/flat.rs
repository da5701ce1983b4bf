//! Moving between lists of tensors and one flat f32 buffer in canonical parameter order — what the
//! collectives send — and the two things every engine does to a replica's parameters through it: take
//! rank 0's, and give them gradients to reduce.

use tch::{Kind, Tensor};
use troupe_cluster::collective::Communicator;
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
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

/// Gives every parameter a (zero) gradient tensor, so ranks whose slice of a batch is empty still take
/// part in every collective with zeros.
pub(crate) fn materialise_grads(params: &[Tensor]) {
    if params.is_empty() {
        return; // a stage whose layers are all frozen (`[peft]`)
    }
    let zero: Tensor = params.iter().map(|p| p.sum(Kind::Float) * 0.0).sum();
    zero.backward();
}
