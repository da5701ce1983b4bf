//! `[peft]` under tensor parallelism against the single-process fine-tuning reference: LoRA adapters split
//! with their layers (B by the rows of a column-parallel weight, A by the columns of a row-parallel one,
//! the other factor whole on every rank with its partial gradients summed over the group) and frozen
//! layers (no gradient; the rank holds only its shard of the base). Per-step losses and adapter
//! gradients and the final adapters equal the reference's within 1e-5 relative, at tp = 2 and 4, SP on
//! and off; the gathered adapters written in PEFT's format hold the reference's, and PEFT loads them
//! with the reference's loss.

use std::path::Path;

use tch::{Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::hf::peft::{export_adapters, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use troupe_model::model::peft::Method;
use troupe_model::model::{param_specs, Model, ModelConfig, PeftConfig};
use troupe_model::oracle::{fine_tuning, run_python_oracle};
use troupe_model::tensor_parallel::{Split, TpLayout};

use super::{assert_equals_reference_as, gpt2, initial_model, rel_diff, Run, SEED};

const DEGREES: [(usize, bool); 4] = [(2, false), (2, true), (4, false), (4, true)];

/// The tests' Llama (grouped-query attention, q/k/v biases, tied) as Qwen2 writes it: head_dim derived.
fn llama() -> ModelConfig {
    ModelConfig { head_dim: 0, ..super::llama() }
}

fn lora(targets: &[&str]) -> PeftConfig {
    PeftConfig { r: 4, alpha: 8.0, targets: targets.iter().map(|s| s.to_string()).collect(), ..PeftConfig::default() }
}

/// LoRA on every linear of the blocks: the column-parallel and the row-parallel ones.
pub(super) fn lora_all_linears(cfg: &ModelConfig) -> PeftConfig {
    match cfg.arch {
        troupe_model::model::Arch::Gpt2 => lora(&["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]),
        troupe_model::model::Arch::Llama => {
            lora(&["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        }
    }
}

/// The last block, the final norm and the head train; the rest is frozen.
fn freeze_last_block() -> PeftConfig {
    PeftConfig { method: Method::Freeze, last_blocks: 1, ..PeftConfig::default() }
}

/// `cfg` fine-tuned with `peft` from a pretrained base written into `dir`.
pub(super) fn fine_tuned(cfg: &ModelConfig, peft: PeftConfig, dir: &Path) -> ModelConfig {
    let job = JobConfig { model: cfg.clone(), ..JobConfig::small(1) };
    let config = fine_tuning(job, peft, dir, 5).model;
    config.validate().unwrap();
    config
}

#[test]
fn lora_on_every_linear_equals_the_reference_at_tp_2_and_4_with_and_without_sp() {
    for cfg in [gpt2(), llama()] {
        let dir = tempfile::tempdir().unwrap();
        let config = fine_tuned(&cfg, lora_all_linears(&cfg), dir.path());
        for (degree, sp) in DEGREES {
            let case = format!("{} LoRA tp={degree} sp={sp}", cfg.arch.as_str());
            let (want, got) = assert_equals_reference_as(&case, &config, degree, sp);
            assert_adapters_moved(&case, &config, &want);
            assert_peft_files_equal(&case, &config, &want, &got);
        }
    }
}

#[test]
fn freeze_equals_the_reference_at_tp_2_and_4_with_and_without_sp() {
    for cfg in [gpt2(), llama()] {
        let dir = tempfile::tempdir().unwrap();
        let config = fine_tuned(&cfg, freeze_last_block(), dir.path());
        let trained = param_specs(&config);
        assert!(
            trained.iter().all(|s| !s.name.contains(".0.")) && trained.len() < param_specs(&cfg).len(),
            "the first block is frozen"
        );
        for (degree, sp) in DEGREES {
            assert_equals_reference_as(
                &format!("{} freeze tp={degree} sp={sp}", cfg.arch.as_str()),
                &config,
                degree,
                sp,
            );
        }
    }
}

/// Both factors of every adapter moved and had non-zero gradients at every step (so the comparisons
/// above test the whole factor's sum over the group).
fn assert_adapters_moved(case: &str, config: &ModelConfig, want: &Run) {
    let initial = initial_model(config);
    for ((spec, before), after) in initial.specs().iter().zip(initial.params()).zip(&want.params) {
        assert!(!before.detach().equal(after), "{case}: {} did not train", spec.name);
    }
    for (step, grads) in want.grads.iter().enumerate() {
        for (spec, g) in initial.specs().iter().zip(grads) {
            assert!(g.abs().max().double_value(&[]) > 0.0, "{case}: {}'s gradient of step {step} is zero", spec.name);
        }
    }
}

/// The gathered adapters written in PEFT's format: the reference's configuration, keys and shapes, values
/// within 1e-5; at tp = 2, PEFT loads them and gets the reference's loss.
fn assert_peft_files_equal(case: &str, config: &ModelConfig, want: &Run, got: &Run) {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, run: &Run| {
        let out = dir.path().join(name);
        let values: Vec<Vec<f32>> =
            run.params.iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
        export_adapters(config, &values, &out).unwrap();
        out
    };
    let (reference, tp) = (write("reference", want), write("tp", got));
    let read = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
    assert_eq!(read(&tp, ADAPTER_CONFIG), read(&reference, ADAPTER_CONFIG), "{case}: adapter_config.json differs");
    let (ours, theirs) = (read(&tp, ADAPTER_WEIGHTS), read(&reference, ADAPTER_WEIGHTS));
    let (ours, theirs) = (
        safetensors::SafeTensors::deserialize(&ours).unwrap(),
        safetensors::SafeTensors::deserialize(&theirs).unwrap(),
    );
    let mut keys = ours.names();
    keys.sort();
    let mut reference_keys = theirs.names();
    reference_keys.sort();
    assert_eq!(keys, reference_keys, "{case}: the adapter files hold other tensors");
    for key in keys {
        let (a, b) = (ours.tensor(key).unwrap(), theirs.tensor(key).unwrap());
        assert_eq!(a.shape(), b.shape(), "{case}: {key}'s shape");
        let tensor = |v: &safetensors::tensor::TensorView| {
            Tensor::from_data_size(v.data(), &[v.data().len() as i64 / 4], Kind::Float)
        };
        let d = rel_diff(&tensor(&a), &tensor(&b));
        assert!(d <= 1e-5, "{case}: {key} in the adapter file differs from the reference's by {d:e}");
    }
    if case.contains("tp=2 sp=false") {
        assert_peft_gives_the_reference_loss(case, config, &tp, want);
    }
}

/// PEFT (`PeftModel.from_pretrained` on the base) loads the tensor-parallel adapters in `adapters`
/// and computes the loss the reference's trained model computes.
fn assert_peft_gives_the_reference_loss(case: &str, config: &ModelConfig, adapters: &Path, want: &Run) {
    let dir = tempfile::tempdir().unwrap();
    let tokens =
        Tensor::randint(config.vocab_size as i64, [2, config.context as i64 + 1], (Kind::Int64, tch::Device::Cpu));
    let file = dir.path().join("tokens.safetensors");
    Tensor::write_safetensors(&[("tokens", &tokens)], &file).unwrap();
    let time = config.context as i64;
    let mut model = Model::new(config.clone(), SEED);
    model.load_values(&want.params);
    let ours =
        tch::no_grad(|| model.loss(&tokens.narrow(1, 0, time).contiguous(), &tokens.narrow(1, 1, time).contiguous()))
            .double_value(&[]);
    let base = config.from_hf.as_ref().unwrap();
    let grads = dir.path().join("grads.safetensors");
    let args =
        ["check", base.to_str().unwrap(), adapters.to_str().unwrap(), file.to_str().unwrap(), grads.to_str().unwrap()];
    let theirs = run_python_oracle("tests/hf/peft_oracle.py", "peft", &args).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(theirs["warnings"], serde_json::json!([]), "{case}: PEFT warned: {theirs}");
    let their_loss = theirs["loss"].as_f64().unwrap();
    assert!((their_loss - ours).abs() <= 1e-5 * ours.abs(), "{case}: PEFT's loss {their_loss}, the reference's {ours}");
}

#[test]
fn adapters_split_with_their_layers_and_the_whole_factor_sums_its_gradient() {
    let dir = tempfile::tempdir().unwrap();
    let config = fine_tuned(&gpt2(), lora_all_linears(&gpt2()), dir.path());
    let layout = TpLayout::new(&config, 2, false).unwrap();
    let of = |name: &str| {
        let at = layout.specs.iter().position(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"));
        (layout.splits[at], layout.partial_grads[at], layout.shard_shapes()[at].clone())
    };
    // Column-parallel c_attn (Q, K, V by heads): B [3d, r] splits as its rows, A [r, d] whole.
    assert_eq!(of("h.0.attn.c_attn.lora_B.weight"), (Split::Column { parts: 3 }, false, vec![48, 4]));
    assert_eq!(of("h.0.attn.c_attn.lora_A.weight"), (Split::Replicated, true, vec![4, 32]));
    assert_eq!(of("h.0.mlp.c_fc.lora_B.weight"), (Split::Column { parts: 1 }, false, vec![64, 4]));
    // Row-parallel c_proj: A [r, in] splits as its columns, B [d, r] whole.
    assert_eq!(of("h.1.mlp.c_proj.lora_A.weight"), (Split::Row, false, vec![4, 64]));
    assert_eq!(of("h.1.mlp.c_proj.lora_B.weight"), (Split::Replicated, true, vec![32, 4]));
    assert_eq!(of("h.0.attn.c_proj.lora_A.weight"), (Split::Row, false, vec![4, 16]));
    // The frozen base splits as the family's table says.
    assert_eq!(layout.base_splits.len(), troupe_model::model::base_specs(&config).len());
}

/// LoRA's dropout (`peft.dropout` = 0.1) on every linear: each rank drops what the single-process forward
/// of the same samples drops — a column-parallel weight's whole input, a row-parallel one's columns of it
/// — so losses, gradients and parameters equal the reference's at tp = 2 and 4, SP on and off. The
/// reference's losses with dropout differ from those without (the masks are not all ones).
#[test]
fn lora_dropout_under_tensor_parallelism_drops_what_the_reference_drops() {
    for cfg in [gpt2(), llama()] {
        let dir = tempfile::tempdir().unwrap();
        let config = fine_tuned(&cfg, PeftConfig { dropout: 0.1, ..lora_all_linears(&cfg) }, dir.path());
        let mut without = config.clone();
        without.peft.as_mut().expect("[peft]").dropout = 0.0;
        let (with_dropout, plain) = (super::reference(&config).losses, super::reference(&without).losses);
        assert!(
            with_dropout.iter().zip(&plain).skip(1).all(|(a, b)| a != b),
            "{}: dropout changes the trajectory: {with_dropout:?} vs {plain:?}",
            cfg.arch.as_str()
        );
        for (degree, sp) in DEGREES {
            let case = format!("{} LoRA dropout 0.1 tp={degree} sp={sp}", cfg.arch.as_str());
            let (want, _) = assert_equals_reference_as(&case, &config, degree, sp);
            assert_adapters_moved(&case, &config, &want);
        }
    }
}
