//! The oracle comparison (DESIGN.md §4): how close a run's parameters and losses are to the reference.
//!
//! "Within ε relative" means, for every parameter tensor, ‖a − b‖₂ / ‖b‖₂ ≤ ε, and for every step's loss
//! |a − b| / |b| ≤ ε.
//!
//! One slice is left out: the key third of each block's `attn.c_attn.bias`. Adding a constant vector to
//! every key adds the same number to every score of a query's row, which the softmax ignores, so the loss
//! does not depend on the key bias at all — its true gradient is exactly zero, the computed one is
//! rounding noise, and AdamW normalises that noise into steps of up to `lr` whose direction depends on
//! the summation order. Two runs that differ only in how sums are ordered (micro-batch splits, ranks,
//! pipeline stages) therefore disagree there by ~1e-4 relative while computing the same function; every
//! other tensor agrees to ~1e-6 after 20 steps (measured, see docs/benchmarks.md).

use std::ops::Range;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::config::JobConfig;
use crate::model::{Model, ParamSpec, PeftConfig};

/// The Python of the provisioned venv (scripts/provision-libtorch.sh), where PyTorch and the pinned
/// external oracles (transformers) live: `TROUPE_PYTHON`, else `$TROUPE_CACHE/venv-torch-2.11.0/bin/python`
/// (`TROUPE_CACHE` defaults to `~/.cache/troupe`).
pub fn venv_python() -> PathBuf {
    if let Some(python) = std::env::var_os("TROUPE_PYTHON") {
        return python.into();
    }
    let cache = std::env::var_os("TROUPE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/troupe"));
    cache.join("venv-torch-2.11.0/bin/python")
}

/// Runs transformers, the external oracle of the model families (kernels/model/tests/hf/oracle.py, see
/// its docstring for the commands), in [`venv_python`]; its last line of output as JSON, or what went
/// wrong. For tests: the script lives in the source tree.
pub fn transformers_oracle(args: &[&str]) -> Result<serde_json::Value, String> {
    run_python_oracle("tests/hf/oracle.py", "transformers", args)
}

/// Runs the script `script` (relative to this crate's directory) with `args` in [`venv_python`]; its last
/// line of output as JSON, or what went wrong (`needs`: the package the script needs, for the message).
pub fn run_python_oracle(script: &str, needs: &str, args: &[&str]) -> Result<serde_json::Value, String> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let name = script.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let python = venv_python();
    let output = std::process::Command::new(&python).arg(&script).args(args).output().map_err(|e| {
        format!("running {} {}: {e}; provision the venv with `make provision`", python.display(), script.display())
    })?;
    if !output.status.success() {
        return Err(format!(
            "{name} {args:?} failed ({needs} installed? `make provision`):\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().ok_or(format!("{name} printed nothing"))?;
    serde_json::from_str(last).map_err(|e| format!("{name} printed {last:?}: {e}"))
}

/// `config` as a fine-tuning job (`[peft]` = `peft`) of a "pretrained" model: the model `config`
/// describes, initialised from `seed`, written into `dir` as the Hugging Face directory `model.from_hf`
/// names. What the tests and benchmarks of `[peft]` start from.
pub fn fine_tuning(mut config: JobConfig, peft: PeftConfig, dir: &Path, seed: u64) -> JobConfig {
    let plain = crate::model::ModelConfig { peft: None, from_hf: None, ..config.model.clone() };
    let base = Model::new(plain, seed);
    let values: Vec<Vec<f32>> =
        base.params().iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).expect("fp32 parameters")).collect();
    crate::hf::export(&base.config, &values, dir, crate::hf::ExportOptions::default())
        .unwrap_or_else(|e| panic!("writing the base model into {}: {e}", dir.display()));
    config.model.from_hf = Some(dir.to_owned());
    config.model.peft = Some(peft);
    config
}

/// The comparison of two parameter lists.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamComparison {
    /// The largest per-tensor relative difference and the tensor's name.
    pub worst: f64,
    pub worst_name: String,
    /// ‖a − b‖₂ / ‖b‖₂ over all compared elements together.
    pub global: f64,
}

impl ParamComparison {
    pub fn within(&self, tolerance: f64) -> bool {
        self.worst <= tolerance
    }
}

/// The elements of a parameter the oracle compares (all but a block's key-bias slice).
fn compared_ranges(spec: &ParamSpec) -> Vec<Range<i64>> {
    let n = spec.numel() as i64;
    if spec.name.ends_with("attn.c_attn.bias") {
        let d = n / 3;
        return vec![0..d, 2 * d..n];
    }
    std::iter::once(0..n).collect()
}

fn compared(spec: &ParamSpec, t: &Tensor) -> Tensor {
    let flat = t.detach().flatten(0, -1).to_kind(Kind::Double);
    let parts: Vec<Tensor> =
        compared_ranges(spec).into_iter().map(|r| flat.narrow(0, r.start, r.end - r.start)).collect();
    Tensor::cat(&parts, 0)
}

/// Compares `actual` with `reference` (both in [`crate::model::param_specs`] order).
pub fn compare_params(specs: &[ParamSpec], actual: &[Tensor], reference: &[Tensor]) -> ParamComparison {
    assert_eq!(specs.len(), actual.len(), "parameter list length");
    assert_eq!(specs.len(), reference.len(), "parameter list length");
    let (mut worst, mut worst_name, mut diff_sq, mut ref_sq) = (0.0f64, String::new(), 0.0, 0.0);
    for ((spec, a), b) in specs.iter().zip(actual).zip(reference) {
        let (a, b) = (compared(spec, a), compared(spec, b));
        let d = (&a - &b).square().sum(Kind::Double).double_value(&[]);
        let r = b.square().sum(Kind::Double).double_value(&[]);
        let rel = d.sqrt() / r.sqrt().max(f64::MIN_POSITIVE);
        if rel > worst || worst_name.is_empty() {
            (worst, worst_name) = (rel, spec.name.clone());
        }
        (diff_sq, ref_sq) = (diff_sq + d, ref_sq + r);
    }
    ParamComparison { worst, worst_name, global: diff_sq.sqrt() / ref_sq.sqrt().max(f64::MIN_POSITIVE) }
}

/// The largest relative difference between two loss sequences (which must have the same length).
pub fn worst_loss_diff(actual: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(actual.len(), reference.len(), "loss sequences differ in length");
    actual.iter().zip(reference).map(|(a, b)| (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)).fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{param_specs, ModelConfig};

    #[test]
    fn key_bias_is_ignored_and_everything_else_counts() {
        let mut cfg = ModelConfig::gpt_tiny();
        cfg.n_layers = 1;
        let specs = param_specs(&cfg);
        let reference: Vec<Tensor> =
            specs.iter().map(|s| Tensor::ones(s.shape.as_slice(), (Kind::Float, tch::Device::Cpu))).collect();
        let bias = specs.iter().position(|s| s.name.ends_with("c_attn.bias")).unwrap();

        let actual: Vec<Tensor> = reference.iter().map(Tensor::copy).collect();
        let _ = actual[bias].narrow(0, 256, 256).fill_(7.0); // the key third
        let same = compare_params(&specs, &actual, &reference);
        assert_eq!(same.worst, 0.0);

        let _ = actual[bias].narrow(0, 0, 1).fill_(1.5); // one query-bias element
        let off = compare_params(&specs, &actual, &reference);
        assert_eq!(off.worst_name, "h.0.attn.c_attn.bias");
        assert!((off.worst - 0.5 / 512f64.sqrt()).abs() < 1e-12, "{off:?}");
        assert!(!off.within(1e-5));
    }

    #[test]
    fn loss_diff_is_relative() {
        assert!((worst_loss_diff(&[2.0, 1.0], &[2.0, 1.1]) - 0.1 / 1.1).abs() < 1e-12);
    }
}
