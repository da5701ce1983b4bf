//! The validation loss of a job (`train.eval_every`), computed data-parallel: the held-out windows
//! ([`EvalWindows`], the trainer's `validation`) are shared among the ranks as a step's samples are
//! (`rank_slice`, then micro-batches of `train.micro_batch` windows), each rank sums its windows' mean
//! losses in a forward without gradients, and one all-reduce adds the sums. Every rank gets the same
//! result, which equals the single process's [`Trainer::evaluate`] within summation order.
//!
//! An evaluation reads the committed parameters and writes nothing — no gradient, no optimizer state,
//! no sampler position, no random draw — so it never changes the training trajectory.

use std::ops::Range;

use troupe_cluster::collective::{Communicator, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::data::{rank_slice, EvalWindows};
use troupe_model::generate::{window_loss_sum, Evaluation};
use troupe_model::Trainer;

/// The windows rank `rank` of `world` evaluates: a contiguous balanced share.
pub(crate) fn share(windows: &EvalWindows, rank: usize, world: usize) -> Range<usize> {
    rank_slice(windows.len(), rank, world)
}

/// Adds the ranks' sums of window losses (a collective of `comm`): the evaluation every rank returns.
pub(crate) async fn reduce_shares<T: Transport>(
    comm: &mut Communicator<T>,
    local_sum: f64,
    windows: &EvalWindows,
) -> Result<Evaluation, ClusterError> {
    let mut sum = [local_sum as f32];
    comm.all_reduce(&mut sum[..], ReduceOp::Sum).await?;
    Ok(Evaluation::of_sum(f64::from(sum[0]), windows))
}

/// A rank that holds the whole model (DDP; ZeRO-1/2 once its parameters are gathered): the summed loss
/// of its share of the windows (forward only) and the windows, for [`reduce_shares`]. None when the job
/// holds no data out.
pub(crate) fn replicated_share(trainer: &Trainer, rank: usize, world: usize) -> Option<(f64, EvalWindows)> {
    let windows = trainer.validation.clone()?;
    let range = share(&windows, rank, world);
    let local = window_loss_sum(&trainer.model, &windows, range, trainer.config.train.micro_batch);
    Some((local, windows))
}
