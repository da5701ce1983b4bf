//! A local cluster on loopback with a throwaway cluster CA: N daemons, either in this process (the job
//! API's tests and examples) or as child processes of the `troupe` binary (`troupe train --nodes N`).
//! Dropping it stops every daemon; child daemons also exit on their own when their parent dies.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use troupe_cluster::membership::MembershipConfig;
use troupe_cluster::{add_node, init_cluster, NodeIdentity, TransportConfig};

use super::Client;
use crate::daemon::{Daemon, NodeConfig};
use crate::error::{Error, Result};
use crate::node_config::restart::RestartPolicy;
use crate::protocol::ClusterStatus;
use crate::telemetry::TelemetryConfig;

/// The certificate the local cluster's clients present.
const CLIENT_NAME: &str = "client";
/// How long the daemons may take to start and form the cluster.
const FORM_TIMEOUT_MS: u64 = 30_000;

#[derive(Clone, Debug)]
pub struct LocalClusterOptions {
    pub nodes: usize,
    pub slots_per_node: u32,
    /// Slots of node 0, the controller, when it differs from `slots_per_node`; `Some(0)` gives a
    /// dedicated controller that runs no worker (so losing every worker does not lose the controller).
    pub controller_slots: Option<u32>,
    pub membership: MembershipConfig,
    /// libtorch threads per daemon (0: the machine's cores shared by the daemons).
    pub torch_threads: usize,
    /// Log filter for child daemons' stderr (RUST_LOG syntax); None: warnings only.
    pub log: Option<String>,
    /// Where each child daemon runs, by node index (nodes past the end: this host, on loopback). The
    /// chaos harness puts daemons in network namespaces this way, to cut and degrade their links.
    pub hosts: Vec<NodeHost>,
    /// Where child daemons' stderr goes: `DIR/NAME.log` (appended across restarts); None: this
    /// process's stderr.
    pub log_dir: Option<PathBuf>,
    /// How each daemon restarts a failing worker before it escalates (stops).
    pub restart: RestartPolicy,
    /// Every daemon's `[telemetry]` (e.g. `metrics_listen` on port 0, `otlp_endpoint`).
    pub telemetry: TelemetryConfig,
    /// Every daemon's `allow_plaintext_tcp`: true by default here, since a local cluster's "hosts" are
    /// this machine's own addresses (a daemon's config file refuses it unless set).
    pub allow_plaintext_tcp: bool,
    /// Controller-eligible daemons: nodes `0..controllers` are listed in every node's node.toml
    /// `controllers`, each with a Raft port of its own; 0 or 1: node 0 is the single controller.
    pub controllers: usize,
    /// Every daemon's node.toml `devices` (None: CPU slots, `slots_per_node` of them). On one machine,
    /// daemons given the same GPU share it (their ranks then sum gradients through host memory).
    pub devices: Option<crate::node_config::devices::Devices>,
}

impl LocalClusterOptions {
    pub fn new(nodes: usize) -> Self {
        LocalClusterOptions {
            nodes,
            slots_per_node: 1,
            controller_slots: None,
            membership: MembershipConfig::default(),
            torch_threads: 0,
            log: None,
            log_dir: None,
            hosts: Vec::new(),
            restart: RestartPolicy::default(),
            telemetry: TelemetryConfig::default(),
            allow_plaintext_tcp: true,
            controllers: 0,
            devices: None,
        }
    }
}

/// How one child daemon is started: a command prefix (e.g. `ip netns exec NS`) and the address it
/// listens on.
#[derive(Clone, Debug)]
pub struct NodeHost {
    pub prefix: Vec<String>,
    pub ip: std::net::IpAddr,
}

enum Node {
    InProcess(Daemon),
    Child(Child),
}

pub struct LocalCluster {
    dir: tempfile::TempDir,
    controller: SocketAddr,
    nodes: Vec<(String, SocketAddr, Node)>,
    client_identity: NodeIdentity,
    options: LocalClusterOptions,
    binary: Option<PathBuf>,
    spawned: Vec<u32>,
    /// Each child daemon's dashboard URL, by node index (with `telemetry.metrics_listen`).
    dashboards: Vec<Option<String>>,
    /// Every node's `controllers` (`options.controllers` entries `NAME@HOST:PORT`, ports drawn once).
    controllers: Vec<String>,
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

impl LocalCluster {
    /// N daemons in this process (tokio tasks and actors; one QUIC endpoint each).
    pub async fn in_process(nodes: usize) -> Result<Self> {
        Self::in_process_with(LocalClusterOptions::new(nodes)).await
    }

    pub async fn in_process_with(options: LocalClusterOptions) -> Result<Self> {
        let mut cluster = Self::without_nodes(&options, None)?;
        for i in 0..options.nodes {
            let config = cluster.node_config(i, &options);
            let daemon = Daemon::start(config).await?;
            if i == 0 {
                cluster.controller = daemon.addr();
            }
            cluster.nodes.push((node_name(i), daemon.addr(), Node::InProcess(daemon)));
        }
        cluster.wait_for_members(options.nodes).await?;
        Ok(cluster)
    }

    /// N `troupe daemon` child processes of `binary`.
    pub async fn processes(binary: &Path, options: LocalClusterOptions) -> Result<Self> {
        let mut cluster = Self::without_nodes(&options, Some(binary))?;
        for i in 0..options.nodes {
            cluster.spawn_child(i)?;
        }
        cluster.wait_for_members(options.nodes).await?;
        Ok(cluster)
    }

    fn spawn_child(&mut self, i: usize) -> Result<()> {
        let nodes = self.nodes.len();
        let binary = self.binary.clone().ok_or(Error::NoSuchNode { index: i, kind: "daemon process", nodes })?;
        let mut config = self.node_config(i, &self.options);
        if i == 0 && !self.nodes.is_empty() {
            // The controller comes back where the others dial it.
            config.listen = self.controller;
        }
        let path = self.dir.path().join(format!("{}.toml", node_name(i)));
        let text = toml::to_string(&config).map_err(|e| Error::start_because("writing a daemon's node config", e))?;
        std::fs::write(&path, text)
            .map_err(|e| Error::start_because(format!("writing the node config {}", path.display()), e))?;
        let stderr = match &self.options.log_dir {
            Some(dir) => {
                let log = dir.join(format!("{}.log", node_name(i)));
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .map_err(|e| Error::start_because(format!("opening the daemon log {}", log.display()), e))?;
                Stdio::from(file)
            }
            None => Stdio::inherit(),
        };
        let prefix = self.options.hosts.get(i).map_or(&[][..], |h| &h.prefix[..]);
        let serves_http = config.telemetry.metrics_listen.is_some();
        let (child, addr, dashboard) =
            spawn_daemon(prefix, &binary, &path, self.options.log.as_deref(), stderr, serves_http)?;
        if i == 0 {
            self.controller = addr;
        }
        self.dashboards.resize(self.dashboards.len().max(i + 1), None);
        self.dashboards[i] = dashboard;
        self.spawned.push(child.id());
        let node = (node_name(i), addr, Node::Child(child));
        match self.nodes.get_mut(i) {
            Some(slot) => *slot = node,
            None => self.nodes.push(node),
        }
        Ok(())
    }

    /// Starts daemon `i` again after its process ended (a node returning after a crash): same name,
    /// certificate and data directory, a new incarnation. It rejoins at the next step boundary. The
    /// controller (node 0) comes back on its address and resumes its jobs from its catalog. Like
    /// `add_node`, it blocks until the daemon listens (about a second): from async code call it inside
    /// `tokio::task::block_in_place` or `spawn_blocking`, so the runtime's other tasks keep running.
    ///
    /// [`Error::NoSuchNode`] when there is no daemon process `i`; [`Error::Start`] when it is still
    /// running or does not start.
    pub fn restart_node(&mut self, i: usize) -> Result<()> {
        let nodes = self.nodes.len();
        match self.nodes.get_mut(i) {
            Some((name, _, Node::Child(child))) => {
                let exited = child.try_wait().map_err(|e| Error::start_because(format!("restarting {name}"), e))?;
                if exited.is_none() {
                    return Err(Error::start(format!("{name} is still running; stop it before restarting it")));
                }
            }
            _ => return Err(Error::NoSuchNode { index: i, kind: "daemon process", nodes }),
        }
        self.spawn_child(i)
    }

    /// Every daemon process this cluster ever started (restarts included), to check none is left.
    pub fn spawned_pids(&self) -> &[u32] {
        &self.spawned
    }

    /// Starts one more daemon process (a node joining); returns its index. It is admitted at the next
    /// step boundary.
    pub fn add_node(&mut self) -> Result<usize> {
        let i = self.nodes.len();
        let name = node_name(i);
        add_node(&name, &self.certs_dir()).map_err(|e| Error::start_because(format!("certifying {name}"), e))?;
        self.spawn_child(i)?;
        Ok(i)
    }

    /// The process id of daemon `i` (None for in-process daemons): for fault injection.
    pub fn pid(&self, i: usize) -> Option<u32> {
        match self.nodes.get(i) {
            Some((_, _, Node::Child(c))) => Some(c.id()),
            _ => None,
        }
    }

    /// The name of daemon `i`.
    pub fn node_name(&self, i: usize) -> String {
        node_name(i)
    }

    /// Waits for daemon process `i` to exit; its exit status.
    pub fn wait_exit(&mut self, i: usize, timeout: Duration) -> Option<std::process::ExitStatus> {
        let Some((_, _, Node::Child(child))) = self.nodes.get_mut(i) else { return None };
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The certificates of `options.nodes` daemons and a client, in a new temporary directory.
    fn without_nodes(options: &LocalClusterOptions, binary: Option<&Path>) -> Result<Self> {
        let (dir, client_identity) = Self::certificates(options.nodes)?;
        Ok(LocalCluster {
            dir,
            controller: SocketAddr::from(([127, 0, 0, 1], 0)),
            nodes: Vec::new(),
            client_identity,
            options: options.clone(),
            binary: binary.map(Path::to_owned),
            spawned: Vec::new(),
            dashboards: Vec::new(),
            controllers: controller_entries(options)?,
        })
    }

    fn certificates(nodes: usize) -> Result<(tempfile::TempDir, NodeIdentity)> {
        let dir = tempfile::Builder::new()
            .prefix("troupe-local-")
            .tempdir()
            .map_err(|e| Error::start_because("creating a temporary directory for the local cluster", e))?;
        let certs = dir.path().join("certs");
        let failed =
            |e| Error::start_because(format!("making the local cluster's certificates in {}", certs.display()), e);
        init_cluster(&certs).map_err(failed)?;
        for i in 0..nodes {
            add_node(&node_name(i), &certs).map_err(failed)?;
        }
        add_node(CLIENT_NAME, &certs).map_err(failed)?;
        let client = NodeIdentity::load(&certs, CLIENT_NAME).map_err(failed)?;
        Ok((dir, client))
    }

    fn node_config(&self, i: usize, options: &LocalClusterOptions) -> NodeConfig {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ranks = options.nodes * options.slots_per_node as usize;
        NodeConfig {
            name: node_name(i),
            listen: SocketAddr::new(options.hosts.get(i).map_or([127, 0, 0, 1].into(), |h| h.ip), 0),
            join: (i > 0).then_some(self.controller),
            data_dir: self.dir.path().join(node_name(i)),
            certs: self.dir.path().join("certs"),
            slots: options.devices.is_none().then_some(if i == 0 {
                options.controller_slots.unwrap_or(options.slots_per_node)
            } else {
                options.slots_per_node
            }),
            devices: options.devices.clone(),
            torch_threads: if options.torch_threads > 0 { options.torch_threads } else { (cores / ranks).max(1) },
            membership: options.membership.clone(),
            restart: options.restart,
            transport: TransportConfig::loopback(),
            telemetry: options.telemetry.clone(),
            allow_plaintext_tcp: options.allow_plaintext_tcp,
            controllers: self.controllers.clone(),
            raft_listen: None,
        }
    }

    /// Daemon `i`'s data directory (its catalog and, on a controller, its Raft log).
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(node_name(i))
    }

    /// Waits until the controller's view has at least `n` members; [`Error::TimedOut`] after 30 s.
    pub async fn wait_for_members(&self, n: usize) -> Result<ClusterStatus> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(FORM_TIMEOUT_MS);
        let mut client = self.client().await?;
        loop {
            let status = client.status().await?;
            if status.members.len() >= n {
                client.close().await;
                return Ok(status);
            }
            if tokio::time::Instant::now() > deadline {
                client.close().await;
                let what = format!("the local cluster did not form ({} of {n} members joined)", status.members.len());
                return Err(Error::TimedOut { what, after: Duration::from_millis(FORM_TIMEOUT_MS) });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The URL of daemon `i`'s dashboard (with `telemetry.metrics_listen`).
    pub fn dashboard_url(&self, i: usize) -> Option<String> {
        match self.nodes.get(i)? {
            (_, _, Node::InProcess(d)) => d.metrics_addr().map(|a| format!("http://{a}/")),
            _ => self.dashboards.get(i).cloned().flatten(),
        }
    }

    /// The controller's address.
    pub fn addr(&self) -> SocketAddr {
        self.controller
    }

    /// The cluster directory (CA and certificates).
    pub fn certs_dir(&self) -> PathBuf {
        self.dir.path().join("certs")
    }

    /// Where daemon `i` listens (its control address); None past the last one.
    pub fn node_addr(&self, i: usize) -> Option<SocketAddr> {
        self.nodes.get(i).map(|(_, addr, _)| *addr)
    }

    /// A new client connection to daemon `i`; [`Error::NoSuchNode`] past the last one.
    pub async fn client_to(&self, i: usize) -> Result<Client> {
        let nodes = self.nodes.len();
        let (_, addr, _) = self.nodes.get(i).ok_or(Error::NoSuchNode { index: i, kind: "node", nodes })?;
        Client::connect(*addr, &self.client_identity).await
    }

    /// A new client connection to the controller.
    pub async fn client(&self) -> Result<Client> {
        Client::connect(self.controller, &self.client_identity).await
    }

    /// The in-process daemon `i` (None for child processes).
    pub fn daemon(&self, i: usize) -> Option<&Daemon> {
        match self.nodes.get(i) {
            Some((_, _, Node::InProcess(d))) => Some(d),
            _ => None,
        }
    }

    /// Stops every daemon: in-process ones drain; children get SIGTERM (drain) and are waited for.
    pub async fn shutdown(mut self) {
        for (_, _, node) in self.nodes.drain(..).rev() {
            match node {
                Node::InProcess(d) => {
                    let _ = d.drain().await;
                }
                Node::Child(mut child) => terminate(&mut child),
            }
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for (_, _, node) in &mut self.nodes {
            if let Node::Child(child) = node {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `controllers` entries for nodes `0..options.controllers` (none for one controller), each Raft port a
/// free UDP port of this host, drawn once so that a restarted controller comes back on it.
fn controller_entries(options: &LocalClusterOptions) -> Result<Vec<String>> {
    if options.controllers < 2 {
        return Ok(Vec::new());
    }
    (0..options.controllers)
        .map(|i| {
            let ip = options.hosts.get(i).map_or([127, 0, 0, 1].into(), |h| h.ip);
            let socket = std::net::UdpSocket::bind(SocketAddr::new([127, 0, 0, 1].into(), 0))
                .and_then(|s| s.local_addr())
                .map_err(|e| Error::start_because("finding a free port for a controller's Raft endpoint", e))?;
            Ok(format!("{}@{}", node_name(i), SocketAddr::new(ip, socket.port())))
        })
        .collect()
}

/// SIGTERM, a bounded wait for the drain, then SIGKILL.
fn terminate(child: &mut Child) {
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Starts `binary daemon --config path` and reads the address it prints once listening, and its
/// dashboard's URL when it serves one.
fn spawn_daemon(
    prefix: &[String],
    binary: &Path,
    config: &Path,
    log: Option<&str>,
    stderr: Stdio,
    serves_http: bool,
) -> Result<(Child, SocketAddr, Option<String>)> {
    // The prefix must exec the daemon (as `ip netns exec` does), so that the child is the daemon.
    let mut command = match prefix.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(binary);
            c
        }
        None => Command::new(binary),
    };
    command
        .arg("daemon")
        .arg("--config")
        .arg(config)
        .arg("--exit-with-parent")
        .env("RUST_LOG", log.unwrap_or("warn"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr);
    let mut child =
        command.spawn().map_err(|e| Error::start_because(format!("starting {} daemon", binary.display()), e))?;
    let stdout = child.stdout.take().expect("piped");
    let mut line = String::new();
    let mut reader = BufReader::new(stdout);
    reader.read_line(&mut line).map_err(|e| Error::start_because("reading the daemon's address", e))?;
    let addr = line.trim().rsplit(' ').next().and_then(|a| a.parse().ok());
    let Some(addr) = addr else {
        let _ = child.kill();
        let status = child.wait();
        let what = format!(
            "daemon {} did not start (said {line:?}, exit {status:?}); see its log for the error",
            config.display()
        );
        return Err(Error::start(what));
    };
    let mut dashboard = None;
    while serves_http && dashboard.is_none() {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        dashboard = line.trim().split_once(" dashboard on ").map(|(_, url)| url.to_owned());
    }
    // Keep draining its stdout so the daemon never blocks on a full pipe.
    std::thread::spawn(move || for _ in reader.lines() {});
    Ok((child, addr, dashboard))
}
