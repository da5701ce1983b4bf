//! Tensor × pipeline parallelism (Megatron's layout): the model cut into P stages, each stage's parts
//! split over a tensor group of T ranks ([`TpRank::running`]); micro-batches flow forward as activations
//! (tensor rank t of stage p to tensor rank t of stage p + 1: the whole residual stream without sequence
//! parallelism, the rank's slice of the sequence with it) and their gradients back. Per-step losses,
//! gradients and, after AdamW steps with clipping over the global norm, the parameters equal the
//! single-process reference's within 1e-5 relative — with a tied head whose stage keeps a copy of the
//! embedding matrix, its gradient summed with the first stage's.

use tch::Tensor;
use troupe_model::model::{Model, ModelConfig, Samples};
use troupe_model::optim::{clip_coefficient, scale_grads, AdamW};
use troupe_model::tensor_parallel::{LocalGroup, StageParts, TpGroup, TpLayout, TpRank};

use super::{
    assert_param_equal, batch, decays, gpt2, initial_model, llama, reference, rel_diff, ADAMW, CLIP, LR, SEED, STEPS,
};

/// Micro-batches of one row each (the batch has 2): the gradients accumulate over them.
const MICROBATCHES: i64 = 2;

/// The stages' parts: the embeddings with the first, the head with the last, the blocks spread evenly.
fn stages(cfg: &ModelConfig, p: usize) -> Vec<StageParts> {
    let n = cfg.n_layers;
    (0..p).map(|s| StageParts { embed: s == 0, blocks: s * n / p..(s + 1) * n / p, head: s + 1 == p }).collect()
}

/// What one tensor rank records over the run: per step the loss and, per stage, its gradient shards; at
/// the end, per stage, its shards.
struct RankRun {
    losses: Vec<f64>,
    grads: Vec<Vec<Vec<Tensor>>>,
    params: Vec<Vec<Tensor>>,
}

/// Tensor rank `t`'s share of every stage, one thread: `groups[s]` is its member of stage s's tensor
/// group, the stages run in pipeline order (every rank of a stage runs the same collectives).
/// With `split`, each backward is a zero-bubble schedule's B (the input's gradient only) and the weight
/// passes (W) run after the step's last micro-batch.
fn rank_run(layout: TpLayout, t: usize, mut groups: Vec<LocalGroup>, parts: Vec<StageParts>, split: bool) -> RankRun {
    tch::set_num_threads(1);
    let cfg = layout.config.clone();
    let full = initial_model(&cfg);
    let decays = decays(&full);
    let mut ranks: Vec<TpRank> = parts
        .iter()
        .map(|p| {
            let held = troupe_model::tensor_parallel::held_params(&cfg, &p.runs(&cfg));
            TpRank::running(layout.clone(), t, layout.shard_held(full.params(), t, &held), p.runs(&cfg))
        })
        .collect();
    drop(full);
    let mut adamw: Vec<AdamW> = ranks.iter().map(|r| AdamW::new(ADAMW, r.params(), decays.clone())).collect();
    let (last, tied) = (ranks.len() - 1, cfg.head_takes_embedding() && ranks.len() > 1);
    let mut run = RankRun { losses: Vec::new(), grads: Vec::new(), params: Vec::new() };
    for step in 0..STEPS {
        let (tokens, targets) = batch(&cfg, step);
        ranks.iter_mut().for_each(|r| r.params_mut().iter_mut().for_each(Tensor::zero_grad));
        let mut loss = 0.0;
        let mut weight_passes = Vec::new();
        for mb in 0..MICROBATCHES {
            let (tokens, targets) = (tokens.narrow(0, mb, 1), targets.narrow(0, mb, 1));
            let samples = Some(Samples::new(SEED, step as u64, mb as usize));
            let mut forwards = Vec::new();
            let mut x = tokens.shallow_clone();
            for (s, rank) in ranks.iter().enumerate() {
                let forward = rank.stage_forward(&mut groups[s], &parts[s], &x, Some(&targets), samples).unwrap();
                x = forward.output().shallow_clone();
                forwards.push(forward);
            }
            loss += x.double_value(&[]) / MICROBATCHES as f64;
            let mut seed = Tensor::from(1.0f32 / MICROBATCHES as f32);
            for (s, forward) in forwards.into_iter().enumerate().rev() {
                let grad = match split {
                    true => {
                        let (grad, pending) =
                            ranks[s].stage_backward_input(&mut groups[s], forward, seed.shallow_clone()).unwrap();
                        weight_passes.push((s, pending));
                        grad
                    }
                    false => ranks[s].stage_backward(&mut groups[s], forward, seed.shallow_clone()).unwrap(),
                };
                match grad {
                    Some(grad) => seed = grad,
                    None => assert_eq!(s, 0, "only the first stage's input is token ids"),
                }
            }
        }
        let untouched =
            |p: &Tensor| p.numel() == 0 || !p.grad().defined() || p.grad().abs().max().double_value(&[]) == 0.0;
        assert!(
            !split || ranks.iter().all(|r| r.params().iter().all(untouched)),
            "the input passes computed a parameter's gradient"
        );
        for (s, pending) in weight_passes {
            ranks[s].stage_backward_weight(&mut groups[s], pending).unwrap();
        }
        if tied {
            // The head's copy of the embedding matrix and the first stage's: one gradient, summed.
            let (first, head) = (ranks[0].params()[0].grad(), ranks[last].params()[0].grad());
            let sum = &first + &head;
            tch::no_grad(|| {
                first.shallow_clone().copy_(&sum);
                head.shallow_clone().copy_(&sum);
            });
        }
        run.losses.push(loss);
        run.grads.push(ranks.iter().map(TpRank::grads).collect());
        // The global norm: every stage's shards, the head's copy of the embedding not counted twice.
        let mut norm_sq = 0.0;
        for (s, rank) in ranks.iter().enumerate() {
            let mut counted = rank.held().to_vec();
            if tied && s == last {
                counted[0] = false;
            }
            let [sharded, replicated] = rank.grad_squares(&counted);
            norm_sq += groups[s].all_reduce(&Tensor::from(sharded)).unwrap().double_value(&[]) + replicated;
        }
        let norm = norm_sq.sqrt();
        assert!(norm > CLIP, "the test must exercise clipping: norm {norm} ≤ {CLIP}");
        for (rank, adamw) in ranks.iter_mut().zip(&mut adamw) {
            scale_grads(rank.params(), clip_coefficient(CLIP, norm));
            adamw.apply(rank.params_mut(), LR);
        }
    }
    run.params = ranks.iter().map(|r| r.params().iter().map(|p| p.detach().copy()).collect()).collect();
    run
}

/// Every parameter's whole tensor from the stage that holds it (the first holder: a tied head's copy of
/// the embedding matrix is the first stage's), each stage's shards gathered over its tensor group.
fn whole(layout: &TpLayout, per_rank: &[&Vec<Vec<Tensor>>]) -> Vec<Tensor> {
    let stages = per_rank[0].len();
    let gathered: Vec<Vec<Tensor>> = (0..stages)
        .map(|s| {
            let shards: Vec<Vec<Tensor>> =
                per_rank.iter().map(|r| r[s].iter().map(Tensor::shallow_clone).collect()).collect();
            layout.gather(&shards)
        })
        .collect();
    (0..layout.specs.len())
        .map(|i| {
            let holder = (0..stages).find(|&s| gathered[s][i].numel() > 0).expect("a stage holds every parameter");
            gathered[holder][i].shallow_clone()
        })
        .collect()
}

fn assert_pipelined_equals_reference(cfg: &ModelConfig, degree: usize, sp: bool, p: usize, split: bool) {
    let case = format!("{} tp={degree} sp={sp} pp={p} split={split}", cfg.arch.as_str());
    let layout = TpLayout::new(cfg, degree, sp).unwrap();
    let parts = stages(cfg, p);
    let mut groups: Vec<Vec<LocalGroup>> = (0..degree).map(|_| Vec::new()).collect();
    for _ in 0..p {
        for (t, member) in LocalGroup::new(degree).into_iter().enumerate() {
            groups[t].push(member);
        }
    }
    let runs: Vec<RankRun> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(t, groups)| {
                let (layout, parts) = (layout.clone(), parts.clone());
                s.spawn(move || rank_run(layout, t, groups, parts, split))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    });
    let want = reference(cfg);
    let names: Vec<String> = layout.specs.iter().map(|s| s.name.clone()).collect();
    let mut worst = [0.0f64; 3];
    for (step, (a, b)) in runs[0].losses.iter().zip(&want.losses).enumerate() {
        let d = (a - b).abs() / b.abs();
        assert!(d <= 1e-5, "{case}: step {step}'s loss {a} vs reference {b}");
        worst[0] = worst[0].max(d);
    }
    for step in 0..STEPS {
        let grads = whole(&layout, &runs.iter().map(|r| &r.grads[step]).collect::<Vec<_>>());
        for ((name, a), b) in names.iter().zip(&grads).zip(&want.grads[step]) {
            let d = rel_diff(a, b);
            assert!(d <= 1e-5, "{case}: step {step}'s gradient of {name} differs by {d:e}");
            worst[1] = worst[1].max(d);
        }
    }
    let params = whole(&layout, &runs.iter().map(|r| &r.params).collect::<Vec<_>>());
    for ((name, a), b) in names.iter().zip(&params).zip(&want.params) {
        worst[2] = worst[2].max(assert_param_equal(cfg, &case, name, a, b));
    }
    if cfg.head_takes_embedding() && p > 1 {
        for (t, run) in runs.iter().enumerate() {
            let (first, head) = (&run.params[0][0], &run.params[p - 1][0]);
            assert!(first.equal(head), "{case}: tensor rank {t}'s two copies of the embedding matrix differ");
        }
    }
    println!(
        "{case}: worst relative difference: loss {:.1e}, gradient {:.1e}, parameter {:.1e}",
        worst[0], worst[1], worst[2]
    );
}

#[test]
fn tensor_parallel_stages_of_a_pipeline_equal_the_reference() {
    let tied_gpt2 = ModelConfig { n_layers: 3, tie_word_embeddings: true, ..gpt2() };
    assert!(tied_gpt2.head_takes_embedding() && llama().head_takes_embedding(), "both heads tied");
    for sp in [true, false] {
        assert_pipelined_equals_reference(&tied_gpt2, 2, sp, 3, false);
        assert_pipelined_equals_reference(&llama(), 2, sp, 2, false);
    }
    assert_pipelined_equals_reference(&llama(), 4, true, 2, false);
    assert!(!gpt2().head_takes_embedding(), "an untied head");
    assert_pipelined_equals_reference(&gpt2(), 2, true, 2, false);
}

/// A zero-bubble schedule's split backward: B gives each stage's input gradient and computes no
/// parameter's, W adds the parameters' later (here after the step's last micro-batch, so a W runs after
/// the next micro-batch's B) — the same gradients, partial ones (SP's replicated norms, key/value heads
/// shared by ranks) summed over the group in W.
#[test]
fn split_input_and_weight_passes_equal_the_reference() {
    let tied_gpt2 = ModelConfig { n_layers: 3, tie_word_embeddings: true, ..gpt2() };
    for sp in [true, false] {
        assert_pipelined_equals_reference(&tied_gpt2, 2, sp, 3, true);
        assert_pipelined_equals_reference(&llama(), 2, sp, 2, true);
    }
    assert_pipelined_equals_reference(&llama(), 4, true, 2, true);
}

/// A stage holds its parts' shards only: the parameters of the other stages are empty tensors.
#[test]
fn a_stage_rank_holds_only_its_parts_shards() {
    let cfg = ModelConfig { n_layers: 4, tie_word_embeddings: true, ..gpt2() };
    let layout = TpLayout::new(&cfg, 2, true).unwrap();
    let full = Model::new(cfg.clone(), SEED);
    let parts = stages(&cfg, 2);
    let held: Vec<Vec<bool>> =
        parts.iter().map(|p| troupe_model::tensor_parallel::held_params(&cfg, &p.runs(&cfg))).collect();
    let elements = |held: &[bool]| -> usize {
        let rank = TpRank::running(layout.clone(), 0, layout.shard_held(full.params(), 0, held), parts[0].runs(&cfg));
        rank.params().iter().map(Tensor::numel).sum()
    };
    let all: usize = layout.shard(full.params(), 0).iter().map(Tensor::numel).sum();
    let first = elements(&held[0]);
    assert!(first < all * 2 / 3, "stage 0 of 2 holds {first} of a rank's {all} elements");
    // Every parameter is held by some stage; only the tied embedding matrix by both.
    for i in 0..layout.specs.len() {
        let holders = held.iter().filter(|h| h[i]).count();
        let want = if i == 0 && cfg.head_takes_embedding() { 2 } else { 1 };
        assert_eq!(holders, want, "{}", layout.specs[i].name);
    }
}

/// Activation recomputation under tensor parallelism without a pipeline
/// (`TpRank::loss_and_backward_recomputed`: the forward block by block without a graph, each block run
/// again at its backward): the loss and the gathered gradients equal the reference's.
#[test]
fn recomputing_block_by_block_equals_the_reference() {
    let cases = [(ModelConfig { n_layers: 3, tie_word_embeddings: true, ..gpt2() }, true), (llama(), false)];
    for (cfg, sp) in cases {
        let case = format!("{} tp=2 sp={sp} recomputed", cfg.arch.as_str());
        let want = reference(&cfg);
        let layout = TpLayout::new(&cfg, 2, sp).unwrap();
        let runs: Vec<(f64, Vec<Tensor>)> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalGroup::new(2)
                .into_iter()
                .enumerate()
                .map(|(t, mut group)| {
                    let (layout, cfg) = (layout.clone(), &cfg);
                    s.spawn(move || {
                        tch::set_num_threads(1);
                        let (tokens, targets) = batch(cfg, 0);
                        let full = initial_model(cfg);
                        let rank = TpRank::new(layout.clone(), t, layout.shard(full.params(), t));
                        let samples = Some(Samples::new(SEED, 0, 0));
                        let loss =
                            rank.loss_and_backward_recomputed(&mut group, &tokens, &targets, samples, 1.0).unwrap();
                        (loss, rank.grads())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
        });
        let d = (runs[0].0 - want.losses[0]).abs() / want.losses[0].abs();
        assert!(d <= 1e-5, "{case}: loss {} vs reference {}", runs[0].0, want.losses[0]);
        let grads =
            layout.gather(&runs.iter().map(|r| r.1.iter().map(Tensor::shallow_clone).collect()).collect::<Vec<_>>());
        let mut worst = 0.0f64;
        for ((spec, a), b) in layout.specs.iter().zip(&grads).zip(&want.grads[0]) {
            let d = rel_diff(a, b);
            assert!(d <= 1e-5, "{case}: the gradient of {} differs by {d:e}", spec.name);
            worst = worst.max(d);
        }
        println!("{case}: loss {d:.1e}, worst gradient {worst:.1e}");
    }
}
