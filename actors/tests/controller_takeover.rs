//! The replicated controller end to end (issue 32): three `troupe daemon` processes, all three
//! controller-eligible (node.toml `controllers`), a DDP job training on all three. The Raft leader is
//! the controller; SIGKILLing its process for good leaves the other two to elect a new leader, which
//! restores the job from the replicated catalog and resumes it from the survivors' memory: the job
//! finishes, every step's loss and the final parameters equal the single-process reference (the
//! oracle, DESIGN.md §4). The job's submitter (a `JobHandle` given every daemon's address) and a
//! `troupe job watch` started before the kill follow the controller across the take-over and see every
//! event of the job's log once, in order. A leader paused past the election timeout (SIGSTOP) comes back
//! (SIGCONT) as a member: it no longer acts as the controller, and no step is committed twice.
//! The controllers changed at run time (`troupe cluster controllers add|remove`): two members added as
//! voters keep a majority past the loss of two of the first three; removing the leader hands over;
//! bad changes are refused with nothing changed.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use troupe_actors::api::{Client, ClusterStatus, DataPlane, Job, JobEvent, JobHandle};
use troupe_actors::daemon::Daemon;
use troupe_actors::node_config::NodeConfig;
use troupe_actors::protocol::ControllersStatus;
use troupe_cluster::{add_node, init_cluster, NodeIdentity};
use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};

const TOLERANCE: f64 = 1e-5;
const NODES: usize = 3;

/// The reference's per-step losses, and the final parameters compared with those saved at `out`.
fn check(config: &JobConfig, losses: &[f64], out: &Path) {
    tch::set_num_threads(1);
    let mut trainer = troupe_model::Trainer::new(config.clone()).unwrap();
    let ref_losses: Vec<f64> = (0..config.train.steps).map(|_| trainer.train_step().loss).collect();
    assert_eq!(losses.len(), ref_losses.len(), "one committed loss per step");
    let loss_diff = worst_loss_diff(losses, &ref_losses);
    let params = common::saved_params(out, &trainer);
    let comparison = compare_params(trainer.model.specs(), &params, &trainer.param_values());
    eprintln!("loss diff {loss_diff:.1e}, params {comparison:?}");
    assert!(loss_diff <= TOLERANCE, "losses differ by {loss_diff:e}");
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Three controller-eligible daemon processes on loopback.
struct Controllers {
    dir: tempfile::TempDir,
    children: Vec<Child>,
    addrs: Vec<SocketAddr>,
    /// The submitter's certificate; the watchers' and the CLI's have names of their own (a daemon sends a
    /// client's replies and events to the peer of that name: two clients of one name at once would take
    /// each other's).
    client: NodeIdentity,
    watcher: NodeIdentity,
    /// The node.toml line listing the three controllers.
    controllers: String,
}

impl Controllers {
    fn start() -> Controllers {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        init_cluster(&certs).unwrap();
        for i in 0..NODES {
            add_node(&format!("node-{i}"), &certs).unwrap();
        }
        for name in ["client", "watcher", "cli", "admin"] {
            add_node(name, &certs).unwrap();
        }
        let client = NodeIdentity::load(&certs, "client").unwrap();
        let watcher = NodeIdentity::load(&certs, "watcher").unwrap();
        let entries: Vec<String> = (0..NODES).map(|i| format!("\"node-{i}@127.0.0.1:{}\"", free_udp_port())).collect();
        let controllers = format!("controllers = [{}]\n", entries.join(", "));
        let (mut children, mut addrs) = (Vec::new(), Vec::new());
        for i in 0..NODES {
            let (child, addr) = spawn(dir.path(), &certs, i, &format!("slots = 1\n{controllers}"));
            children.push(child);
            addrs.push(addr);
        }
        Controllers { dir, children, addrs, client, watcher, controllers }
    }

    /// Starts daemon `node-{i}` (i ≥ 3), not a controller, joining node-0, with no slots (the job keeps
    /// the three controllers' ranks) and its Raft endpoint at the returned address (`raft_listen`), so
    /// that it can be made a controller at run time.
    fn spawn_standby(&mut self, i: usize) -> SocketAddr {
        let raft: SocketAddr = format!("127.0.0.1:{}", free_udp_port()).parse().unwrap();
        self.spawn_member(i, &format!("raft_listen = \"{raft}\"\n"));
        raft
    }

    /// Starts daemon `node-{i}` (i ≥ 3; again if it ran), not a controller, joining node-0, with no slots
    /// and the node.toml lines `extra`.
    fn spawn_member(&mut self, i: usize, extra: &str) {
        let certs = self.dir.path().join("certs");
        if !certs.join("nodes").join(format!("node-{i}.pem")).exists() {
            add_node(&format!("node-{i}"), &certs).unwrap();
        }
        let extra = format!("slots = 0\njoin = \"{}\"\n{extra}{}", self.addrs[0], self.controllers);
        let (child, addr) = spawn(self.dir.path(), &certs, i, &extra);
        if i < self.children.len() {
            (self.children[i], self.addrs[i]) = (child, addr);
        } else {
            self.children.push(child);
            self.addrs.push(addr);
        }
    }

    async fn status(&self, i: usize) -> Option<ClusterStatus> {
        let mut client = Client::connect(self.addrs[i], &self.watcher).await.ok()?;
        let status = client.status().await.ok();
        client.close().await;
        status
    }

    /// Waits until one node of `alive` is the controller with every node of `alive` in its view, and
    /// every other node of `alive` says it is not the controller; gives the controller's index.
    async fn leader_of(&self, alive: &[usize], within: Duration) -> usize {
        let t0 = Instant::now();
        loop {
            let mut leaders = Vec::new();
            for &i in alive {
                if let Some(s) = self.status(i).await.filter(|s| s.controller) {
                    leaders.push((i, s.members.len()));
                }
            }
            if let [(leader, members)] = leaders[..] {
                if members == alive.len() {
                    return leader;
                }
            }
            assert!(t0.elapsed() < within, "no single controller of {alive:?} within {within:?}: {leaders:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Follows `job` from event `since` through any live daemon of `alive` (redirected to the
    /// controller), retrying while an election is under way.
    async fn watch(&self, alive: &[usize], job: u64, since: u64, within: Duration) -> JobHandle {
        let t0 = Instant::now();
        loop {
            for &i in alive {
                // A redirect to a controller that just died would wait for the connect timeout.
                let tried = tokio::time::timeout(Duration::from_secs(1), async {
                    Client::connect(self.addrs[i], &self.watcher).await?.watch_from(job, since).await
                });
                match tried.await {
                    Ok(Ok(handle)) => return handle,
                    Ok(Err(e)) => eprintln!("watching job {job} through node-{i}: {e}"),
                    Err(_) => eprintln!("watching job {job} through node-{i}: no answer within 1 s"),
                }
            }
            assert!(t0.elapsed() < within, "no controller answered for job {job} within {within:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `troupe cluster controllers --json` asked of daemon `i`.
    fn controllers_cli(&self, i: usize) -> ControllersStatus {
        self.change_controllers(&[i], &[]).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `troupe cluster controllers [change…] --json` given the daemons `at`: the group the leader answers
    /// after the change, or the command's error output.
    fn change_controllers(&self, at: &[usize], change: &[&str]) -> Result<ControllersStatus, String> {
        let addrs: Vec<String> = at.iter().map(|&i| self.addrs[i].to_string()).collect();
        let out = Command::new(common::binary())
            .args(["cluster", "controllers"])
            .args(change)
            .args(["--json", "--as", "admin", "--cluster", &addrs.join(",")])
            .arg("--certs")
            .arg(self.dir.path().join("certs"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{stdout}: {e}")))
    }

    /// The whole event log of `job` (ended), replayed from event 0 by the controller among `alive`.
    async fn replay(&self, alive: &[usize], job: u64) -> Vec<JobEvent> {
        let mut handle = self.watch(alive, job, 0, Duration::from_secs(30)).await;
        let mut log = Vec::new();
        while let Some((seq, event)) = handle.next_numbered().await.unwrap() {
            assert_eq!(seq, log.len() as u64);
            log.push(event);
        }
        log
    }

    /// `troupe job watch JOB --from 0 --json`, given every daemon's address; returns once it printed a
    /// step (it is following the job).
    fn watch_cli(&self, job: u64) -> CliWatcher {
        let addrs: Vec<String> = self.addrs.iter().map(SocketAddr::to_string).collect();
        let mut child = Command::new(common::binary())
            .args(["job", "watch", &job.to_string(), "--from", "0", "--json", "--as", "cli", "--cluster"])
            .arg(addrs.join(","))
            .arg("--certs")
            .arg(self.dir.path().join("certs"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || stdout.lines().map_while(Result::ok).try_for_each(|l| tx.send(l)));
        let mut watcher = CliWatcher { child, lines, steps: Vec::new() };
        while watcher.steps.is_empty() {
            let line = watcher.lines.recv_timeout(Duration::from_secs(30)).expect("`troupe job watch` prints steps");
            watcher.read(&line);
        }
        watcher
    }

    fn log(&self) -> String {
        (0..self.children.len())
            .map(|i| std::fs::read_to_string(self.dir.path().join(format!("node-{i}.log"))).unwrap_or_default())
            .collect()
    }
}

impl Drop for Controllers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A `troupe job watch --json` process and the steps it printed.
struct CliWatcher {
    child: Child,
    lines: mpsc::Receiver<String>,
    steps: Vec<u64>,
}

impl CliWatcher {
    fn read(&mut self, line: &str) {
        let value: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        if value["event"] == "step" {
            self.steps.push(value["step"].as_u64().unwrap());
        }
    }

    /// Waits for it to exit (successfully: the job finished) and gives the steps it printed.
    fn finish(mut self) -> Vec<u64> {
        let status = common::wait_child(&mut self.child, Duration::from_secs(60), "troupe job watch");
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut self.child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(status.success(), "troupe job watch: {status}\n{stderr}");
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.read(&line);
        }
        std::mem::take(&mut self.steps)
    }
}

impl Drop for CliWatcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts daemon `i` with the node.toml lines `extra` (slots, controllers…); its address is the first
/// line it prints.
fn spawn(dir: &Path, certs: &Path, i: usize, extra: &str) -> (Child, SocketAddr) {
    let name = format!("node-{i}");
    let data: PathBuf = dir.join(&name);
    let toml = format!(
        "name = \"{name}\"\nlisten = \"127.0.0.1:0\"\ndata_dir = \"{}\"\ncerts = \"{}\"\n\
         torch_threads = 1\n{extra}",
        data.display(),
        certs.display()
    );
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, toml).unwrap();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let mut child = Command::new(common::binary())
        .args(["daemon", "--config"])
        .arg(&config)
        .arg("--exit-with-parent")
        .env("RUST_LOG", "warn,troupe_actors::runtime::node=info,troupe_actors::runtime::node_core=info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().parse().unwrap_or_else(|e| panic!("{line:?}: {e}"));
    (child, addr)
}

/// What a watcher saw of a job: each step's loss (a step seen twice must have the same loss within the
/// oracle's tolerance: a step whose `Commit` the killed controller recorded but never delivered is redone
/// by the new one on the same global batch — the same bits when the world is unchanged, a different
/// summation order when the killed daemon's rank is gone), its events in order, and when each new step came.
#[derive(Clone, Default)]
struct Seen {
    losses: BTreeMap<u64, f64>,
    /// The events yielded, by number: the handle's numbers run 0, 1, 2, … with none missing or twice.
    log: Vec<JobEvent>,
    events: u64,
    /// Whether the new controller's "resuming after step N" came (later steps are its own commits).
    resumed: bool,
    /// When the first step the new controller committed arrived.
    first_after: Option<Instant>,
}

impl Seen {
    fn saw(&mut self, seq: u64, event: &JobEvent) {
        assert_eq!(seq, self.events, "event {seq} yielded where {} was next: one missing or twice", self.events);
        self.events += 1;
        self.log.push(event.clone());
        match event {
            JobEvent::Step { step, loss, .. } => {
                if let Some(before) = self.losses.insert(*step, *loss) {
                    let log: Vec<String> =
                        self.log.iter().map(|e| format!("{e:?}").chars().take(120).collect()).collect();
                    assert!(
                        (before - loss).abs() <= TOLERANCE * before.abs().max(1.0),
                        "step {step} committed twice with losses {before} and {loss}, beyond the tolerance; the events:\n{}",
                        log.join("\n")
                    );
                }
                if self.resumed && self.first_after.is_none() {
                    self.first_after = Some(Instant::now());
                }
            }
            JobEvent::Membership { changes, .. } if changes.iter().any(|c| c.contains("resuming after step")) => {
                self.resumed = true;
            }
            _ => {}
        }
    }

    /// Follows `handle` until the job ends; gives the terminal event.
    async fn until_end(&mut self, mut handle: JobHandle) -> JobEvent {
        loop {
            let next = tokio::time::timeout(Duration::from_secs(60), handle.next_numbered()).await;
            let (seq, event) =
                next.expect("the job makes progress").expect("the stream goes on").expect("not over yet");
            self.saw(seq, &event);
            if event.is_terminal() {
                return event;
            }
        }
    }
}

/// Submits a 30-step job through a client given every daemon's address and follows it until step `at`
/// is committed; the handle goes on following it.
async fn submit_and_follow_to(c: &Controllers, config: &JobConfig, out: &Path, at: u64, seen: &mut Seen) -> JobHandle {
    let client = Client::connect_any(&c.addrs, &c.client).await.unwrap();
    let mut handle = client.submit(Job::new(config.clone()).save_final(out).data_plane(DataPlane::Quic)).await.unwrap();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), handle.next_numbered()).await.unwrap().unwrap();
        let (seq, event) = event.unwrap_or_else(|| panic!("the job ended before step {at}"));
        seen.saw(seq, &event);
        if matches!(event, JobEvent::Step { step, .. } if step >= at) {
            return handle;
        }
    }
}

/// Three controller daemons, their leader, and a 30-step job submitted and followed to step `at`.
struct Running {
    c: Controllers,
    all: Vec<usize>,
    leader: usize,
    config: JobConfig,
    out: PathBuf,
    seen: Seen,
    job: u64,
    /// The submitter's handle, connected to the controller (the leader).
    handle: JobHandle,
}

async fn running_until(at: u64) -> Running {
    let c = Controllers::start();
    let all: Vec<usize> = (0..NODES).collect();
    let leader = c.leader_of(&all, Duration::from_secs(30)).await;
    let config = common::two_block_job(30);
    let out = c.dir.path().join("final.safetensors");
    let mut seen = Seen::default();
    let handle = submit_and_follow_to(&c, &config, &out, at, &mut seen).await;
    let job = handle.id();
    Running { c, all, leader, config, out, seen, job, handle }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_controller_is_killed_for_good_and_the_job_equals_the_reference() {
    let Running { c, all, leader, config, out, seen, job, handle } = running_until(8).await;
    let cli = c.watch_cli(job);

    common::signal(c.children[leader].id(), "KILL");
    let killed = Instant::now();
    let survivors: Vec<usize> = all.iter().copied().filter(|&i| i != leader).collect();
    // The submitter's handle reconnects by itself (once its QUIC connection times out); a watcher
    // started after the kill through the survivors times the take-over.
    let mut timing = seen.clone();
    let submitter = tokio::spawn(async move {
        let mut seen = seen;
        let end = seen.until_end(handle).await;
        (seen, end)
    });
    let fresh = c.watch(&survivors, job, timing.events, Duration::from_secs(30)).await;
    let end = timing.until_end(fresh).await;
    assert!(matches!(end, JobEvent::Finished { steps: 30, .. }), "{end:?}\n{}", c.log());
    let takeover = timing.first_after.expect("a step committed by the new controller") - killed;
    eprintln!("take-over: SIGKILL of the controller -> the next committed step arrived after {takeover:?}");
    assert!(takeover < Duration::from_secs(10), "take-over took {takeover:?}\n{}", c.log());
    let (seen, end) = submitter.await.unwrap();
    assert!(matches!(end, JobEvent::Finished { steps: 30, .. }), "{end:?}");
    // The job's whole event log, replayed by the new controller from its replicated catalog: the
    // submitter saw exactly it, and so did the CLI watcher.
    let all_events = c.replay(&survivors, job).await;
    assert_eq!(seen.log, all_events, "the submitter's events are the job's log");
    assert_eq!(timing.log, all_events, "the timing watcher's too");
    let steps = |log: &[JobEvent]| -> Vec<u64> {
        log.iter().filter_map(|e| if let JobEvent::Step { step, .. } = e { Some(*step) } else { None }).collect()
    };
    assert_eq!(cli.finish(), steps(&all_events), "`troupe job watch` printed each committed step once");

    let new_leader = c.leader_of(&survivors, Duration::from_secs(10)).await;
    assert_ne!(new_leader, leader);
    // `troupe cluster controllers`, asked of the new leader: it leads a later term and knows how far
    // the other survivor's log matches its own.
    let group = c.controllers_cli(new_leader);
    let name = |i: usize| format!("node-{i}");
    assert!(group.replicated && group.term >= 2, "{group:?}");
    assert_eq!(group.leader, Some(name(new_leader)), "{group:?}");
    let names: Vec<&str> = group.controllers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["node-0", "node-1", "node-2"]);
    let follower = survivors.iter().copied().find(|&i| i != new_leader).unwrap();
    let matched = group.controllers.iter().find(|c| c.name == name(follower)).and_then(|c| c.matched);
    assert!(matched.is_some() && matched <= group.last_log_index, "{group:?}");
    let losses: Vec<f64> = seen.losses.values().copied().collect();
    check(&config, &losses, &out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_paused_past_the_election_comes_back_as_a_member_and_commits_nothing() {
    let Running { c, all, leader, config, out, mut seen, job, handle } = running_until(6).await;
    drop(handle);

    common::signal(c.children[leader].id(), "STOP");
    let others: Vec<usize> = all.iter().copied().filter(|&i| i != leader).collect();
    let handle = c.watch(&others, job, seen.events, Duration::from_secs(30)).await;
    // The others elect a controller; the paused one, resumed, learns it lost and rejoins as a member.
    let mut handle = Some(handle);
    let mut resumed_at = None;
    let end = loop {
        let event = tokio::time::timeout(Duration::from_secs(60), handle.as_mut().unwrap().next_numbered()).await;
        let (seq, event) = event.expect("progress").expect("stream").expect("not over yet");
        seen.saw(seq, &event);
        if resumed_at.is_none() && seen.first_after.is_some() {
            common::signal(c.children[leader].id(), "CONT");
            resumed_at = Some(Instant::now());
        }
        if event.is_terminal() {
            break event;
        }
    };
    drop(handle.take());
    assert!(matches!(end, JobEvent::Finished { steps: 30, .. }), "{end:?}\n{}", c.log());
    // One controller among all three, and it is not the one that was paused.
    let now_leader = c.leader_of(&all, Duration::from_secs(15)).await;
    assert_ne!(now_leader, leader, "{}", c.log());
    let paused = c.status(leader).await.expect("the resumed daemon answers");
    assert!(!paused.controller, "the paused controller still acts as one: {paused:?}");
    assert!(c.log().contains("is no longer the controller"), "{}", c.log());
    let losses: Vec<f64> = seen.losses.values().copied().collect();
    check(&config, &losses, &out);
}

/// A node whose node.toml `controllers` lists other controllers than the controller's is refused at its
/// join: it stops with an error naming `controllers` on both sides, and the controller's view never
/// admits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_listing_other_controllers_is_refused_naming_both_lists() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    init_cluster(&certs).unwrap();
    for name in ["node-0", "node-9"] {
        add_node(name, &certs).unwrap();
    }
    let config = |name: &str, extra: &str| {
        let data = dir.path().join(name);
        let text = format!(
            "name = \"{name}\"\nlisten = \"127.0.0.1:0\"\ndata_dir = \"{}\"\ncerts = \"{}\"\n{extra}",
            data.display(),
            certs.display()
        );
        NodeConfig::parse(&text, name).unwrap()
    };
    let controller = Daemon::start(config("node-0", "")).await.unwrap();
    let three = r#"controllers = ["node-0@127.0.0.1:9", "node-1@127.0.0.1:10", "node-2@127.0.0.1:11"]"#;
    let joiner =
        Daemon::start(config("node-9", &format!("join = \"{}\"\n{three}\n", controller.addr()))).await.unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(30), joiner.wait()).await.expect("the refused node stops");
    let err = stopped.expect_err("stopped by the refusal").to_string();
    assert!(err.contains("node-9's node.toml `controllers` lists node-0, node-1, node-2"), "{err}");
    assert!(err.contains("the controller node-0's node.toml `controllers` lists none"), "{err}");
    let status = controller.status().await.unwrap();
    assert_eq!(common::names(&status), ["node-0"], "never admitted");
    controller.drain().await.unwrap();
}

fn names(group: &ControllersStatus) -> Vec<&str> {
    group.controllers.iter().map(|c| c.name.as_str()).collect()
}

/// Controllers changed at run time: three controllers and a job; two members (`raft_listen` in their
/// node.toml, no slots) made controllers with `troupe cluster controllers add` while it trains (one
/// with `--address`, one by name alone: the address its `Join` announced) — five
/// voters, a majority is three. Then the leader is SIGKILLed and, once the job resumed, another of the
/// first three: three of five remain, a majority only thanks to the two added (one of the first three
/// would be left). The job finishes equal to the reference. The submitter's handle, connected to the
/// killed leader, re-attaches to the new one within the bound (the client's 2 s idle timeout beside the
/// election).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controllers_added_at_run_time_vote_and_keep_a_majority_past_two_losses() {
    let mut c = Controllers::start();
    let first: Vec<usize> = (0..NODES).collect();
    c.leader_of(&first, Duration::from_secs(30)).await;
    let rafts = [c.spawn_standby(3), c.spawn_standby(4)];
    let mut alive: Vec<usize> = (0..5).collect();
    let leader = c.leader_of(&alive, Duration::from_secs(30)).await;
    // Long enough to outlast the two additions and both kills on a quiet machine (40 steps ended before
    // the first kill in CI).
    const STEPS: u64 = 400;
    let config = common::two_block_job(STEPS);
    let out = c.dir.path().join("final.safetensors");
    let mut seen = Seen::default();
    let mut handle = submit_and_follow_to(&c, &config, &out, 3, &mut seen).await;
    for (i, raft) in [3, 4].into_iter().zip(rafts) {
        let node = format!("node-{i}");
        // node-3 named with its address; node-4 by name alone: the `raft_listen` its `Join` announced.
        let raft = raft.to_string();
        let args: &[&str] = if i == 3 { &["add", &node, "--address", &raft] } else { &["add", &node] };
        let group = c.change_controllers(&first, args);
        let group = group.unwrap_or_else(|e| panic!("adding {node}: {e}\n{}", c.log()));
        assert!(names(&group).contains(&node.as_str()), "{node} votes: {group:?}");
    }
    // Asked of an added node itself: five voters, no learner left.
    let group = c.controllers_cli(4);
    assert_eq!(names(&group), ["node-0", "node-1", "node-2", "node-3", "node-4"], "{group:?}");
    assert!(group.learners.is_empty(), "{group:?}");

    common::signal(c.children[leader].id(), "KILL");
    let killed = Instant::now();
    alive.retain(|&i| i != leader);
    while !seen.resumed {
        let next = tokio::time::timeout(Duration::from_secs(60), handle.next_numbered()).await;
        let next = next.expect("the new controller's events").expect("the stream");
        let (seq, event) = next.unwrap_or_else(|| panic!("the job ended before the take-over: {:?}", seen.log.last()));
        seen.saw(seq, &event);
    }
    let reattached = killed.elapsed();
    eprintln!("watch re-attach: SIGKILL of the controller -> the new controller's first event after {reattached:?}");
    assert!(reattached < Duration::from_secs(6), "re-attached after {reattached:?}\n{}", c.log());

    // The second loss: the new leader if it is one of the first three, else another of them.
    let second = c.leader_of(&alive, Duration::from_secs(30)).await;
    let second = if second < NODES { second } else { *alive.iter().find(|&&i| i < NODES).unwrap() };
    common::signal(c.children[second].id(), "KILL");
    alive.retain(|&i| i != second);
    let end = seen.until_end(handle).await;
    assert!(matches!(end, JobEvent::Finished { steps: STEPS, .. }), "{end:?}\n{}", c.log());
    let leader = c.leader_of(&alive, Duration::from_secs(30)).await;
    let group = c.controllers_cli(leader);
    assert_eq!(group.leader, Some(format!("node-{leader}")), "{group:?}");
    assert_eq!(group.controllers.len(), 5, "the membership is the committed one: {group:?}");
    let losses: Vec<f64> = seen.losses.values().copied().collect();
    check(&config, &losses, &out);
}

/// `troupe cluster controllers remove` of the leader hands the controller over to another, and the job
/// is unaffected; bad changes are refused naming the node and the fix, with nothing changed: a node
/// that is not a member, one that is not a controller, one that already is, the last controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_leader_hands_over_and_bad_changes_change_nothing() {
    let Running { c, all, leader, config, out, mut seen, job: _, handle } = running_until(5).await;
    let name = |i: usize| format!("node-{i}");
    let err = c.change_controllers(&all, &["add", "node-9", "--address", "127.0.0.1:9"]).unwrap_err();
    assert!(err.contains("node-9 is not a member of the cluster"), "{err}");
    assert!(err.contains("troupe cluster add-node node-9") && err.contains("raft_listen"), "{err}");
    let err = c.change_controllers(&all, &["remove", "node-7"]).unwrap_err();
    assert!(err.contains("node-7 is not a controller (the controllers are node-0, node-1, node-2)"), "{err}");
    let err = c.change_controllers(&all, &["add", "node-1", "--address", "127.0.0.1:9"]).unwrap_err();
    assert!(err.contains("node-1 is already a controller"), "{err}");
    let group = c.controllers_cli(leader);
    assert_eq!(names(&group), ["node-0", "node-1", "node-2"], "nothing changed: {group:?}");
    assert_eq!(group.leader, Some(name(leader)), "{group:?}");

    let group = c.change_controllers(&all, &["remove", &name(leader)]).unwrap_or_else(|e| panic!("{e}"));
    let others: Vec<usize> = all.iter().copied().filter(|&i| i != leader).collect();
    assert_eq!(names(&group), others.iter().map(|&i| name(i)).collect::<Vec<_>>(), "{group:?}");
    // Another takes over; the removed one stays a member (its rank trains on).
    let new_leader = c.leader_of(&all, Duration::from_secs(30)).await;
    assert_ne!(new_leader, leader, "{}", c.log());
    let end = seen.until_end(handle).await;
    assert!(matches!(end, JobEvent::Finished { steps: 30, .. }), "{end:?}\n{}", c.log());
    let losses: Vec<f64> = seen.losses.values().copied().collect();
    check(&config, &losses, &out);

    // Down to one controller; the last one cannot be removed.
    let follower = others.iter().copied().find(|&i| i != new_leader).unwrap();
    let group = c.change_controllers(&all, &["remove", &name(follower)]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(names(&group), [name(new_leader).as_str()], "{group:?}");
    let err = c.change_controllers(&all, &["remove", &name(new_leader)]).unwrap_err();
    assert!(err.contains(&format!("{} is the last controller", name(new_leader))), "{err}");
    assert_eq!(names(&c.controllers_cli(new_leader)), [name(new_leader).as_str()]);
}

/// A member (not a controller) restarted after the controller its `join` names is gone for good finds
/// the cluster: it kept the daemons of its last view in its data dir and tries them — any redirects it
/// to the controller. Before, it knew no other to dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_restarted_after_its_join_is_gone_finds_the_controller() {
    let mut c = Controllers::start();
    c.spawn_member(3, "");
    let all: Vec<usize> = (0..4).collect();
    c.leader_of(&all, Duration::from_secs(30)).await;
    for i in [3, 0] {
        common::signal(c.children[i].id(), "KILL");
        let _ = c.children[i].wait();
    }
    // node-3 restarted, its `join` (node-0's address) gone for good; it must still land in the view.
    let known = std::fs::read_to_string(c.dir.path().join("node-3").join("known-daemons.json")).unwrap();
    assert!(known.contains("node-1") && known.contains("node-2"), "{known}");
    c.spawn_member(3, "");
    let rejoined = c.leader_of(&[1, 2, 3], Duration::from_secs(30)).await;
    assert!(rejoined == 1 || rejoined == 2, "{}", c.log());
}
