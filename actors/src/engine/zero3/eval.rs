//! ZeRO-3's share of a validation loss: forward only, unit by unit. Each unit's parameters are gathered
//! once for the whole evaluation (the same broadcasts from their owners as a step's, in the same order on
//! every rank), run on every one of the rank's micro-batches of held-out windows — the unit's compute on
//! a blocking-pool thread beside the next unit's gather — and dropped; so at most two units'
//! parameters are alive at once, as in a step, and a rank's boundary activations (one `[windows,
//! context, d_model]` tensor per micro-batch) are the only other memory. No graph, no gradient, no
//! reduction: the owners' shards are read, never written.

use std::ops::Range;

use tch::{Device, Tensor};
use troupe_cluster::collective::{Collective, Communicator};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::config::JobConfig;
use troupe_model::data::{micro_batch_ranges, EvalWindows};
use troupe_model::model::{self, ParamSpec};
use troupe_model::precision::Precision;
use troupe_model::transfer::upload;

use super::{on_thread, plan_units, DevicePlane, Exchange, Model};

/// The sum of this rank's windows' mean losses ([`crate::engine::eval::share`] of `windows`, in
/// micro-batches of `train.micro_batch`) under the model of `config` computing in `precision` (its
/// parameters `specs`), the parameters gathered unit by unit from their owners. `own` must be this
/// rank's own shard: its range of the flat order and its masters. A collective: every rank calls it,
/// with windows or without. The units compute on `device`; `plane` gathers there (as a step's).
pub(crate) async fn evaluate_share<T: Transport>(
    (comm, plane): (&mut Communicator<T>, Option<&mut (dyn DevicePlane + 'static)>),
    (config, precision, specs, device): (JobConfig, Precision, Vec<ParamSpec>, Device),
    (own, masters): (Range<usize>, &[f32]),
    windows: &EvalWindows,
) -> Result<f64, ClusterError> {
    let share = crate::engine::eval::share(windows, comm.rank(), comm.world());
    let units = plan_units(&config.model, &specs);
    let total = units.last().map_or(0, |u| u.flat.end);
    let batches: Vec<(Tensor, Tensor, f64)> = micro_batch_ranges(share, config.train.micro_batch)
        .into_iter()
        .map(|range| {
            let count = range.len() as f64;
            let (tokens, targets) = windows.batch(range);
            (upload(&tokens, device), upload(&targets, device), count)
        })
        .collect();
    let mut no_grad_shard: [f32; 0] = [];
    let grad = &mut no_grad_shard;
    let mut ex = Exchange { comm, plane, device, specs, total, own, masters, grad, buf: Vec::new() };
    let model = Model { config: config.model.clone(), precision };
    let (head, body) = units.split_last().expect("the model has a head");

    // The embeddings and blocks: each unit on every micro-batch, beside the next unit's gather.
    let mut xs: Vec<Option<Tensor>> = batches.iter().map(|_| None).collect();
    let mut params = ex.gather(&body[0]).await?;
    for u in 0..body.len() {
        let next = body.get(u + 1).unwrap_or(head);
        let (model, tokens) = (model.clone(), batches.iter().map(|b| b.0.shallow_clone()).collect::<Vec<_>>());
        let inputs = std::mem::take(&mut xs);
        let compute = on_thread(move || {
            tch::no_grad(|| {
                inputs
                    .into_iter()
                    .zip(&tokens)
                    .map(|(x, tokens)| Some(model.run(u, &params, x.as_ref(), tokens, None)))
                    .collect()
            })
        });
        let (outputs, gathered) = tokio::join!(compute, ex.gather(next));
        xs = outputs;
        params = gathered?;
    }

    // The head and the loss of each micro-batch: Σ mean loss × windows.
    let targets: Vec<(Tensor, f64)> = batches.iter().map(|b| (b.1.shallow_clone(), b.2)).collect();
    let head_model = model.clone();
    let sum = on_thread(move || {
        tch::no_grad(|| {
            xs.into_iter()
                .zip(&targets)
                .map(|(x, (targets, count))| {
                    let x = x.expect("every unit ran");
                    let logits = model::head(&head_model.config, head_model.precision, &params, &x);
                    model::cross_entropy(&logits, targets).double_value(&[]) * count
                })
                .sum::<f64>()
        })
    })
    .await;
    Ok(sum)
}
