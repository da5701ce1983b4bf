//! A Llama-family model from a Hugging Face directory on an embedded local cluster of daemon processes:
//! DDP over QUIC that loses a SIGKILLed daemon mid-run, ZeRO-3 across two daemons, and a 1F1B pipeline
//! across two daemons — each equal to the single-process reference started from the same weights
//! (per-step losses and final parameters within 1e-5 relative, fp32). The final parameters then export
//! as a Hugging Face directory that reads back bit for bit.

mod common;

use std::path::Path;
use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, LocalCluster};
use troupe_model::config::JobConfig;
use troupe_model::hf::{self, ExportOptions};
use troupe_model::model::Model;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;

/// A Llama directory as a user brings it: config.json and model.safetensors (the small Llama shape,
/// GQA 4/2, 2 blocks, initialised from seed 99 — not the job's seed, so the weights must come from the
/// file).
fn hf_dir(root: &Path) -> std::path::PathBuf {
    let mut shape = JobConfig::small_llama(1).model;
    shape.n_layers = 2;
    let model = Model::new(shape.clone(), 99);
    let values: Vec<Vec<f32>> =
        model.params().iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
    let dir = root.join("llama-hf");
    hf::export(&shape, &values, &dir, ExportOptions::default()).unwrap();
    dir
}

/// The job: `[model] from_hf`, as a user writes it, with a shorter context than the model's positions.
fn config(dir: &Path, steps: u64, parallel: &str) -> JobConfig {
    let toml = format!(
        "[model]\nfrom_hf = {:?}\ncontext = 24\n[train]\nsteps = {steps}\nglobal_batch = 8\nmicro_batch = 4\nwarmup_steps = 2\ntorch_threads = 1\n[parallel]\n{parallel}\n",
        dir.display().to_string()
    );
    JobConfig::from_toml(&toml, "llama.toml").unwrap()
}

fn check(config: &JobConfig, losses: &[f64], final_params: &Path, what: &str) -> Trainer {
    tch::set_num_threads(1);
    let mut reference = Trainer::new(config.clone()).unwrap();
    let ref_losses: Vec<f64> = (0..config.train.steps).map(|_| reference.train_step().loss).collect();
    assert_eq!(losses.len(), ref_losses.len(), "{what}: one committed loss per step");
    let diff = worst_loss_diff(losses, &ref_losses);
    let params = common::saved_params(final_params, &reference);
    let comparison = compare_params(reference.model.specs(), &params, &reference.param_values());
    eprintln!("{what}: loss diff {diff:.1e}, params {comparison:?}");
    assert!(diff <= TOLERANCE, "{what}: losses differ by {diff:e}");
    assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
    reference
}

/// Runs `job` to its end on `cluster`, SIGKILLing daemon `kill` once step `at` has committed; every
/// step's loss and world size.
async fn run(cluster: &LocalCluster, job: Job, kill: Option<(usize, u64)>) -> (Vec<f64>, Vec<usize>) {
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let (mut losses, mut worlds, mut killed) = (Vec::new(), Vec::new(), false);
    loop {
        let event =
            tokio::time::timeout(Duration::from_secs(90), handle.next_event()).await.expect("progress").unwrap();
        match event.expect("the stream ends with a terminal event") {
            JobEvent::Step { step, loss, world, .. } => {
                losses.push(loss);
                worlds.push(world);
                if let Some((node, at)) = kill.filter(|&(_, at)| !killed && step >= at) {
                    let _ = at;
                    common::signal(cluster.pid(node).unwrap(), "KILL");
                    killed = true;
                }
            }
            end if end.is_terminal() => {
                assert!(matches!(end, JobEvent::Finished { .. }), "{end:?}");
                return (losses, worlds);
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_llama_from_hugging_face_trains_under_ddp_zero3_and_a_pipeline_and_survives_a_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let weights = hf_dir(dir.path());

    // DDP on three daemons, one SIGKILLed after step 3: the survivors go on on the reference's trajectory.
    let cluster = common::processes(3).await;
    let ddp = config(&weights, 10, "");
    let out = dir.path().join("ddp.safetensors");
    let (losses, worlds) = run(&cluster, Job::new(ddp.clone()).save_final(&out), Some((2, 3))).await;
    assert_eq!((worlds.first(), worlds.last()), (Some(&3), Some(&2)), "{worlds:?}");
    let reference = check(&ddp, &losses, &out, "llama DDP, a daemon killed");
    cluster.shutdown().await;

    // Exported as a Hugging Face directory, the trained model reads back bit for bit.
    let exported = dir.path().join("exported");
    let values: Vec<Vec<f32>> =
        reference.param_values().iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
    hf::export(&ddp.model, &values, &exported, ExportOptions::default()).unwrap();
    let back = Model::load(
        troupe_model::hf::read_config(&exported)
            .map(|c| troupe_model::ModelConfig { from_hf: Some(exported.clone()), ..c })
            .unwrap(),
        0,
    )
    .unwrap();
    for (a, b) in back.params().iter().zip(reference.param_values().iter()) {
        assert!(a.equal(b), "export → import changed a parameter");
    }

    // ZeRO-3 and a 1F1B pipeline, each across two daemons.
    let cluster = common::processes(2).await;
    for (what, parallel) in [("llama ZeRO-3", "shard = \"zero3\""), ("llama pp=2 1f1b", "pp = 2\nschedule = \"1f1b\"")]
    {
        let config = config(&weights, 6, parallel);
        let out = dir.path().join(format!("{}.safetensors", what.replace(' ', "-")));
        let (losses, worlds) = run(&cluster, Job::new(config.clone()).save_final(&out), None).await;
        assert!(worlds.iter().all(|&w| w == 2), "{what}: {worlds:?}");
        check(&config, &losses, &out, what);
    }
    cluster.shutdown().await;
}

/// Fine-tuning as a user writes it — `[peft]` LoRA (r 4 on q, v, o) on a Hugging Face Llama — on three
/// daemon processes, one SIGKILLed after step 3: under DDP the survivors go on from their replicas, under
/// ZeRO-2 from the lost rank's buddy copy of its adapter shard, each on the reference's trajectory. The
/// final state is the adapters alone; the base is never trained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_fine_tuning_job_survives_a_sigkill_under_ddp_and_zero2() {
    let dir = tempfile::tempdir().unwrap();
    let weights = hf_dir(dir.path());
    for (what, parallel) in [("LoRA DDP", ""), ("LoRA ZeRO-2", "shard = \"zero2\"")] {
        let cluster = common::processes(3).await;
        let lora = format!(
            "{parallel}\n[peft]\nmethod = \"lora\"\nr = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\", \"o_proj\"]\n"
        );
        let config = config(&weights, 8, &lora);
        let out = dir.path().join(format!("{}.safetensors", what.replace(' ', "-")));
        let (losses, worlds) = run(&cluster, Job::new(config.clone()).save_final(&out), Some((2, 3))).await;
        assert_eq!((worlds.first(), worlds.last()), (Some(&3), Some(&2)), "{what}: {worlds:?}");
        let reference = check(&config, &losses, &out, what);
        let saved = tch::Tensor::read_safetensors(&out).unwrap();
        assert!(
            saved.iter().all(|(name, _)| name.contains(".lora_")),
            "{what}: saved {:?}",
            saved.iter().map(|(n, _)| n).collect::<Vec<_>>()
        );
        assert_eq!(saved.len(), reference.model.params().len());
        cluster.shutdown().await;
    }
}
