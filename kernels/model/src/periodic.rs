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
//! Every replica then continues from the new global parameters. The arithmetic of a synchronization is
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
//! Membership changes ([`ReplicaSet::regroup`]): every replica goes back to its state at the last
//! synchronization — a lost replica loses the interval's local progress, and so do the others, which redo
//! the interval from the last synchronization with the new set — and a new replica starts from the state
//! of the replica it copies (the distributed runtime's source rank).

use std::ops::Range;
use std::path::Path;

use tch::Tensor;

use crate::checkpoint::TrainingState;
use crate::config::JobConfig;
use crate::data::rank_slice;
use crate::optim::scale_grads;
use crate::sections::ParallelConfig;
use crate::{StepReport, TrainError, Trainer};

/// How the replicas' parameters are combined at a synchronization.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OuterRule {
    /// Local SGD: the mean of the replicas' parameters.
    Average,
    /// DiLoCo: outer SGD with Nesterov momentum on the mean delta (global − local).
    Nesterov { lr: f32, momentum: f32 },
}

/// A job's periodic synchronization: every `every` local steps, by `rule`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeriodicSync {
    pub every: u64,
    pub rule: OuterRule,
}

impl PeriodicSync {
    /// The job's periodic synchronization; None for `parallel.sync = "every_step"`.
    pub fn of(parallel: &ParallelConfig) -> Option<Self> {
        let rule = match parallel.sync.as_str() {
            "local_sgd" => OuterRule::Average,
            "diloco" => OuterRule::Nesterov { lr: parallel.outer_lr as f32, momentum: parallel.outer_momentum as f32 },
            _ => return None,
        };
        Some(Self { every: parallel.sync_every.max(1), rule })
    }

    /// Whether the replicas synchronize after step `step` (counted from 0) of a job of `steps` steps: after
    /// every `every`-th step and after the last.
    pub fn syncs_after(&self, step: u64, steps: u64) -> bool {
        (step + 1).is_multiple_of(self.every) || step + 1 == steps
    }

    /// The step of the last synchronization when `committed` steps are done (of a job of `steps`): what
    /// a rank lost after it rolls the job back to.
    pub fn last_sync(&self, committed: u64, steps: u64) -> u64 {
        if committed >= steps {
            return committed;
        }
        committed / self.every * self.every
    }
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
    /// DiLoCo's `momentum` (empty before the first synchronization: zeros) moves on.
    pub fn conclude(&self, sum: &[f32], world: usize, global: &mut [f32], momentum: &mut Vec<f32>) {
        assert_eq!(global.len(), sum.len(), "flat parameter length");
        let inv = 1.0 / world as f32;
        match *self {
            OuterRule::Average => {
                for (g, s) in global.iter_mut().zip(sum) {
                    *g = s * inv;
                }
            }
            OuterRule::Nesterov { lr, momentum: mu } => {
                momentum.resize(global.len(), 0.0);
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

/// The reference: `world` replicas of one job in one process.
pub struct ReplicaSet {
    config: JobConfig,
    sync: PeriodicSync,
    replicas: Vec<Trainer>,
    /// The parameters of the last synchronization (flat).
    global: Vec<f32>,
    /// DiLoCo's outer momentum (flat; empty before the first synchronization).
    momentum: Vec<f32>,
    /// Each replica's whole state at the last synchronization.
    synced: Vec<TrainingState>,
}

impl ReplicaSet {
    /// `world` replicas of `config` (whose `parallel.sync` must be periodic) at step 0.
    pub fn new(config: &JobConfig, world: usize) -> Result<Self, TrainError> {
        let sync = PeriodicSync::of(&config.parallel).expect("parallel.sync = \"local_sgd\" or \"diloco\"");
        let first = Trainer::new(config.clone())?;
        let global = flat_params(&first);
        let synced = vec![TrainingState::snapshot(&first); world];
        let mut set =
            Self { config: config.clone(), sync, replicas: vec![first], global, momentum: Vec::new(), synced };
        set.regroup(&(0..world).map(|_| 0).collect::<Vec<_>>())?;
        Ok(set)
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
        if self.sync.syncs_after(step, steps) {
            self.synchronize();
        }
        loss
    }

    fn synchronize(&mut self) {
        let mut sum = vec![0f32; self.global.len()];
        for replica in &self.replicas {
            let mut local = flat_params(replica);
            self.sync.rule.contribute(&self.global, &mut local);
            for (s, l) in sum.iter_mut().zip(&local) {
                *s += l;
            }
        }
        self.sync.rule.conclude(&sum, self.world(), &mut self.global, &mut self.momentum);
        for (replica, synced) in self.replicas.iter().zip(&mut self.synced) {
            load_flat_params(replica, &self.global);
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
        check(&|p| p.fragments = 4, &["parallel.fragments", "Streaming DiLoCo", "= 1"]);
        check(&|p| p.shard = "zero2".into(), &["parallel.shard", "plain data-parallel", "\"none\""]);
        check(&|p| p.pp = 2, &["parallel.pp", "parallel.pp = 1"]);
        check(&|p| p.tp = 2, &["parallel.tp", "parallel.tp = 1"]);
        check(&|p| p.precision = "fp16".into(), &["parallel.precision", "bf16"]);
        // every_step ignores the periodic keys.
        check(&|p| (p.sync, p.sync_every) = ("every_step".into(), 0), &[]);
    }

    #[test]
    fn sync_points_are_every_h_steps_and_the_last() {
        let sync = PeriodicSync { every: 4, rule: OuterRule::Average };
        let points: Vec<u64> = (0..10).filter(|&s| sync.syncs_after(s, 10)).collect();
        assert_eq!(points, vec![3, 7, 9]);
        assert_eq!([0, 3, 4, 7, 8, 9, 10].map(|c| sync.last_sync(c, 10)), [0, 0, 4, 4, 8, 8, 10]);
    }

    #[test]
    fn nesterov_outer_step_is_pytorchs_sgd_with_nesterov() {
        // Two replicas, one parameter at 1.0: deltas 0.2 and 0.4 → Δ = 0.3.
        let rule = OuterRule::Nesterov { lr: 0.5, momentum: 0.9 };
        let (mut global, mut momentum) = (vec![1.0f32], Vec::new());
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
