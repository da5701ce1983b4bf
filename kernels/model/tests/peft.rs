//! `[peft]` in the single-process reference: LoRA computes `W·x + s·B·(A·x)` — checked against the merged
//! model `W + s·B·A` for the logits and, through the chain rule, for the adapters' gradients; a fresh
//! adapter (B = 0) leaves the base model's function unchanged to the bit; training moves the adapters
//! only; freeze trains exactly the modules it names; bad `[peft]` input is refused before anything runs,
//! with the key and what the model has.

use tch::{Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::model::peft::Method;
use troupe_model::model::{self, base_specs, param_specs, Model, ModelConfig, PeftConfig};
use troupe_model::oracle::fine_tuning;
use troupe_model::Trainer;

fn lora(targets: &[&str], r: usize, alpha: f64) -> PeftConfig {
    PeftConfig { r, alpha, targets: targets.iter().map(|s| s.to_string()).collect(), ..PeftConfig::default() }
}

fn two_layers(mut config: JobConfig) -> JobConfig {
    config.model.n_layers = 2;
    config
}

fn relative(actual: &Tensor, expected: &Tensor) -> f64 {
    let diff = (actual - expected).norm().double_value(&[]);
    diff / expected.norm().double_value(&[]).max(f64::MIN_POSITIVE)
}

fn tokens(config: &ModelConfig) -> (Tensor, Tensor) {
    let all =
        Tensor::randint(config.vocab_size as i64, [2, config.context as i64 + 1], (Kind::Int64, tch::Device::Cpu));
    let time = config.context as i64;
    (all.narrow(1, 0, time).contiguous(), all.narrow(1, 1, time).contiguous())
}

/// The base model's weights with every adapter merged in: `W + s·B·A`.
fn merged_values(lora_model: &Model) -> Vec<Tensor> {
    let config = &lora_model.config;
    let scale = config.peft.as_ref().unwrap().scale();
    let base = lora_model.base().expect("a peft model holds its base");
    let trainable: std::collections::HashMap<&str, &Tensor> = lora_model.named_params().collect();
    base_specs(config)
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let w = base.tensor(config, i, tch::Device::Cpu);
            let module = spec.name.trim_end_matches(".weight");
            match (
                trainable.get(format!("{module}.lora_A.weight").as_str()),
                trainable.get(format!("{module}.lora_B.weight").as_str()),
            ) {
                (Some(a), Some(b)) => tch::no_grad(|| &w + b.matmul(a) * scale),
                _ => w,
            }
        })
        .collect()
}

fn plain(config: &ModelConfig) -> ModelConfig {
    ModelConfig { peft: None, from_hf: None, ..config.clone() }
}

#[test]
fn lora_is_the_merged_model_in_value_and_gradient() {
    tch::manual_seed(3);
    let cases = [
        (
            "gpt2 all linears",
            two_layers(JobConfig::small(1)),
            lora(&["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"], 4, 8.0),
        ),
        (
            "llama all linears",
            two_layers(JobConfig::small_llama(1)),
            lora(&["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 16.0),
        ),
        (
            "llama rslora q,v",
            JobConfig::small_llama(1),
            PeftConfig { rslora: true, ..lora(&["q_proj", "v_proj"], 8, 4.0) },
        ),
    ];
    for (name, config, peft) in cases {
        let dir = tempfile::tempdir().unwrap();
        let config = fine_tuning(config, peft, dir.path(), 5);
        config.validate().unwrap();
        let mut lora_model = Model::new(config.model.clone(), 11);
        // Fresh adapters (B = 0) leave the function unchanged, to the bit.
        let base_model = Model::load(ModelConfig { peft: None, ..config.model.clone() }, 0).unwrap();
        let (input, targets) = tokens(&config.model);
        assert!(
            lora_model.forward(&input).equal(&base_model.forward(&input)),
            "{name}: a fresh adapter changed the output"
        );

        // Give B values, then compare with the merged model.
        tch::no_grad(|| {
            for (spec, p) in param_specs(&config.model).iter().zip(lora_model.params_mut()) {
                if spec.name.contains("lora_B") {
                    p.copy_(&(Tensor::randn(spec.shape.as_slice(), (Kind::Float, tch::Device::Cpu)) * 0.05));
                }
            }
        });
        let loss = model::cross_entropy(&lora_model.forward(&input), &targets);
        loss.backward();
        let merged = Model::new(plain(&config.model), 0);
        let mut merged = merged;
        merged.load_values(&merged_values(&lora_model));
        let merged_loss = model::cross_entropy(&merged.forward(&input), &targets);
        merged_loss.backward();
        let (a, b) = (loss.double_value(&[]), merged_loss.double_value(&[]));
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{name}: LoRA loss {a}, merged {b}");

        // dL/dA = s·Bᵀ·dL/dW, dL/dB = s·dL/dW·Aᵀ, where dL/dW is the merged weight's gradient.
        let scale = config.model.peft.as_ref().unwrap().scale();
        let merged_grads: std::collections::HashMap<&str, Tensor> =
            merged.named_params().map(|(n, p)| (n, p.grad())).collect();
        let params: std::collections::HashMap<&str, &Tensor> = lora_model.named_params().collect();
        let mut adapters = 0;
        for (spec, p) in lora_model.specs().iter().zip(lora_model.params()) {
            let Some(module) = spec.name.strip_suffix(".lora_A.weight") else { continue };
            let g = &merged_grads[format!("{module}.weight").as_str()];
            let b = params[format!("{module}.lora_B.weight").as_str()];
            let expected_a = b.detach().transpose(0, 1).matmul(g) * scale;
            let worst = relative(&p.grad(), &expected_a);
            assert!(worst <= 1e-5, "{name}: gradient of {} off by {worst:e}", spec.name);
            let expected_b = g.matmul(&p.detach().transpose(0, 1)) * scale;
            let worst = relative(&b.grad(), &expected_b);
            assert!(worst <= 1e-5, "{name}: gradient of {module}.lora_B off by {worst:e}");
            adapters += 1;
        }
        let targets_per_block = config.model.peft.as_ref().unwrap().targets(config.model.arch).len();
        let linears_hit = match (config.model.arch, targets_per_block) {
            (model::Arch::Gpt2, 4) | (model::Arch::Llama, 7) => targets_per_block,
            (_, n) => n,
        };
        assert_eq!(adapters, linears_hit * config.model.n_layers, "{name}: adapters");
    }
}

#[test]
fn lora_specs_follow_peft_shapes_and_init() {
    let dir = tempfile::tempdir().unwrap();
    let config = fine_tuning(JobConfig::small_llama(1), lora(&["q_proj", "v_proj"], 8, 16.0), dir.path(), 1);
    let specs = param_specs(&config.model);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model.layers.0.self_attn.q_proj.lora_A.weight",
            "model.layers.0.self_attn.q_proj.lora_B.weight",
            "model.layers.0.self_attn.v_proj.lora_A.weight",
            "model.layers.0.self_attn.v_proj.lora_B.weight",
        ]
    );
    let d = config.model.d_model as i64;
    let kv = (config.model.kv_heads() * config.model.head_dim()) as i64;
    assert_eq!(specs[0].shape, [8, d]);
    assert_eq!(specs[1].shape, [d, 8]);
    assert_eq!(specs[3].shape, [kv, 8]);
    assert_eq!(config.model.embed_range(), 0..0);
    assert_eq!(config.model.block_range(0), 0..4);
    assert_eq!(config.model.head_range(), 4..4);
    let model = Model::new(config.model.clone(), 9);
    let a = model.params()[0].detach();
    let bound = 1.0 / (d as f64).sqrt();
    let max = a.abs().max().double_value(&[]);
    assert!(max <= bound && max > 0.9 * bound, "A is Kaiming-uniform in ±1/√in: max |A| = {max}, bound {bound}");
    assert_eq!(model.params()[1].abs().sum(Kind::Float).double_value(&[]), 0.0, "B starts at zero");
    assert!(Model::new(config.model.clone(), 9).params()[0].equal(&a), "adapters are a function of the seed");
    assert!(!Model::new(config.model, 10).params()[0].equal(&a));
}

#[test]
fn training_moves_only_the_adapters_and_the_loss_falls() {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        fine_tuning(JobConfig::small_llama(8), lora(&["q_proj", "k_proj", "v_proj", "o_proj"], 4, 8.0), dir.path(), 2);
    config.train.lr = 1e-2;
    let mut trainer = Trainer::new(config.clone()).unwrap();
    let full = Model::load(ModelConfig { peft: None, ..config.model.clone() }, 0).unwrap();
    let adapter_elements: usize = param_specs(&config.model).iter().map(|s| s.numel()).sum();
    assert!(adapter_elements * 10 < full.param_count(), "the adapters are a small fraction of the model");
    let before: Vec<Tensor> = trainer.model.params().iter().map(|p| p.detach().copy()).collect();
    let losses: Vec<f64> = (0..8).map(|_| trainer.train_step().loss).collect();
    assert!(losses[7] < losses[0], "the loss falls: {losses:?}");
    for (spec, (a, b)) in trainer.model.specs().iter().zip(trainer.model.params().iter().zip(&before)) {
        assert!(!a.equal(b), "{} did not train", spec.name);
    }
    // The frozen base is what the file holds, bit for bit.
    let base = trainer.model.base().unwrap();
    for (i, p) in full.params().iter().enumerate() {
        assert!(base.tensor(&config.model, i, tch::Device::Cpu).equal(p), "base parameter {i} changed");
    }
    // The optimizer holds moments for the adapters alone.
    let state = troupe_model::checkpoint::TrainingState::snapshot(&trainer);
    assert!(state.values.iter().all(|v| v.len() == adapter_elements), "parameters and both moments: adapters only");
}

#[test]
fn freeze_trains_the_named_modules_and_the_last_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let freeze = |last_blocks: usize, train: &[&str]| PeftConfig {
        method: Method::Freeze,
        last_blocks,
        train: train.iter().map(|s| s.to_string()).collect(),
        ..PeftConfig::default()
    };
    let base = two_layers(JobConfig::small_llama(2));
    let last = fine_tuning(base.clone(), freeze(1, &[]), dir.path(), 1);
    let names: Vec<String> = param_specs(&last.model).into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().all(|n| n.starts_with("model.layers.1.") || n == "model.norm.weight" || n == "lm_head.weight"),
        "{names:?}"
    );
    assert_eq!(names.len(), 9 + 2);
    let mlp = fine_tuning(base.clone(), freeze(0, &["mlp", "lm_head"]), dir.path(), 1);
    let names: Vec<String> = param_specs(&mlp.model).into_iter().map(|s| s.name).collect();
    assert_eq!(names.len(), 2 * 3 + 1, "{names:?}");
    assert!(names.iter().all(|n| n.contains(".mlp.") || n == "lm_head.weight"), "{names:?}");

    // The layout covers the list: the first block and the embeddings hold nothing that trains.
    let c = &last.model;
    assert_eq!(
        (c.embed_range().len(), c.block_range(0).len(), c.block_range(1).len(), c.head_range().len()),
        (0, 0, 9, 2)
    );
    let mut trainer = Trainer::new(last.clone()).unwrap();
    let before: Vec<Tensor> = trainer.model.params().iter().map(|p| p.detach().copy()).collect();
    let losses: Vec<f64> = (0..2).map(|_| trainer.train_step().loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(trainer.model.params().iter().zip(&before).all(|(a, b)| !a.equal(b)), "every trained parameter moved");

    // A tied model's head is the embedding matrix: it trains with the last blocks.
    let mut tied = base;
    tied.model.tie_word_embeddings = true;
    let tied = fine_tuning(tied, freeze(1, &[]), dir.path(), 1);
    let names: Vec<String> = param_specs(&tied.model).into_iter().map(|s| s.name).collect();
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert!(tied.model.head_takes_embedding());
    let mut trainer = Trainer::new(tied).unwrap();
    assert!(trainer.train_step().loss.is_finite());
}

#[test]
fn bad_peft_input_is_refused_with_the_key_and_what_the_model_has() {
    let dir = tempfile::tempdir().unwrap();
    let error = |config: JobConfig| config.validate().unwrap_err().to_string();
    let llama = JobConfig::small_llama(1);

    let e = error(fine_tuning(llama.clone(), lora(&["query"], 8, 8.0), dir.path(), 1));
    assert!(
        e.contains("peft.targets")
            && e.contains("\"query\"")
            && e.contains("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        "{e}"
    );
    let e = error(fine_tuning(JobConfig::small(1), lora(&["q_proj"], 8, 8.0), dir.path(), 1));
    assert!(e.contains("c_attn, c_proj, c_fc"), "{e}");
    let e = error(fine_tuning(llama.clone(), lora(&["q_proj"], 0, 8.0), dir.path(), 1));
    assert!(e.contains("peft.r") && e.contains("at least 1"), "{e}");
    let e = error(fine_tuning(llama.clone(), lora(&["v_proj"], 33, 8.0), dir.path(), 1));
    assert!(e.contains("peft.r") && e.contains("v_proj") && e.contains("at most 32"), "{e}");
    let e = error(fine_tuning(llama.clone(), PeftConfig { dropout: 1.0, ..lora(&["q_proj"], 8, 8.0) }, dir.path(), 1));
    assert!(e.contains("peft.dropout") && e.contains("[0, 1)"), "{e}");
    let e = error(fine_tuning(
        llama.clone(),
        PeftConfig { train: vec!["mlpp".into()], ..lora(&["q_proj"], 8, 8.0) },
        dir.path(),
        1,
    ));
    assert!(e.contains("peft.train") && e.contains("mlpp"), "{e}");
    let freeze_nothing = PeftConfig { method: Method::Freeze, ..PeftConfig::default() };
    let e = error(fine_tuning(llama.clone(), freeze_nothing, dir.path(), 1));
    assert!(e.contains("trains nothing"), "{e}");
    let mut no_base = llama.clone();
    no_base.model.peft = Some(PeftConfig::default());
    let e = error(no_base);
    assert!(e.contains("model.from_hf") && e.contains("pretrained"), "{e}");

    // `[peft]` in a job file: read into the model config, unknown keys named.
    let toml = format!(
        "[model]\nfrom_hf = {:?}\ncontext = 32\n[peft]\nmethod = \"lora\"\nr = 4\nalpha = 8\ntargets = [\"q_proj\"]\n",
        dir.path().display().to_string()
    );
    let parsed = JobConfig::from_toml(&toml, "finetune.toml").unwrap();
    assert_eq!(parsed.model.peft.as_ref().unwrap().r, 4);
    let e = JobConfig::from_toml(&format!("{toml}rank = 4\n"), "finetune.toml").unwrap_err().to_string();
    assert!(e.contains("rank") && e.contains("finetune.toml"), "{e}");

    // A checkpoint of one [peft] config does not resume under another: the error names the key.
    let mut lora4 = fine_tuning(llama.clone(), lora(&["q_proj"], 4, 8.0), dir.path(), 1);
    let trainer = Trainer::new(lora4.clone()).unwrap();
    let saved = trainer.save_checkpoint(&dir.path().join("ckpt")).unwrap();
    lora4.model.peft.as_mut().unwrap().r = 2;
    let e = Trainer::resume(lora4, &saved).unwrap_err().to_string();
    assert!(e.contains("model.peft.r: 4 vs 2"), "{e}");
}

/// LoRA's dropout mask: each element kept with probability 1 − p and scaled by 1/(1 − p); a function of
/// the sample (the same rows in any split of the batch), different per step, layer and target.
#[test]
fn dropout_masks_are_a_function_of_the_sample() {
    use troupe_model::model::peft::dropout_mask;
    use troupe_model::model::Samples;
    let x = Tensor::ones([4, 64, 96], (Kind::Float, tch::Device::Cpu));
    let p = 0.1;
    let whole = dropout_mask(&x, p, Samples::new(7, 3, 10), 1, 2);
    let kept = whole.ne(0.0).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
    assert!((kept - 0.9).abs() < 0.005, "kept fraction {kept}");
    let values = whole.masked_select(&whole.ne(0.0));
    assert!(values.eq(1.0 / 0.9).all().int64_value(&[]) == 1, "kept elements are scaled by 1/(1-p)");
    let (a, b) = (x.narrow(0, 0, 2), x.narrow(0, 2, 2));
    let halves = Tensor::cat(
        &[dropout_mask(&a, p, Samples::new(7, 3, 10), 1, 2), dropout_mask(&b, p, Samples::new(7, 3, 12), 1, 2)],
        0,
    );
    assert!(halves.equal(&whole), "a sample's mask does not depend on the micro-batch it is in");
    for other in [
        dropout_mask(&x, p, Samples::new(7, 4, 10), 1, 2),
        dropout_mask(&x, p, Samples::new(7, 3, 10), 2, 2),
        dropout_mask(&x, p, Samples::new(7, 3, 10), 1, 3),
        dropout_mask(&x, p, Samples::new(8, 3, 10), 1, 2),
    ] {
        let same = whole.eq_tensor(&other).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!(same < 0.9, "masks of another step, layer, target or seed agree on {same} of the elements");
    }
}

/// With dropout, the reference's step does not depend on how the batch is cut into micro-batches (or
/// whether activations are recomputed): every sample gets its mask — and training differs from the same
/// job without dropout, while evaluation (no samples named) runs without it.
#[test]
fn dropout_training_is_the_same_in_any_split_and_off_in_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    let job = |micro_batch: usize, recompute: bool, dropout: f64| {
        let mut config = two_layers(JobConfig::small_llama(3));
        config.train.global_batch = 4;
        config.train.micro_batch = micro_batch;
        config.parallel.recompute = recompute;
        let peft = PeftConfig { dropout, ..lora(&["q_proj", "v_proj", "down_proj"], 4, 8.0) };
        fine_tuning(config, peft, dir.path(), 4)
    };
    let run = |config: JobConfig| {
        let mut trainer = Trainer::new(config).unwrap();
        let losses: Vec<f64> = (0..3).map(|_| trainer.train_step().loss).collect();
        (losses, trainer.param_values())
    };
    let (reference, ref_params) = run(job(4, false, 0.2));
    for (micro_batch, recompute) in [(2, false), (1, false), (2, true)] {
        let (losses, params) = run(job(micro_batch, recompute, 0.2));
        for (a, b) in losses.iter().zip(&reference) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "micro {micro_batch} recompute {recompute}: {losses:?} vs {reference:?}"
            );
        }
        for (a, b) in params.iter().zip(&ref_params) {
            assert!(relative(a, b) <= 1e-5, "micro {micro_batch} recompute {recompute}: parameters differ");
        }
    }
    let (without, _) = run(job(4, false, 0.0));
    assert!(without[1] != reference[1], "dropout changes training: {without:?} vs {reference:?}");
    // Evaluation (no samples) computes the model without dropout; a training forward applies it.
    let config = job(4, false, 0.2);
    let mut model = Model::new(config.model.clone(), 1);
    tch::no_grad(|| {
        for (spec, p) in param_specs(&config.model).iter().zip(model.params_mut()) {
            if spec.name.contains("lora_B") {
                p.copy_(&(Tensor::randn(spec.shape.as_slice(), (Kind::Float, tch::Device::Cpu)) * 0.1));
            }
        }
    });
    let (input, _) = tokens(&config.model);
    let mut undropped = Model::new(job(4, false, 0.0).model, 1);
    undropped.load_values(model.params());
    let evaluated = model.forward(&input);
    assert!(evaluated.equal(&undropped.forward(&input)), "evaluation applied dropout");
    let trained = model.forward_training(&input, Some(troupe_model::model::Samples::new(1, 0, 0)));
    assert!(!trained.equal(&evaluated), "a training forward did not apply dropout");
}
