//! The job configuration: one TOML file with `[model]`, `[data]`, `[train]`, `[checkpoint]`,
//! `[parallel]`, `[elastic]` and `[peft]` sections (`[peft]` is stored as `model.peft`: it decides the parameter list). Every key has a default (gpt-tiny on the synthetic corpus), an unknown key is
//! an error naming it, and every value is validated with a message that says what is allowed.
//!
//! Here: [`JobConfig`] — `[model]` beside the plain sections — read from TOML, `[model]` resolved (a
//! preset, or `from_hf`'s `config.json`), and checked as a whole. The plain sections and [`ConfigError`]
//! are [`crate::sections`]' (re-exported here), below the model and everything that reads a section.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::model::{presets, ModelConfig};
use crate::sections::{invalid, positive};
pub use crate::sections::{
    CheckpointConfig, ConfigError, DataConfig, DataKind, ElasticConfig, ParallelConfig, TrainConfig, BUCKET_MIB_MAX,
    ELASTIC_NODES_MAX, EVAL_SAMPLES_MAX, NODES_MAX, PIPELINE_STAGES_MAX, RANKS_MAX, SHARD_REPLICAS_MAX,
    VAL_FRACTION_MAX,
};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    pub model: ModelConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub checkpoint: CheckpointConfig,
    pub parallel: ParallelConfig,
    pub elastic: ElasticConfig,
}

impl JobConfig {
    /// A model small enough to train a few steps in about a second on two shared CPU cores — for tests
    /// and examples: 1 block, d_model 64, 2 heads, context 32; batch 4 in micro-batches of 2; warm-up 2
    /// steps; 1 torch thread. The data and optimizer are gpt-tiny's.
    pub fn small(steps: u64) -> Self {
        let mut config = JobConfig::default();
        config.model.n_layers = 1;
        config.model.d_model = 64;
        config.model.n_heads = 2;
        config.model.context = 32;
        config.train.steps = steps;
        config.train.global_batch = 4;
        config.train.micro_batch = 2;
        config.train.warmup_steps = 2;
        config.train.torch_threads = 1;
        config
    }

    /// [`Self::small`] with a Llama-family model of the same size: 1 block, d_model 64, 4 query heads
    /// sharing 2 key/value heads, SwiGLU of 128, RoPE θ = 500000 (not the default, so a convention
    /// mistake shows).
    pub fn small_llama(steps: u64) -> Self {
        let mut config = Self::small(steps);
        config.model = ModelConfig {
            arch: crate::model::Arch::Llama,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_hidden: 128,
            rope_theta: 500_000.0,
            ..config.model
        };
        config
    }

    /// Reads and validates a TOML job config.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let config = Self::parse_file(path)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads a TOML job config without validating its values — for a caller that changes some (command
    /// line flags) and validates the result.
    pub fn parse_file(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse_toml(&text, &path.display().to_string())
    }

    /// Parses a TOML job config without validating its values, `[model]` resolved: a `preset` or a
    /// `from_hf` directory's `config.json` gives the shape, keys set beside it override the preset (and
    /// must agree with `config.json`); `arch = "llama"` alone starts from the llama-tiny shape.
    fn parse_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let parse_error = |e: toml::de::Error| ConfigError::Parse { origin: origin.to_owned(), message: e.to_string() };
        let mut table: toml::Table = toml::from_str(text).map_err(parse_error)?;
        let mut config: Self = match table.remove("peft") {
            // `[peft]` is the model's: it decides the parameter list every engine trains.
            Some(peft) => {
                let model = table.entry("model").or_insert_with(|| toml::Value::Table(toml::Table::new()));
                let model = model.as_table_mut().ok_or_else(|| ConfigError::Parse {
                    origin: origin.to_owned(),
                    message: "`model` must be a table ([model])".into(),
                })?;
                if model.insert("peft".into(), peft).is_some() {
                    return Err(ConfigError::Parse {
                        origin: origin.to_owned(),
                        message: "[peft] is given twice (also as [model.peft]): keep one".into(),
                    });
                }
                toml::Value::Table(table.clone()).try_into().map_err(parse_error)?
            }
            None => toml::from_str(text).map_err(parse_error)?,
        };
        if let Some(model) = table.get("model").and_then(toml::Value::as_table) {
            config.model = resolve_model(model, &config.model)?;
        }
        // Like `from_hf`, PEFT adapters are named for every node: relative to where the job was read.
        if let Some(dir) = config.model.peft.as_mut().and_then(|p| p.from_adapters.as_mut()) {
            *dir = std::path::absolute(&*dir).unwrap_or_else(|_| dir.clone());
        }
        Ok(config)
    }

    /// Parses a TOML job config; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let config = Self::parse_toml(text, origin)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        self.validate_train()?;
        if self.checkpoint.replicas > SHARD_REPLICAS_MAX {
            return Err(invalid(
                "checkpoint.replicas",
                self.checkpoint.replicas,
                format!("must be in 0..={SHARD_REPLICAS_MAX} (1, the default, survives the loss of any one rank)"),
            ));
        }
        self.validate_data()?;
        self.validate_eval()?;
        self.parallel.validate()?;
        self.elastic.validate()?;
        self.validate_parallel_fits()?;
        self.validate_tensor_parallel()?;
        let specs = crate::model::param_specs(&self.model);
        crate::optim::validate(&self.train, specs.iter().map(|s| (s.name.as_str(), s.shape.as_slice())))
    }

    /// `parallel.tp` and `parallel.sp`: a degree the model's split tables accept (the layout's own
    /// refusal, naming the model key and the nearest valid degree). Every schedule, both balances,
    /// recomputation, ZeRO-1/2/3 inside the data-parallel groups, fp32, bf16 and fp16 run with it.
    fn validate_tensor_parallel(&self) -> Result<(), ConfigError> {
        let p = &self.parallel;
        if p.tp == 0 || p.tp > crate::sections::RANKS_MAX {
            return Err(invalid("parallel.tp", p.tp, format!("must be in 1..={}", crate::sections::RANKS_MAX)));
        }
        if p.tp == 1 {
            return Ok(());
        }
        if let Err(e) = crate::tensor_parallel::TpLayout::new(&self.model, p.tp, p.sp) {
            return Err(invalid("parallel.tp", p.tp, e.to_string()));
        }
        Ok(())
    }
}

impl JobConfig {
    /// The `[train]` keys: steps, batch sizes and the optimizer's hyperparameters.
    fn validate_train(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        if t.steps == 0 {
            return Err(invalid("train.steps", t.steps, "must be at least 1"));
        }
        positive("train.global_batch", t.global_batch)?;
        positive("train.micro_batch", t.micro_batch)?;
        if t.micro_batch > t.global_batch {
            return Err(invalid(
                "train.micro_batch",
                t.micro_batch,
                format!("must be at most train.global_batch ({})", t.global_batch),
            ));
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(invalid("train.lr", t.lr, "must be a finite number > 0, e.g. 1e-3"));
        }
        if !(t.min_lr.is_finite() && (0.0..=t.lr).contains(&t.min_lr)) {
            return Err(invalid("train.min_lr", t.min_lr, format!("must be in [0, train.lr = {}]", t.lr)));
        }
        for (key, beta) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(key, beta, "must be in [0, 1), e.g. 0.9 or 0.95"));
            }
        }
        if !(t.eps.is_finite() && t.eps > 0.0) {
            return Err(invalid("train.eps", t.eps, "must be a finite number > 0, e.g. 1e-8"));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return Err(invalid("train.weight_decay", t.weight_decay, "must be ≥ 0, e.g. 0.1"));
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            return Err(invalid("train.grad_clip", t.grad_clip, "must be ≥ 0 (0 disables clipping)"));
        }
        Ok(())
    }

    /// The `[data]` keys: a corpus long enough for one window, or a file to read, and a tokenizer only
    /// where there is text to encode.
    fn validate_data(&self) -> Result<(), ConfigError> {
        match self.data.kind {
            DataKind::Synthetic => {
                let needed = self.model.context + 1;
                if self.data.synthetic_bytes < needed {
                    return Err(invalid(
                        "data.synthetic_bytes",
                        self.data.synthetic_bytes,
                        format!("must be at least model.context + 1 = {needed}"),
                    ));
                }
            }
            DataKind::Text | DataKind::Jsonl | DataKind::Bin => {
                if self.data.path.is_none() {
                    return Err(invalid(
                        "data.path",
                        "(missing)",
                        "must name the file to train on when data.kind is \"text\", \"jsonl\" or \"bin\"",
                    ));
                }
            }
        }
        if let (Some(tokenizer), DataKind::Synthetic | DataKind::Bin) = (&self.data.tokenizer, self.data.kind) {
            let (kind, why) = if self.data.kind == DataKind::Bin {
                ("bin", "a bin file holds tokens already (`troupe data prepare --tokenizer` encoded them): remove data.tokenizer")
            } else {
                (
                    "synthetic",
                    "the synthetic corpus is bytes: remove data.tokenizer, or set data.kind = \"text\" or \"jsonl\"",
                )
            };
            return Err(invalid("data.tokenizer", format!("{tokenizer:?} with data.kind = \"{kind}\""), why));
        }
        Ok(())
    }

    /// What `[parallel]` asks of the other sections: fp16 for an injected overflow, enough blocks for the
    /// pipeline's chunks and enough samples for its replicas and micro-batches.
    fn validate_parallel_fits(&self) -> Result<(), ConfigError> {
        let (t, p) = (&self.train, &self.parallel);
        if !t.inject_overflow_at.is_empty() && p.precision != "fp16" {
            return Err(invalid(
                "train.inject_overflow_at",
                format!("{:?} with parallel.precision = {:?}", t.inject_overflow_at, p.precision),
                "an injected overflow tests fp16's loss scaler: set parallel.precision = \"fp16\" or leave it empty",
            ));
        }
        if p.pp > 1 && p.pp * p.virtual_stages > self.model.n_layers {
            return Err(invalid(
                "parallel.pp",
                p.pp,
                format!(
                    "pp × virtual_stages = {} chunks must be at most model.n_layers ({}): every chunk runs at least one block",
                    p.pp * p.virtual_stages,
                    self.model.n_layers
                ),
            ));
        }
        if p.periodic_sync() && p.fragments > self.model.n_layers.max(1) {
            let why = format!(
                "must be at most model.n_layers ({}): every fragment holds at least one block",
                self.model.n_layers
            );
            return Err(invalid("parallel.fragments", p.fragments, why));
        }
        let replicas = if p.pp > 1 { p.dp.max(1) } else { 1 };
        if replicas > t.global_batch {
            return Err(invalid(
                "parallel.dp",
                p.dp,
                format!("must be at most train.global_batch ({})", t.global_batch),
            ));
        }
        let samples = t.global_batch / replicas;
        if p.microbatches > samples {
            let allowed = if replicas == 1 {
                format!("must be at most train.global_batch ({samples})")
            } else {
                format!("must be at most the samples of one pipeline, train.global_batch / parallel.dp = {samples}")
            };
            return Err(invalid("parallel.microbatches", p.microbatches, allowed));
        }
        Ok(())
    }

    /// The validation keys: where the held-out tokens come from, and how often and how much is evaluated.
    fn validate_eval(&self) -> Result<(), ConfigError> {
        let (data, train) = (&self.data, &self.train);
        let fraction = data.val_fraction;
        if !(fraction == 0.0 || (fraction > 0.0 && fraction <= VAL_FRACTION_MAX)) {
            return Err(invalid(
                "data.val_fraction",
                fraction,
                format!("must be 0 (nothing held out) or in (0, {VAL_FRACTION_MAX}], e.g. 0.1 holds out the last tenth of the corpus"),
            ));
        }
        if let (Some(path), true) = (&data.val_path, fraction > 0.0) {
            return Err(invalid(
                "data.val_path",
                format!("{path:?} with data.val_fraction = {fraction}"),
                "validation data comes from one place: set data.val_fraction (the corpus' tail) or data.val_path (a separate file), not both",
            ));
        }
        if let (Some(path), DataKind::Synthetic) = (&data.val_path, data.kind) {
            return Err(invalid(
                "data.val_path",
                format!("{path:?} with data.kind = \"synthetic\""),
                "a validation file has the training data's kind, and the synthetic corpus has no file: hold out its tail with data.val_fraction instead",
            ));
        }
        if !(1..=EVAL_SAMPLES_MAX).contains(&train.eval_samples) {
            return Err(invalid(
                "train.eval_samples",
                train.eval_samples,
                format!("must be in 1..={EVAL_SAMPLES_MAX}"),
            ));
        }
        if train.eval_every > 0 && fraction == 0.0 && data.val_path.is_none() {
            return Err(invalid(
                "train.eval_every",
                train.eval_every,
                "evaluates held-out data, and there is none: set data.val_fraction (e.g. 0.1, the corpus' tail) or data.val_path (a separate file), or set train.eval_every = 0",
            ));
        }
        Ok(())
    }

    /// Whether the validation loss is evaluated after committed step `step` (1-based: `step` updates
    /// applied): every `train.eval_every`-th and the last.
    pub fn eval_due(&self, step: u64) -> bool {
        let every = self.train.eval_every;
        every > 0 && step > 0 && (step.is_multiple_of(every) || step == self.train.steps)
    }
}

/// `[model]` as the user wrote it (`table`) over its serde defaults (`parsed`), resolved into the whole
/// model config: see [`JobConfig::parse_file`].
fn resolve_model(table: &toml::Table, parsed: &ModelConfig) -> Result<ModelConfig, ConfigError> {
    let base = if let Some(dir) = &parsed.from_hf {
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
        let from_json =
            crate::hf::read_config(&dir).map_err(|e| invalid("model.from_hf", dir.display(), e.to_string()))?;
        check_agreement(table, &from_json, &dir)?;
        ModelConfig { from_hf: Some(dir), ..from_json }
    } else if let Some(name) = &parsed.preset {
        presets::preset(name).ok_or_else(|| {
            invalid("model.preset", format!("{name:?}"), format!("must be one of {}", presets::names()))
        })?
    } else if table.contains_key("arch") && parsed.arch == crate::model::Arch::Llama {
        ModelConfig { preset: None, ..presets::preset("llama-tiny").expect("a preset") }
    } else {
        return Ok(parsed.clone());
    };
    // The keys the user set override the base.
    let mut merged = model_table(&base);
    for (key, value) in table {
        if key != "from_hf" && key != "preset" {
            merged.insert(key.clone(), value.clone());
        }
    }
    toml::Value::Table(merged).try_into().map_err(|e: toml::de::Error| invalid("model", "(resolved)", e.to_string()))
}

fn model_table(config: &ModelConfig) -> toml::Table {
    match toml::Value::try_from(config).expect("a model config serialises") {
        toml::Value::Table(table) => table,
        other => unreachable!("a struct serialises to a table, not {other}"),
    }
}

/// Every key of `[model]` that `config.json` also decides must agree with it (the training `context`,
/// the initialisation and the references excepted).
fn check_agreement(table: &toml::Table, from_json: &ModelConfig, dir: &Path) -> Result<(), ConfigError> {
    let json = model_table(from_json);
    for (key, value) in table {
        if matches!(key.as_str(), "from_hf" | "preset" | "context" | "init_std" | "peft") {
            continue;
        }
        let derived = json.get(key);
        let agrees = match (derived, value) {
            (Some(toml::Value::Float(a)), toml::Value::Float(b)) => (a - b).abs() <= 1e-12 * a.abs().max(b.abs()),
            (Some(toml::Value::Float(a)), toml::Value::Integer(b)) => *a == *b as f64,
            (Some(a), b) => a == b,
            (None, _) => false,
        };
        if !agrees {
            let shown = derived.map_or("(not set)".to_owned(), |v| v.to_string());
            return Err(ConfigError::Parse {
                origin: "model.from_hf".into(),
                message: crate::hf::HfError::Disagrees {
                    key: key.clone(),
                    toml: value.to_string(),
                    path: dir.join("config.json"),
                    json_key: crate::hf::json_key(from_json.arch, key).to_owned(),
                    json: shown,
                }
                .to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(toml: &str) -> String {
        JobConfig::from_toml(toml, "test.toml").unwrap_err().to_string()
    }

    #[test]
    fn empty_config_is_gpt_tiny_on_synthetic_data() {
        let config = JobConfig::from_toml("", "empty").unwrap();
        assert_eq!(config, JobConfig::default());
        assert_eq!(config.model, ModelConfig::gpt_tiny());
        assert_eq!(config.data.kind, DataKind::Synthetic);
    }

    #[test]
    fn peft_adapters_are_named_absolutely() {
        let config = JobConfig::parse_toml("[peft]\nfrom_adapters = \"my-adapters\"\n", "t").unwrap();
        let dir = config.model.peft.unwrap().from_adapters.unwrap();
        assert!(dir.is_absolute() && dir.ends_with("my-adapters"), "{}", dir.display());
    }

    #[test]
    fn bigger_model_is_one_line() {
        let config = JobConfig::from_toml("[model]\nn_layers = 8\n", "t").unwrap();
        assert_eq!(config.model.n_layers, 8);
        assert_eq!(config.model.d_model, 256);
    }

    #[test]
    fn errors_name_the_key_and_what_is_allowed() {
        let cases: &[(&str, &[&str])] = &[
            ("[train]\nlearning_rate = 0.1\n", &["unknown field `learning_rate`", "expected one of", "`lr`"]),
            ("[modle]\n", &["unknown field `modle`"]),
            ("[train]\nlr = -1.0\n", &["train.lr", "> 0"]),
            ("[train]\nsteps = 0\n", &["train.steps", "must be at least 1"]),
            ("[train]\nmicro_batch = 16\n", &["train.micro_batch", "at most train.global_batch (8)"]),
            ("[train]\nbeta2 = 1.0\n", &["train.beta2", "[0, 1)"]),
            ("[model]\nn_heads = 3\n", &["model.n_heads", "divide model.d_model (256)"]),
            ("[model]\nvocab_size = 0\n", &["model.vocab_size", "at least 1"]),
            ("[data]\nkind = \"text\"\n", &["data.path", "must name the file"]),
            ("[data]\nkind = \"parquet\"\n", &["unknown variant `parquet`", "synthetic"]),
            ("[data]\nkind = \"jsonl\"\n", &["data.path", "\"jsonl\""]),
            (
                "[data]\nkind = \"bin\"\npath = \"t.bin\"\ntokenizer = \"tok.json\"\n",
                &["data.tokenizer", "holds tokens already"],
            ),
            ("[data]\ntokenizer = \"tok.json\"\n", &["data.tokenizer", "the synthetic corpus is bytes"]),
            ("[parallel]\nshard = \"zero4\"\n", &["parallel.shard", "none, zero1, zero2, zero3"]),
            ("[checkpoint]\nreplicas = 4\n", &["checkpoint.replicas", "0..=3"]),
            ("[parallel]\npp = 8\n", &["parallel.pp", "at most model.n_layers (4)"]),
            ("[parallel]\nmicrobatches = 4\n", &["parallel.microbatches", "--pp"]),
            ("[parallel]\npp = 2\nvirtual_stages = 2\n", &["parallel.virtual_stages", "interleaved"]),
            ("[parallel]\npp = 2\nbalance = \"time\"\n", &["parallel.balance", "measured"]),
            ("[parallel]\nbalance = \"measured\"\n", &["parallel.balance", "--pp"]),
            ("[parallel]\nnodes = 0\n", &["parallel.nodes", "1..=64"]),
            ("[parallel]\nbucket_mib = 4096\n", &["parallel.bucket_mib", "at most 1024"]),
            ("[parallel]\ntp = 3\n", &["parallel.tp", "model.n_heads (4)", "nearest valid degree is 2"]),
            ("[parallel]\ntp = 0\n", &["parallel.tp", "1..=4096"]),
            ("[train]\nsteps = \"many\"\n", &["invalid type", "steps"]),
            ("[elastic]\nmin_nodes = 0\n", &["elastic.min_nodes", "1..=4096"]),
            ("[elastic]\nmin_nodes = 3\nmax_nodes = 2\n", &["elastic.max_nodes", "at least elastic.min_nodes (3)"]),
            ("[elastic]\nmin_ranks = 2\n", &["unknown field `min_ranks`", "min_nodes"]),
        ];
        for (toml, needles) in cases {
            let message = error_of(toml);
            for needle in *needles {
                assert!(message.contains(needle), "error for {toml:?} lacks {needle:?}: {message}");
            }
        }
    }

    #[test]
    fn tensor_parallel_jobs_take_every_precision() {
        for precision in ["fp32", "bf16", "fp16"] {
            let toml = format!("[parallel]\ntp = 2\nprecision = \"{precision}\"\n");
            let config = JobConfig::from_toml(&toml, "t").unwrap_or_else(|e| panic!("{precision}: {e}"));
            assert_eq!((config.parallel.tp, config.parallel.precision.as_str()), (2, precision));
        }
    }

    #[test]
    fn tensor_parallel_jobs_take_a_pipeline_with_every_schedule() {
        for schedule in ["gpipe", "1f1b", "zb-h1"] {
            let toml = format!("[parallel]\ntp = 2\npp = 2\nschedule = \"{schedule}\"\nrecompute = true\n");
            let config = JobConfig::from_toml(&toml, "t").unwrap_or_else(|e| panic!("{schedule}: {e}"));
            assert_eq!((config.parallel.tp, config.parallel.pp), (2, 2));
        }
    }

    #[test]
    fn recompute_is_accepted_for_data_parallel_jobs() {
        let config = JobConfig::from_toml("[parallel]\nrecompute = true\nnodes = 2\n", "t").unwrap();
        assert!(config.parallel.recompute);
    }

    #[test]
    fn zero_modes_are_accepted_with_buddy_copies_by_default() {
        for mode in ["zero1", "zero2", "zero3"] {
            let config = JobConfig::from_toml(&format!("[parallel]\nshard = \"{mode}\"\nnodes = 3\n"), "t").unwrap();
            assert_eq!(config.parallel.shard, mode);
            assert_eq!(config.checkpoint.replicas, 1);
        }
        let config = JobConfig::from_toml("[checkpoint]\nreplicas = 0\n", "t").unwrap();
        assert_eq!(config.checkpoint.replicas, 0);
    }

    /// A tied head (GPT-2 small, SmolLM2) trains under every layout: DDP, ZeRO-1/2/3, pipelines of every
    /// schedule, and pipelines with ZeRO inside the stages' groups.
    #[test]
    fn tied_heads_are_accepted_with_pipelines_and_zero3() {
        let tied = "[model]\ntie_word_embeddings = true\nn_layers = 4\n";
        for parallel in [
            "shard = \"zero3\"\nnodes = 2\n",
            "pp = 2\n",
            "pp = 2\nschedule = \"zb-h1\"\n",
            "pp = 2\nschedule = \"interleaved\"\nvirtual_stages = 2\n",
            "pp = 2\ndp = 2\nshard = \"zero3\"\n",
        ] {
            let toml = format!("{tied}[parallel]\n{parallel}");
            let config = JobConfig::from_toml(&toml, "t").unwrap_or_else(|e| panic!("{toml}: {e}"));
            assert!(config.model.tie_word_embeddings, "{toml}");
        }
    }

    #[test]
    fn validation_keys_are_checked_and_named_with_the_fix() {
        let cases: &[(&str, &[&str])] = &[
            ("[data]\nval_fraction = 0.6\n", &["data.val_fraction", "(0, 0.5]"]),
            ("[data]\nval_fraction = -0.1\n", &["data.val_fraction", "must be 0"]),
            ("[data]\nval_fraction = nan\n", &["data.val_fraction", "NaN"]),
            (
                "[data]\nkind = \"text\"\npath = \"a.txt\"\nval_fraction = 0.1\nval_path = \"b.txt\"\n",
                &["data.val_path", "data.val_fraction = 0.1", "not both"],
            ),
            ("[data]\nval_path = \"b.txt\"\n", &["data.val_path", "synthetic", "data.val_fraction instead"]),
            ("[train]\neval_every = 10\n", &["train.eval_every", "data.val_fraction", "data.val_path"]),
            ("[data]\nval_fraction = 0.1\n[train]\neval_samples = 0\n", &["train.eval_samples", "1..="]),
            ("[train]\nevaluate_every = 10\n", &["unknown field `evaluate_every`", "eval_every"]),
        ];
        for (toml, needles) in cases {
            let message = error_of(toml);
            for needle in *needles {
                assert!(message.contains(needle), "error for {toml:?} lacks {needle:?}: {message}");
            }
        }
        let config =
            JobConfig::from_toml("[data]\nval_fraction = 0.1\n[train]\neval_every = 50\nsteps = 120\n", "t").unwrap();
        let due: Vec<u64> = (0..=120).filter(|&s| config.eval_due(s)).collect();
        assert_eq!(due, [50, 100, 120], "every 50th committed step and the last, never step 0");
        assert!(!JobConfig::default().eval_due(200), "eval_every = 0: never");
    }

    #[test]
    fn missing_config_file_is_named() {
        let err = JobConfig::from_file(Path::new("/nonexistent/job.toml")).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/job.toml"), "{err}");
    }
}
