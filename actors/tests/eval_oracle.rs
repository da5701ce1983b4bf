//! The validation loss (`train.eval_every`) under every engine equals the single-process reference's:
//! DDP, ZeRO-1/2/3 and pipelines (in process, and the cluster's `PipelineReplica`) evaluate the held-out
//! windows data-parallel, and each evaluation equals `troupe_model::generate::evaluate` — what `troupe
//! eval` runs — on the reference trainer's model after the same steps, within 1e-5 relative in fp32.
//! An evaluation changes nothing: a run that evaluates after every step computes the same bits as one
//! that never does.
//!
//! The small model (`JobConfig::small`, deepened where a pipeline needs the blocks) on the synthetic
//! corpus with its last tenth held out; 13 windows, so ranks and replicas get unequal shares, and
//! micro-batches of 2 leave a short last one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tch::Tensor;
use troupe_actors::engine::pipeline::{run_in_process, PipelineOptions, PipelineReplica, ScheduleKind};
use troupe_actors::engine::DEFAULT_BUCKET_BYTES;
use troupe_actors::engine::{CommittedState, DataParallelReplica, ShardMode, ShardedReplica, StepEngine};
use troupe_cluster::collective::{CollectiveConfig, Communicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::TransportConfig;
use troupe_model::config::JobConfig;
use troupe_model::data::load_corpora;
use troupe_model::generate::{evaluate, Evaluation};
use troupe_model::Trainer;

const STEPS: u64 = 4;
const WINDOWS: usize = 13;
const TOLERANCE: f64 = 1e-5;

/// Evaluations after steps 2 and 4.
fn job(layers: usize) -> JobConfig {
    let mut config = JobConfig::small(STEPS);
    config.model.n_layers = layers;
    config.train.global_batch = 8;
    config.train.micro_batch = 2;
    config.data.val_fraction = 0.1;
    config.train.eval_every = 2;
    config.train.eval_samples = WINDOWS;
    config.validate().unwrap();
    config
}

/// The reference's evaluation after each step: `generate::evaluate` on the held-out tail, every window in
/// one forward (the reference trainer's own `evaluate`, in micro-batches, agrees).
fn reference(config: &JobConfig) -> Vec<Evaluation> {
    tch::set_num_threads(1);
    let (_, held_out) = load_corpora(&config.data, &config.model).unwrap();
    let held_out = held_out.expect("val_fraction holds the tail out");
    let mut trainer = Trainer::new(config.clone()).unwrap();
    (0..STEPS)
        .map(|_| {
            trainer.train_step();
            let eval = evaluate(&trainer.model, &held_out, WINDOWS, WINDOWS).unwrap();
            assert_close(&trainer.evaluate().expect("held out"), &eval, "the reference trainer's evaluate");
            eval
        })
        .collect()
}

fn assert_close(got: &Evaluation, want: &Evaluation, what: &str) {
    assert_eq!((got.windows, got.tokens), (WINDOWS, WINDOWS * 32), "{what}");
    let diff = (got.loss - want.loss).abs() / want.loss.abs();
    assert!(diff <= TOLERANCE, "{what}: validation loss {} vs the reference's {} ({diff:.2e})", got.loss, want.loss);
    assert!((got.perplexity - got.loss.exp()).abs() <= 1e-12 * got.perplexity, "{what}");
}

/// One rank's run: its step losses, its evaluations (after the due steps) and final parameters.
struct RankRun {
    losses: Vec<f64>,
    evals: Vec<(u64, Evaluation)>,
    params: Vec<Tensor>,
}

/// The worker's step loop in small: reduce → apply → evaluate when due (`every_step`: after every step,
/// to show evaluations change nothing; `never`: not at all).
async fn drive<E: StepEngine>(engine: &mut E, config: &JobConfig, when: When) -> RankRun {
    engine.sync(None).await.unwrap();
    let (mut losses, mut evals) = (Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let reduced = engine.reduce().await.unwrap();
        losses.push(reduced.loss);
        engine.apply(reduced).await;
        let step = engine.trainer().step;
        let due = match when {
            When::Due => config.eval_due(step),
            When::EveryStep => true,
            When::Never => false,
        };
        if due {
            evals.push((step, engine.evaluate().await.unwrap().expect("held out")));
        }
    }
    engine.finish().await.unwrap();
    RankRun { losses, evals, params: engine.trainer().param_values() }
}

#[derive(Clone, Copy, Debug)]
enum When {
    Due,
    EveryStep,
    Never,
}

#[derive(Clone, Copy, Debug)]
enum Engine {
    Ddp,
    /// Started as the daemon starts a fresh job (ZeRO-3 from an unmaterialised state).
    Sharded(ShardMode),
    /// The cluster's pipeline rank: a stage actor per rank (pp = world).
    Pipeline,
}

type RankFuture = Pin<Box<dyn Future<Output = RankRun>>>;

/// Runs `body` on `world` ranks, each a thread with its own runtime, over the in-memory transport.
fn on_ranks(
    world: usize,
    body: impl Fn(Communicator<MemoryTransport>) -> RankFuture + Send + Sync + 'static,
) -> Vec<RankRun> {
    let body = Arc::new(body);
    let handles: Vec<_> = MemoryTransport::mesh(world, 4096)
        .into_iter()
        .map(|transport| {
            let body = body.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                let comm =
                    Communicator::new(Arc::new(transport), 0, 1, CollectiveConfig::from(&TransportConfig::default()));
                runtime.block_on(body(comm))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank panicked")).collect()
}

fn run(engine: Engine, config: &JobConfig, world: usize, when: When) -> Vec<RankRun> {
    let config = config.clone();
    on_ranks(world, move |comm| {
        let config = config.clone();
        Box::pin(async move {
            let collective = CollectiveConfig::from(&TransportConfig::default());
            match engine {
                Engine::Ddp => {
                    let trainer = Trainer::new(config.clone()).unwrap();
                    let mut replica = DataParallelReplica::new(trainer, comm, DEFAULT_BUCKET_BYTES).await.unwrap();
                    drive(&mut replica, &config, when).await
                }
                Engine::Sharded(mode) => {
                    let state = CommittedState::Initial(Box::new(Trainer::new_unmaterialised(config.clone()).unwrap()));
                    let mut replica = ShardedReplica::adopt(state, comm, mode, 1, None);
                    drive(&mut replica, &config, when).await
                }
                Engine::Pipeline => {
                    let state = CommittedState::Initial(Box::new(Trainer::new_unmaterialised(config.clone()).unwrap()));
                    let mut replica = PipelineReplica::adopt(state, comm, collective, None);
                    let run = drive(&mut replica, &config, when).await;
                    replica.into_state().await.expect("the state comes back");
                    run
                }
            }
        })
    })
}

/// Every rank reports the same evaluations, equal to the reference's after the same steps, at the steps
/// `eval_every` names (2 and the last, 4).
fn check_engine(engine: Engine, config: &JobConfig, world: usize) {
    let want = reference(config);
    let runs = run(engine, config, world, When::Due);
    for (rank, run) in runs.iter().enumerate() {
        let steps: Vec<u64> = run.evals.iter().map(|e| e.0).collect();
        assert_eq!(steps, [2, 4], "{engine:?} rank {rank}");
        for ((step, eval), (_, first)) in run.evals.iter().zip(&runs[0].evals) {
            assert_close(eval, &want[*step as usize - 1], &format!("{engine:?} world {world} rank {rank} step {step}"));
            assert_eq!(eval.loss, first.loss, "{engine:?}: every rank reduced the same");
        }
    }
}

#[test]
fn data_parallel_and_zero_evaluate_the_references_validation_loss() {
    let config = job(1);
    check_engine(Engine::Ddp, &config, 2);
    check_engine(Engine::Ddp, &config, 3);
    check_engine(Engine::Sharded(ShardMode::Zero2), &config, 2);
    check_engine(Engine::Sharded(ShardMode::Zero3), &config, 2);
    check_engine(Engine::Sharded(ShardMode::Zero3), &config, 3);
}

#[test]
fn a_cluster_pipeline_rank_evaluates_through_its_stage_actor() {
    let mut config = job(2);
    config.parallel.pp = 2;
    check_engine(Engine::Pipeline, &config, 2);
}

/// Evaluating after every step leaves the training bits as they are without evaluating.
#[test]
fn an_evaluation_changes_nothing_the_run_computes() {
    let config = job(1);
    for (engine, world) in
        [(Engine::Ddp, 2), (Engine::Sharded(ShardMode::Zero2), 2), (Engine::Sharded(ShardMode::Zero3), 2)]
    {
        let (with, without) = (run(engine, &config, world, When::EveryStep), run(engine, &config, world, When::Never));
        assert_eq!(with[0].evals.len(), STEPS as usize, "{engine:?}");
        for (a, b) in with.iter().zip(&without) {
            assert_eq!(a.losses, b.losses, "{engine:?}: the step losses");
            for (p, q) in a.params.iter().zip(&b.params) {
                assert!(p.equal(q), "{engine:?}: the final parameters, bit for bit");
            }
        }
    }
}

/// In-process pipelines (`troupe train --pp`): the evaluation of each due step equals the reference's,
/// and the step losses are those of the same pipeline that never evaluates.
#[test]
fn in_process_pipelines_evaluate_the_references_validation_loss() {
    tch::set_num_threads(1);
    for (kind, stages, virtual_stages, replicas, shard) in
        [(ScheduleKind::OneFOneB, 2, 1, 1, "none"), (ScheduleKind::Interleaved, 2, 2, 2, "zero3")]
    {
        let mut config = job(stages * virtual_stages);
        config.parallel.pp = stages;
        config.parallel.dp = replicas;
        config.parallel.shard = shard.into();
        config.parallel.schedule = kind.name().into();
        config.parallel.virtual_stages = virtual_stages;
        let want = reference(&config);
        let mut options = PipelineOptions::new(kind, stages, 4 / replicas, virtual_stages);
        options.data_parallel = replicas;
        let what = format!("{kind} P={stages} V={virtual_stages} dp={replicas} {shard}");
        let mut evals = Vec::new();
        let with = run_in_process(&config, &options, STEPS, |step| {
            if let Some(eval) = step.eval {
                evals.push((step.step + 1, eval));
            }
        })
        .unwrap();
        assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 4], "{what}");
        for (step, eval) in &evals {
            assert_close(eval, &want[*step as usize - 1], &format!("{what} step {step}"));
        }
        let mut quiet = config.clone();
        quiet.train.eval_every = 0;
        let without = run_in_process(&quiet, &options, STEPS, |step| assert!(step.eval.is_none())).unwrap();
        let losses =
            |run: &troupe_actors::engine::pipeline::PipelineRun| run.steps.iter().map(|s| s.loss).collect::<Vec<_>>();
        assert_eq!(losses(&with), losses(&without), "{what}: evaluating changed the training");
    }
}
