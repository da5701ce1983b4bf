//! Fine-tuning under tensor parallelism as a job (`[parallel] tp = 2` with `[peft]`), on an embedded
//! in-process cluster, from a tiny Hugging Face directory (`model.from_hf`): LoRA on every linear of a
//! Llama (column- and row-parallel; sequence parallelism on) and freeze (the last block and the head) of
//! a GPT-2 (sequence parallelism off) each equal the single-process fine-tuning reference — per-step
//! losses and the final trained parameters (the adapters, or the unfrozen modules) within 1e-5 relative,
//! fp32. LoRA's dropout, which tensor parallelism does not run, is refused at submission naming
//! `peft.dropout` and the fix.

mod common;

use std::path::Path;
use std::time::Duration;

use troupe_actors::api::{Error, Job, JobEvent, LocalCluster};
use troupe_model::config::JobConfig;
use troupe_model::model::peft::{Method, PeftConfig};
use troupe_model::oracle::{compare_params, fine_tuning, worst_loss_diff};
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;
const STEPS: u64 = 6;

fn reference(config: &JobConfig) -> (Vec<f64>, Trainer) {
    tch::set_num_threads(1);
    let mut reference = config.clone();
    reference.parallel.tp = 1;
    let mut trainer = Trainer::new(reference).unwrap();
    let mut losses = Vec::new();
    while trainer.step < config.train.steps {
        losses.push(trainer.train_step().loss);
    }
    (losses, trainer)
}

/// `job` with two blocks, fine-tuned with `peft` from a base written under `dir`, at tp = 2.
fn fine_tuned(mut job: JobConfig, peft: PeftConfig, sp: bool, dir: &Path) -> JobConfig {
    job.model.n_layers = 2;
    let mut config = fine_tuning(job, peft, dir, 5);
    config.parallel.tp = 2;
    config.parallel.sp = sp;
    config
}

fn lora(targets: &[&str]) -> PeftConfig {
    PeftConfig { r: 4, alpha: 8.0, targets: targets.iter().map(|t| t.to_string()).collect(), ..PeftConfig::default() }
}

async fn run_to_end(cluster: &LocalCluster, job: Job) -> Vec<JobEvent> {
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let mut events = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(90), handle.next_event()).await.unwrap().unwrap() {
        events.push(e);
    }
    events
}

async fn check(cluster: &LocalCluster, config: JobConfig, out: &Path, what: &str) {
    let events = run_to_end(cluster, Job::new(config.clone()).save_final(out)).await;
    assert!(matches!(events.last(), Some(JobEvent::Finished { .. })), "{what}: {events:?}");
    let (losses, worlds): (Vec<f64>, Vec<usize>) = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Step { loss, world, .. } => Some((*loss, *world)),
            _ => None,
        })
        .unzip();
    assert!(worlds.iter().all(|&w| w == 2), "{what}: {worlds:?}");
    let (ref_losses, reference) = reference(&config);
    assert_eq!(losses.len(), ref_losses.len(), "{what}: one committed loss per step");
    let diff = worst_loss_diff(&losses, &ref_losses);
    let params = common::saved_params(out, &reference);
    let comparison = compare_params(reference.model.specs(), &params, &reference.param_values());
    eprintln!("{what}: loss diff {diff:.1e}, trained params {comparison:?}");
    assert!(diff <= TOLERANCE, "{what}: losses differ by {diff:e}");
    assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_lora_and_freeze_jobs_equal_the_fine_tuning_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::in_process(2).await.unwrap();

    let all_linears = lora(&["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]);
    let dropout = PeftConfig { dropout: 0.1, ..all_linears.clone() };
    let refused = fine_tuned(JobConfig::small_llama(STEPS), dropout, true, &dir.path().join("d"));
    match cluster.client().await.unwrap().submit(Job::new(refused)).await {
        Err(Error::Refused { message, .. }) => {
            assert!(message.contains("peft.dropout = 0.1") && message.contains("set peft.dropout = 0"), "{message}");
        }
        other => panic!("LoRA dropout at tp = 2 is refused naming peft.dropout: {:?}", other.map(|h| h.id())),
    }

    let freeze = PeftConfig { method: Method::Freeze, last_blocks: 1, ..PeftConfig::default() };
    let cases = [
        ("llama LoRA tp=2 sp", fine_tuned(JobConfig::small_llama(STEPS), all_linears, true, &dir.path().join("l"))),
        ("gpt2 freeze tp=2 no sp", fine_tuned(JobConfig::small(STEPS), freeze, false, &dir.path().join("g"))),
    ];
    for (what, config) in cases {
        let out = dir.path().join(format!("{}.safetensors", what.replace(' ', "-")));
        check(&cluster, config, &out, what).await;
    }
    cluster.shutdown().await;
}
