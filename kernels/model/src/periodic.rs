//! Periodic synchronization — `parallel.sync = "local_sgd" | "diloco"` — and its single-process
//! reference: R replicas in one process, each with its share of every batch, exactly as the distributed
//! ranks get it (DESIGN.md §4's oracle for these modes).
//!
//! The algorithm. Every replica starts an interval from the same parameters (the *global* ones, those of
//! the last synchronization) and takes `sync_every` = H local steps: forward and backward on its share
//! `rank_slice(global_batch, rank, world)` of the step's global batch, its gradient scaled to the mean
//! over that share, clipped by its own norm and applied by its own AdamW at the step's scheduled rate.
//! The inner optimizer's state never leaves the replica (as in DiLoCo). After the H-th step — and after
//! the job's last step, so that a finished job's parameters are one set — the replicas synchronize:
//! - local SGD ([`OuterRule::Average`]): the global parameters become the mean of the replicas';
//! - DiLoCo ([`OuterRule::Nesterov`], Douillard et al. 2023): the outer gradient Δ is the mean of the
//!   replicas' deltas (global − local); the outer optimizer is SGD with Nesterov momentum, as PyTorch's
//!   `SGD(nesterov=True)`: `m = μ·m + Δ`, `global −= lr·(Δ + μ·m)` (paper: lr 0.7, μ 0.9).
//!
//! Every replica then continues from the new global parameters.
//!
//! Streaming DiLoCo (`parallel.fragments` = P > 1; Douillard et al. 2025): the flat parameter order is cut
//! into P fragments, each a contiguous group of blocks (the embeddings with the first, the final norm and
//! head with the last; [`fragment_ranges`] balances their sizes), and fragment p synchronizes on its own
//! schedule — after step s when `(s + 1) mod H = offset_p = p·H/P` ([`PeriodicSync::due_after`]) and
//! after the job's last step — so the syncs spread over the H steps and each moves about 1/P of the model.
//! Only the due fragments' parameters are replaced by their new global values; the others keep their
//! local progress. Each fragment has its own slice of the global parameters and of the outer momentum.
//! The all-reduce is synchronous (the paper's overlap, τ > 0, is not in this build). With P = 1 every
//! step of the arithmetic is the plain DiLoCo's, bit for bit. The arithmetic of a synchronization is
//! [`OuterRule::contribute`] (what each replica adds to the sum) and [`OuterRule::conclude`] (the new
//! global parameters from the sum), shared by this reference and the distributed engine: the two differ
//! only in the order the sum is added up.
//!
//! What H = 1 equals. With an inner AdamW, neither mode at H = 1 is DDP on more than one replica: DDP
//! applies AdamW once to the mean gradient, these average R AdamW updates of R share gradients (AdamW
//! normalises each gradient by its own moments, so the average of the updates is not the update of the
//! average). What holds instead, and is tested: with one replica, local SGD is the plain trainer for any
//! H; and DiLoCo with `outer_lr = 1`, `outer_momentum = 0` is local SGD for any H and R.
//!
//! Checkpoints ([`ReplicaSet::checkpoint_state`], [`ReplicaSet::resume`]; the distributed engine saves
//! the same): the state of the last synchronization — the global parameters, every replica's own inner
//! optimizer state (and with fragments its own parameters) and the outer momentum, so a resume on the
//! same world is the uninterrupted run. A resume on another world gives replica `r` saved replica
//! `r mod n`'s state: what a membership change at that synchronization gives ([`ReplicaSet::regroup`]
//! with members `r mod n`).
//!
//! Membership changes ([`ReplicaSet::regroup`]): every replica goes back to its state at the last
//! synchronization — a lost replica loses the interval's local progress, and so do the others, which redo
//! the interval from the last synchronization with the new set — and a new replica starts from the state
//! of the replica it copies (the distributed runtime's source rank).
//! With fragments, "the last synchronization" is the last step after which any fragment synchronized
//! ([`PeriodicSync::last_sync`]): each replica's whole state then — its other fragments' local progress
//! included — is what it goes back to.

use std::ops::Range;
use std::path::Path;

use tch::Tensor;

use crate::checkpoint::{PeriodicState, RankState, TrainingState};
use crate::config::JobConfig;
use crate::data::rank_slice;
use crate::model::ParamSpec;
use crate::optim::scale_grads;
use crate::sections::{invalid, ConfigError, ParallelConfig};
use crate::{StepReport, TrainError, Trainer};

/// How the replicas' parameters are combined at a synchronization.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OuterRule {
    /// Local SGD: the mean of the replicas' parameters.
    Average,
    /// DiLoCo: outer SGD with Nesterov momentum on the mean delta (global − local).
    Nesterov { lr: f32, momentum: f32 },
}

/// A job's periodic synchronization: every `every` local steps, by `rule`, one fragment of the model at a
/// time when `fragments` > 1 (Streaming DiLoCo).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeriodicSync {
    pub every: u64,
    pub rule: OuterRule,
    pub fragments: usize,
}

impl PeriodicSync {
    /// The job's periodic synchronization; None for `parallel.sync = "every_step"`.
    pub fn of(parallel: &ParallelConfig) -> Option<Self> {
        let rule = match parallel.sync.as_str() {
            "local_sgd" => OuterRule::Average,
            "diloco" => OuterRule::Nesterov { lr: parallel.outer_lr as f32, momentum: parallel.outer_momentum as f32 },
            _ => return None,
        };
        Some(Self { every: parallel.sync_every.max(1), rule, fragments: parallel.fragments.max(1) })
    }

    /// Fragment `fragment`'s offset in the interval: it synchronizes after the steps `s` with
    /// `(s + 1) mod every` equal to it (`fragment · every / fragments`: 0 for the first).
    pub fn offset(&self, fragment: usize) -> u64 {
        fragment as u64 * self.every / self.fragments as u64
    }

    /// The fragments that synchronize after step `step` (counted from 0) of a job of `steps` steps: those
    /// whose offset `(step + 1) mod every` is, and all of them after the last step.
    pub fn due_after(&self, step: u64, steps: u64) -> Vec<usize> {
        if step + 1 == steps {
            return (0..self.fragments).collect();
        }
        (0..self.fragments).filter(|&p| (step + 1) % self.every == self.offset(p)).collect()
    }

    /// Whether any fragment synchronizes after step `step` (one fragment: after every `every`-th step and
    /// after the last).
    pub fn syncs_after(&self, step: u64, steps: u64) -> bool {
        !self.due_after(step, steps).is_empty()
    }

    /// The step of the last synchronization (of any fragment) when `committed` steps are done (of a job
    /// of `steps`): what a rank lost after it rolls the job back to.
    pub fn last_sync(&self, committed: u64, steps: u64) -> u64 {
        if committed >= steps {
            return committed;
        }
        (1..=committed).rev().find(|&c| self.syncs_after(c - 1, steps)).unwrap_or(0)
    }

    /// The contributions of a replica's `local` parameters (flat) to the synchronization of `ranges`,
    /// concatenated in their order: what is summed over the replicas.
    pub fn contributions(&self, ranges: &[Range<usize>], global: &[f32], local: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(ranges.iter().map(Range::len).sum());
        for range in ranges {
            let at = out.len();
            out.extend_from_slice(&local[range.clone()]);
            self.rule.contribute(&global[range.clone()], &mut out[at..]);
        }
        out
    }

    /// Concludes the synchronization of `ranges` from `sum` (their contributions summed over `world`
    /// replicas, concatenated): those ranges of `global` and of DiLoCo's `momentum` (allocated, zeros, at
    /// the first synchronization) move on; the rest stay.
    pub fn conclude(
        &self,
        ranges: &[Range<usize>],
        sum: &[f32],
        world: usize,
        global: &mut [f32],
        momentum: &mut Vec<f32>,
    ) {
        if matches!(self.rule, OuterRule::Nesterov { .. }) && momentum.is_empty() {
            momentum.resize(global.len(), 0.0);
        }
        let mut at = 0;
        for range in ranges {
            let n = range.len();
            let m = if momentum.is_empty() { &mut [][..] } else { &mut momentum[range.clone()] };
            self.rule.conclude(&sum[at..at + n], world, &mut global[range.clone()], m);
            at += n;
        }
        assert_eq!(at, sum.len(), "synchronized length");
    }
}

/// The fragments of a model of parameters `specs` (in the flat order) as ranges of that order: `fragments`
/// contiguous groups of blocks — a parameter outside the blocks goes with the nearest block before it, or
/// the first (the embeddings with the first, the final norm and head with the last) — cut to make the
/// largest as small as it can be. Refuses more fragments than blocks, naming the keys.
pub fn fragment_ranges(specs: &[ParamSpec], fragments: usize) -> Result<Vec<Range<usize>>, ConfigError> {
    let total: usize = specs.iter().map(ParamSpec::numel).sum();
    if fragments <= 1 {
        return Ok(vec![0..total]);
    }
    let mut sizes: Vec<usize> = Vec::new();
    let mut current: Option<usize> = None;
    for spec in specs {
        let block = block_of(&spec.name);
        if let (Some(b), Some(c)) = (block, current) {
            if b < c {
                let why = format!("parameter {} comes after block {c}'s: the blocks are not contiguous in the flat order; set parallel.fragments = 1", spec.name);
                return Err(invalid("parallel.fragments", fragments, why));
            }
        }
        let next_block = matches!((block, current), (Some(b), Some(c)) if b != c);
        if next_block || sizes.is_empty() {
            sizes.push(0);
        }
        current = block.or(current);
        *sizes.last_mut().expect("a unit") += spec.numel();
    }
    if fragments > sizes.len() {
        let why = format!(
            "is more than the model's {} blocks (model.n_layers): every fragment holds at least one block; lower parallel.fragments",
            sizes.len()
        );
        return Err(invalid("parallel.fragments", fragments, why));
    }
    let cuts = balanced_cuts(&sizes, fragments);
    let mut ranges = Vec::with_capacity(fragments);
    let (mut start, mut unit) = (0, 0);
    for cut in cuts {
        let len: usize = sizes[unit..cut].iter().sum();
        ranges.push(start..start + len);
        (start, unit) = (start + len, cut);
    }
    Ok(ranges)
}

/// The block a parameter belongs to, from its name (`h.3.…` for GPT-2, `model.layers.3.…` for Llama).
fn block_of(name: &str) -> Option<usize> {
    let parts: Vec<&str> = name.split('.').collect();
    parts.windows(2).find(|w| w[0] == "h" || w[0] == "layers").and_then(|w| w[1].parse().ok())
}

/// The ends of `groups` contiguous groups of `sizes` (each non-empty) whose largest sum is least
/// (dynamic programming over the prefix sums; the models' block counts are small).
fn balanced_cuts(sizes: &[usize], groups: usize) -> Vec<usize> {
    let n = sizes.len();
    let prefix: Vec<usize> = std::iter::once(0).chain(sizes.iter().scan(0, |s, &x| Some(*s + x))).collect();
    // best[g][i]: the least largest sum of the first i units in g groups; from[g][i]: where the last starts.
    let mut best = vec![vec![usize::MAX; n + 1]; groups + 1];
    let mut from = vec![vec![0; n + 1]; groups + 1];
    best[0][0] = 0;
    for g in 1..=groups {
        for i in g..=n {
            for j in (g - 1)..i {
                if best[g - 1][j] == usize::MAX {
                    continue;
                }
                let worst = best[g - 1][j].max(prefix[i] - prefix[j]);
                if worst < best[g][i] {
                    (best[g][i], from[g][i]) = (worst, j);
                }
            }
        }
    }
    let mut cuts = vec![n];
    for g in (2..=groups).rev() {
        cuts.push(from[g][*cuts.last().expect("a cut")]);
    }
    cuts.reverse();
    cuts
}

impl OuterRule {
    /// Replaces `local` (a replica's parameters, flat) by what it adds to the synchronization's sum: the
    /// parameters themselves (local SGD) or the delta `global − local` (DiLoCo).
    pub fn contribute(&self, global: &[f32], local: &mut [f32]) {
        assert_eq!(global.len(), local.len(), "flat parameter length");
        if let OuterRule::Nesterov { .. } = self {
            for (l, g) in local.iter_mut().zip(global) {
                *l = g - *l;
            }
        }
    }

    /// The new global parameters, in place, from `sum` (the contributions summed over `world` replicas);
    /// DiLoCo's `momentum` (as long as `global`; ignored by local SGD) moves on.
    pub fn conclude(&self, sum: &[f32], world: usize, global: &mut [f32], momentum: &mut [f32]) {
        assert_eq!(global.len(), sum.len(), "flat parameter length");
        let inv = 1.0 / world as f32;
        match *self {
            OuterRule::Average => {
                for (g, s) in global.iter_mut().zip(sum) {
                    *g = s * inv;
                }
            }
            OuterRule::Nesterov { lr, momentum: mu } => {
                assert_eq!(momentum.len(), global.len(), "outer momentum length");
                for ((g, s), m) in global.iter_mut().zip(sum).zip(momentum.iter_mut()) {
                    let delta = s * inv;
                    *m = mu * *m + delta;
                    *g -= lr * (delta + mu * *m);
                }
            }
        }
    }
}

/// The samples of each global batch that replica `rank` of `world` trains on, or why it has none.
pub fn replica_share(global_batch: usize, rank: usize, world: usize) -> Result<Range<usize>, String> {
    if world > global_batch {
        return Err(format!(
            "{world} replicas for train.global_batch = {global_batch}: every replica needs at least one sample of each batch; raise train.global_batch or cap the replicas (elastic.max_nodes, parallel.dp)"
        ));
    }
    Ok(rank_slice(global_batch, rank, world))
}

/// One replica's local step (see the module's doc): gradients of its `share` of the step's batch,
/// scaled to that share's mean, clipped by their own norm, its AdamW at the scheduled rate; the step
/// counter advances. Its report's loss is the share's loss weighted by its part of the global batch
/// (summed over the replicas: the batch's mean loss); its gradient norm, the share's mean gradient's.
pub fn local_step(trainer: &mut Trainer, share: Range<usize>) -> StepReport {
    let step = trainer.step;
    let global_batch = trainer.config.train.global_batch;
    let factor = global_batch as f64 / share.len() as f64;
    let loss = trainer.accumulate_slice(step, share);
    scale_grads(trainer.model.params(), factor);
    trainer.apply_update_with_norm(loss, None)
}

/// The trainer's parameters, flat, in the parameter order.
pub fn flat_params(trainer: &Trainer) -> Vec<f32> {
    let mut flat = Vec::new();
    for p in trainer.model.params() {
        let at = flat.len();
        flat.resize(at + p.numel(), 0.0);
        p.detach().copy_data(&mut flat[at..], p.numel());
    }
    flat
}

/// Sets the trainer's parameters to `flat` (in the parameter order).
pub fn load_flat_params(trainer: &Trainer, flat: &[f32]) {
    let mut at = 0;
    tch::no_grad(|| {
        for p in trainer.model.params() {
            let n = p.numel();
            p.shallow_clone().copy_(&Tensor::from_slice(&flat[at..at + n]).view_as(p));
            at += n;
        }
    });
    assert_eq!(at, flat.len(), "flat parameter length");
}

/// Sets `ranges` of the trainer's parameters (flat, in the parameter order) to those of `flat`; the rest
/// stay. One range covering the whole order is [`load_flat_params`].
pub fn load_flat_ranges(trainer: &Trainer, flat: &[f32], ranges: &[Range<usize>]) {
    if ranges.len() == 1 && ranges[0] == (0..flat.len()) {
        return load_flat_params(trainer, flat);
    }
    let mut mixed = flat_params(trainer);
    for range in ranges {
        mixed[range.clone()].copy_from_slice(&flat[range.clone()]);
    }
    load_flat_params(trainer, &mixed);
}

/// A rank's own part of a checkpoint of a periodically synchronizing job, from its state at the last
/// synchronization `synced`: the optimizer's two slots, and with fragments (`fragmented`) its parameters.
pub fn own_part(synced: &TrainingState, fragmented: bool) -> RankState {
    let params = if fragmented { synced.values[0].clone() } else { Vec::new() };
    RankState { slots: [synced.values[1].clone(), synced.values[2].clone()], params }
}

/// The reference: `world` replicas of one job in one process.
pub struct ReplicaSet {
    config: JobConfig,
    sync: PeriodicSync,
    replicas: Vec<Trainer>,
    /// The parameters of the last synchronization (flat).
    global: Vec<f32>,
    /// DiLoCo's outer momentum (flat; empty before the first synchronization).
    momentum: Vec<f32>,
    /// The fragments (ranges of the flat order; one covering it all without Streaming DiLoCo).
    fragments: Vec<Range<usize>>,
    /// Each replica's whole state at the last synchronization.
    synced: Vec<TrainingState>,
}

impl ReplicaSet {
    /// `world` replicas of `config` (whose `parallel.sync` must be periodic) at step 0.
    pub fn new(config: &JobConfig, world: usize) -> Result<Self, TrainError> {
        let sync = PeriodicSync::of(&config.parallel).expect("parallel.sync = \"local_sgd\" or \"diloco\"");
        let first = Trainer::new(config.clone())?;
        let fragments = fragment_ranges(first.model.specs(), sync.fragments).map_err(TrainError::Config)?;
        let global = flat_params(&first);
        let synced = vec![TrainingState::snapshot(&first); world];
        let (config, replicas, momentum) = (config.clone(), vec![first], Vec::new());
        let mut set = Self { config, sync, replicas, global, momentum, fragments, synced };
        set.regroup(&(0..world).map(|_| 0).collect::<Vec<_>>())?;
        Ok(set)
    }

    /// The job's state at the last synchronization as a checkpoint holds it: the global parameters with
    /// replica 0's inner optimizer state, and the periodic part — every replica's inner state (with
    /// fragments, its own parameters too) and the outer momentum.
    pub fn checkpoint_state(&self) -> TrainingState {
        let fragmented = self.fragments.len() > 1;
        let ranks = self.synced.iter().map(|synced| own_part(synced, fragmented)).collect();
        let mut state = self.synced[0].clone();
        state.values[0].clone_from(&self.global);
        state.periodic = Some(PeriodicState { ranks, outer_momentum: self.momentum.clone() });
        state
    }

    /// `world` replicas of `config` resumed from a checkpoint's `state`: replica `r` as saved rank
    /// `r mod n` ([`PeriodicState::source_of`]; all as the saved state's one trainer when it has no
    /// periodic part), the global parameters and outer momentum as saved.
    pub fn resume(config: &JobConfig, state: &TrainingState, world: usize) -> Result<Self, TrainError> {
        let sync = PeriodicSync::of(&config.parallel).expect("parallel.sync = \"local_sgd\" or \"diloco\"");
        let (mut replicas, mut synced, mut momentum) =
            (Vec::with_capacity(world), Vec::with_capacity(world), Vec::new());
        for rank in 0..world {
            let mut own = state.clone();
            momentum = own.take_rank(rank).outer_momentum;
            let mut trainer = Trainer::new(config.clone())?;
            own.restore_into(&mut trainer, Path::new("the checkpoint"))?;
            synced.push(TrainingState::snapshot(&trainer));
            replicas.push(trainer);
        }
        let fragments = fragment_ranges(replicas[0].model.specs(), sync.fragments).map_err(TrainError::Config)?;
        let (config, global) = (config.clone(), state.values[0].clone());
        Ok(Self { config, sync, replicas, global, momentum, fragments, synced })
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.replicas[0].step
    }

    pub fn world(&self) -> usize {
        self.replicas.len()
    }

    /// One step of every replica, then the synchronization when due. Returns the step's loss (the global
    /// batch's mean, as the distributed run reports it).
    pub fn train_step(&mut self) -> f64 {
        let (world, step, steps) = (self.world(), self.step(), self.config.train.steps);
        let global_batch = self.config.train.global_batch;
        let mut loss = 0.0;
        for (rank, replica) in self.replicas.iter_mut().enumerate() {
            let share = replica_share(global_batch, rank, world).unwrap_or_else(|e| panic!("{e}"));
            loss += local_step(replica, share).loss;
        }
        let due = self.sync.due_after(step, steps);
        if !due.is_empty() {
            self.synchronize(&due);
        }
        loss
    }

    /// The synchronization of fragments `due`.
    fn synchronize(&mut self, due: &[usize]) {
        let ranges: Vec<Range<usize>> = due.iter().map(|&p| self.fragments[p].clone()).collect();
        let mut sum = vec![0f32; ranges.iter().map(Range::len).sum()];
        for replica in &self.replicas {
            let local = self.sync.contributions(&ranges, &self.global, &flat_params(replica));
            for (s, l) in sum.iter_mut().zip(&local) {
                *s += l;
            }
        }
        self.sync.conclude(&ranges, &sum, self.world(), &mut self.global, &mut self.momentum);
        for (replica, synced) in self.replicas.iter().zip(&mut self.synced) {
            load_flat_ranges(replica, &self.global, &ranges);
            synced.refresh(replica);
        }
    }

    /// A membership change: new replica `i` restarts from old replica `members[i]`'s state at the last
    /// synchronization (a survivor from its own, a joiner from its source's); every replica's progress
    /// since then is dropped.
    pub fn regroup(&mut self, members: &[usize]) -> Result<(), TrainError> {
        let mut replicas = Vec::with_capacity(members.len());
        for &m in members {
            let mut trainer = Trainer::new(self.config.clone())?;
            self.synced[m].restore_into(&mut trainer, Path::new("the last synchronization"))?;
            replicas.push(trainer);
        }
        self.synced = members.iter().map(|&m| self.synced[m].clone()).collect();
        self.replicas = replicas;
        Ok(())
    }

    /// The parameters of the last synchronization (a finished job's final parameters), as tensors in
    /// the parameter order.
    pub fn params(&self) -> Vec<Tensor> {
        let trainer = &self.replicas[0];
        let mut at = 0;
        trainer
            .model
            .params()
            .iter()
            .map(|p| {
                let n = p.numel();
                let t = Tensor::from_slice(&self.global[at..at + n]).view_as(p);
                at += n;
                t
            })
            .collect()
    }

    /// Replica 0's trainer (its config and parameter specs).
    pub fn first(&self) -> &Trainer {
        &self.replicas[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oracle::compare_params;

    fn job(sync: &str, every: u64, steps: u64) -> JobConfig {
        let mut config = JobConfig::default();
        config.model.n_layers = 1;
        config.model.d_model = 64;
        config.model.context = 32;
        config.train.steps = steps;
        config.train.global_batch = 4;
        config.train.micro_batch = 2;
        config.train.warmup_steps = 2;
        config.parallel.sync = sync.into();
        config.parallel.sync_every = every;
        config
    }

    fn run(config: &JobConfig, world: usize) -> (Vec<f64>, ReplicaSet) {
        let mut set = ReplicaSet::new(config, world).unwrap();
        let losses = (0..config.train.steps).map(|_| set.train_step()).collect();
        (losses, set)
    }

    #[test]
    fn bad_sync_settings_are_refused_naming_the_key_and_what_works() {
        let check = |edit: &dyn Fn(&mut ParallelConfig), words: &[&str]| {
            let mut parallel = ParallelConfig { sync: "diloco".into(), sync_every: 8, ..ParallelConfig::default() };
            edit(&mut parallel);
            let message = parallel.validate().map(|_| String::new()).unwrap_or_else(|e| e.to_string());
            assert_eq!(words.is_empty(), message.is_empty(), "{message:?}");
            for word in words {
                assert!(message.contains(word), "{message:?} lacks {word:?}");
            }
        };
        check(&|_| {}, &[]);
        check(&|p| p.sync = "sometimes".into(), &["parallel.sync", "every_step, local_sgd, diloco"]);
        check(&|p| p.sync_every = 0, &["parallel.sync_every", "must be in 1..="]);
        check(&|p| p.outer_lr = 0.0, &["parallel.outer_lr", "0.7"]);
        check(&|p| p.outer_momentum = 1.0, &["parallel.outer_momentum", "[0, 1)"]);
        check(&|p| p.fragments = 4, &[]);
        check(&|p| p.fragments = 0, &["parallel.fragments", "1..=parallel.sync_every (8)"]);
        check(&|p| p.fragments = 9, &["parallel.fragments", "1..=parallel.sync_every (8)"]);
        check(&|p| p.shard = "zero2".into(), &["parallel.shard", "plain data-parallel", "\"none\""]);
        check(&|p| p.pp = 2, &["parallel.pp", "parallel.pp = 1"]);
        check(&|p| p.tp = 2, &["parallel.tp", "parallel.tp = 1"]);
        check(&|p| p.precision = "fp16".into(), &["parallel.precision", "bf16"]);
        // every_step ignores the periodic keys.
        check(&|p| (p.sync, p.sync_every) = ("every_step".into(), 0), &[]);
    }

    #[test]
    fn more_fragments_than_blocks_are_refused_naming_both_keys() {
        let mut config = job("diloco", 8, 10);
        (config.model.n_layers, config.parallel.fragments) = (2, 4);
        let message = config.validate().unwrap_err().to_string();
        assert!(message.contains("parallel.fragments") && message.contains("model.n_layers (2)"), "{message}");
        config.parallel.fragments = 2;
        config.validate().unwrap();
    }

    #[test]
    fn sync_points_are_every_h_steps_and_the_last() {
        let sync = PeriodicSync { every: 4, rule: OuterRule::Average, fragments: 1 };
        let points: Vec<u64> = (0..10).filter(|&s| sync.syncs_after(s, 10)).collect();
        assert_eq!(points, vec![3, 7, 9]);
        assert_eq!([0, 3, 4, 7, 8, 9, 10].map(|c| sync.last_sync(c, 10)), [0, 0, 4, 4, 8, 8, 10]);
    }

    #[test]
    fn fragments_sync_on_staggered_offsets_and_all_after_the_last_step() {
        let sync = PeriodicSync { every: 8, rule: OuterRule::Average, fragments: 4 };
        assert_eq!((0..4).map(|p| sync.offset(p)).collect::<Vec<_>>(), vec![0, 2, 4, 6]);
        let due: Vec<(u64, Vec<usize>)> =
            (0..20).map(|s| (s, sync.due_after(s, 20))).filter(|(_, d)| !d.is_empty()).collect();
        let expected = [(1, vec![1]), (3, vec![2]), (5, vec![3]), (7, vec![0]), (9, vec![1]), (11, vec![2])];
        assert_eq!(due[..6], expected);
        assert_eq!(due.last().unwrap(), &(19, vec![0, 1, 2, 3]), "every fragment after the last step");
        // A rollback goes to the last step after which any fragment synchronized.
        assert_eq!([0, 1, 2, 3, 5, 8, 9, 20].map(|c| sync.last_sync(c, 20)), [0, 0, 2, 2, 4, 8, 8, 20]);
    }

    #[test]
    fn fragments_are_contiguous_groups_of_blocks_with_the_embeddings_first_and_the_head_last() {
        let config = JobConfig { model: crate::model::ModelConfig::gpt_tiny(), ..JobConfig::default() };
        let specs = crate::model::param_specs(&config.model);
        let total: usize = specs.iter().map(ParamSpec::numel).sum();
        assert_eq!(fragment_ranges(&specs, 1).unwrap(), vec![0..total]);
        let ranges = fragment_ranges(&specs, 4).unwrap();
        assert_eq!(ranges.len(), 4);
        assert_eq!((ranges[0].start, ranges[3].end), (0, total));
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start && !w[1].is_empty()));
        // Which fragment each parameter falls in: blocks in order, h.0 with the embeddings, h.3 with ln_f.
        let mut at = 0;
        let mut fragment_of = std::collections::BTreeMap::new();
        for spec in &specs {
            fragment_of.insert(spec.name.clone(), ranges.iter().position(|r| r.contains(&at)).unwrap());
            let end = at + spec.numel();
            assert!(ranges.iter().any(|r| r.start <= at && end <= r.end), "{} is cut", spec.name);
            at = end;
        }
        let first = |prefix: &str| fragment_of.iter().find(|(n, _)| n.starts_with(prefix)).map(|(_, f)| *f).unwrap();
        assert_eq!([first("wte"), first("wpe"), first("h.0."), first("h.1."), first("h.2.")], [0, 0, 0, 1, 2]);
        assert_eq!([first("h.3."), first("ln_f"), first("lm_head")], [3, 3, 3]);
        let err = fragment_ranges(&specs, 5).unwrap_err().to_string();
        assert!(err.contains("parallel.fragments") && err.contains("4 blocks"), "{err}");
    }

    #[test]
    fn the_peak_bytes_of_a_sync_drop_with_the_fragments() {
        // gpt-tiny: four blocks of 790k parameters, 98k of embeddings, a 66k head. The largest fragment,
        // the most one synchronization moves, is within 10% of 1/P of the model.
        let specs = crate::model::param_specs(&crate::model::ModelConfig::gpt_tiny());
        let total: usize = specs.iter().map(ParamSpec::numel).sum();
        for fragments in [2, 4] {
            let largest = fragment_ranges(&specs, fragments).unwrap().iter().map(Range::len).max().unwrap();
            let ratio = largest as f64 * fragments as f64 / total as f64;
            assert!(ratio < 1.1, "{fragments} fragments: the largest is {ratio:.2}× its share");
        }
    }

    #[test]
    fn synchronizing_all_fragments_at_once_is_the_one_fragment_sync_bit_for_bit() {
        let rule = OuterRule::Nesterov { lr: 0.7, momentum: 0.9 };
        let whole = PeriodicSync { every: 4, rule, fragments: 1 };
        let global: Vec<f32> = (0..10).map(|i| (i as f32 * 0.37).sin()).collect();
        let locals: Vec<Vec<f32>> =
            (0..3).map(|r| global.iter().map(|g| g - 0.01 * (r as f32 + g).cos()).collect()).collect();
        let run = |ranges: &[Range<usize>]| {
            let (mut g, mut m) = (global.clone(), Vec::new());
            for _ in 0..2 {
                let mut sum = vec![0f32; 10];
                for local in &locals {
                    let c = whole.contributions(ranges, &g, local);
                    let mut at = 0;
                    for range in ranges {
                        for (s, v) in sum[range.clone()].iter_mut().zip(&c[at..at + range.len()]) {
                            *s += v;
                        }
                        at += range.len();
                    }
                }
                let packed: Vec<f32> = ranges.iter().flat_map(|r| sum[r.clone()].to_vec()).collect();
                whole.conclude(ranges, &packed, 3, &mut g, &mut m);
            }
            (g, m)
        };
        assert_eq!(run(&[0..10]), run(&[0..3, 3..4, 4..10]));
    }

    #[test]
    fn streaming_replaces_only_the_due_fragment_and_keeps_the_others_local_progress() {
        let mut config = job("diloco", 4, 12);
        config.model.n_layers = 2;
        config.parallel.fragments = 2;
        let mut set = ReplicaSet::new(&config, 2).unwrap();
        let ranges = set.fragments.clone();
        set.train_step();
        set.train_step(); // after step 1: fragment 1 (offset 2) synchronizes, fragment 0 does not
        let (a, b) = (flat_params(&set.replicas[0]), flat_params(&set.replicas[1]));
        assert_eq!(a[ranges[1].clone()], set.global[ranges[1].clone()], "the synchronized fragment is the global one");
        assert_eq!(a[ranges[1].clone()], b[ranges[1].clone()]);
        assert_ne!(a[ranges[0].clone()], b[ranges[0].clone()], "the other fragment keeps each replica's progress");
        assert_eq!(set.momentum[ranges[0].clone()].iter().map(|m| m.abs()).sum::<f32>(), 0.0);
        for _ in 2..12 {
            assert!(set.train_step().is_finite());
        }
        config.parallel.fragments = 1;
        let plain = run(&config, 2).1;
        let cmp = compare_params(set.first().model.specs(), &set.params(), &plain.params());
        assert!(!cmp.within(1e-4), "streaming is another schedule than plain DiLoCo: {cmp:?}");
        assert_eq!(flat_params(&set.replicas[0]), set.global, "after the last step the replicas are the global model");
    }

    #[test]
    fn nesterov_outer_step_is_pytorchs_sgd_with_nesterov() {
        // Two replicas, one parameter at 1.0: deltas 0.2 and 0.4 → Δ = 0.3.
        let rule = OuterRule::Nesterov { lr: 0.5, momentum: 0.9 };
        let (mut global, mut momentum) = (vec![1.0f32], vec![0.0f32]);
        let mut a = vec![0.8f32];
        let mut b = vec![0.6f32];
        rule.contribute(&global, &mut a);
        rule.contribute(&global, &mut b);
        rule.conclude(&[a[0] + b[0]], 2, &mut global, &mut momentum);
        // m = 0.3; update = 0.3 + 0.9·0.3 = 0.57; global = 1 − 0.5·0.57.
        assert!((momentum[0] - 0.3).abs() < 1e-6 && (global[0] - 0.715).abs() < 1e-6, "{global:?} {momentum:?}");
        // Second sync with Δ = 0.1: m = 0.37, update 0.1 + 0.333.
        let mut c = vec![global[0] - 0.1];
        rule.contribute(&global, &mut c);
        rule.conclude(&c, 1, &mut global, &mut momentum);
        assert!((momentum[0] - 0.37).abs() < 1e-6 && (global[0] - (0.715 - 0.5 * 0.433)).abs() < 1e-6);
    }

    #[test]
    fn one_replica_of_local_sgd_is_the_plain_trainer() {
        let config = job("local_sgd", 3, 7);
        let (losses, set) = run(&config, 1);
        let mut plain = Trainer::new(config.clone()).unwrap();
        let plain_losses: Vec<f64> = (0..7).map(|_| plain.train_step().loss).collect();
        assert_eq!(losses, plain_losses);
        let cmp = compare_params(plain.model.specs(), &set.params(), &plain.param_values());
        assert_eq!(cmp.worst, 0.0, "{cmp:?}");
    }

    #[test]
    fn diloco_with_unit_lr_and_no_momentum_is_local_sgd_and_momentum_changes_it() {
        let local = run(&job("local_sgd", 2, 6), 2);
        let mut config = job("diloco", 2, 6);
        (config.parallel.outer_lr, config.parallel.outer_momentum) = (1.0, 0.0);
        let plain = run(&config, 2);
        let specs = local.1.first().model.specs();
        let cmp = compare_params(specs, &plain.1.params(), &local.1.params());
        assert!(cmp.within(1e-6), "{cmp:?}");
        let paper = run(&job("diloco", 2, 6), 2);
        let cmp = compare_params(specs, &paper.1.params(), &local.1.params());
        assert!(!cmp.within(1e-3), "the outer momentum moves the parameters: {cmp:?}");
    }

    #[test]
    fn two_replicas_at_h1_differ_from_one_adamw_on_the_mean_gradient() {
        // Documented, not a wish: averaging two AdamW updates is not DDP's AdamW of the mean gradient.
        let config = job("local_sgd", 1, 4);
        let (_, set) = run(&config, 2);
        let mut ddp = Trainer::new(config.clone()).unwrap();
        for _ in 0..4 {
            ddp.train_step();
        }
        let cmp = compare_params(ddp.model.specs(), &set.params(), &ddp.param_values());
        assert!(!cmp.within(1e-5), "{cmp:?}");
    }

    #[test]
    fn regrouping_rolls_every_replica_back_to_the_last_sync() {
        let config = job("diloco", 3, 9);
        let mut set = ReplicaSet::new(&config, 3).unwrap();
        for _ in 0..5 {
            set.train_step();
        }
        set.regroup(&[0, 2]).unwrap();
        assert_eq!((set.step(), set.world()), (3, 2));
        let synced = set.params();
        for replica in &set.replicas {
            let cmp = compare_params(replica.model.specs(), &replica.param_values(), &synced);
            assert_eq!(cmp.worst, 0.0, "every replica restarts from the global parameters");
        }
        assert!(replica_share(1, 0, 2).unwrap_err().contains("train.global_batch"));
    }
}
