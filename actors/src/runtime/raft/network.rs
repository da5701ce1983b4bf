//! Raft's RPCs over the mutually-authenticated QUIC control plane ([`ControlEndpoint`]): a request
//! carries an id, the answer names it, and a pending map hands it to the caller (request id → oneshot).
//! Messages are JSON. The group has an endpoint of its own this session ([`RaftEndpoint`], node.toml's
//! controller address), so that its traffic neither waits behind nor is parsed by the node's protocol;
//! riding on the node's endpoint is for the integration (docs/runtime-semantics.md).
//!
//! Connections: the lower-named of two controllers dials the higher-named one (a connector task keeps
//! those connections up), never the other way, because two nodes dialing each other at once may each
//! keep the connection the other replaced (`troupe_cluster::control`, "Replacement"). A call to a
//! higher-named peer that is not connected fails as `Unreachable` at once (openraft backs off and
//! retries); a call that gets no answer within openraft's TTL fails as `Timeout`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::RPCTypes;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use troupe_cluster::control::{ControlEndpoint, ControlEvent, PeerRole};
use troupe_cluster::{ClusterError, NodeIdentity, TransportConfig};

use super::{Controller, NodeId, Raft, TypeConfig};

/// The Raft group's own control-plane endpoint.
pub struct RaftEndpoint {
    pub(super) endpoint: ControlEndpoint,
    pub(super) events: mpsc::UnboundedReceiver<ControlEvent>,
}

impl RaftEndpoint {
    /// Binds `addr` (port 0 allowed) with this node's certificate.
    pub fn bind(id: &NodeIdentity, addr: SocketAddr, transport: &TransportConfig) -> Result<Self, ClusterError> {
        let (endpoint, events) = ControlEndpoint::bind(id, addr, PeerRole::Node, transport)?;
        Ok(RaftEndpoint { endpoint, events })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr()
    }
}

#[derive(Serialize, Deserialize)]
enum Wire {
    Request { id: u64, rpc: Rpc },
    Response { id: u64, reply: Reply },
}

#[derive(Serialize, Deserialize)]
enum Rpc {
    Append(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    Snapshot(InstallSnapshotRequest<TypeConfig>),
}

#[derive(Serialize, Deserialize)]
enum Reply {
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
}

/// Why a call got no answer.
enum Failed {
    Unreachable(String),
    Timeout,
}

/// The calls in flight and the connections they ride on; shared by the network clients and the task
/// serving incoming messages.
pub(super) struct Rpcs {
    me: NodeId,
    endpoint: ControlEndpoint,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    next_id: AtomicU64,
    /// The peers being dialed: one dial per peer at a time, so that two do not replace each other's
    /// connection.
    dialing: Mutex<HashSet<String>>,
}

impl Rpcs {
    pub(super) fn new(me: NodeId, endpoint: ControlEndpoint) -> Arc<Self> {
        Arc::new(Rpcs {
            me,
            endpoint,
            pending: Mutex::default(),
            next_id: AtomicU64::new(1),
            dialing: Mutex::default(),
        })
    }

    /// Connects to `peer` if this node is the one that dials it (the lower name) and it is not connected.
    pub(super) async fn ensure_connected(&self, peer: &Controller) -> Result<(), String> {
        if self.endpoint.is_connected(&peer.name) {
            return Ok(());
        }
        if self.endpoint.name() == peer.name {
            return Err("this node".into());
        }
        if self.endpoint.name() > peer.name.as_str() {
            return Err(format!("not connected; {} dials this node", peer.name));
        }
        if !self.dialing.lock().expect("dialing").insert(peer.name.clone()) {
            return Err(format!("dialing {} already", peer.name));
        }
        let _dialed = Dialed { rpcs: self, peer: &peer.name };
        let addr: SocketAddr = peer.addr.parse().map_err(|e| format!("address {:?}: {e}", peer.addr))?;
        let name = self.endpoint.connect(addr).await.map_err(|e| e.to_string())?;
        if name != peer.name {
            self.endpoint.disconnect(&name).await;
            return Err(format!("{addr} answered as {name}, not {}", peer.name));
        }
        Ok(())
    }

    async fn call(&self, peer: &Controller, rpc: Rpc, ttl: Duration) -> Result<Reply, Failed> {
        let work = async {
            self.ensure_connected(peer).await.map_err(Failed::Unreachable)?;
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            self.pending.lock().expect("pending calls").insert(id, tx);
            let body = Bytes::from(serde_json::to_vec(&Wire::Request { id, rpc }).expect("an RPC serialises"));
            if let Err(e) = self.endpoint.send(&peer.name, 0, body).await {
                self.pending.lock().expect("pending calls").remove(&id);
                return Err(Failed::Unreachable(e.to_string()));
            }
            let _forget = Forget { rpcs: self, id };
            rx.await.map_err(|_| Failed::Unreachable("the group shut down".into()))
        };
        tokio::time::timeout(ttl, work).await.unwrap_or(Err(Failed::Timeout))
    }

    fn answer(&self, id: u64, reply: Reply) {
        if let Some(tx) = self.pending.lock().expect("pending calls").remove(&id) {
            let _ = tx.send(reply);
        }
    }
}

struct Dialed<'a> {
    rpcs: &'a Rpcs,
    peer: &'a str,
}

impl Drop for Dialed<'_> {
    fn drop(&mut self) {
        self.rpcs.dialing.lock().expect("dialing").remove(self.peer);
    }
}

/// Removes a call's entry when the caller stops waiting (answered, timed out or dropped).
struct Forget<'a> {
    rpcs: &'a Rpcs,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.rpcs.pending.lock().expect("pending calls").remove(&self.id);
    }
}

/// Serves incoming requests with `raft` and hands answers to their callers, until the endpoint closes.
pub(super) async fn serve(rpcs: Arc<Rpcs>, mut events: mpsc::UnboundedReceiver<ControlEvent>, raft: Raft) {
    while let Some(event) = events.recv().await {
        let ControlEvent::Message { from, body, .. } = event else { continue };
        match serde_json::from_slice::<Wire>(&body) {
            Ok(Wire::Response { id, reply }) => rpcs.answer(id, reply),
            Ok(Wire::Request { id, rpc }) => {
                let (rpcs, raft) = (rpcs.clone(), raft.clone());
                tokio::spawn(async move {
                    let reply = match rpc {
                        Rpc::Append(req) => Reply::Append(raft.append_entries(req).await),
                        Rpc::Vote(req) => Reply::Vote(raft.vote(req).await),
                        Rpc::Snapshot(req) => Reply::Snapshot(raft.install_snapshot(req).await),
                    };
                    let body =
                        Bytes::from(serde_json::to_vec(&Wire::Response { id, reply }).expect("a reply serialises"));
                    if let Err(e) = rpcs.endpoint.send(&from, 0, body).await {
                        tracing::debug!(peer = %from, error = %e, "raft: answer not sent");
                    }
                });
            }
            Err(e) => tracing::warn!(peer = %from, error = %e, "raft: a message that is not a Raft RPC, ignored"),
        }
    }
}

/// openraft's network factory: one client per target.
pub(super) struct Network {
    pub(super) rpcs: Arc<Rpcs>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Controller) -> PeerClient {
        PeerClient { rpcs: self.rpcs.clone(), target, node: node.clone() }
    }
}

pub(super) struct PeerClient {
    rpcs: Arc<Rpcs>,
    target: NodeId,
    node: Controller,
}

impl PeerClient {
    async fn call<T, E: std::error::Error>(
        &self,
        rpc: Rpc,
        action: RPCTypes,
        option: &RPCOption,
        pick: fn(Reply) -> Option<Result<T, E>>,
    ) -> Result<T, RPCError<NodeId, Controller, E>> {
        let ttl = option.hard_ttl();
        match self.rpcs.call(&self.node, rpc, ttl).await {
            Ok(reply) => match pick(reply) {
                Some(Ok(answer)) => Ok(answer),
                Some(Err(e)) => {
                    Err(RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e)))
                }
                None => Err(RPCError::Network(NetworkError::new(&std::io::Error::other("an answer of another kind")))),
            },
            Err(Failed::Unreachable(why)) => {
                Err(RPCError::Unreachable(Unreachable::new(&std::io::Error::other(format!("{}: {why}", self.node)))))
            }
            Err(Failed::Timeout) => {
                Err(RPCError::Timeout(Timeout { action, id: self.rpcs.me, target: self.target, timeout: ttl }))
            }
        }
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, Controller, RaftError<NodeId>>> {
        self.call(Rpc::Append(rpc), RPCTypes::AppendEntries, &option, |r| match r {
            Reply::Append(r) => Some(r),
            _ => None,
        })
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RPCError<NodeId, Controller, RaftError<NodeId, InstallSnapshotError>>>
    {
        self.call(Rpc::Snapshot(rpc), RPCTypes::InstallSnapshot, &option, |r| match r {
            Reply::Snapshot(r) => Some(r),
            _ => None,
        })
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, Controller, RaftError<NodeId>>> {
        self.call(Rpc::Vote(rpc), RPCTypes::Vote, &option, |r| match r {
            Reply::Vote(r) => Some(r),
            _ => None,
        })
        .await
    }

    fn backoff(&self) -> openraft::network::Backoff {
        // A peer is back within a heartbeat or two of its restart (the default waits 500 ms).
        openraft::network::Backoff::new(std::iter::repeat(Duration::from_millis(100)))
    }
}
