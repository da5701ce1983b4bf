//! Running the PyTorch Gloo all-reduce peer (bench/peers/gloo_allreduce.py) for a side-by-side figure.

use std::path::Path;
use std::process::Command;

use anyhow::Context;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerReport {
    pub name: String,
    pub world: usize,
    pub mib: usize,
    #[serde(rename = "busbw_GBps")]
    pub busbw_gbps: f64,
    pub seconds_per_iter: f64,
}

pub fn run_gloo_peer(
    python: &Path,
    script: &Path,
    world: usize,
    mib: usize,
    iters: usize,
    warmup: usize,
) -> anyhow::Result<PeerReport> {
    let out = Command::new(python)
        .arg(script)
        .args([
            "--world",
            &world.to_string(),
            "--mib",
            &mib.to_string(),
            "--iters",
            &iters.to_string(),
            "--warmup",
            &warmup.to_string(),
            "--json",
        ])
        .output()
        .with_context(|| {
            format!(
                "running {} {} (set TROUPE_TORCH_PYTHON to a python with torch)",
                python.display(),
                script.display()
            )
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        anyhow::bail!("gloo peer failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("gloo peer printed no JSON")?;
    Ok(serde_json::from_str(line)?)
}
