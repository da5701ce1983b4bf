//! [`TpGroup`] over the attempt's collectives: the tensor group's ranks as a `Subgroup` of the
//! attempt's mesh, each call a `Communicator` collective driven to completion with `Handle::block_on`.
//! The model's tensor-parallel code is synchronous, so it runs on a blocking thread of the runtime
//! (`tokio::task::spawn_blocking`) that owns this group; the attempt's task awaits that thread. When the
//! rank's tensor group has a device plane (its ranks on GPUs of their own: NCCL), the group's
//! collectives run there instead ([`super::device`]), and the host communicator carries only the buddy
//! copy's gradients and the gathers of whole state.

use tch::{Kind, Tensor};
use tokio::runtime::Handle;
use troupe_cluster::collective::ReduceOp;
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::tensor_parallel::{TpError, TpGroup};

use super::device::PlaneClient;
use super::meter::Metered;

/// One rank's tensor group over a metered `Communicator` (f32 on the wire; an f64 tensor, the norm's sum
/// of squares, travels as f32 and comes back as f64), or over its device plane when it has one.
pub struct CommGroup<T: Transport> {
    pub comm: Metered<T>,
    pub handle: Handle,
    pub device: Option<PlaneClient>,
}

/// `t`'s values as f32, flat (a detached contiguous copy).
pub(super) fn values(t: &Tensor) -> Vec<f32> {
    let t = t.detach().to_kind(Kind::Float).contiguous().view(-1);
    let mut out = vec![0.0f32; t.numel()];
    t.copy_data(&mut out, t.numel());
    out
}

fn tensor(values: &[f32], shape: &[i64], like: &Tensor) -> Tensor {
    Tensor::from_slice(values).view(shape).to_kind(like.kind()).to_device(like.device())
}

fn failed(e: ClusterError) -> TpError {
    TpError::Comm(e.to_string())
}

impl<T: Transport> TpGroup for CommGroup<T> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce(&mut self, t: &Tensor) -> Result<Tensor, TpError> {
        if let Some(device) = &self.device {
            return device.all_reduce(t);
        }
        let mut v = values(t);
        self.handle.block_on(self.comm.all_reduce(&mut v[..], ReduceOp::Sum)).map_err(failed)?;
        Ok(tensor(&v, &t.size(), t))
    }

    fn all_gather(&mut self, t: &Tensor, dim: i64) -> Result<Tensor, TpError> {
        if let Some(device) = &self.device {
            return device.all_gather(t, dim);
        }
        let n = self.size();
        let moved = t.transpose(0, dim).contiguous();
        let v = values(&moved);
        let mut out = vec![0.0f32; v.len() * n];
        self.handle.block_on(self.comm.all_gather(&v[..], &mut out[..])).map_err(failed)?;
        let mut shape = moved.size();
        shape[0] *= n as i64;
        Ok(tensor(&out, &shape, t).transpose(0, dim).contiguous())
    }

    fn reduce_scatter(&mut self, t: &Tensor, dim: i64) -> Result<Tensor, TpError> {
        if let Some(device) = &self.device {
            return device.reduce_scatter(t, dim);
        }
        let n = self.size();
        let moved = t.transpose(0, dim).contiguous();
        let v = values(&moved);
        let mut out = vec![0.0f32; v.len() / n];
        self.handle.block_on(self.comm.reduce_scatter(&v[..], &mut out[..], ReduceOp::Sum)).map_err(failed)?;
        let mut shape = moved.size();
        shape[0] /= n as i64;
        Ok(tensor(&out, &shape, t).transpose(0, dim).contiguous())
    }
}
