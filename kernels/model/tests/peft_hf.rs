//! Hugging Face PEFT is the external oracle of troupe's LoRA and of its adapter format
//! (tests/hf/peft_oracle.py, peft pinned by scripts/provision-libtorch.sh): on a tiny random Llama and
//! GPT-2 base written by troupe's `hf::export`, troupe's adapters (B non-zero, so a misread B shows)
//! loaded by `PeftModel.from_pretrained` give troupe's loss and adapter gradients within 1e-5 relative;
//! trained adapters give troupe's loss; the merged export loads in transformers with the unmerged loss;
//! adapters made by PEFT start a troupe job (`[peft] from_adapters`) with PEFT's loss. Bad adapter
//! directories are refused before anything runs, naming the file and the fix.

use std::path::Path;

use tch::{Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::hf::peft::{export_adapters, export_merged, peft_key, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use troupe_model::hf::ExportOptions;
use troupe_model::model::{param_specs, Model, PeftConfig};
use troupe_model::oracle::{fine_tuning, run_python_oracle, transformers_oracle};
use troupe_model::Trainer;

fn peft_oracle(args: &[&str]) -> serde_json::Value {
    run_python_oracle("tests/hf/peft_oracle.py", "peft", args).unwrap_or_else(|e| panic!("{e}"))
}

fn lora(targets: &[&str], r: usize, alpha: f64) -> PeftConfig {
    PeftConfig { r, alpha, targets: targets.iter().map(|s| s.to_string()).collect(), ..PeftConfig::default() }
}

fn relative(actual: &Tensor, expected: &Tensor) -> f64 {
    let diff = (actual - expected).norm().double_value(&[]);
    diff / expected.norm().double_value(&[]).max(f64::MIN_POSITIVE)
}

fn close(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance * b.abs()
}

/// Random tokens of `vocab` written where the oracle reads them; the input and target halves.
fn tokens(dir: &Path, vocab: usize) -> (String, Tensor, Tensor) {
    let tokens = Tensor::randint(vocab as i64, [2, 17], (Kind::Int64, tch::Device::Cpu));
    let file = dir.join("tokens.safetensors");
    Tensor::write_safetensors(&[("tokens", &tokens)], &file).unwrap();
    let (input, targets) = (tokens.narrow(1, 0, 16).contiguous(), tokens.narrow(1, 1, 16).contiguous());
    (file.to_str().unwrap().to_owned(), input, targets)
}

fn values(model: &Model) -> Vec<Vec<f32>> {
    model.params().iter().map(|p| Vec::<f32>::try_from(p.detach().flatten(0, -1)).unwrap()).collect()
}

/// Tensor `name` of a safetensors file.
fn saved(path: &Path, name: &str) -> Tensor {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = file.tensor(name).unwrap_or_else(|_| panic!("{}: no tensor {name}", path.display()));
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    Tensor::from_data_size(view.data(), &shape, Kind::Float)
}

fn cases() -> Vec<(&'static str, JobConfig, PeftConfig)> {
    vec![
        (
            "llama all linears, lm_head trained",
            JobConfig::small_llama(4),
            PeftConfig {
                train: vec!["lm_head".into()],
                ..lora(&["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8.0)
            },
        ),
        (
            "gpt2 all linears, rslora",
            JobConfig::small(4),
            PeftConfig { rslora: true, ..lora(&["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"], 4, 16.0) },
        ),
    ]
}

#[test]
fn peft_loads_troupes_adapters_with_the_same_loss_and_gradients() {
    tch::set_num_threads(1);
    tch::manual_seed(11);
    for (name, job, peft) in cases() {
        let dir = tempfile::tempdir().unwrap();
        let config = fine_tuning(job, peft, &dir.path().join("base"), 3);
        let (tokens_file, input, targets) = tokens(dir.path(), config.model.vocab_size);
        let model = Model::load(config.model.clone(), 4).unwrap();
        // B starts at zero; a non-zero B makes the update (and a misread or transposed B) count.
        tch::no_grad(|| {
            for (spec, p) in model.specs().iter().zip(model.params()) {
                if spec.name.ends_with("lora_B.weight") {
                    let _ = p.shallow_clone().copy_(&(Tensor::randn(p.size(), (Kind::Float, tch::Device::Cpu)) * 0.1));
                }
            }
        });
        let adapters = dir.path().join("adapters");
        export_adapters(&config.model, &values(&model), &adapters).unwrap();

        let loss = model.loss(&input, &targets);
        let ours = loss.double_value(&[]);
        loss.backward();
        let grads = dir.path().join("grads.safetensors");
        let theirs = peft_oracle(&[
            "check",
            dir.path().join("base").to_str().unwrap(),
            adapters.to_str().unwrap(),
            &tokens_file,
            grads.to_str().unwrap(),
        ]);
        assert_eq!(theirs["warnings"], serde_json::json!([]), "{name}: PEFT warned: {theirs}");
        let adapters_count = param_specs(&config.model).iter().filter(|s| s.name.contains(".lora_")).count();
        assert_eq!(theirs["lora_tensors"], adapters_count, "{name}: PEFT loaded another set of adapters: {theirs}");
        let their_loss = theirs["loss"].as_f64().unwrap();
        assert!(close(ours, their_loss, 1e-5), "{name}: troupe's loss {ours}, PEFT's {their_loss}");
        let trainable: Vec<String> = serde_json::from_value(theirs["trainable"].clone()).unwrap();
        assert_eq!(trainable.len(), model.specs().len(), "{name}: PEFT trains {trainable:?}");
        for (spec, param) in model.specs().iter().zip(model.params()) {
            let (key, transposed) = peft_key(&config.model, spec);
            let mut expected = saved(&grads, &key);
            if transposed {
                expected = expected.t_().contiguous();
            }
            let worst = relative(&param.grad(), &expected);
            assert!(worst <= 1e-5, "{name}: gradient of {} differs from PEFT's by {worst:e} relative", spec.name);
        }
    }
}

/// Adapters trained by troupe give PEFT troupe's loss; the merged model, loaded by transformers alone,
/// gives the same loss.
#[test]
fn trained_adapters_and_the_merged_model_give_troupes_loss() {
    tch::set_num_threads(1);
    tch::manual_seed(12);
    for (name, mut job, peft) in cases() {
        let dir = tempfile::tempdir().unwrap();
        job.train.lr = 1e-2;
        let config = fine_tuning(job, peft, &dir.path().join("base"), 5);
        let (tokens_file, input, targets) = tokens(dir.path(), config.model.vocab_size);
        let mut trainer = Trainer::new(config.clone()).unwrap();
        let untrained = trainer.model.loss(&input, &targets).double_value(&[]);
        for _ in 0..4 {
            trainer.train_step();
        }
        let ours = trainer.model.loss(&input, &targets).double_value(&[]);
        assert!(!close(ours, untrained, 1e-4), "{name}: training did not move the loss ({ours} vs {untrained})");

        let trained = values(&trainer.model);
        let adapters = dir.path().join("adapters");
        export_adapters(&config.model, &trained, &adapters).unwrap();
        let grads = dir.path().join("grads.safetensors");
        let base = dir.path().join("base");
        let theirs = peft_oracle(&[
            "check",
            base.to_str().unwrap(),
            adapters.to_str().unwrap(),
            &tokens_file,
            grads.to_str().unwrap(),
        ]);
        let their_loss = theirs["loss"].as_f64().unwrap();
        assert!(
            close(their_loss, ours, 1e-5),
            "{name}: PEFT's loss of troupe's trained adapters {their_loss}, troupe's {ours}"
        );

        let merged = dir.path().join("merged");
        export_merged(&config.model, &trained, &merged, ExportOptions::default()).unwrap();
        let checked = transformers_oracle(&["check", merged.to_str().unwrap(), &tokens_file]).unwrap();
        for key in ["missing", "unexpected", "mismatched", "warnings"] {
            assert_eq!(checked[key], serde_json::json!([]), "{name}: transformers reports {key}: {checked}");
        }
        let merged_loss = checked["loss"].as_f64().unwrap();
        assert!(close(merged_loss, ours, 1e-5), "{name}: the merged model's loss {merged_loss}, unmerged {ours}");
    }
}

/// Adapters made by PEFT (`get_peft_model` + `save_pretrained`, randomised) start a troupe job with
/// PEFT's loss.
#[test]
fn peft_made_adapters_start_a_job_with_pefts_loss() {
    tch::set_num_threads(1);
    tch::manual_seed(13);
    let made: [(&str, JobConfig, PeftConfig, &str); 2] = [
        (
            "llama q,v + lm_head",
            JobConfig::small_llama(2),
            PeftConfig { train: vec!["lm_head".into()], ..lora(&["q_proj", "v_proj"], 4, 8.0) },
            "lm_head",
        ),
        ("gpt2 c_attn, c_fc", JobConfig::small(2), lora(&["c_attn", "c_fc"], 2, 4.0), ""),
    ];
    for (name, job, peft, modules_to_save) in made {
        let dir = tempfile::tempdir().unwrap();
        let (r, alpha, targets) = (peft.r.to_string(), peft.alpha.to_string(), peft.targets.join(","));
        let mut config = fine_tuning(job, peft, &dir.path().join("base"), 6);
        let (tokens_file, input, targets_t) = tokens(dir.path(), config.model.vocab_size);
        let adapters = dir.path().join("peft-adapters");
        let base = dir.path().join("base");
        let theirs = peft_oracle(&[
            "make",
            base.to_str().unwrap(),
            adapters.to_str().unwrap(),
            &tokens_file,
            &r,
            &alpha,
            &targets,
            modules_to_save,
        ]);
        let (their_loss, base_loss) = (theirs["loss"].as_f64().unwrap(), theirs["base_loss"].as_f64().unwrap());
        assert!(!close(their_loss, base_loss, 1e-4), "{name}: PEFT's random adapters changed nothing: {theirs}");
        config.model.peft.as_mut().unwrap().from_adapters = Some(adapters.clone());
        config.validate().unwrap();
        let trainer = Trainer::new(config.clone()).unwrap();
        let ours = trainer.model.loss(&input, &targets_t).double_value(&[]);
        assert!(
            close(ours, their_loss, 1e-5),
            "{name}: troupe's loss from PEFT's adapters {ours}, PEFT's {their_loss}"
        );
        // Round trip: troupe writes back what it read, bit for bit.
        let again = dir.path().join("again");
        export_adapters(&config.model, &values(&trainer.model), &again).unwrap();
        assert_eq!(
            std::fs::read(again.join(ADAPTER_WEIGHTS)).unwrap(),
            std::fs::read(adapters.join(ADAPTER_WEIGHTS)).unwrap(),
            "{name}: import(export) of PEFT's adapters changed them"
        );
    }
}

/// What a bad adapter directory gets: refused by `Trainer::new` (nothing runs, nothing is written),
/// naming the file, the key and the fix.
#[test]
fn bad_adapter_directories_are_refused_before_training() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let config =
        fine_tuning(JobConfig::small_llama(1), lora(&["q_proj", "v_proj"], 4, 8.0), &dir.path().join("base"), 1);
    let model = Model::load(config.model.clone(), 1).unwrap();
    let good = dir.path().join("good");
    export_adapters(&config.model, &values(&model), &good).unwrap();
    let with_adapters = |dir: &Path| {
        let mut c = config.clone();
        c.model.peft.as_mut().unwrap().from_adapters = Some(dir.to_owned());
        c
    };
    Trainer::new(with_adapters(&good)).unwrap();

    let refused = |dir: &Path| match Trainer::new(with_adapters(dir)) {
        Ok(_) => panic!("{}: accepted", dir.display()),
        Err(e) => e.to_string(),
    };
    let variant = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(good.join(ADAPTER_WEIGHTS), d.join(ADAPTER_WEIGHTS)).unwrap();
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(good.join(ADAPTER_CONFIG)).unwrap()).unwrap();
        edit(&mut json);
        std::fs::write(d.join(ADAPTER_CONFIG), json.to_string()).unwrap();
        d
    };

    let e = refused(&variant("ia3", &|j| j["peft_type"] = "IA3".into()));
    assert!(e.contains(ADAPTER_CONFIG) && e.contains("IA3") && e.contains("LORA"), "{e}");
    let e = refused(&variant("r8", &|j| j["r"] = 8.into()));
    assert!(e.contains("peft.r") && e.contains('8') && e.contains('4'), "{e}");
    let e = refused(&variant("alpha", &|j| j["lora_alpha"] = 32.0.into()));
    assert!(e.contains("peft.alpha") && e.contains("32"), "{e}");
    let e = refused(&variant("targets", &|j| j["target_modules"] = serde_json::json!(["q_proj", "k_proj"])));
    assert!(e.contains("peft.targets") && e.contains("k_proj"), "{e}");
    let e = refused(&variant("dora", &|j| j["use_dora"] = true.into()));
    assert!(e.contains("use_dora") && e.contains("DoRA"), "{e}");
    let e = refused(&variant("regex", &|j| j["target_modules"] = ".*proj".into()));
    assert!(e.contains("target_modules") && e.contains("list"), "{e}");
    let e = refused(&dir.path().join("missing"));
    assert!(e.contains(ADAPTER_CONFIG) && e.contains("from_adapters"), "{e}");

    // A file that lacks an adapter, and one with a tensor this model does not have.
    let tensors = |drop: &str, add: Option<&str>| {
        let d = dir.path().join(format!("tensors-{}", add.unwrap_or(drop).replace('.', "_")));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(good.join(ADAPTER_CONFIG), d.join(ADAPTER_CONFIG)).unwrap();
        let bytes = std::fs::read(good.join(ADAPTER_WEIGHTS)).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut kept: Vec<(String, Tensor)> = file
            .names()
            .into_iter()
            .filter(|n| *n != drop)
            .map(|n| (n.to_owned(), saved(&good.join(ADAPTER_WEIGHTS), n)))
            .collect();
        if let Some(extra) = add {
            kept.push((extra.to_owned(), Tensor::zeros([4, 64], (Kind::Float, tch::Device::Cpu))));
        }
        let refs: Vec<(&str, &Tensor)> = kept.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&refs, d.join(ADAPTER_WEIGHTS)).unwrap();
        d
    };
    let q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let e = refused(&tensors(q_a, None));
    assert!(e.contains(q_a) && e.contains(ADAPTER_WEIGHTS), "{e}");
    let k_a = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight";
    let e = refused(&tensors("", Some(k_a)));
    assert!(e.contains(k_a) && e.contains("peft.targets"), "{e}");
}

/// A `[peft]` checkpoint records its base (`model.from_hf` and the checksum of its weights) and refuses to
/// load — resume or export — once the base's weights differ; a full-model checkpoint records none.
#[test]
fn a_lora_checkpoint_refuses_a_changed_base() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let config = fine_tuning(JobConfig::small_llama(2), lora(&["q_proj", "v_proj"], 4, 8.0), &base, 1);
    let mut trainer = Trainer::new(config.clone()).unwrap();
    trainer.train_step();
    let saved = trainer.save_checkpoint(&dir.path().join("ckpt")).unwrap();
    let manifest = troupe_model::checkpoint::read::read_manifest(&saved).unwrap();
    let recorded = manifest.base.clone().expect("a [peft] checkpoint records its base");
    assert_eq!(recorded.dir, base);
    assert_eq!(recorded.checksum, troupe_model::hf::peft::base_checksum(&base).unwrap());
    Trainer::resume(config.clone(), &saved).unwrap();
    troupe_model::checkpoint::load_state(&saved).unwrap();

    // Another base of the same shape written over it: same names and shapes, other weights.
    let other = fine_tuning(JobConfig::small_llama(2), lora(&["q_proj", "v_proj"], 4, 8.0), &base, 2);
    assert_eq!(other.model, config.model);
    let e = Trainer::resume(config.clone(), &saved).unwrap_err().to_string();
    assert!(e.contains("base model") && e.contains(&base.display().to_string()) && e.contains("checksum"), "{e}");
    let e = troupe_model::checkpoint::load_state(&saved).unwrap_err().to_string();
    assert!(e.contains("checksum") && e.contains(&format!("{:016x}", recorded.checksum)), "{e}");

    let full = Trainer::new(JobConfig::small_llama(1)).unwrap();
    let saved = full.save_checkpoint(&dir.path().join("full")).unwrap();
    assert!(troupe_model::checkpoint::read::read_manifest(&saved).unwrap().base.is_none());
}
