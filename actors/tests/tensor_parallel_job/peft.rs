//! Fine-tuning under tensor parallelism as a job (`[parallel] tp = 2` with `[peft]`), checked as the
//! other tensor-parallel jobs are, from a tiny Hugging Face directory (`model.from_hf`): LoRA on every
//! linear of a Llama (column- and row-parallel; sequence parallelism on) and freeze (the last block and
//! the head) of a GPT-2 (sequence parallelism off) each equal the single-process fine-tuning reference —
//! per-step losses and the final trained parameters (the adapters, or the unfrozen modules) within 1e-5
//! relative, fp32. LoRA's dropout, which tensor parallelism does not run, is refused at submission naming
//! `peft.dropout` and the fix.

use std::path::Path;

use troupe_actors::api::{Error, Job, LocalCluster};
use troupe_model::config::JobConfig;
use troupe_model::model::peft::{Method, PeftConfig};
use troupe_model::oracle::fine_tuning;

use super::check;

const STEPS: u64 = 6;

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
        check(&cluster, config, &out, 2, what).await;
    }
    cluster.shutdown().await;
}
