//! troupe's Adafactor equals Hugging Face transformers' `Adafactor` (tests/adafactor/oracle.py, in the
//! provisioned venv) on the same random parameters and gradients within 1e-6 relative over 30 steps —
//! factored (matrices, a 3-D tensor, a one-row matrix) and unfactored (vectors), relative step on and
//! off, first moment on and off, weight decay — in both its parameters and its state tensors. And the
//! reference trainer with `train.optimizer = "adafactor"`: it learns, resumes from a checkpoint bit for
//! bit, holds a fraction of AdamW's state, and its config is checked.

use std::collections::HashMap;

use serde_json::json;
use tch::{Device, Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::optim::{Adafactor, Optimizer};
use troupe_model::oracle::run_python_oracle;
use troupe_model::sections::AdafactorConfig;
use troupe_model::Trainer;

const STEPS: usize = 30;
const TOLERANCE: f64 = 1e-6;

/// Factored: two matrices, a 3-D tensor, a one-row matrix; unfactored: two vectors.
const SHAPES: [&[i64]; 6] = [&[24, 17], &[6, 5, 4], &[33], &[1, 9], &[40, 3], &[2]];

fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    (&a - &b).norm().double_value(&[]) / b.norm().double_value(&[]).max(f64::MIN_POSITIVE)
}

/// Initial parameters and `STEPS` gradients per parameter (each step's gradients of another scale),
/// drawn from `seed`.
fn problem(seed: i64) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
    tch::manual_seed(seed);
    let randn = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
    let params: Vec<Tensor> = SHAPES.iter().map(|s| randn(s)).collect();
    let grads =
        (0..STEPS).map(|step| SHAPES.iter().map(|s| randn(s) * 10f64.powi(step as i32 % 3 - 1)).collect()).collect();
    (params, grads)
}

/// troupe's Adafactor over the problem: final parameters and named state tensors.
fn troupe_run(config: &AdafactorConfig, lrs: &[f64], seed: i64) -> HashMap<String, Tensor> {
    let (init, grads) = problem(seed);
    let mut params: Vec<Tensor> = init.iter().map(|p| p.copy().set_requires_grad(true)).collect();
    let mut opt = Adafactor::new(config.clone(), &params, vec![true; params.len()]);
    for (step, step_grads) in grads.iter().enumerate() {
        for (p, g) in params.iter_mut().zip(step_grads) {
            p.zero_grad();
            (&*p * g).sum(Kind::Float).backward();
        }
        opt.apply(&mut params, lrs[step]);
    }
    let mut out: HashMap<String, Tensor> = opt.state_tensors().into_iter().collect();
    out.extend(params.iter().enumerate().map(|(i, p)| (format!("p.{i}"), p.detach())));
    out
}

/// transformers' Adafactor over the same problem, through oracle.py.
fn transformers_run(config: &AdafactorConfig, lrs: &[f64], seed: i64) -> HashMap<String, Tensor> {
    let dir = tempfile::tempdir().unwrap();
    let (init, grads) = problem(seed);
    let mut named: Vec<(String, Tensor)> = init.into_iter().enumerate().map(|(i, p)| (format!("p.{i}"), p)).collect();
    for (step, step_grads) in grads.into_iter().enumerate() {
        named.extend(step_grads.into_iter().enumerate().map(|(i, g)| (format!("g.{step}.{i}"), g)));
    }
    let (input, output) = (dir.path().join("in.safetensors"), dir.path().join("out.safetensors"));
    Tensor::write_safetensors(&named, &input).unwrap();
    let hyper = json!({
        "eps": [config.eps1, config.eps2], "clip_threshold": config.clip_threshold,
        "decay_rate": config.decay_rate, "beta1": config.beta1, "weight_decay": config.weight_decay,
        "scale_parameter": config.scale_parameter, "relative_step": config.relative_step,
        "warmup_init": config.warmup_init, "steps": STEPS, "lrs": lrs,
    });
    let args = [input.to_str().unwrap(), output.to_str().unwrap(), &hyper.to_string()];
    run_python_oracle("tests/adafactor/oracle.py", "transformers", &args).unwrap_or_else(|e| panic!("{e}"));
    Tensor::read_safetensors(&output).unwrap().into_iter().collect()
}

/// Compares troupe's run with transformers'; every parameter must have moved by `min_moved` relative
/// (with `warmup_init`'s steps of 1e-6·t the parameters barely move: its first moment, the scaled updates
/// themselves, is what that comparison rests on).
fn check(what: &str, config: AdafactorConfig, min_moved: f64) {
    let lrs: Vec<f64> = (0..STEPS).map(|s| 1e-2 * (1.0 + (s as f64 * 0.3).cos()) / 2.0 + 1e-3).collect();
    let ours = troupe_run(&config, &lrs, 7);
    let theirs = transformers_run(&config, &lrs, 7);
    let mut names: Vec<&String> = theirs.keys().collect();
    names.sort();
    assert_eq!(ours.len(), theirs.len(), "{what}: state names {:?} vs transformers' {names:?}", ours.keys());
    let (init, _) = problem(7);
    for (i, start) in init.iter().enumerate() {
        let moved = relative(&ours[&format!("p.{i}")], start);
        assert!(
            moved > min_moved,
            "{what}: parameter {i} barely moved ({moved:e}): the comparison would prove nothing"
        );
    }
    for name in names {
        let mine = ours.get(name).unwrap_or_else(|| panic!("{what}: troupe has no state {name}"));
        assert_eq!(mine.size(), theirs[name].size(), "{what}: {name}");
        let rel = relative(mine, &theirs[name]);
        assert!(rel <= TOLERANCE, "{what}: {name} differs from transformers' by {rel:e} relative");
    }
}

#[test]
fn equals_transformers_with_relative_step_and_no_first_moment() {
    check("HF defaults", AdafactorConfig::default(), 1e-3);
}

#[test]
fn equals_transformers_with_relative_step_and_a_first_moment_and_warmup_init() {
    let config = AdafactorConfig { beta1: Some(0.9), warmup_init: true, weight_decay: 0.01, ..Default::default() };
    check("relative step, beta1, warmup_init", config, 1e-5);
}

#[test]
fn equals_transformers_with_the_scheduled_lr_and_a_first_moment() {
    let config = AdafactorConfig {
        relative_step: false,
        beta1: Some(0.9),
        weight_decay: 0.1,
        clip_threshold: 0.5,
        ..Default::default()
    };
    check("scheduled lr, beta1", config, 1e-3);
}

#[test]
fn equals_transformers_with_the_scheduled_lr_unscaled_and_no_first_moment() {
    let config =
        AdafactorConfig { relative_step: false, scale_parameter: false, decay_rate: -0.5, ..Default::default() };
    check("scheduled lr, unscaled", config, 1e-3);
}

fn adafactor_job(steps: u64) -> JobConfig {
    let toml = format!(
        "[train]\nsteps = {steps}\nmicro_batch = 4\noptimizer = \"adafactor\"\n\
         [train.adafactor]\nbeta1 = 0.9\nrelative_step = false\nweight_decay = 0.01\n"
    );
    JobConfig::from_toml(&toml, "adafactor.toml").unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let values: Vec<f32> = Vec::try_from(t.detach().flatten(0, -1)).unwrap();
    values.into_iter().map(f32::to_bits).collect()
}

#[test]
fn trainer_with_adafactor_learns_and_resumes_bit_exact() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let mut straight = Trainer::new(adafactor_job(40)).unwrap();
    assert!(matches!(straight.optimizer, Optimizer::Adafactor(_)));
    let straight_losses: Vec<f64> = (0..40).map(|_| straight.train_step().loss).collect();
    let (first, last) = (straight_losses[0], straight_losses[35..].iter().sum::<f64>() / 5.0);
    assert!(last < first - 1.0, "Adafactor should learn: loss {first} → {last}");

    let mut first_half = Trainer::new(adafactor_job(40)).unwrap();
    let mut losses: Vec<f64> = (0..20).map(|_| first_half.train_step().loss).collect();
    let saved = first_half.save_checkpoint(dir.path()).unwrap();
    drop(first_half);
    let mut as_adamw = adafactor_job(40);
    as_adamw.train.optimizer = "adamw".into();
    let refused = Trainer::resume(as_adamw, &saved).unwrap_err().to_string();
    assert!(refused.contains("train.optimizer"), "{refused}");
    let mut resumed = Trainer::resume(adafactor_job(40), &saved).unwrap();
    assert_eq!((resumed.step, resumed.optimizer.step()), (20, 20));
    losses.extend((0..20).map(|_| resumed.train_step().loss));
    let to_bits = |l: &[f64]| l.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(to_bits(&losses), to_bits(&straight_losses));
    for ((name, a), (_, b)) in resumed.optimizer.state_tensors().iter().zip(straight.optimizer.state_tensors()) {
        assert_eq!(bits(a), bits(&b), "{name}");
    }
}

#[test]
fn adafactor_state_is_a_tenth_of_adamws_for_matrices() {
    let adamw = Trainer::new(JobConfig::default()).unwrap();
    let mut config = JobConfig::default();
    config.train.optimizer = "adafactor".into();
    let adafactor = Trainer::new(config).unwrap();
    let matrices = |o: &Optimizer, name_of: fn(usize) -> Vec<String>| {
        let state: HashMap<String, usize> = o.state_tensors().into_iter().map(|(n, t)| (n, t.numel())).collect();
        let is_matrix = |i: &usize| adamw.model.specs()[*i].shape.len() >= 2;
        (0..adamw.model.specs().len())
            .filter(is_matrix)
            .flat_map(name_of)
            .map(|n| state.get(&n).copied().unwrap_or(0))
            .sum::<usize>()
    };
    let adamw_matrices = matrices(&adamw.optimizer, |i| vec![format!("exp_avg.{i}"), format!("exp_avg_sq.{i}")]);
    let adafactor_matrices =
        matrices(&adafactor.optimizer, |i| vec![format!("exp_avg_sq_row.{i}"), format!("exp_avg_sq_col.{i}")]);
    let ratio = adafactor_matrices as f64 / adamw_matrices as f64;
    let whole = adafactor.optimizer.state_numel() as f64 / adamw.optimizer.state_numel() as f64;
    println!("Adafactor/AdamW state: matrices {ratio:.4}, whole model {whole:.4}");
    assert!(adafactor_matrices > 0 && ratio <= 0.1, "matrices' state ratio {ratio}");
    assert!(whole < 0.1, "whole state ratio {whole}");
}

#[test]
fn an_unknown_optimizer_names_the_key_and_every_layout_takes_adafactor() {
    let err = |toml: &str| JobConfig::from_toml(toml, "bad.toml").unwrap_err().to_string();
    let unknown = err("[train]\noptimizer = \"adam\"\n");
    assert!(unknown.contains("train.optimizer") && unknown.contains("adafactor"), "{unknown}");
    // Every layout runs it: a pipeline (with ZeRO inside its stage groups too), tensor parallelism with
    // data parallelism, inside a pipeline and with ZeRO.
    let ok = |toml: &str| JobConfig::from_toml(toml, "good.toml").map(|_| ()).map_err(|e| e.to_string());
    for layout in [
        "pp = 2",
        "pp = 2\ndp = 2\nshard = \"zero3\"",
        "tp = 2\ndp = 2",
        "tp = 2\npp = 2",
        "tp = 2\ndp = 2\nshard = \"zero1\"",
    ] {
        assert_eq!(ok(&format!("[train]\noptimizer = \"adafactor\"\n[parallel]\n{layout}\n")), Ok(()), "{layout}");
    }
    let beta = err("[train]\noptimizer = \"adafactor\"\n[train.adafactor]\nbeta1 = 1.5\n");
    assert!(beta.contains("train.adafactor.beta1"), "{beta}");
}
