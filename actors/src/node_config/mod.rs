//! `node.toml`: what `troupe daemon --config` reads. Every key is checked; an error names the key and
//! the fix.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use troupe_cluster::identity::validate_node_name;
use troupe_cluster::membership::MembershipConfig;
use troupe_cluster::TransportConfig;

pub mod controllers;
pub mod devices;
pub mod restart;

use crate::protocol::SlotDevice;
use crate::telemetry::TelemetryConfig;
use devices::Devices;
use restart::RestartPolicy;

/// Most device slots one node may offer.
pub const SLOTS_MAX: u32 = 64;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's name: a certificate `certs/nodes/NAME.pem` must exist for it.
    pub name: String,
    /// Where the daemon listens (UDP, QUIC), e.g. "10.0.0.5:7400".
    pub listen: SocketAddr,
    /// The controller's address. Absent: this node is the controller (the first node of a cluster).
    #[serde(default)]
    pub join: Option<SocketAddr>,
    /// Where the daemon keeps its metadata: its catalog (redb, `daemon.redb`).
    pub data_dir: PathBuf,
    /// The cluster directory made by `troupe cluster init` / `add-node` (ca.pem, nodes/NAME.pem).
    pub certs: PathBuf,
    /// CPU slots this node offers (one worker each; absent: 1). With `devices`, the slots are the
    /// devices: leave `slots` out (or give their number).
    #[serde(default)]
    pub slots: Option<u32>,
    /// The CUDA devices this node offers, one slot each: `"cuda"` (every visible GPU) or ordinals
    /// (`[0, 1]`); absent: CPU slots (`devices`).
    #[serde(default)]
    pub devices: Option<Devices>,
    /// libtorch threads of this daemon (0: the machine's cores shared by its slots).
    #[serde(default)]
    pub torch_threads: usize,
    #[serde(default)]
    pub membership: MembershipConfig,
    #[serde(default)]
    pub restart: RestartPolicy,
    #[serde(default = "TransportConfig::loopback")]
    pub transport: TransportConfig,
    /// Whether jobs may choose `data_plane = plaintext_tcp` (tensors between hosts unencrypted: for a
    /// fabric no one else can read or write). Read on the controller, which refuses such a job
    /// otherwise. Default: refused.
    #[serde(default)]
    pub allow_plaintext_tcp: bool,
    /// `/metrics` and `/status` over HTTP, the MFU peak, OTLP export (all off when absent).
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// The controller-eligible daemons (`node_config::controllers`): absent or one, the single
    /// controller of today; 3 or 5 (at most 7) as "NAME@HOST:PORT" (the Raft address), a replicated
    /// controller. Every node lists the same.
    #[serde(default)]
    pub controllers: Vec<String>,
    /// Where this node's Raft endpoint listens when it is not in `controllers` but is to be made a
    /// controller at run time (`troupe cluster controllers add NAME --address` this address).
    #[serde(default)]
    pub raft_listen: Option<SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeConfigError {
    #[error("cannot read node config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("node config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("node config {path}: `{key}`: {message}")]
    Invalid { path: String, key: &'static str, message: String },
}

impl NodeConfig {
    /// The names of the controller-eligible nodes (`controllers`; the entries' Raft addresses left out).
    /// Unparseable entries are left out too: [`NodeConfig::validate`] refuses them.
    pub fn controller_names(&self) -> Vec<String> {
        self.controllers.iter().filter_map(|c| controllers::ControllerEntry::parse(c).ok()).map(|e| e.name).collect()
    }

    /// The slots this node offers on this machine (`devices::resolve`): CPU slots, or the CUDA devices
    /// `devices` names as the driver finds them. An error names the key and the fix.
    pub fn slot_devices(&self, origin: &str) -> Result<Vec<SlotDevice>, NodeConfigError> {
        devices::resolve(self.devices.as_ref(), self.slots, devices::Probe::machine)
            .map_err(|(key, message)| NodeConfigError::Invalid { path: origin.into(), key, message })
    }

    pub fn load(path: &Path) -> Result<Self, NodeConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| NodeConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, origin: &str) -> Result<Self, NodeConfigError> {
        let config: Self =
            toml::from_str(text).map_err(|e| NodeConfigError::Parse { path: origin.into(), message: e.to_string() })?;
        config.validate(origin)?;
        Ok(config)
    }

    pub fn validate(&self, origin: &str) -> Result<(), NodeConfigError> {
        let bad = |key, message: String| NodeConfigError::Invalid { path: origin.into(), key, message };
        validate_node_name(&self.name).map_err(|m| bad("name", m))?;
        if let Some(slots) = self.slots.filter(|s| *s > SLOTS_MAX) {
            return Err(bad("slots", format!("{slots} is not in 0..={SLOTS_MAX}")));
        }
        if let Some(devices) = &self.devices {
            devices.validate().map_err(|m| bad("devices", m))?;
        }
        if self.join == Some(self.listen) {
            return Err(bad("join", "is this node's own `listen` address; leave `join` out on the controller".into()));
        }
        self.membership.validate().map_err(|m| bad("membership", m))?;
        self.telemetry.validate().map_err(|(key, m)| bad(key, m))?;
        let (_, warnings) = controllers::check(&self.name, self.listen, self.join, &self.controllers)
            .map_err(|m| bad("controllers", m))?;
        controllers::check_raft_listen(&self.name, self.listen, self.raft_listen, &self.controllers)
            .map_err(|m| bad("raft_listen", m))?;
        for warning in warnings {
            tracing::warn!(config = origin, "`controllers`: {warning}");
        }
        let ca = self.certs.join("ca.pem");
        if !ca.exists() {
            return Err(bad(
                "certs",
                format!(
                    "{} has no ca.pem; run `troupe cluster init --dir {}` first",
                    self.certs.display(),
                    self.certs.display()
                ),
            ));
        }
        let cert = self.certs.join("nodes").join(format!("{}.pem", self.name));
        if !cert.exists() {
            return Err(bad(
                "certs",
                format!(
                    "no certificate for node {:?} ({} is missing); run `troupe cluster add-node {} --dir {}`",
                    self.name,
                    cert.display(),
                    self.name,
                    self.certs.display()
                ),
            ));
        }
        Ok(())
    }
}
