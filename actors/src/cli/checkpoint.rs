//! `troupe checkpoint list|verify|reshard|export`: inspect the checkpoints of a job, check them byte by
//! byte, rewrite one under another shard count, and take the trained parameters out as a Hugging Face
//! model directory (config.json + safetensors that `from_pretrained` loads) or, with `--raw`, as one
//! plain safetensors file of troupe's own names and layout.
//!
//! A checkpoint path may name one `step-NNNNNNNN` directory or a checkpoint root (`checkpoint.dir`); for
//! `reshard` and `export` a root means its newest valid checkpoint — the one a job would continue from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use indicatif::ProgressBar;
use serde_json::json;
use troupe_model::checkpoint::manifest::{Layout, Manifest, ShardMode};
use troupe_model::checkpoint::read::read_manifest;
use troupe_model::checkpoint::tensor_file::{read_verified, write_f32_file, FileTensor};
use troupe_model::checkpoint::{latest_valid, load_state, step_dirs, CheckpointStore, StateKind, MANIFEST};

use troupe_model::hf::{self, ExportDtype, ExportOptions};
use troupe_model::ModelConfig;

use super::table::Table;
use crate::progress::{bytes_bar, spinner, Spinner};

#[derive(Debug, clap::Subcommand)]
pub enum CheckpointCommand {
    /// Every checkpoint under a root: step, layout, size, and whether it is valid (`--verify` reads
    /// every byte; without it only the manifests are checked).
    List {
        /// A checkpoint root (`checkpoint.dir`).
        root: PathBuf,
        /// Check every file's checksum, not only the manifests.
        #[arg(long)]
        verify: bool,
        /// One JSON object per checkpoint on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Check a checkpoint (or every checkpoint under a root) byte by byte against its manifest; exits
    /// non-zero if any is torn or corrupt, naming the file.
    Verify {
        /// A `step-NNNNNNNN` directory or a checkpoint root.
        path: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Rewrite a checkpoint as SHARDS files under another root (any layout loads into any other at
    /// restore time; this writes it out, e.g. to ship one file per host).
    Reshard {
        /// A `step-NNNNNNNN` directory, or a root (its newest valid checkpoint).
        src: PathBuf,
        /// Shard files (data-parallel ranks) of the new layout.
        #[arg(long)]
        shards: usize,
        /// The checkpoint root to write into (created if missing).
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Write the parameters of a checkpoint (no optimizer state) as a Hugging Face model directory:
    /// config.json, generation_config.json and model.safetensors — sharded with an index above
    /// --max-shard-mib — that transformers' `AutoModelForCausalLM.from_pretrained(DIR)` loads, and the
    /// job's tokenizer (`[data] tokenizer`) beside it. With
    /// --raw: one safetensors file with troupe's names and layout, what `troupe train --save-final` gives.
    Export {
        /// A `step-NNNNNNNN` directory, or a root (its newest valid checkpoint).
        src: PathBuf,
        /// The directory to write (must not exist or be empty); with --raw, the `.safetensors` file.
        /// Written under a temporary name and renamed into place.
        #[arg(long)]
        out: PathBuf,
        /// The dtype of the exported weights.
        #[arg(long, value_enum, default_value_t = ExportDtypeArg::Fp32)]
        dtype: ExportDtypeArg,
        /// Largest safetensors file of the export, in MiB; a larger model is split into shards.
        #[arg(long, default_value_t = 5 * 1024)]
        max_shard_mib: u64,
        /// One safetensors file of troupe's parameter names and layout instead of a Hugging Face directory.
        #[arg(long)]
        raw: bool,
        /// A LoRA checkpoint's adapters as a Hugging Face PEFT directory (`adapter_config.json` +
        /// `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(base, DIR)` loads.
        #[arg(long, conflicts_with_all = ["raw", "merge"])]
        adapters: bool,
        /// A `[peft]` checkpoint merged into its base (`W + s·B·A`; freeze: the trained modules) as a full
        /// Hugging Face model directory.
        #[arg(long, conflicts_with = "raw")]
        merge: bool,
        #[arg(long)]
        json: bool,
    },
}

/// What `checkpoint export` writes as a Hugging Face directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HfExport {
    /// The model (a checkpoint without `[peft]`).
    Model,
    /// A LoRA checkpoint's adapters (PEFT's format).
    Adapters,
    /// A `[peft]` checkpoint merged into its base.
    Merged,
}

pub fn run(command: CheckpointCommand) -> anyhow::Result<()> {
    match command {
        CheckpointCommand::List { root, verify, json } => list(&root, verify, json),
        CheckpointCommand::Verify { path, json } => verify_all(&path, json),
        CheckpointCommand::Reshard { src, shards, out, json } => reshard(&src, shards, &out, json),
        CheckpointCommand::Export { src, out, raw: true, json, .. } => export(&src, &out, json),
        CheckpointCommand::Export { src, out, dtype, max_shard_mib, raw: false, adapters, merge, json } => {
            let dtype = match dtype {
                ExportDtypeArg::Fp32 => ExportDtype::F32,
                ExportDtypeArg::Bf16 => ExportDtype::Bf16,
            };
            let what = match (adapters, merge) {
                (true, _) => HfExport::Adapters,
                (_, true) => HfExport::Merged,
                _ => HfExport::Model,
            };
            export_hf(&src, &out, what, ExportOptions { dtype, max_shard_bytes: max_shard_mib.max(1) << 20 }, json)
        }
    }
}

/// The checkpoint directories `path` names: itself if it holds a manifest, else every `step-*` under it.
fn checkpoints_at(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if !path.exists() {
        bail!("{}: no such file or directory; pass a checkpoint root (checkpoint.dir) or a step-NNNNNNNN directory inside one", path.display());
    }
    if path.join(MANIFEST).exists() {
        return Ok(vec![path.to_owned()]);
    }
    let dirs: Vec<PathBuf> = step_dirs(path).into_iter().map(|(_, dir)| dir).collect();
    if dirs.is_empty() {
        bail!("{}: no checkpoints here (neither a {MANIFEST} nor step-NNNNNNNN directories); pass a checkpoint root (checkpoint.dir) or a step directory", path.display());
    }
    Ok(dirs)
}

/// The one checkpoint `src` names: a step directory, or the newest valid one under a root.
pub(crate) fn source(src: &Path) -> anyhow::Result<PathBuf> {
    if src.join(MANIFEST).exists() {
        return Ok(src.to_owned());
    }
    checkpoints_at(src)?;
    let (latest, skipped) = latest_valid(src);
    for (dir, why) in &skipped {
        eprintln!("troupe: skipping {}: {why}", dir.display());
    }
    latest.with_context(|| format!("{}: no valid checkpoint (every one is torn or corrupt)", src.display()))
}

fn layout_text(layout: &Layout) -> String {
    let mode = match layout.shard_mode {
        ShardMode::Ddp => "ddp",
        ShardMode::Zero1 => "zero1",
        ShardMode::Zero2 => "zero2",
        ShardMode::Zero3 => "zero3",
    };
    format!("dp={} pp={} {mode}, {} shard(s)", layout.dp, layout.pp, layout.shards)
}

/// A periodically synchronizing job's part of a checkpoint, in words (empty without one).
fn periodic_text(manifest: &Manifest) -> String {
    match &manifest.periodic {
        Some(p) if p.outer_momentum.is_empty() => format!(" + {} ranks' inner state", p.ranks),
        Some(p) => format!(" + {} ranks' inner state, outer momentum", p.ranks),
        None => String::new(),
    }
}

/// Checks every file of `dir` against its manifest, advancing `bar` by each file's bytes.
fn verify_dir(dir: &Path, bar: Option<&ProgressBar>) -> Result<Manifest, String> {
    let manifest = read_manifest(dir).map_err(|e| e.to_string())?;
    for file in &manifest.files {
        read_verified(dir, &file.name, file.bytes, file.checksum).map_err(|e| e.to_string())?;
        if let Some(bar) = bar {
            bar.inc(file.bytes);
        }
    }
    Ok(manifest)
}

fn manifest_bytes(manifest: &Manifest) -> u64 {
    manifest.files.iter().map(|f| f.bytes).sum()
}

fn list(root: &Path, verify: bool, json: bool) -> anyhow::Result<()> {
    let dirs = checkpoints_at(root)?;
    let resume = latest_valid(root).0;
    let mut table = Table::new(&["step", "layout", "files", "size", "state", ""]);
    for dir in &dirs {
        let checked = if verify { verify_dir(dir, None) } else { read_manifest(dir).map_err(|e| e.to_string()) };
        let resumes = resume.as_deref() == Some(dir.as_path());
        if json {
            let mut line = json!({ "path": dir, "valid": checked.is_ok(), "resume_from": resumes, "verified": verify });
            match &checked {
                Ok(m) => {
                    line["step"] = json!(m.step);
                    line["layout"] = json!(m.layout);
                    line["version"] = json!(m.version);
                    if let Some(p) = &m.periodic {
                        line["periodic"] = json!({ "ranks": p.ranks, "outer_momentum": !p.outer_momentum.is_empty() });
                    }
                    line["files"] = json!(m.files.len());
                    line["bytes"] = json!(manifest_bytes(m));
                }
                Err(why) => line["error"] = json!(why),
            }
            println!("{line}");
            continue;
        }
        let name = dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let mark = if resumes { "← a job continues from here".to_string() } else { String::new() };
        match &checked {
            Ok(m) => table.row(vec![
                m.step.to_string(),
                layout_text(&m.layout) + &periodic_text(m),
                m.files.len().to_string(),
                format!("{:.1} MiB", manifest_bytes(m) as f64 / (1 << 20) as f64),
                if verify { "verified" } else { "manifest ok" }.into(),
                mark,
            ]),
            Err(why) => table.row(vec![name, "-".into(), "-".into(), "-".into(), format!("INVALID: {why}"), mark]),
        }
    }
    if !json {
        print!("{}", table.render());
    }
    Ok(())
}

fn verify_all(path: &Path, json: bool) -> anyhow::Result<()> {
    let dirs = checkpoints_at(path)?;
    let total: u64 = dirs.iter().filter_map(|d| read_manifest(d).ok()).map(|m| manifest_bytes(&m)).sum();
    let bar = bytes_bar(json, total, "verifying");
    let mut bad = Vec::new();
    for dir in &dirs {
        let t0 = Instant::now();
        let result = verify_dir(dir, bar.as_ref());
        let seconds = t0.elapsed().as_secs_f64();
        if json {
            let line = match &result {
                Ok(m) => {
                    json!({ "path": dir, "valid": true, "step": m.step, "bytes": manifest_bytes(m), "seconds": seconds })
                }
                Err(why) => json!({ "path": dir, "valid": false, "error": why }),
            };
            println!("{line}");
        } else {
            let line = match &result {
                Ok(m) => format!("ok       {} (step {}, {} files)", dir.display(), m.step, m.files.len()),
                Err(why) => format!("INVALID  {why}"),
            };
            match &bar {
                Some(bar) => bar.println(line),
                None => println!("{line}"),
            }
        }
        if let Err(why) = result {
            bad.push(why);
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if !bad.is_empty() {
        bail!(
            "{} of {} checkpoint(s) do not verify; a job skips them for the newest valid one (remove them, or restore the files from a copy)",
            bad.len(),
            dirs.len()
        );
    }
    Ok(())
}

fn reshard(src: &Path, shards: usize, out: &Path, json: bool) -> anyhow::Result<()> {
    if !(1..=troupe_model::config::RANKS_MAX).contains(&shards) {
        bail!("--shards {shards}: must be in 1..={}", troupe_model::config::RANKS_MAX);
    }
    let dir = source(src)?;
    let t0 = Instant::now();
    let state = load(&dir, json)?;
    let loaded = t0.elapsed().as_secs_f64();
    let store = CheckpointStore::open(out, 0).with_context(|| format!("--out {}", out.display()))?;
    let mib = state.bytes() as f64 / (1 << 20) as f64;
    let writing = spinner(json, format!("writing {mib:.1} MiB as {shards} shard(s) into {}", out.display()));
    let layout = Layout { dp: shards, pp: 1, shard_mode: ShardMode::Ddp, shards };
    let saved = store.save(&state, &layout).with_context(|| format!("writing into {}", out.display()))?;
    drop(writing);
    let verifying = bytes_bar(json, saved.bytes, "verifying");
    verify_dir(&saved.path, verifying.as_ref())
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("re-reading {}", saved.path.display()))?;
    drop(verifying);
    if json {
        println!(
            "{}",
            json!({ "event": "resharded", "from": dir, "to": saved.path, "step": saved.step, "shards": shards,
                    "bytes": saved.bytes, "load_seconds": loaded, "write_seconds": saved.seconds,
                    "kept_existing": saved.kept_existing })
        );
    } else if saved.kept_existing {
        println!("{} already holds a valid checkpoint of step {}; kept it", saved.path.display(), saved.step);
    } else {
        println!(
            "resharded step {} from {} into {} shard(s) at {} ({:.1} MiB; loaded in {loaded:.2} s, written and verified in {:.2} s)",
            saved.step,
            dir.display(),
            shards,
            saved.path.display(),
            saved.bytes as f64 / (1 << 20) as f64,
            t0.elapsed().as_secs_f64() - loaded
        );
    }
    Ok(())
}

/// Loads the whole state of the checkpoint `dir`, with a spinner saying so on a terminal.
fn load(dir: &Path, json: bool) -> anyhow::Result<troupe_model::checkpoint::TrainingState> {
    let bytes = read_manifest(dir).map(|m| manifest_bytes(&m)).unwrap_or(0);
    let _loading = spinner(json, format!("loading {} ({:.1} MiB)", dir.display(), bytes as f64 / (1 << 20) as f64));
    load_state(dir).with_context(|| format!("loading {}", dir.display()))
}

/// `--dtype` of `checkpoint export`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ExportDtypeArg {
    Fp32,
    Bf16,
}

/// `checkpoint export` to a Hugging Face directory: written into a hidden sibling, renamed into place.
fn export_hf(src: &Path, out: &Path, what: HfExport, options: ExportOptions, json: bool) -> anyhow::Result<()> {
    let dir = source(src)?;
    if out.exists() && std::fs::read_dir(out).map_or(true, |mut entries| entries.next().is_some()) {
        bail!(
            "--out {}: exists and is not an empty directory; choose a new directory (nothing was written)",
            out.display()
        );
    }
    let manifest = read_manifest(&dir).with_context(|| format!("reading the manifest of {}", dir.display()))?;
    let model = &manifest.config.model;
    check_exportable(&dir, what, model)?;
    let state = load(&dir, json)?;
    let offsets = state.offsets();
    let params = state.values(StateKind::Param);
    let values: Vec<Vec<f32>> = (0..state.tensors.len()).map(|i| params[offsets[i]..offsets[i + 1]].to_vec()).collect();
    let files = write_then_rename(out, json, |partial| {
        let written = match what {
            HfExport::Model => hf::export(model, &values, partial, options),
            HfExport::Adapters => hf::peft::export_adapters(model, &values, partial),
            HfExport::Merged => hf::peft::export_merged(model, &values, partial, options),
        };
        written
            .map_err(anyhow::Error::from)
            .and_then(|mut files| {
                if what != HfExport::Adapters {
                    files.extend(copy_tokenizer(manifest.config.data.tokenizer.as_deref(), partial)?);
                }
                Ok(files)
            })
            .with_context(|| format!("exporting {} to {}", dir.display(), out.display()))
    })?;
    print_exported((&dir, out), what, model, state.step, &files, json);
    Ok(())
}

/// Refuses an export the checkpoint `dir` of `model` has nothing for: a whole model of a `[peft]` one,
/// adapters or a merge of a full one, adapters of a freeze one.
fn check_exportable(dir: &Path, what: HfExport, model: &ModelConfig) -> anyhow::Result<()> {
    let lora = model.peft.as_ref().is_some_and(|p| p.method == troupe_model::model::peft::Method::Lora);
    match (what, &model.peft) {
        (HfExport::Model, Some(_)) => bail!(
            "{}: a [peft] checkpoint holds what trains, not the whole model; export it with --adapters (a Hugging \
             Face PEFT adapter directory) or --merge (the base with the trained part merged in, a full Hugging Face model) \
             (nothing was written)",
            dir.display()
        ),
        (HfExport::Adapters | HfExport::Merged, None) => bail!(
            "{}: not a [peft] checkpoint, so it has no adapters to export or merge; export the model without \
             --adapters and --merge (nothing was written)",
            dir.display()
        ),
        (HfExport::Adapters, Some(_)) if !lora => bail!(
            "{}: a [peft] method = \"freeze\" checkpoint has no adapters; export it with --merge (nothing was written)",
            dir.display()
        ),
        _ => Ok(()),
    }
}

/// Runs `write` on a hidden sibling of `out` (with a spinner), then renames the sibling to `out`
/// (replacing an empty directory there); a failed `write` leaves no sibling. Returns the files written.
fn write_then_rename(
    out: &Path,
    json: bool,
    write: impl FnOnce(&Path) -> anyhow::Result<Vec<String>>,
) -> anyhow::Result<Vec<String>> {
    let file_name = out.file_name().with_context(|| format!("--out {}: name a directory", out.display()))?;
    let partial = out.with_file_name(format!(".{}.partial", file_name.to_string_lossy()));
    let _ = std::fs::remove_dir_all(&partial);
    let writing: Option<Spinner> = spinner(json, format!("writing a Hugging Face directory {}", out.display()));
    let files = match write(&partial) {
        Ok(files) => files,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&partial);
            return Err(e);
        }
    };
    if out.exists() {
        std::fs::remove_dir(out).with_context(|| format!("replacing the empty directory {}", out.display()))?;
    }
    std::fs::rename(&partial, out).with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    drop(writing);
    Ok(files)
}

/// The export's event (`--json`) or line: what was exported from `dir` to `out`, and what loads it.
fn print_exported(
    (dir, out): (&Path, &Path),
    what: HfExport,
    model: &ModelConfig,
    step: u64,
    files: &[String],
    json: bool,
) {
    let bytes: u64 = files.iter().filter_map(|f| std::fs::metadata(out.join(f)).ok()).map(|m| m.len()).sum();
    if json {
        println!(
            "{}",
            json!({ "event": "exported", "from": dir, "to": out, "step": step,
                    "format": if what == HfExport::Adapters { "peft" } else { "huggingface" }, "merged": what == HfExport::Merged,
                    "arch": model.arch.as_str(), "files": files, "bytes": bytes })
        );
    } else {
        println!(
            "exported step {} ({} {}, {} files, {:.1} MiB) from {} to {} — {} loads it",
            step,
            model.arch.as_str(),
            match what {
                HfExport::Model => "model",
                HfExport::Adapters => "LoRA adapters",
                HfExport::Merged => "model, adapters merged",
            },
            files.len(),
            bytes as f64 / (1 << 20) as f64,
            dir.display(),
            out.display(),
            match what {
                HfExport::Adapters => "peft.PeftModel.from_pretrained(base, DIR)",
                _ => "AutoModelForCausalLM.from_pretrained",
            }
        );
    }
}

/// The job's tokenizer (`[data] tokenizer`) beside the exported model, as a Hugging Face directory holds
/// it: `tokenizer.json`, and the `tokenizer_config.json` and `special_tokens_map.json` beside it if there
/// are. Returns the files copied.
fn copy_tokenizer(tokenizer: Option<&Path>, out: &Path) -> anyhow::Result<Vec<String>> {
    let Some(tokenizer) = tokenizer else { return Ok(Vec::new()) };
    let mut copied = Vec::new();
    for (from, name) in [
        (tokenizer.to_owned(), "tokenizer.json"),
        (tokenizer.with_file_name("tokenizer_config.json"), "tokenizer_config.json"),
        (tokenizer.with_file_name("special_tokens_map.json"), "special_tokens_map.json"),
    ] {
        if name != "tokenizer.json" && !from.is_file() {
            continue;
        }
        std::fs::copy(&from, out.join(name)).with_context(|| {
            format!("copying the job's tokenizer {} (data.tokenizer) beside the model", from.display())
        })?;
        copied.push(name.to_owned());
    }
    Ok(copied)
}

fn export(src: &Path, out: &Path, json: bool) -> anyhow::Result<()> {
    let dir = source(src)?;
    let state = load(&dir, json)?;
    let offsets = state.offsets();
    let params = state.values(StateKind::Param);
    let tensors: Vec<FileTensor<'_>> = state
        .tensors
        .iter()
        .enumerate()
        .map(|(i, spec)| FileTensor {
            key: spec.name.clone(),
            shape: spec.shape.clone(),
            data: &params[offsets[i]..offsets[i + 1]],
        })
        .collect();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert("troupe_step".to_string(), state.step.to_string());
    let file_name = out.file_name().with_context(|| format!("--out {}: name a file", out.display()))?;
    let partial = out.with_file_name(format!(".{}.partial", file_name.to_string_lossy()));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let params_mib = params.len() as f64 * 4.0 / (1 << 20) as f64;
    let writing: Option<Spinner> =
        spinner(json, format!("writing {params_mib:.1} MiB of parameters to {}", out.display()));
    let written = match write_f32_file(&partial, &tensors, &metadata, threads) {
        Ok(written) => written,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e).with_context(|| format!("writing {}", partial.display()));
        }
    };
    std::fs::rename(&partial, out).with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    drop(writing);
    if json {
        println!(
            "{}",
            json!({ "event": "exported", "from": dir, "to": out, "step": state.step, "tensors": tensors.len(),
                    "bytes": written.bytes })
        );
    } else {
        println!(
            "exported the parameters of step {} ({} tensors, {:.1} MiB) from {} to {}",
            state.step,
            tensors.len(),
            written.bytes as f64 / (1 << 20) as f64,
            dir.display(),
            out.display()
        );
    }
    Ok(())
}
