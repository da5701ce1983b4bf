//! Fine-tuning under tensor parallelism as a job (`[parallel] tp = 2` with `[peft]`), checked as the
//! other tensor-parallel jobs are, from a tiny Hugging Face directory (`model.from_hf`): LoRA on every
//! linear of a Llama (column- and row-parallel; sequence parallelism on) and freeze (the last block and
//! the head) of a GPT-2 (sequence parallelism off) each equal the single-process fine-tuning reference —
//! per-step losses and the final trained parameters (the adapters, or the unfrozen modules) within 1e-5
//! relative, fp32 — and LoRA with dropout (`peft.dropout` = 0.1), whose masks each rank draws for the
//! samples of its micro-batches as the reference does; LoRA trained with Adafactor (its factored
//! statistics of each adapter all-reduced over the tensor group).

use std::path::Path;

use troupe_actors::api::LocalCluster;
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
    let freeze = PeftConfig { method: Method::Freeze, last_blocks: 1, ..PeftConfig::default() };
    let cases = [
        (
            "llama LoRA tp=2 sp",
            fine_tuned(JobConfig::small_llama(STEPS), all_linears.clone(), true, &dir.path().join("l")),
        ),
        ("llama LoRA dropout tp=2 sp", fine_tuned(JobConfig::small_llama(STEPS), dropout, true, &dir.path().join("d"))),
        ("gpt2 freeze tp=2 no sp", fine_tuned(JobConfig::small(STEPS), freeze, false, &dir.path().join("g"))),
        (
            "llama LoRA adafactor tp=2 sp",
            super::common::with_adafactor(
                fine_tuned(JobConfig::small_llama(STEPS), all_linears, true, &dir.path().join("a")),
                true,
            ),
        ),
    ];
    let with_dropout = troupe_model::Trainer::new(cases[1].1.clone()).unwrap();
    let out = |what: &str| dir.path().join(format!("{}.safetensors", what.replace(' ', "-")));
    for (what, config) in cases {
        check(&cluster, config, &out(what), 2, what).await;
    }
    // The masks were not all ones: the runs with and without dropout trained different adapters.
    let [plain, dropped] = ["llama LoRA tp=2 sp", "llama LoRA dropout tp=2 sp"]
        .map(|what| super::common::saved_params(&out(what), &with_dropout));
    let apart = troupe_model::oracle::compare_params(with_dropout.model.specs(), &dropped, &plain);
    eprintln!("LoRA with dropout against without: {apart:?}");
    assert!(apart.worst > 1e-3, "dropout changed nothing: {apart:?}");
    cluster.shutdown().await;
}
