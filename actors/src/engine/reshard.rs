//! Putting a job's committed state back together at the start of an attempt, for any engine that keeps
//! it in pieces of the flat parameter order (ZeRO shards and their buddy copies, pipeline stages' chunks,
//! or whole states from a checkpoint): every rank says what it holds, the most advanced step wins, and
//! each rank ends up with the ranges the new layout gives it.

use std::ops::Range;

use troupe_cluster::collective::{Collective, Communicator};
use troupe_cluster::transport::Transport;
use troupe_model::init::initial_flat;
use troupe_model::model::ModelConfig;
use troupe_model::precision::LossScale;
use troupe_model::Trainer;

use super::committed::ShardPiece;
use super::shard_plan::{all_local, decode_holding, encode_holding, plan_restore, Holding, HOLDING_WORDS};
use super::step_engine::EngineError;

/// What a rank holds when an attempt starts.
pub struct Held<'a> {
    /// Committed steps of its state.
    pub step: u64,
    /// AdamW updates applied to it.
    pub optimizer_step: u64,
    /// fp16's loss scaler at that step.
    pub loss_scale: LossScale,
    pub pieces: &'a [ShardPiece],
    /// A fresh job's step 0 ([`super::CommittedState::Initial`]): the rank holds every range in effect,
    /// computed or read from the model config and seed when needed instead of `pieces`.
    pub fresh: Option<(&'a ModelConfig, u64)>,
}

impl<'a> Held<'a> {
    /// What a rank holds: `pieces` at its trainer's committed step.
    pub fn of(trainer: &Trainer, pieces: &'a [ShardPiece]) -> Self {
        let (step, optimizer_step, loss_scale) = (trainer.step, trainer.optimizer.step(), trainer.loss_scale);
        Self { step, optimizer_step, loss_scale, pieces, fresh: None }
    }

    /// What a rank with a fresh job's step 0 holds: any range, from `trainer`'s model config and seed.
    pub fn fresh(trainer: &'a Trainer) -> Self {
        Self { fresh: Some((&trainer.config.model, trainer.config.train.seed)), ..Self::of(trainer, &[]) }
    }

    /// Copies `range` of the held state (which must contain it) into masters and the two moments.
    fn read(&self, range: &Range<usize>, out: [&mut [f32]; 3]) -> Result<(), EngineError> {
        let [master, exp_avg, exp_avg_sq] = out;
        if let Some((model, seed)) = self.fresh {
            let values = initial_flat(model, seed, range.clone())
                .map_err(|e| EngineError::Setup(format!("reading the model's initial values: {e}")))?;
            master.copy_from_slice(&values);
            exp_avg.fill(0.0);
            exp_avg_sq.fill(0.0);
            return Ok(());
        }
        let source = self.pieces.iter().find(|p| p.range.start <= range.start && range.end <= p.range.end);
        source.expect("the rank holds the range it reads").read(range, [master, exp_avg, exp_avg_sq]);
        Ok(())
    }
}

/// A rank's state after [`reshard`]: the pieces it needs, at the most advanced committed step.
pub struct Resharded {
    /// In the order of `needed_of(rank)`.
    pub pieces: Vec<ShardPiece>,
    pub step: u64,
    pub optimizer_step: u64,
    pub loss_scale: LossScale,
}

/// Reshards the committed state to this attempt's layout, in which rank `r` needs the flat ranges
/// `needed_of(r)` (at most [`super::shard_plan::HOLDING_RANGES_MAX`] of them, as a rank may hold). A
/// collective over `comm`'s ranks. Every rank all-gathers what every other holds; the most advanced step
/// wins. When every rank already holds what it needs at that step, nothing else moves; otherwise every
/// piece of the flat state is broadcast once from the lowest rank that holds it. The loss scaler comes
/// from the lowest rank at that step. A piece held by no rank at that step fails with
/// [`EngineError::StateLost`]; any failure leaves `held` as it was.
pub async fn reshard<T: Transport>(
    comm: &mut Communicator<T>,
    total: usize,
    held: Held<'_>,
    needed_of: impl Fn(usize) -> Vec<Range<usize>>,
) -> Result<Resharded, EngineError> {
    let (rank, world) = (comm.rank(), comm.world());
    let mine = Holding {
        step: held.step,
        optimizer_step: held.optimizer_step,
        ranges: match held.fresh {
            Some(_) => vec![0..total],
            None => held.pieces.iter().map(|p| p.range.clone()).collect(),
        },
    };
    let mut words = vec![0f32; world * HOLDING_WORDS];
    comm.all_gather(&encode_holding(&mine), &mut words).await?;
    let holdings: Vec<Holding> = words.chunks(HOLDING_WORDS).map(decode_holding).collect();
    let plan = plan_restore(total, &holdings)
        .map_err(|missing| EngineError::StateLost { step: missing.step, range: missing.range })?;
    let mut pieces: Vec<ShardPiece> = needed_of(rank).into_iter().map(ShardPiece::zeros).collect();
    if all_local(&holdings, plan.step, &needed_of) {
        for piece in &mut pieces {
            let ShardPiece { range, master, exp_avg, exp_avg_sq } = piece;
            held.read(range, [master, exp_avg, exp_avg_sq])?;
        }
    } else {
        let mut buf = Vec::new();
        for (range, provider) in &plan.sources {
            let n = range.len();
            buf.clear();
            buf.resize(3 * n, 0.0);
            if *provider == rank {
                let (m, rest) = buf.split_at_mut(n);
                let (v1, v2) = rest.split_at_mut(n);
                held.read(range, [m, v1, v2])?;
            }
            comm.broadcast(&mut buf[..], *provider).await?;
            for piece in &mut pieces {
                let (start, end) = (range.start.max(piece.range.start), range.end.min(piece.range.end));
                if start >= end {
                    continue;
                }
                let (at, from) = (start - piece.range.start..end - piece.range.start, start - range.start);
                let dsts = [&mut piece.master, &mut piece.exp_avg, &mut piece.exp_avg_sq];
                for (k, dst) in dsts.into_iter().enumerate() {
                    dst[at.clone()].copy_from_slice(&buf[k * n + from..k * n + from + (end - start)]);
                }
            }
        }
    }
    let provider = holdings.iter().position(|h| h.step == plan.step).expect("plan_restore: a rank holds the step");
    let mut scaler = held.loss_scale.to_words();
    comm.broadcast(&mut scaler[..], provider).await?;
    Ok(Resharded {
        pieces,
        step: plan.step,
        optimizer_step: plan.optimizer_step,
        loss_scale: LossScale::from_words(scaler),
    })
}
