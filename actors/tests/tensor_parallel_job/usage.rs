//! What a tensor-parallel job's ranks hold and send, as its `Usage` event says: each rank's parameters,
//! gradients and AdamW state are the layout planner's figures for its place (two independent countings:
//! the engine's tensors and the planner's table), its buddy copy is its neighbour's shard four times over
//! (parameters, gradients, two moments), sequence parallelism holds fewer activation bytes than without,
//! and the bytes it hands its transport per step are Megatron's volume for the layout (`plan::traffic`):
//! all-gathers and reduce-scatters with SP (and the all-reduce of the replicated parameters' gradients),
//! the data-parallel gradient all-reduce, a pipeline's sends.

use troupe_actors::api::{Job, JobEvent, LocalCluster};
use troupe_actors::plan::{plan_layout, CollectiveKind, Degrees, GroupKind, Host, LayoutPlan, LayoutRequest};
use troupe_actors::protocol::RankUsage;
use troupe_model::config::JobConfig;

use super::{run_to_end, with_tp};

/// The one `Usage` event of a job run to its end on `cluster`, by rank.
async fn usage_of(cluster: &LocalCluster, config: &JobConfig) -> Vec<RankUsage> {
    let events = run_to_end(cluster, Job::new(config.clone())).await;
    assert!(matches!(events.last(), Some(JobEvent::Finished { .. })), "{events:?}");
    let told: Vec<&Vec<RankUsage>> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Usage { attempt: 1, step: 2, ranks } => Some(ranks),
            JobEvent::Usage { .. } => panic!("one usage event, at the attempt's second step: {e:?}"),
            _ => None,
        })
        .collect();
    assert_eq!(told.len(), 1, "{events:?}");
    told[0].clone()
}

/// The planner's layout of `config` over `world` ranks (all on one host).
fn planned(config: &JobConfig, world: usize) -> LayoutPlan {
    let p = &config.parallel;
    let degrees = Degrees { tp: p.tp, pp: p.pp.max(1), dp: world / (p.tp * p.pp.max(1)) };
    let mut request = LayoutRequest::new(degrees, Host::uniform(1, degrees.world()), config.model.clone());
    (request.sp, request.global_batch, request.micro_batch) =
        (p.sp, config.train.global_batch, config.train.micro_batch);
    plan_layout(&request).expect("the planner places the job")
}

/// Bytes the plan says rank `rank` sends per step in `group` by `collective`.
fn planned_bytes(plan: &LayoutPlan, rank: usize, group: GroupKind, collective: CollectiveKind) -> u64 {
    let stage = &plan.stages[plan.ranks[rank].pp];
    stage.traffic.iter().filter(|t| t.group == group && t.collective == collective).map(|t| t.bytes_per_rank).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_reports_the_planners_memory_and_megatrons_traffic() {
    let cluster = LocalCluster::in_process(4).await.unwrap();
    let mut sp = with_tp(JobConfig::small(3), 2, true);
    sp.parallel.dp = 2;
    let no_sp = with_tp(sp.clone(), 2, false);
    let (with, without) = (usage_of(&cluster, &sp).await, usage_of(&cluster, &no_sp).await);
    assert_eq!(with.len(), 4);
    let plan = planned(&sp, 4);
    for (rank, u) in with.iter().enumerate() {
        let memory = &plan.ranks[rank].memory;
        let held = (u.param_bytes, u.grad_bytes, u.optimizer_bytes);
        assert_eq!(held, (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes), "rank {rank}");
        assert_eq!(u.buddy_bytes, 4 * u.param_bytes, "rank {rank}: a neighbour's shard, gradients and moments");
        assert!(
            u.activation_bytes.is_some_and(|a| a > 0) && u.step_seconds > 0.0 && u.comm_seconds() > 0.0,
            "rank {rank}: {u:?}"
        );

        // Megatron's volume with SP: each all-gather and reduce-scatter of the blocks, the embedding and the
        // head, exactly; the data-parallel all-reduce of the gradients and the loss word.
        for kind in [CollectiveKind::AllGather, CollectiveKind::ReduceScatter] {
            let (measured, theory) =
                (u.sent_by(GroupKind::Tensor, kind), planned_bytes(&plan, rank, GroupKind::Tensor, kind));
            assert!(
                theory > 0 && measured == theory,
                "rank {rank} {kind:?}: sent {measured}, Megatron's scheme {theory}"
            );
        }
        // The all-reduces: the replicated parameters' gradients and the cross-entropy's sums, and the
        // norm's one word beyond the scheme.
        let reduced = u.sent_by(GroupKind::Tensor, CollectiveKind::AllReduce);
        let theory = planned_bytes(&plan, rank, GroupKind::Tensor, CollectiveKind::AllReduce);
        assert!(
            theory > 0 && (theory..=theory + 8).contains(&reduced),
            "rank {rank}: all-reduced {reduced}, scheme {theory}"
        );
        let data = u.sent_by(GroupKind::Data, CollectiveKind::AllReduce);
        let theory = planned_bytes(&plan, rank, GroupKind::Data, CollectiveKind::AllReduce);
        assert_eq!(data, theory + 4, "rank {rank}: the gradients' all-reduce carries the loss word too");
    }
    // Without SP the same blocks all-reduce; the residual stream and norms are held whole, so more bytes.
    let plan = planned(&no_sp, 4);
    for (rank, (u, sharded)) in without.iter().zip(&with).enumerate() {
        // The only all-gather left: the cross-entropy's maxima.
        let gathered = planned_bytes(&plan, rank, GroupKind::Tensor, CollectiveKind::AllGather);
        assert_eq!(u.sent_by(GroupKind::Tensor, CollectiveKind::AllGather), gathered, "rank {rank}");
        let theory = planned_bytes(&plan, rank, GroupKind::Tensor, CollectiveKind::AllReduce);
        let measured = u.sent_by(GroupKind::Tensor, CollectiveKind::AllReduce);
        assert!(measured >= theory && measured < theory + theory / 10, "rank {rank}: sent {measured}, scheme {theory}");
        assert!(
            sharded.activation_bytes.unwrap() < u.activation_bytes.unwrap(),
            "rank {rank}: SP {sharded:?} against {u:?}"
        );
    }
    cluster.shutdown().await;
}

/// tp = 2 × pp = 2 (1F1B): each stage's ranks send their slice of the sequence to the neighbouring
/// stage, the plan's volume, and hold the parameters of their stage only (and a buddy copy of their
/// tensor neighbour's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelines_ranks_report_their_stages_memory_and_sends() {
    let cluster = LocalCluster::in_process(4).await.unwrap();
    let mut config = with_tp(JobConfig::small_llama(3), 2, true);
    (config.parallel.pp, config.parallel.schedule, config.model.n_layers) = (2, "1f1b".into(), 2);
    let usage = usage_of(&cluster, &config).await;
    let plan = planned(&config, usage.len());
    for (rank, u) in usage.iter().enumerate() {
        let memory = &plan.ranks[rank].memory;
        assert_eq!(u.param_bytes, memory.param_bytes, "rank {rank} (stage {})", plan.ranks[rank].pp);
        assert_eq!(u.buddy_bytes, 4 * u.param_bytes, "rank {rank}: its stage neighbour's shard, gradients, moments");
        let theory = planned_bytes(&plan, rank, GroupKind::Pipeline, CollectiveKind::Send);
        let measured = u.sent_by(GroupKind::Pipeline, CollectiveKind::Send);
        assert!(theory > 0 && measured == theory, "rank {rank}: sent {measured} to its neighbour, the plan {theory}");
    }
    cluster.shutdown().await;
}
