//! The nemesis: real faults on the daemons of a local cluster — signals to their processes, bytes of
//! their checkpoints, the space of their disk. Each fault runs as its own task and reports what it did and
//! when; the run loop decides when to start it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::sync::{watch, Mutex};
use troupe_actors::api::{Client, LocalCluster};
use troupe_cluster::NodeIdentity;

use super::link::LinkStats;
use super::netns::Network;
use super::scenario::{Fault, FaultKind, Target};

/// What the job looks like from the client: the last committed step and its world size.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    pub step: u64,
    pub world: usize,
    /// The view's epoch the step was committed at.
    pub epoch: u64,
}

/// One fault as injected.
#[derive(Clone, Debug)]
pub struct Injected {
    pub kind: FaultKind,
    /// The nodes hit (daemon names), in order.
    pub nodes: Vec<String>,
    /// Their indices in the cluster.
    pub indices: Vec<usize>,
    pub at: Instant,
    /// When the fault ended: the process resumed, the disk freed, the node restarted. None: permanent.
    pub healed: Option<Instant>,
    /// The checkpoint file a corruption hit.
    pub corrupted: Option<PathBuf>,
    /// Set when the fault could not be applied as asked (the reason); the checker reports it.
    pub error: Option<String>,
    /// How the fault was applied where there is a choice (link faults: tc netem or NFQUEUE).
    pub note: Option<String>,
    /// Link faults: what the link nemesis did, per node (filled when the links heal).
    pub links: Vec<LinkStats>,
    /// Pause with fencing observed: what the woken node said, and how many stale messages the
    /// controller refused while it was paused and after.
    pub fenced: Option<Fencing>,
    /// A fault on the controller (`node = "controller"`): who led before it, and after.
    pub takeover: Option<Takeover>,
}

impl Injected {
    /// A fault of `kind` on `nodes` (names) at cluster `indices`, started `at`; nothing healed or
    /// observed yet.
    pub fn new(kind: FaultKind, nodes: Vec<String>, indices: Vec<usize>, at: Instant) -> Self {
        Injected {
            kind,
            nodes,
            indices,
            at,
            healed: None,
            corrupted: None,
            error: None,
            note: None,
            links: Vec::new(),
            fenced: None,
            takeover: None,
        }
    }
}

/// The controller as the daemons name it: the Raft leader and its term (node 0 in term 0 with one
/// controller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    pub index: usize,
    pub name: String,
    pub term: u64,
}

/// What a fault on the controller did to the leadership.
#[derive(Clone, Debug)]
pub struct Takeover {
    /// The controller when the fault started (the node it hit).
    pub before: Leader,
    /// Replicated controllers: the next leader — another node, in a later term — once one was named
    /// (within the progress bound after the fault ended, or after a kill for good).
    pub after: Option<Leader>,
    /// The old leader's own record, once back (woken, reachable again), that it stepped down.
    pub stepped_down: Option<String>,
}

/// Evidence that a paused node was fenced when it woke.
#[derive(Clone, Debug)]
pub struct Fencing {
    /// The woken node's own record of its fence (from its status), if it recorded one in time.
    pub zombie_change: Option<String>,
    /// Messages the controller refused for their stale epoch since the pause began.
    pub refused_stale: u64,
}

/// How long the nemesis waits for a daemon's answer when it looks for the controller (a paused or
/// cut-off one never answers; a live one on this host within milliseconds, or a few hundred under load).
const ASK_MS: u64 = 500;

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
    /// Pause: ask the woken node and the controller whether it was fenced (the scenario expects it).
    pub observe_fencing: bool,
    /// Controller-eligible daemons (nodes `0..controllers`); 1: node 0 alone.
    pub controllers: usize,
    /// Daemons in the cluster.
    pub nodes: usize,
    /// The local cluster's client certificate, to ask daemons without holding the cluster's lock (a
    /// paused or cut-off daemon keeps a request waiting for its whole timeout).
    pub identity: NodeIdentity,
}

impl Nemesis {
    /// Applies `fault` to `nodes` (indices chosen by the run from the seed); a link nemesis draws its
    /// choices from `seed`.
    /// `node = "controller"` is resolved now: the leader the daemons name when the fault starts.
    pub async fn apply(&self, fault: &Fault, nodes: &[usize], seed: u64) -> Injected {
        let mut takeover = None;
        let nodes: Vec<usize> = match fault.node {
            Target::Controller => match self.controller().await {
                Some(leader) => {
                    let index = leader.index;
                    takeover = Some(Takeover { before: leader, after: None, stepped_down: None });
                    vec![index]
                }
                None => {
                    let mut injected = Injected::new(fault.kind, Vec::new(), Vec::new(), Instant::now());
                    injected.error = Some("no daemon named a controller when the fault was due".into());
                    return injected;
                }
            },
            _ => nodes.to_vec(),
        };
        let names = {
            let cluster = self.cluster.lock().await;
            nodes.iter().map(|&i| cluster.node_name(i)).collect()
        };
        let mut injected = Injected::new(fault.kind, names, nodes.clone(), Instant::now());
        if let Err(e) = self.apply_inner(fault, &nodes, seed, &mut injected).await {
            injected.error = Some(format!("{e:#}"));
        }
        if let Some(mut takeover) = takeover {
            if self.controllers >= 3 && injected.error.is_none() {
                takeover.after = self.next_leader(&takeover.before).await;
                let back = injected.healed.is_some() && fault.kind != FaultKind::Kill;
                if back {
                    takeover.stepped_down =
                        self.wait_change(takeover.before.index, "is no longer the controller").await;
                }
            }
            injected.takeover = Some(takeover);
        }
        injected
    }

    /// The controller now: the Raft leader that says so itself (`troupe cluster controllers` asked of
    /// every daemon at once, [`ASK_MS`] each), in the highest term if two do (a woken old leader may not
    /// know yet); node 0 with one controller. None: no daemon that answered leads (an election).
    pub async fn controller(&self) -> Option<Leader> {
        if self.controllers < 2 {
            return Some(Leader { index: 0, name: self.cluster.lock().await.node_name(0), term: 0 });
        }
        let asks = (0..self.nodes).map(|i| async move {
            let asked = async { anyhow::Ok(self.connect(i).await?.controllers().await?) };
            let status = tokio::time::timeout(Duration::from_millis(ASK_MS), asked).await.ok()?.ok()?;
            (status.leader.as_deref() == Some(status.node.as_str())).then_some((i, status))
        });
        let leading = all(asks.collect()).await.into_iter().flatten().max_by_key(|(_, s)| s.term)?;
        let (index, status) = leading;
        Some(Leader { index, name: status.node, term: status.term })
    }

    /// The highest view epoch any daemon that answers acts on.
    async fn max_epoch(&self) -> u64 {
        let asks = (0..self.nodes).map(|i| async move {
            let asked = async { anyhow::Ok(self.connect(i).await?.status().await?) };
            tokio::time::timeout(Duration::from_millis(ASK_MS), asked).await.ok()?.ok().map(|s| s.epoch)
        });
        all(asks.collect()).await.into_iter().flatten().max().unwrap_or(0)
    }

    /// Waits (up to twice the progress bound) until the controller's view, of an epoch past `past`,
    /// has node `i` as a member; that epoch.
    async fn wait_member(&self, i: usize, past: u64) -> anyhow::Result<u64> {
        let name = self.cluster.lock().await.node_name(i);
        let deadline = Instant::now() + self.bound * 2;
        while Instant::now() < deadline {
            if let Some(leader) = self.controller().await {
                let asked = async { anyhow::Ok(self.connect(leader.index).await?.status().await?) };
                if let Ok(Ok(status)) = tokio::time::timeout(Duration::from_millis(ASK_MS), asked).await {
                    if status.controller && status.epoch > past && status.members.iter().any(|m| m.name == name) {
                        return Ok(status.epoch);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("the controller's view did not have {name} back within {:?}", self.bound * 2)
    }

    /// A client of daemon `i` (its address read under the cluster's lock, the connection made without it).
    pub async fn connect(&self, i: usize) -> anyhow::Result<Client> {
        Ok(Client::connect(self.node_addr(i).await?, &self.identity).await?)
    }

    /// Node `i`'s control address.
    pub async fn node_addr(&self, i: usize) -> anyhow::Result<std::net::SocketAddr> {
        self.cluster.lock().await.node_addr(i).with_context(|| format!("no node {i}"))
    }

    /// Waits (up to the progress bound) for the daemons to name a leader other than `old`, in a later
    /// term.
    async fn next_leader(&self, old: &Leader) -> Option<Leader> {
        let deadline = Instant::now() + self.bound;
        while Instant::now() < deadline {
            if let Some(leader) = self.controller().await.filter(|l| l.name != old.name && l.term > old.term) {
                return Some(leader);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    }

    async fn apply_inner(
        &self,
        fault: &Fault,
        nodes: &[usize],
        seed: u64,
        injected: &mut Injected,
    ) -> anyhow::Result<()> {
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
                let refused_before = if self.observe_fencing { self.refused_stale().await? } else { 0 };
                for &i in nodes {
                    self.signal(i, "STOP").await?;
                }
                tokio::time::sleep(Duration::from_secs_f64(fault.duration_s)).await;
                for &i in nodes {
                    self.signal(i, "CONT").await?;
                }
                injected.healed = Some(Instant::now());
                if self.observe_fencing {
                    let mut zombie_change = None;
                    for &i in nodes {
                        zombie_change = self.wait_change(i, "was fenced").await;
                    }
                    let refused_stale = self.refused_stale().await?.saturating_sub(refused_before);
                    injected.fenced = Some(Fencing { zombie_change, refused_stale });
                }
            }
            FaultKind::CorruptCheckpoint => {
                // The step the fault is due at may come before the first checkpoint is durable (a slow
                // disk: the writer runs behind the steps); the newest one is corrupted once there is one.
                let mut latest = self.latest_checkpoint.clone();
                let reported = tokio::time::timeout(self.bound, latest.wait_for(Option::is_some)).await;
                let dir = match reported {
                    Ok(Ok(dir)) => dir.clone().expect("waited for a checkpoint"),
                    _ => {
                        bail!("the job reported no checkpoint within {:?}; corrupt later (at_step or at_s)", self.bound)
                    }
                };
                injected.corrupted = Some(flip_a_byte(&dir, seed)?);
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
            FaultKind::Partition | FaultKind::FlakyLink | FaultKind::Reorder => {
                let network = self.network.as_ref().context("link faults need the daemons in network namespaces")?;
                for (n, &i) in nodes.iter().enumerate() {
                    if fault.kind == FaultKind::Partition {
                        network.partition(i, fault.one_way)?;
                    } else {
                        let how = network.degrade(i, &fault.link_shape(), seed.wrapping_add(n as u64))?;
                        injected.note = Some(format!("links degraded with {how}"));
                    }
                }
                if fault.duration_s > 0.0 {
                    tokio::time::sleep(Duration::from_secs_f64(fault.duration_s)).await;
                    for &i in nodes {
                        injected.links.extend(network.heal(i)?);
                    }
                    injected.healed = Some(Instant::now());
                }
            }
            FaultKind::RollingRestart => {
                for &i in nodes {
                    let before = self.progress.borrow().step;
                    self.signal(i, "TERM").await?;
                    self.wait_exit(i).await?;
                    let gone_at = if self.controllers > 1 { self.max_epoch().await } else { 0 };
                    let mut cluster = self.cluster.lock().await;
                    tokio::task::block_in_place(|| cluster.restart_node(i))?;
                    drop(cluster);
                    // The next node goes once the job committed a step on the whole cluster again.
                    let after = format!("after restarting node {i}");
                    if self.controllers > 1 {
                        // The client's events may lag (picked up again at a new leader, replayed): the
                        // step must be of a view that has the restarted node back, asked of the controller.
                        let epoch = self.wait_member(i, gone_at).await.context(after.clone())?;
                        self.wait_progress(|p| p.epoch >= epoch && p.world == self.full_world).await.context(after)?;
                    } else {
                        self.wait_progress(|p| p.step > before && p.world == self.full_world).await.context(after)?;
                    }
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

    /// Messages the controller refused for a stale epoch so far.
    async fn refused_stale(&self) -> anyhow::Result<u64> {
        let controller = self.controller().await.context("no daemon names a controller")?;
        let status = async { anyhow::Ok(self.connect(controller.index).await?.status().await?) };
        let status = tokio::time::timeout(Duration::from_secs(5), status)
            .await
            .context("the controller's status did not come within 5 s")?
            .context("asking the controller for its status")?;
        Ok(status.refused_stale)
    }

    /// Waits (up to the progress bound) for node `i`, back from a fault, to record a change containing
    /// `needle` (that it was fenced, that it is no longer the controller); the record.
    async fn wait_change(&self, i: usize, needle: &str) -> Option<String> {
        let deadline = Instant::now() + self.bound;
        while Instant::now() < deadline {
            let status = async { anyhow::Ok(self.connect(i).await?.status().await?) };
            let status = tokio::time::timeout(Duration::from_secs(2), status).await;
            if let Ok(Ok(status)) = status {
                if let Some(c) = status.changes.iter().rev().find(|c| c.contains(needle)) {
                    return Some(c.clone());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
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

/// Runs `futures` together (on this task); their outputs, in order.
async fn all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    use std::task::Poll;
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()).filter(|(_, o)| o.is_none()) {
            match future.as_mut().poll(cx) {
                Poll::Ready(value) => *output = Some(value),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(|o| o.expect("every future finished")).collect()
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
