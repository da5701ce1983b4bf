//! `troupe bench recovery --peft lora`: what a lost daemon costs a LoRA fine-tuning beside full
//! fine-tuning of the same base. The preset's model is drawn once and written as a Hugging Face
//! directory; each run trains it twice on fresh clusters, every parameter trained and then LoRA, and
//! takes the same daemon away at the same step. Under ZeRO (`--shard zero1|zero2`) the lost rank's
//! shard comes back from its buddy's copy: the trained state — what a restore moves — is the whole
//! model's for full fine-tuning and the adapters' alone for LoRA, while the frozen base is read from the
//! directory by every rank and never moves. The report has both measurements (or their p50/p99 with
//! `--runs`), the trainable parameters and optimizer-state bytes of each, and full / LoRA ratios.

use anyhow::Context;
use serde_json::{json, Value};
use troupe_model::config::JobConfig;
use troupe_model::model::PeftConfig;

use super::{job_config, measure, summarise, RecoveryArgs};

pub(super) fn run(args: &RecoveryArgs, runtime: &tokio::runtime::Runtime) -> anyhow::Result<Value> {
    let base = tempfile::tempdir().context("creating a directory for the fine-tuning base")?;
    let (full, lora) = configs(args, &job_config(args)?, base.path())?;
    let (mut full_runs, mut lora_runs) = (Vec::new(), Vec::new());
    // Alternated, so that a change in the machine's load falls on both alike.
    for run in 0..args.runs {
        for (name, config, runs) in [("full", &full, &mut full_runs), ("lora", &lora, &mut lora_runs)] {
            let report = runtime
                .block_on(measure(args, config))
                .with_context(|| format!("{name} fine-tuning, run {} of {}", run + 1, args.runs))?;
            eprintln!(
                "run {}/{} {name}: recovery_s {}, phases {}",
                run + 1,
                args.runs,
                report["recovery_s"],
                report["phases"]
            );
            runs.push(report);
        }
    }
    let one = |runs: Vec<Value>| {
        if args.runs == 1 {
            runs.into_iter().next().unwrap_or_default()
        } else {
            summarise(args, &runs)
        }
    };
    let (full_report, lora_report) = (one(full_runs), one(lora_runs));
    Ok(report(args, [(&full, full_report), (&lora, lora_report)]))
}

/// The two jobs on the base written into `dir`: every parameter trained, and LoRA r `--lora-r`
/// (alpha 2r) on the family's default targets.
fn configs(args: &RecoveryArgs, config: &JobConfig, dir: &std::path::Path) -> anyhow::Result<(JobConfig, JobConfig)> {
    let peft = PeftConfig { r: args.lora_r, alpha: 2.0 * args.lora_r as f64, ..Default::default() };
    let lora = troupe_model::oracle::fine_tuning(config.clone(), peft, dir, config.train.seed);
    lora.validate().with_context(|| format!("--peft lora --lora-r {}", args.lora_r))?;
    let mut full = lora.clone();
    full.model.peft = None;
    Ok((full, lora))
}

/// Both measurements side by side, with the state each trains and the full / LoRA ratios of the
/// recovery and its restore (p50s with `--runs`).
fn report(args: &RecoveryArgs, [(full, full_report), (lora, lora_report)]: [(&JobConfig, Value); 2]) -> Value {
    let figure = |report: &Value, pick: &dyn Fn(&Value) -> &Value| {
        let value = pick(report);
        value.as_f64().or_else(|| value["p50"].as_f64())
    };
    let ratio = |pick: &dyn Fn(&Value) -> &Value| {
        figure(&full_report, pick).zip(figure(&lora_report, pick)).map(|(f, l)| f / l.max(1e-9))
    };
    let state = |config: &JobConfig| {
        let trainable = config.model.param_count() as u64;
        // AdamW's fp32 master and two moments per trained parameter, over all ranks (one copy).
        json!({ "trainable_params": trainable, "optimizer_state_bytes": trainable * 12 })
    };
    json!({
        "bench": "recovery", "peft": "lora", "lora_r": args.lora_r,
        "lora_targets": lora.model.peft.as_ref().map(|p| p.targets(lora.model.arch)),
        "model": lora.model.preset, "nodes": args.nodes, "shard": args.shard, "kill_at_step": args.kill_at_step,
        "runs_count": args.runs, "fault": super::fault_name(args),
        "state": { "full": state(full), "lora": state(lora) },
        "full": full_report, "lora": lora_report,
        "ratio_full_over_lora": {
            "recovery_s": ratio(&|r| &r["recovery_s"]),
            "restore_s": ratio(&|r| &r["phases"]["resume"]["restore_s"]),
            "resume_s": ratio(&|r| &r["phases"]["resume_s"]),
            "step_s": ratio(&|r| &r["step_s_median"]),
        },
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: RecoveryArgs,
    }

    fn args(flags: &[&str]) -> RecoveryArgs {
        Cli::parse_from(["recovery"].iter().chain(flags)).args
    }

    /// Both jobs start from the same written base; only LoRA's has adapters, and it trains a small
    /// fraction of what full fine-tuning trains.
    #[test]
    fn both_jobs_fine_tune_the_same_base_and_only_lora_has_adapters() {
        let args = args(&["--peft", "lora", "--shard", "zero1", "--model", "llama-tiny", "--context", "32"]);
        let dir = tempfile::tempdir().unwrap();
        let (full, lora) = configs(&args, &job_config(&args).unwrap(), dir.path()).unwrap();
        assert_eq!(full.model.from_hf.as_deref(), Some(dir.path()));
        assert_eq!(lora.model.from_hf, full.model.from_hf);
        assert!(full.model.peft.is_none());
        assert_eq!(lora.model.peft.as_ref().map(|p| (p.r, p.alpha)), Some((8, 16.0)));
        assert!(dir.path().join("config.json").exists());
        let (trained_full, trained_lora) = (full.model.param_count(), lora.model.param_count());
        assert!(trained_lora * 50 < trained_full, "{trained_lora} of {trained_full}");
        assert_eq!((full.parallel.shard.as_str(), lora.train.steps), ("zero1", 10));
    }

    /// The ratios are full over LoRA, from single runs' figures or from summaries' p50s.
    #[test]
    fn the_ratios_divide_full_by_lora_for_one_run_and_for_p50s() {
        let args = args(&["--peft", "lora"]);
        let dir = tempfile::tempdir().unwrap();
        let (full, lora) = configs(&args, &job_config(&args).unwrap(), dir.path()).unwrap();
        let single = |recovery: f64, restore: f64| json!({ "recovery_s": recovery, "phases": { "resume_s": 0.2, "resume": { "restore_s": restore } } });
        let out = report(&args, [(&full, single(0.9, 0.3)), (&lora, single(0.3, 0.1))]);
        assert!((out["ratio_full_over_lora"]["recovery_s"].as_f64().unwrap() - 3.0).abs() < 1e-12, "{out}");
        assert!((out["ratio_full_over_lora"]["restore_s"].as_f64().unwrap() - 3.0).abs() < 1e-12, "{out}");
        assert_eq!(out["ratio_full_over_lora"]["step_s"], Value::Null);
        let p50 = |recovery: f64| json!({ "recovery_s": { "p50": recovery, "p99": 9.0 } });
        let out = report(&args, [(&full, p50(1.0)), (&lora, p50(0.5))]);
        assert_eq!(out["ratio_full_over_lora"]["recovery_s"], json!(2.0));
        let state = &out["state"];
        assert_eq!(state["full"]["optimizer_state_bytes"], json!(full.model.param_count() as u64 * 12));
        assert!(state["lora"]["trainable_params"].as_u64() < state["full"]["trainable_params"].as_u64());
    }
}
