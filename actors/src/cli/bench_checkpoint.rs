//! `troupe bench checkpoint`: checkpoint write throughput beside `dd` of the same bytes to the same
//! directory in the same run (bench/peers/dd_write.sh), and the step loop's share of an asynchronous save
//! — the host-memory snapshot — as a fraction of a gpt-tiny training step.
//!
//! Writes are timed from the first byte to the catalog commit (shards fsynced, manifest fsynced, rename,
//! directory fsyncs, catalog transaction), each repetition alternating with the peer so disk-cache and
//! machine drift hit both; medians are reported, with and without the catalog transaction (a fixed cost
//! of a few fsyncs that weighs on small checkpoints). With `--json`, one JSON object per line: a `write`
//! figure per (state, shards), a `snapshot` figure, then `{"event":"summary", ...}` with the target ratios.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_model::checkpoint::{synthetic_state, CheckpointStore, Layout, RedbCatalog, TrainingState};
use troupe_model::config::JobConfig;
use troupe_model::{ModelConfig, Trainer};

use super::bench_train::peer_script;

#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    /// One JSON object per line instead of plain lines.
    #[arg(long)]
    pub json: bool,
    /// Directory to write in (the disk under test); default: a temporary directory in the current one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Repetitions of each write (and of dd); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Shard counts to write each state with.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub shards: Vec<usize>,
    /// Skip the ~200 MB state.
    #[arg(long)]
    pub skip_large: bool,
    /// Training steps timed for the snapshot overhead (median).
    #[arg(long, default_value_t = 5)]
    pub steps: u64,
}

/// A state of about 200 MB (16.2M parameters × 3 f32 states): gpt-tiny's shape scaled to d_model 384 and
/// 9 blocks.
fn large_config() -> JobConfig {
    JobConfig {
        model: ModelConfig { d_model: 384, n_layers: 9, n_heads: 6, ..ModelConfig::gpt_tiny() },
        ..JobConfig::default()
    }
}

pub fn run(args: CheckpointArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repeats > 0 && args.steps > 0, "--repeats and --steps must be at least 1");
    anyhow::ensure!(args.shards.iter().all(|&s| s > 0), "--shards: every count must be at least 1");
    let scratch = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("--dir {}", dir.display()))?;
            tempfile::tempdir_in(dir)
        }
        None => tempfile::tempdir_in("."),
    }
    .context("creating a scratch directory for the benchmark (pass --dir on a writable disk)")?;
    let print = |value: Value, text: String| {
        if args.json {
            println!("{value}");
        } else {
            println!("{text}");
        }
    };
    let (tiny, fraction) = bench_snapshot(args.steps, &print)?;
    let mut states = vec![("gpt-tiny", tiny)];
    if !args.skip_large {
        states.push(("large", synthetic_state(&large_config(), 1)));
    }
    let mut worst_ratio = f64::INFINITY;
    for (name, state) in &states {
        for &shards in &args.shards {
            let ratio = bench_write(&args, scratch.path(), (name, state), shards, &print)?;
            worst_ratio = worst_ratio.min(ratio);
        }
    }
    print(
        json!({ "event": "summary", "worst_write_vs_dd": worst_ratio, "snapshot_fraction": fraction,
                "dir": scratch.path() }),
        format!("summary: worst write {worst_ratio:.2}× dd; snapshot {:.2}% of a step", fraction * 100.0),
    );
    Ok(())
}

/// The snapshot: gpt-tiny trained for real, its snapshot timed against its own training step (the median
/// of `steps`), printed. Returns a snapshot of its state and the snapshot's fraction of a step.
fn bench_snapshot(steps: u64, print: &dyn Fn(Value, String)) -> anyhow::Result<(TrainingState, f64)> {
    let threads = troupe_model::trainer::configure_torch_threads(0, 1);
    let mut trainer = Trainer::new(JobConfig::default())?;
    trainer.train_step(); // warm-up (allocations, first-touch)
    let step_s = median(
        (0..steps)
            .map(|_| {
                timed(|| {
                    trainer.train_step();
                })
            })
            .collect(),
    );
    let fresh_s = median((0..steps).map(|_| timed(|| drop(TrainingState::snapshot(&trainer)))).collect());
    // What the worker does: refresh the snapshot the writer handed back.
    let mut spare = TrainingState::snapshot(&trainer);
    let snapshot_s = median((0..steps).map(|_| timed(|| spare.refresh(&trainer))).collect());
    let fraction = snapshot_s / step_s;
    print(
        json!({ "event": "snapshot", "state": "gpt-tiny", "bytes": TrainingState::snapshot(&trainer).bytes(),
                "snapshot_s": snapshot_s, "fresh_snapshot_s": fresh_s, "step_s": step_s,
                "snapshot_fraction": fraction, "torch_threads": threads }),
        format!(
            "snapshot of gpt-tiny's state: {:.2} ms into recycled buffers ({:.2} ms fresh), a training step {:.0} ms: {:.2}% of a step (target ≤ 3%)",
            snapshot_s * 1e3,
            fresh_s * 1e3,
            step_s * 1e3,
            fraction * 100.0
        ),
    );
    Ok((TrainingState::snapshot(&trainer), fraction))
}

/// Writes `state` in `shards` shards under `scratch` `--repeats` times, each beside dd writing as many
/// bytes, and prints the medians. Returns troupe's write throughput over dd's.
fn bench_write(
    args: &CheckpointArgs,
    scratch: &Path,
    (name, state): (&str, &TrainingState),
    shards: usize,
    print: &dyn Fn(Value, String),
) -> anyhow::Result<f64> {
    let (mut troupe, mut files, mut peer) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0;
    for r in 0..args.repeats {
        let root = scratch.join(format!("{name}-{shards}-{r}"));
        let store = CheckpointStore::with_catalog(&root, 0, Arc::new(RedbCatalog::at_root(&root)))?;
        let t0 = Instant::now();
        let saved = store.save(state, &Layout::ddp(shards))?;
        let seconds = t0.elapsed().as_secs_f64();
        troupe.push(seconds);
        files.push(seconds - saved.catalog_seconds);
        bytes = saved.bytes;
        std::fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
        peer.push(dd_write(scratch, bytes)?);
    }
    let (troupe_s, files_s, dd_s) = (median(troupe), median(files), median(peer));
    let (mbps, dd_mbps) = (bytes as f64 / troupe_s / 1e6, bytes as f64 / dd_s / 1e6);
    let ratio = mbps / dd_mbps;
    let files_ratio = dd_s / files_s;
    print(
        json!({ "event": "write", "state": name, "bytes": bytes, "shards": shards, "seconds": troupe_s,
                "MBps": mbps, "dd_seconds": dd_s, "dd_MBps": dd_mbps, "vs_dd": ratio,
                "without_catalog_seconds": files_s, "without_catalog_vs_dd": files_ratio }),
        format!(
            "write {name} ({:.1} MB) in {shards} shard(s): {mbps:.0} MB/s, dd {dd_mbps:.0} MB/s: {ratio:.2}× dd (target ≥ 0.8×; {files_ratio:.2}× without the catalog commit)",
            bytes as f64 / 1e6
        ),
    );
    Ok(ratio)
}

/// Seconds `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let t0 = Instant::now();
    f();
    t0.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// bench/peers/dd_write.sh: seconds dd takes to write (and fsync) `bytes` bytes in `dir`.
fn dd_write(dir: &Path, bytes: u64) -> anyhow::Result<f64> {
    let script = peer_script("dd_write.sh")?;
    let output = Command::new("bash")
        .arg(&script)
        .arg(dir)
        .arg(bytes.to_string())
        .output()
        .with_context(|| format!("running the peer {}", script.display()))?;
    if !output.status.success() {
        bail!("peer {} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let value: Value = serde_json::from_str(line).with_context(|| format!("peer printed {line:?}, not JSON"))?;
    let seconds = value["seconds"].as_f64().with_context(|| format!("peer printed no seconds: {line}"))?;
    // dd writes whole 8 MiB blocks: scale to the same byte count.
    let written = value["bytes"].as_f64().unwrap_or(bytes as f64).max(1.0);
    Ok(seconds * bytes as f64 / written)
}
