//! The nemesis: real faults on the daemons of a local cluster — signals to their processes, bytes of
//! their checkpoints, the space of their disk. Each fault runs as its own task and reports what it did and
//! when; the run loop decides when to start it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::sync::{watch, Mutex};
use troupe_actors::api::LocalCluster;

use super::netns::Network;
use super::scenario::{Fault, FaultKind};

/// What the job looks like from the client: the last committed step and its world size.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    pub step: u64,
    pub world: usize,
}

/// One fault as injected.
#[derive(Clone, Debug)]
pub struct Injected {
    pub kind: FaultKind,
    /// The nodes hit (daemon names), in order.
    pub nodes: Vec<String>,
    pub at: Instant,
    /// When the fault ended: the process resumed, the disk freed, the node restarted. None: permanent.
    pub healed: Option<Instant>,
    /// The checkpoint file a corruption hit.
    pub corrupted: Option<PathBuf>,
    /// Set when the fault could not be applied as asked (the reason); the checker reports it.
    pub error: Option<String>,
    /// Part of the fault this machine could not apply, said in the report (e.g. no tc netem).
    pub note: Option<String>,
}

pub struct Nemesis {
    pub cluster: Arc<Mutex<LocalCluster>>,
    pub progress: watch::Receiver<Progress>,
    /// The newest checkpoint the job reported durable.
    pub latest_checkpoint: watch::Receiver<Option<PathBuf>>,
    /// The checkpoint directory when it sits on a tmpfs (for fill-disk).
    pub tmpfs: Option<PathBuf>,
    /// The world size with every node up.
    pub full_world: usize,
    pub bound: Duration,
    /// The daemons' network namespaces, for link faults.
    pub network: Option<Arc<Network>>,
}

impl Nemesis {
    /// Applies `fault` to `nodes` (indices chosen by the run from the seed).
    pub async fn apply(&self, fault: &Fault, nodes: &[usize]) -> Injected {
        let names = {
            let cluster = self.cluster.lock().await;
            nodes.iter().map(|&i| cluster.node_name(i)).collect()
        };
        let mut injected = Injected {
            kind: fault.kind,
            nodes: names,
            at: Instant::now(),
            healed: None,
            corrupted: None,
            error: None,
            note: None,
        };
        if let Err(e) = self.apply_inner(fault, nodes, &mut injected).await {
            injected.error = Some(format!("{e:#}"));
        }
        injected
    }

    async fn apply_inner(&self, fault: &Fault, nodes: &[usize], injected: &mut Injected) -> anyhow::Result<()> {
        match fault.kind {
            FaultKind::Kill => {
                for &i in nodes {
                    self.signal(i, "KILL").await?;
                }
                if let Some(after) = fault.return_after_s {
                    for &i in nodes {
                        self.wait_exit(i).await?;
                    }
                    tokio::time::sleep(Duration::from_secs_f64(after)).await;
                    let mut cluster = self.cluster.lock().await;
                    for &i in nodes {
                        // Blocks until the daemon listens (~1 s): off the async workers, whose queued tasks
                        // (the client's QUIC connection among them) must keep running.
                        tokio::task::block_in_place(|| cluster.restart_node(i))?;
                    }
                    injected.healed = Some(Instant::now());
                }
            }
            FaultKind::Pause => {
                for &i in nodes {
                    self.signal(i, "STOP").await?;
                }
                tokio::time::sleep(Duration::from_secs_f64(fault.duration_s)).await;
                for &i in nodes {
                    self.signal(i, "CONT").await?;
                }
                injected.healed = Some(Instant::now());
            }
            FaultKind::CorruptCheckpoint => {
                let latest = self.latest_checkpoint.borrow().clone();
                let dir = latest.context("the job has not reported a checkpoint yet; corrupt later (at_step)")?;
                injected.corrupted = Some(flip_a_byte(&dir, fault.at_step)?);
            }
            FaultKind::FillDisk => {
                let dir = self.tmpfs.clone().context("fill-disk needs the checkpoints on a tmpfs")?;
                let filler = dir.join(".chaos-filler");
                // Kept full for the whole duration: space the job frees (retention deleting an old
                // checkpoint) is taken again within milliseconds, else each new checkpoint could fit in
                // the space of the one retention just deleted and none would fail.
                let until = Instant::now() + Duration::from_secs_f64(fault.duration_s);
                while Instant::now() < until {
                    fill(&filler)?;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                std::fs::remove_file(&filler).with_context(|| format!("removing {}", filler.display()))?;
                injected.healed = Some(Instant::now());
            }
            FaultKind::Partition | FaultKind::FlakyLink => {
                let network = self.network.as_ref().context("link faults need the daemons in network namespaces")?;
                for &i in nodes {
                    if fault.kind == FaultKind::Partition {
                        network.partition(i, fault.one_way)?;
                    } else if let Some(missing) = network.degrade(i, fault.loss_percent, fault.delay_ms)? {
                        injected.note = Some(missing);
                    }
                }
                if fault.duration_s > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(fault.duration_s)).await;
                    for &i in nodes {
                        network.heal(i)?;
                    }
                    injected.healed = Some(Instant::now());
                }
            }
            FaultKind::RollingRestart => {
                for &i in nodes {
                    let before = self.progress.borrow().step;
                    self.signal(i, "TERM").await?;
                    self.wait_exit(i).await?;
                    let mut cluster = self.cluster.lock().await;
                    tokio::task::block_in_place(|| cluster.restart_node(i))?;
                    drop(cluster);
                    // The next node goes once the job committed a step on the whole cluster again.
                    self.wait_progress(|p| p.step > before && p.world == self.full_world)
                        .await
                        .with_context(|| format!("after restarting node {i}"))?;
                }
                injected.healed = Some(Instant::now());
            }
        }
        Ok(())
    }

    async fn signal(&self, i: usize, sig: &str) -> anyhow::Result<()> {
        let pid = self.cluster.lock().await.pid(i).with_context(|| format!("node {i} is not a process"))?;
        let status = std::process::Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status()?;
        if !status.success() {
            bail!("kill -{sig} {pid} (node {i}) failed");
        }
        Ok(())
    }

    async fn wait_exit(&self, i: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.bound;
        loop {
            if self.cluster.lock().await.wait_exit(i, Duration::from_millis(1)).is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("node {i} did not exit within {:?}", self.bound);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_progress(&self, done: impl Fn(&Progress) -> bool) -> anyhow::Result<()> {
        let mut progress = self.progress.clone();
        let outcome = tokio::time::timeout(self.bound * 2, progress.wait_for(|p| done(p))).await.map(|r| r.is_ok());
        match outcome {
            Ok(true) => Ok(()),
            Ok(false) => bail!("the job ended"),
            Err(_) => bail!("no step on {} ranks within {:?}", self.full_world, self.bound * 2),
        }
    }
}

/// Flips one byte in the largest file of checkpoint directory `dir` (a tensor file, not the manifest, so
/// only the checksum can tell); the offset is drawn from `salt`. Returns the file.
fn flip_a_byte(dir: &Path, salt: u64) -> anyhow::Result<PathBuf> {
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("reading checkpoint {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
        .collect();
    files.sort();
    let (len, file) = files.pop().with_context(|| format!("checkpoint {} is empty", dir.display()))?;
    let mut bytes = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    // Past the safetensors header, inside the tensor data.
    let offset = (len / 2 + salt.wrapping_mul(2_654_435_761) % (len / 4).max(1)) as usize;
    bytes[offset] ^= 0x5a;
    std::fs::write(&file, &bytes).with_context(|| format!("writing {}", file.display()))?;
    Ok(file)
}

/// Writes to `path` until the filesystem is full.
fn fill(path: &Path) -> anyhow::Result<()> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let block = vec![0u8; 64 << 10];
    loop {
        match file.write(&block) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("filling {}", path.display())),
        }
    }
}
