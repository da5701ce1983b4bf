//! `ShardOwnerActor`: a ZeRO-1/2/3 rank's shard as a ractor actor. It owns the committed optimizer
//! state the rank holds — the fp32 masters and AdamW moments of its own shard, and its copies of its
//! buddies' shards ([`super::shard_plan`]) — and, between the reduction and the update, the step's
//! reduced gradient of each. It applies the update itself, with the fused AdamW kernel, once the
//! controller committed the step.
//!
//! The rank's engine ([`super::ShardedReplica`]) runs the step's communication and compute and talks
//! to its owner at three points of a step: it borrows the own shard's masters for the step's gathers
//! ([`ShardOwnerMsg::Masters`], shared read-only, no copy), hands over the reduced gradients before the
//! vote ([`ShardOwnerMsg::Stage`], the owner answers the own shard's squared norm), and after the commit
//! asks for the update ([`ShardOwnerMsg::Apply`]). An aborted step is never applied: its gradients are
//! never staged, or are replaced by the next step's, and `Apply` names the step it updates.
//!
//! On the cluster the actor is linked under its rank's WorkerActor for the length of an attempt, as a
//! pipeline device's `StageActor` is. It is not restarted: an owner that dies takes the rank's shard
//! with it, the rank's next step fails, the rank reports no state, and the next attempt restores the
//! shard from a buddy's copy or the checkpoint (docs/runtime-semantics.md).
//!
//! With Adafactor (`train.optimizer = "adafactor"`) the owner keeps, per piece, the first moment (with
//! `beta1`) and the vectors' elementwise second moment, and for the whole model the replicated factored
//! statistics ([`troupe_model::optim::adafactor_shard`]); `Stage` answers its terms of the per-matrix
//! sums too, and a [`ShardOwnerMsg::Prepare`] between the reduction and the vote readies the update
//! (its terms of each update's RMS), so the update after the commit stays local.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use troupe_model::checkpoint::TrainingState;
use troupe_model::config::TrainConfig;
use troupe_model::optim::adafactor_shard::{Prepared, ShardLayout, ShardSlots};
use troupe_model::sections::AdafactorConfig;

use super::committed::ShardPiece;
use super::segments::{adamw_on_segments, ShardSegment};

pub enum ShardOwnerMsg {
    /// The own shard's range and masters, shared read-only for the step's gathers. The update runs in
    /// place only once every such lease is dropped (otherwise it copies the masters first).
    Masters(RpcReplyPort<(Range<usize>, Arc<Vec<f32>>)>),
    /// The reduced gradient of `step` for every piece held (own first, then the buddies' in the order
    /// the owner was given them). Kept until `Apply` or the next `Stage`; the reply is the own shard's
    /// squared L2 norm, the rank's term of the global gradient norm, and with Adafactor the own shard's
    /// terms of the per-matrix sums.
    Stage { step: u64, grads: Vec<Vec<f32>>, reply: RpcReplyPort<Staged> },
    /// Adafactor: readies update `t` of the staged `step` at rate `lr` with the factor `grad_factor` and
    /// the all-reduced sums of `Stage`; the reply is the own shard's terms of each parameter's Σ update²
    /// (an error when `step` is not the staged one, or the owner runs AdamW).
    Prepare {
        step: u64,
        grad_factor: f32,
        lr: f64,
        t: u64,
        sums: Vec<f32>,
        reply: RpcReplyPort<Result<Vec<f32>, String>>,
    },
    /// Applies AdamW update `t` at learning rate `lr` to every piece, with the staged gradients of
    /// `step` times `grad_factor` (unscaling and clipping). The reply gives the gradient buffers back for
    /// the next step; an error (nothing applied) when no gradient of `step` is staged.
    Apply { step: u64, update: OwnerUpdate, reply: RpcReplyPort<Result<Vec<Vec<f32>>, String>> },
    /// Writes the own shard's masters and moments into their range of a whole-state snapshot (rank 0's
    /// checkpoint) and gives the snapshot back.
    Fill(Box<TrainingState>, RpcReplyPort<Box<TrainingState>>),
    /// The own shard's masters, then its first and second moments, appended to the buffer (what a rank
    /// sends rank 0 for a checkpoint).
    Pack(Vec<f32>, RpcReplyPort<Vec<f32>>),
    /// Every piece held, in order, for the next attempt; the actor stops after replying.
    Export(RpcReplyPort<Vec<ShardPiece>>),
}

/// An update's parameters, the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnerUpdate {
    pub grad_factor: f32,
    pub lr: f64,
    /// AdamW's step count after this update (bias correction).
    pub t: u64,
    /// Adafactor: each parameter's Σ update² over the whole model (the all-reduced replies to
    /// `Prepare`); empty with AdamW.
    pub update_sq: Vec<f32>,
}

/// `Stage`'s reply.
#[derive(Clone, Debug, PartialEq)]
pub struct Staged {
    /// The own shard's squared gradient norm.
    pub sum_sq: f64,
    /// Adafactor: the own shard's terms of [`ShardLayout::partial_sums`]; empty with AdamW.
    pub sums: Vec<f32>,
}

/// An Adafactor owner's start: the layout, the hyper-parameters and the whole model's factored
/// statistics (put together by the engine from every owner's slots).
pub struct OwnerAdafactor {
    pub layout: Arc<ShardLayout>,
    pub config: AdafactorConfig,
    pub stats: Vec<f32>,
}

/// An Adafactor owner's state beside its pieces.
struct AdafactorState {
    layout: Arc<ShardLayout>,
    config: AdafactorConfig,
    stats: Vec<f32>,
    /// The step readied by `Prepare`.
    prepared: Option<(u64, Prepared)>,
}

/// What the owner starts with: the pieces (own first), the parameter segments each covers, and the
/// AdamW hyper-parameters.
pub struct OwnerArgs {
    pub pieces: Vec<ShardPiece>,
    pub segments: Vec<Vec<ShardSegment>>,
    pub train: TrainConfig,
    /// With `train.optimizer = "adafactor"`: the pieces' second slots are read into the compact form.
    pub adafactor: Option<OwnerAdafactor>,
}

/// One held piece: the masters shareable with the engine, the moments the owner's alone (Adafactor:
/// `exp_avg` the first moment or empty, `exp_avg_sq` the compact second moment).
struct Piece {
    range: Range<usize>,
    master: Arc<Vec<f32>>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    segments: Vec<ShardSegment>,
}

pub struct OwnerState {
    pieces: Vec<Piece>,
    train: TrainConfig,
    /// The step whose gradients are staged, and those gradients (one per piece).
    staged: Option<(u64, Vec<Vec<f32>>)>,
    adafactor: Option<AdafactorState>,
}

#[derive(Default)]
pub struct ShardOwnerActor;

impl Actor for ShardOwnerActor {
    type Msg = ShardOwnerMsg;
    type State = OwnerState;
    type Arguments = OwnerArgs;

    async fn pre_start(&self, _me: ActorRef<ShardOwnerMsg>, args: OwnerArgs) -> Result<OwnerState, ActorProcessingErr> {
        if args.pieces.is_empty() || args.pieces.len() != args.segments.len() {
            return Err(format!(
                "a shard owner needs its own shard and one segment plan per piece ({} pieces, {} plans)",
                args.pieces.len(),
                args.segments.len()
            )
            .into());
        }
        let adafactor = args.adafactor.map(|a| AdafactorState {
            layout: a.layout,
            config: a.config,
            stats: a.stats,
            prepared: None,
        });
        let pieces = args
            .pieces
            .into_iter()
            .zip(args.segments)
            .map(|(p, segments)| {
                let (exp_avg, exp_avg_sq) = match &adafactor {
                    None => (p.exp_avg, p.exp_avg_sq),
                    Some(a) => {
                        let first = if a.config.beta1.is_some() { p.exp_avg } else { Vec::new() };
                        (first, a.layout.compact(&p.range, &p.exp_avg_sq))
                    }
                };
                Piece { range: p.range, master: Arc::new(p.master), exp_avg, exp_avg_sq, segments }
            })
            .collect();
        Ok(OwnerState { pieces, train: args.train, staged: None, adafactor })
    }

    async fn handle(
        &self,
        me: ActorRef<ShardOwnerMsg>,
        msg: ShardOwnerMsg,
        state: &mut OwnerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ShardOwnerMsg::Masters(reply) => {
                let own = &state.pieces[0];
                let _ = reply.send((own.range.clone(), own.master.clone()));
            }
            ShardOwnerMsg::Stage { step, grads, reply } => {
                let lens: Vec<usize> = state.pieces.iter().map(|p| p.range.len()).collect();
                let given: Vec<usize> = grads.iter().map(Vec::len).collect();
                if lens != given {
                    // The engine and the owner disagree on what the rank holds: a bug, not a fault to
                    // train through. Failing the actor fails the rank's step and drops its state.
                    return Err(format!("staged gradients of lengths {given:?} for pieces of {lens:?}").into());
                }
                let sum_sq = grads[0].iter().map(|&g| f64::from(g) * f64::from(g)).sum();
                let own = &state.pieces[0];
                let sums = match &mut state.adafactor {
                    Some(a) => {
                        a.prepared = None;
                        a.layout.partial_sums(&own.range, &own.master, &grads[0])
                    }
                    None => Vec::new(),
                };
                state.staged = Some((step, grads));
                let _ = reply.send(Staged { sum_sq, sums });
            }
            ShardOwnerMsg::Prepare { step, grad_factor, lr, t, sums, reply } => {
                let _ = reply.send(state.prepare(step, grad_factor, lr, t, &sums));
            }
            ShardOwnerMsg::Apply { step, update, reply } => {
                let _ = reply.send(state.apply(step, update));
            }
            ShardOwnerMsg::Fill(mut snapshot, reply) => {
                let own = &state.pieces[0];
                let [exp_avg, exp_avg_sq] = state.slots(own);
                for (k, v) in [&own.master[..], &exp_avg, &exp_avg_sq].into_iter().enumerate() {
                    snapshot.values[k][own.range.clone()].copy_from_slice(v);
                }
                let _ = reply.send(snapshot);
            }
            ShardOwnerMsg::Pack(mut buf, reply) => {
                let own = &state.pieces[0];
                let [exp_avg, exp_avg_sq] = state.slots(own);
                for v in [&own.master[..], &exp_avg, &exp_avg_sq] {
                    buf.extend_from_slice(v);
                }
                let _ = reply.send(buf);
            }
            ShardOwnerMsg::Export(reply) => {
                let pieces = std::mem::take(&mut state.pieces);
                let pieces = pieces
                    .into_iter()
                    .map(|p| {
                        let [exp_avg, exp_avg_sq] = state.slots(&p).map(Cow::into_owned);
                        let master = Arc::try_unwrap(p.master).unwrap_or_else(|shared| (*shared).clone());
                        ShardPiece { range: p.range, master, exp_avg, exp_avg_sq }
                    })
                    .collect();
                let _ = reply.send(pieces);
                me.stop(None);
            }
        }
        Ok(())
    }
}

impl OwnerState {
    /// A piece's two optimizer slots in the checkpoint's format (AdamW's moments as they are; Adafactor's
    /// first moment, or zeros, and its second slot expanded).
    fn slots<'a>(&self, piece: &'a Piece) -> [Cow<'a, [f32]>; 2] {
        match &self.adafactor {
            None => [Cow::Borrowed(&piece.exp_avg[..]), Cow::Borrowed(&piece.exp_avg_sq[..])],
            Some(a) => {
                let first = match a.config.beta1 {
                    Some(_) => Cow::Borrowed(&piece.exp_avg[..]),
                    None => Cow::Owned(vec![0.0; piece.range.len()]),
                };
                [first, Cow::Owned(a.layout.expand(&piece.range, &piece.exp_avg_sq, &a.stats))]
            }
        }
    }

    /// `Prepare`: the step's per-matrix quantities, kept for `Apply`, and the own shard's Σ update².
    fn prepare(&mut self, step: u64, grad_factor: f32, lr: f64, t: u64, sums: &[f32]) -> Result<Vec<f32>, String> {
        let Some(a) = &mut self.adafactor else {
            return Err("Prepare is Adafactor's; this owner runs AdamW".into());
        };
        let Some((staged, grads)) = self.staged.as_ref().filter(|(staged, _)| *staged == step) else {
            return Err(format!("no gradient of step {step} is staged; nothing prepared"));
        };
        if sums.len() != a.layout.sums_len() {
            return Err(format!("{} sums for a layout of {}", sums.len(), a.layout.sums_len()));
        }
        let prepared = Prepared::new(&a.layout, &a.config, &a.stats, sums, grad_factor, lr, t);
        let own = &self.pieces[0];
        let update_sq = prepared.partial_update_sq(&a.layout, &own.range, &grads[0], &own.exp_avg_sq);
        a.prepared = Some((*staged, prepared));
        Ok(update_sq)
    }

    /// Adafactor's `Apply`: the prepared step on every piece, then the new statistics.
    fn apply_adafactor(&mut self, step: u64, update: &OwnerUpdate, grads: &[Vec<f32>]) -> Result<(), String> {
        let a = self.adafactor.as_mut().expect("an Adafactor owner");
        let Some((_, prepared)) = a.prepared.take().filter(|(prepared, _)| *prepared == step) else {
            return Err(format!("step {step} was not prepared; nothing applied"));
        };
        if update.update_sq.len() != a.layout.param_count() {
            return Err(format!("{} update sums for {} parameters", update.update_sq.len(), a.layout.param_count()));
        }
        for (piece, grad) in self.pieces.iter_mut().zip(grads) {
            let master = Arc::make_mut(&mut piece.master);
            let slots = ShardSlots { master, exp_avg: &mut piece.exp_avg, compact: &mut piece.exp_avg_sq, grad };
            prepared.apply(&a.layout, &piece.range, slots, &update.update_sq);
        }
        a.stats = prepared.stats;
        Ok(())
    }

    fn apply(&mut self, step: u64, update: OwnerUpdate) -> Result<Vec<Vec<f32>>, String> {
        let Some((staged, mut grads)) = self.staged.take() else {
            return Err(format!("no gradient of step {step} is staged; nothing applied"));
        };
        if staged != step {
            let message = format!("the staged gradient is step {staged}'s, not step {step}'s; nothing applied");
            self.staged = Some((staged, grads));
            return Err(message);
        }
        if self.adafactor.is_some() {
            // The factor is applied inside the update (the prepared sums were of the unscaled gradient).
            return match self.apply_adafactor(step, &update, &grads) {
                Ok(()) => Ok(grads),
                Err(e) => {
                    self.staged = Some((staged, grads));
                    Err(e)
                }
            };
        }
        if update.grad_factor != 1.0 {
            grads.iter_mut().flatten().for_each(|g| *g *= update.grad_factor);
        }
        for (piece, grad) in self.pieces.iter_mut().zip(&grads) {
            if Arc::get_mut(&mut piece.master).is_none() {
                tracing::debug!(step, "a lease on the masters is still held: the update copies them");
            }
            let master = Arc::make_mut(&mut piece.master);
            let state = [master, &mut piece.exp_avg, &mut piece.exp_avg_sq];
            adamw_on_segments(state, &piece.segments, grad, &self.train, update.lr, update.t);
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ractor::rpc::CallResult;

    fn args() -> OwnerArgs {
        let piece = |range: Range<usize>| ShardPiece {
            master: range.clone().map(|i| i as f32 * 0.1).collect(),
            exp_avg: vec![0.0; range.len()],
            exp_avg_sq: vec![0.0; range.len()],
            range,
        };
        let segment = |n| vec![ShardSegment { param: 0, in_shard: 0..n, decays: true }];
        OwnerArgs {
            pieces: vec![piece(4..8), piece(0..4)],
            segments: vec![segment(4), segment(4)],
            train: TrainConfig::default(),
            adafactor: None,
        }
    }

    async fn ask<R: Send + 'static>(
        actor: &ActorRef<ShardOwnerMsg>,
        msg: impl FnOnce(RpcReplyPort<R>) -> ShardOwnerMsg,
    ) -> R {
        match actor.call(msg, None).await.unwrap() {
            CallResult::Success(r) => r,
            _ => panic!("the owner did not reply"),
        }
    }

    const UPDATE: OwnerUpdate = OwnerUpdate { grad_factor: 0.5, lr: 0.01, t: 1, update_sq: Vec::new() };

    #[tokio::test]
    async fn applies_only_the_staged_step_and_matches_the_kernel_on_every_piece() {
        let (owner, handle) = Actor::spawn(None, ShardOwnerActor, args()).await.unwrap();
        // Nothing staged: refused, nothing changes.
        let refused = ask(&owner, |reply| ShardOwnerMsg::Apply { step: 0, update: UPDATE, reply }).await;
        assert!(refused.unwrap_err().contains("no gradient of step 0"));

        let grads = vec![vec![1.0, -2.0, 0.5, 0.0], vec![3.0, 0.0, 0.0, 4.0]];
        let staged = ask(&owner, |reply| ShardOwnerMsg::Stage { step: 7, grads: grads.clone(), reply }).await;
        assert_eq!(staged.sum_sq, 1.0 + 4.0 + 0.25, "the own shard's squared norm only");
        assert!(staged.sums.is_empty(), "AdamW has no per-matrix sums");
        // An aborted step 7 followed by step 8's reduction: step 7 is never applied.
        let wrong = ask(&owner, |reply| ShardOwnerMsg::Apply { step: 6, update: UPDATE, reply }).await;
        assert!(wrong.unwrap_err().contains("step 7's, not step 6's"));

        // A lease held across the update: the update copies, the lease keeps the old values.
        let (range, lease) = ask(&owner, ShardOwnerMsg::Masters).await;
        assert_eq!(range, 4..8);
        let back = ask(&owner, |reply| ShardOwnerMsg::Apply { step: 7, update: UPDATE, reply }).await.unwrap();
        assert_eq!(back.iter().map(Vec::len).collect::<Vec<_>>(), vec![4, 4], "buffers handed back");
        assert_eq!(*lease, args().pieces[0].master);
        // Applied once: a second Apply of step 7 finds nothing staged.
        assert!(ask(&owner, |reply| ShardOwnerMsg::Apply { step: 7, update: UPDATE, reply }).await.is_err());

        let mut expected = args();
        let train = expected.train.clone();
        for (piece, (segments, grad)) in expected.pieces.iter_mut().zip(expected.segments.iter().zip(&grads)) {
            let grad: Vec<f32> = grad.iter().map(|g| g * UPDATE.grad_factor).collect();
            let state = [&mut piece.master, &mut piece.exp_avg, &mut piece.exp_avg_sq];
            adamw_on_segments(state, segments, &grad, &train, UPDATE.lr, UPDATE.t);
        }
        let mut packed = ask(&owner, |reply| ShardOwnerMsg::Pack(vec![9.0], reply)).await;
        assert_eq!(packed.remove(0), 9.0, "appended to the buffer");
        let own = &expected.pieces[0];
        assert_eq!(packed, [own.master.clone(), own.exp_avg.clone(), own.exp_avg_sq.clone()].concat());

        let exported = ask(&owner, ShardOwnerMsg::Export).await;
        assert_eq!(exported, expected.pieces);
        handle.await.unwrap(); // Export stops the actor.
    }

    #[tokio::test]
    async fn gradients_that_do_not_fit_the_pieces_fail_the_owner() {
        let (owner, handle) = Actor::spawn(None, ShardOwnerActor, args()).await.unwrap();
        let grads = vec![vec![0.0; 4]];
        let call = owner.call(|reply| ShardOwnerMsg::Stage { step: 0, grads, reply }, None).await;
        assert!(!matches!(call, Ok(CallResult::Success(_))), "no reply from a failed owner");
        handle.await.unwrap();
        assert_eq!(owner.get_status(), ractor::ActorStatus::Stopped);
    }
}
