//! Helpers for the tests that run daemons as real processes on loopback.
#![allow(dead_code)]

use std::future::Future;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use troupe_actors::api::{ClusterStatus, LocalCluster, LocalClusterOptions};

/// The final parameters rank 0 saved at `path` (`--save-final`), in `reference`'s parameter order.
pub fn saved_params(path: &Path, reference: &troupe_model::Trainer) -> Vec<tch::Tensor> {
    let mut saved = tch::Tensor::read_safetensors(path).unwrap();
    reference
        .model
        .named_params()
        .map(|(name, _)| {
            let i = saved.iter().position(|(n, _)| n == name).unwrap_or_else(|| panic!("{name} not saved"));
            saved.swap_remove(i).1
        })
        .collect()
}

/// The `troupe` binary: `TROUPE_BIN` when set (a test binary carried to another machine, as
/// scripts/gpu-check.sh does), else the one cargo built beside this test.
pub fn binary() -> &'static Path {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| std::env::var_os("TROUPE_BIN").map_or_else(|| env!("CARGO_BIN_EXE_troupe").into(), Into::into))
}

/// A cluster of `n` daemon processes with one slot and one torch thread each.
pub async fn processes(n: usize) -> LocalCluster {
    let mut options = LocalClusterOptions::new(n);
    options.torch_threads = 1;
    LocalCluster::processes(binary(), options).await.expect("local cluster starts")
}

/// Waits for `child` to exit; after `timeout` it is killed and the test fails, naming `what`.
pub fn wait_child(child: &mut std::process::Child, timeout: Duration, what: &str) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} (pid {}) still running after {timeout:?}; killed it", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().expect("kill runs");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// Status of daemon `i` as it sees the cluster.
pub async fn status(cluster: &LocalCluster, i: usize) -> ClusterStatus {
    let mut client = cluster.client_to(i).await.expect("connects");
    let status = client.status().await.expect("status");
    client.close().await;
    status
}

pub fn names(status: &ClusterStatus) -> Vec<String> {
    status.members.iter().map(|m| m.name.clone()).collect()
}

/// Polls `check` until it returns Some, or panics after `timeout` with `what`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let t0 = Instant::now();
    loop {
        if let Some(v) = check().await {
            return (v, t0.elapsed());
        }
        assert!(t0.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until every daemon in `nodes` sees exactly the members `expected`, all at one epoch; returns it.
pub async fn converged(cluster: &LocalCluster, nodes: &[usize], expected: &[&str], timeout: Duration) -> u64 {
    let (epoch, _) = wait_for(timeout, &format!("nodes {nodes:?} to see members {expected:?}"), || async {
        let mut epochs = Vec::new();
        for &i in nodes {
            let s = status(cluster, i).await;
            if names(&s) != expected {
                return None;
            }
            epochs.push(s.epoch);
        }
        epochs.windows(2).all(|w| w[0] == w[1]).then(|| epochs[0])
    })
    .await;
    epoch
}

/// A job of two blocks (d_model 128, context 64), batch 8 in micro-batches of 4, warm-up 2 steps, 1
/// torch thread: small enough for several daemon processes on two shared cores, large enough that a
/// drift from the reference shows.
pub fn two_block_job(steps: u64) -> troupe_model::config::JobConfig {
    let mut config = troupe_model::config::JobConfig::default();
    config.model.n_layers = 2;
    config.model.d_model = 128;
    config.model.context = 64;
    config.train.steps = steps;
    config.train.global_batch = 8;
    config.train.micro_batch = 4;
    config.train.warmup_steps = 2;
    config.train.torch_threads = 1;
    config
}

/// `config` with Adafactor: HF's defaults (a relative step scaled by the parameter's RMS, no decay), or
/// with `first_moment` a first moment (`beta1` 0.9), the schedule's rate and weight decay 0.01.
pub fn with_adafactor(
    mut config: troupe_model::config::JobConfig,
    first_moment: bool,
) -> troupe_model::config::JobConfig {
    config.train.optimizer = "adafactor".into();
    if first_moment {
        config.train.adafactor.beta1 = Some(0.9);
        config.train.adafactor.relative_step = false;
        config.train.adafactor.weight_decay = 0.01;
    }
    config
}
