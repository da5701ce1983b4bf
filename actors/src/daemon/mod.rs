//! `troupe daemon`: a node of a cluster. [`Daemon::start`] runs one in the current tokio runtime (the
//! binary, the in-process local cluster and the tests all use it); [`run`] is the command, with signal
//! handling: SIGTERM or Ctrl-C drain the node and leave the cluster cleanly.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ractor::{Actor, ActorRef};
use troupe_cluster::control::{ControlEndpoint, PeerRole};
use troupe_cluster::NodeIdentity;

pub use crate::catalog::{Catalog, StoredJob, StoredView};
pub use crate::node_config::{NodeConfig, NodeConfigError, SLOTS_MAX};

use crate::error::{Error, Result};
use crate::node_config::controllers::ControllerEntry;
use crate::protocol::ClusterStatus;
use crate::runtime::node::{actor_scope, NodeActor, NodeArgs, NodeMsg};
use crate::runtime::raft::group::committed_controllers;
use crate::runtime::raft::{Controller, ControllerGroup, GroupConfig, RaftEndpoint, RaftTimeouts};
use crate::runtime::worker::WorkerMsg;
use crate::telemetry::{endpoint, http, otel, otel_metrics, NodeMetrics};

/// How long a drain may take before the daemon exits anyway.
const DRAIN_TIMEOUT_MS: u64 = 5_000;

/// A running daemon.
pub struct Daemon {
    node: ActorRef<NodeMsg>,
    handle: tokio::task::JoinHandle<()>,
    addr: SocketAddr,
    name: String,
    stop_reason: Arc<std::sync::Mutex<Option<String>>>,
    /// The dashboard, `/metrics` and `/status` endpoint, when `telemetry.metrics_listen` is set.
    http: Option<(SocketAddr, tokio::task::JoinHandle<()>)>,
    /// Whether that endpoint speaks https (`telemetry.dashboard_tls` or `dashboard_auth`).
    https: bool,
    /// The controllers' Raft group (or the single controller's catalog), shut down after a drain.
    group: Arc<ControllerGroup>,
}

impl Daemon {
    /// Loads the certificates, opens the metadata catalog, binds the listen address and starts the
    /// node actor (and its workers). A bad `config` is [`Error::Config`]; certificates, a catalog, an
    /// address or a dashboard it cannot use are [`Error::Start`], naming the node.toml key.
    pub async fn start(config: NodeConfig) -> Result<Daemon> {
        config.validate("node config")?;
        let identity = NodeIdentity::load(&config.certs, &config.name).map_err(|e| {
            let what = format!("loading the certificates of node {:?} from {}", config.name, config.certs.display());
            Error::start_because(what, e)
        })?;
        let catalog = Catalog::open(&config.data_dir).map_err(catalog_error)?;
        let devices = config.slot_devices("node config")?;
        for (slot, device) in devices.iter().enumerate() {
            if let crate::protocol::SlotDevice::Cuda { name, memory_bytes, nccl_missing, .. } = device {
                let gib = *memory_bytes as f64 / f64::from(1u32 << 30);
                let nccl = nccl_missing.as_deref().unwrap_or("available");
                tracing::info!(slot, device = %device.label(), "{name}, {gib:.0} GiB; NCCL: {nccl}");
            }
        }
        troupe_model::trainer::configure_torch_threads(config.torch_threads, devices.len());
        let incarnation = catalog.next_incarnation().map_err(catalog_error)?;
        tracing::info!(node = %config.name, incarnation, "starting");
        let (endpoint, events) = ControlEndpoint::bind(&identity, config.listen, PeerRole::Node, &config.transport)
            .map_err(|e| address_error(&config.listen, e))?;
        let addr = endpoint.local_addr();
        let group = Arc::new(controller_group(&config, &identity, catalog.clone()).await?);
        let listener = match config.telemetry.metrics_listen {
            Some(at) => Some(http::bind(at).map_err(|e| {
                Error::start(format!(
                    "telemetry.metrics_listen = {at}: {e}; pick a free port in node.toml (or leave the key out)"
                ))
            })?),
            None => None,
        };
        let (secure, auth) = (config.telemetry.dashboard_tls, config.telemetry.dashboard_auth);
        let tls = if secure || auth {
            Some(http::server_tls(&identity, auth).map_err(|e| {
                Error::start(format!(
                    "telemetry.dashboard_tls: serving https with node {}'s certificate: {e}",
                    config.name
                ))
            })?)
        } else {
            None
        };
        let https = tls.is_some();
        let bound = listener.as_ref().map(|l| l.local_addr()).transpose();
        let bound = bound.map_err(|e| Error::start_because("telemetry.metrics_listen: its address", e))?;
        let dashboard = bound.map(|at| http::dashboard_url(https, at, addr));
        let name = config.name.clone();
        let stop_reason = Arc::new(std::sync::Mutex::new(None));
        let metrics = Arc::new(NodeMetrics::new(config.telemetry.peak_tflops_per_slot));
        otel_metrics::observe_links(metrics.clone());
        let args = NodeArgs {
            config,
            identity: Arc::new(identity),
            endpoint,
            events,
            stop_reason: stop_reason.clone(),
            metrics: metrics.clone(),
            catalog,
            group: group.clone(),
            dashboard,
            devices,
        };
        let (node, handle) = Actor::spawn(Some(format!("{}/node", actor_scope(&name, addr))), NodeActor, args)
            .await
            .map_err(|e| Error::start(format!("starting node {name}: {e}")))?;
        let http = match (listener, bound) {
            (Some(l), Some(at)) => Some((at, endpoint::spawn(l, endpoint_sources(&node), metrics, tls))),
            _ => None,
        };
        Ok(Daemon { node, handle, addr, name, stop_reason, http, https, group })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the dashboard, `/metrics` and `/status` are served (None without `telemetry.metrics_listen`).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().map(|(a, _)| *a)
    }

    fn stop_http(&mut self) {
        if let Some((_, task)) = self.http.take() {
            task.abort();
        }
    }

    /// The cluster as this node sees it; [`Error::NotRunning`] once it stopped.
    pub async fn status(&self) -> Result<ClusterStatus> {
        ractor::call!(self.node, NodeMsg::Status).map_err(|e| self.not_running(e))
    }

    fn not_running(&self, e: impl std::fmt::Display) -> Error {
        Error::NotRunning { node: self.name.clone(), reason: e.to_string() }
    }

    /// The worker actor of `slot` (fault injection in tests).
    pub async fn worker(&self, slot: u32) -> Option<ActorRef<WorkerMsg>> {
        ractor::call!(self.node, NodeMsg::Worker, slot).ok().flatten()
    }

    /// Leaves the cluster cleanly and stops; [`Error::NotRunning`] if it had stopped already.
    pub async fn drain(mut self) -> Result<()> {
        self.stop_http();
        let drained = ractor::call!(self.node, NodeMsg::Drain);
        let _ = tokio::time::timeout(Duration::from_millis(DRAIN_TIMEOUT_MS), &mut self.handle).await;
        self.group.shutdown().await;
        drained.map_err(|e| self.not_running(format!("draining it: {e}")))
    }

    /// Waits until the node stops; [`Error::Escalated`] if it stopped because a child kept failing.
    pub async fn wait(mut self) -> Result<()> {
        let _ = (&mut self.handle).await;
        self.stop_http();
        self.stop_error()
    }

    /// Why the node stopped on its own (escalation), if it did.
    pub fn stop_reason(&self) -> Option<String> {
        self.stop_reason.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn stop_error(&self) -> Result<()> {
        match self.stop_reason.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(why) => Err(Error::Escalated { node: self.name.clone(), reason: why.clone() }),
            None => Ok(()),
        }
    }

    pub fn is_running(&self) -> bool {
        !self.handle.is_finished()
    }
}

/// What the HTTP endpoint asks the node actor: its status, and (a member's page) the controller's
/// page fragment, which the node fetches over its connection to the controller.
fn endpoint_sources(node: &ActorRef<NodeMsg>) -> endpoint::NodeSources {
    let asked = node.clone();
    let status = endpoint::source(move || {
        let node = asked.clone();
        async move { ractor::call!(node, NodeMsg::Status).map_err(|e| e.to_string()) }
    });
    let asked = node.clone();
    let controller_page = endpoint::source(move || {
        let node = asked.clone();
        async move { ractor::call!(node, NodeMsg::ControllerDashboard).map_err(|e| e.to_string())? }
    });
    endpoint::NodeSources { status, controller_page }
}

/// The node's [`ControllerGroup`]: with two or more `controllers` and this node among them, its Raft
/// group, over its own endpoint on its entry's Raft address; otherwise the catalog itself (the single
/// controller, or a node that is not controller-eligible and never writes it).
async fn controller_group(config: &NodeConfig, identity: &NodeIdentity, catalog: Catalog) -> Result<ControllerGroup> {
    let entries: Vec<ControllerEntry> =
        config.controllers.iter().filter_map(|c| ControllerEntry::parse(c).ok()).collect();
    // Not listed: a node to be added at run time (`raft_listen`), or one added before and restarted.
    let me = entries.iter().find(|e| e.name == config.name).and_then(|e| e.raft_addr).or(config.raft_listen);
    let added = || committed_controllers(&catalog).ok()?.into_iter().find(|c| c.name == config.name)?.addr.parse().ok();
    let Some(raft_addr) = me.or_else(added).filter(|_| entries.len() >= 2) else {
        return Ok(ControllerGroup::single(&config.name, catalog));
    };
    let endpoint = RaftEndpoint::bind(identity, raft_addr, &config.transport).map_err(|e| {
        Error::start(format!(
            "controllers: this node's Raft address {raft_addr}: {e}; give it a free port in node.toml `controllers`"
        ))
    })?;
    let controllers = entries
        .iter()
        .filter_map(|e| e.raft_addr.map(|a| Controller { name: e.name.clone(), addr: a.to_string() }))
        .collect();
    let group = GroupConfig { name: config.name.clone(), controllers, timeouts: RaftTimeouts::default() };
    ControllerGroup::replicated(endpoint, catalog, group)
        .await
        .map_err(|e| Error::start(format!("controllers: starting this node's Raft group: {e:#}")))
}

fn address_error(addr: &SocketAddr, e: troupe_cluster::ClusterError) -> Error {
    let text = e.to_string();
    if text.contains("in use") {
        Error::start(format!("listen = {addr}: the address is in use (another daemon?); pick a free port in node.toml"))
    } else {
        Error::start(format!("listen = {addr}: {text}"))
    }
}

/// The catalog's errors name its file, or `data_dir` and the fix; causes on the same line.
fn catalog_error(e: anyhow::Error) -> Error {
    Error::start(format!("{e:#}"))
}

/// `troupe daemon --config node.toml`. With `exit_with_parent` (set by the local cluster), the daemon
/// also drains and exits when the process that started it dies; with `json`, its addresses are printed
/// as one JSON object.
pub fn run(config_path: &Path, exit_with_parent: bool, json: bool) -> anyhow::Result<()> {
    init_logging();
    let config = NodeConfig::load(config_path)?;
    // Flushes the last spans when the daemon exits (dropped after the runtime below).
    let _otlp = match config.telemetry.otlp_endpoint() {
        Some(endpoint) => Some(
            otel::install(&endpoint, &config.name)
                .with_context(|| format!("telemetry.otlp_endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT) = {endpoint}"))?,
        ),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(3)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        let daemon = Daemon::start(config).await?;
        let scheme = if daemon.https { "https" } else { "http" };
        let metrics = daemon.metrics_addr().map(|at| format!("{scheme}://{at}/metrics"));
        let dashboard = daemon.metrics_addr().map(|at| format!("{scheme}://{at}/"));
        if json {
            let started = serde_json::json!({ "event": "daemon", "node": daemon.name(), "listen": daemon.addr(), "metrics": metrics, "dashboard": dashboard });
            println!("{started}");
        } else {
            println!("troupe daemon {} listening on {}", daemon.name(), daemon.addr());
            if let (Some(metrics), Some(dashboard)) = (&metrics, &dashboard) {
                println!("troupe daemon {} metrics on {metrics}", daemon.name());
                println!("troupe daemon {} dashboard on {dashboard}", daemon.name());
            }
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = wait_stopped(&daemon) => return Ok(daemon.stop_error()?),
            _ = parent_gone(exit_with_parent) => tracing::warn!(node = daemon.name(), "the parent process died"),
        }
        tracing::info!(node = daemon.name(), "draining");
        Ok(daemon.drain().await?)
    })
}

async fn parent_gone(enabled: bool) {
    if !enabled {
        return std::future::pending().await;
    }
    let parent = std::os::unix::process::parent_id();
    while std::os::unix::process::parent_id() == parent {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_stopped(daemon: &Daemon) {
    while daemon.is_running() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Logs to stderr; `RUST_LOG` filters (default: info for troupe, warn for the rest).
pub fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("warn,troupe_actors=info,troupe_cluster=info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
