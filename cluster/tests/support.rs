//! Shared helpers for the QUIC integration tests (included with `mod support;`).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use troupe_cluster::transport::quic::{bind_endpoint, PeerInfo, QuicListener};
use troupe_cluster::transport::{frame_control, FrameLimits, Mailbox};
use troupe_cluster::wire::{ControlMessage, FrameKind};
use troupe_cluster::{add_node, init_cluster, NodeIdentity, TransportConfig};

pub fn cluster(dir: &Path, names: &[&str]) -> Vec<NodeIdentity> {
    init_cluster(dir).unwrap();
    names
        .iter()
        .map(|n| {
            add_node(n, dir).unwrap();
            NodeIdentity::load(dir, n).unwrap()
        })
        .collect()
}

pub fn config() -> TransportConfig {
    TransportConfig { connect_timeout_ms: 5_000, ..TransportConfig::loopback() }
}

/// A listener for rank 0 of `roster` (whose addresses other than rank 0's are unused).
pub fn listener(id: &NodeIdentity, roster_names: &[&str]) -> (QuicListener, SocketAddr) {
    let cfg = config();
    let endpoint = bind_endpoint(id, "127.0.0.1:0".parse().unwrap(), &cfg).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let roster = roster_names.iter().map(|n| PeerInfo { name: n.to_string(), addr }).collect();
    let mailbox = Arc::new(Mailbox::new(0, cfg.unmatched_messages_max));
    (QuicListener::start(endpoint, 0, roster, mailbox, FrameLimits::from(&cfg), 2_000), addr)
}

/// Dials `addr` as `id`, says hello as `rank` of `world`.
pub async fn dial(id: &NodeIdentity, addr: SocketAddr, server_name: &str, rank: u32, world: u32) -> quinn::Connection {
    let endpoint = bind_endpoint(id, "127.0.0.1:0".parse().unwrap(), &config()).unwrap();
    let conn = endpoint.connect(addr, server_name).unwrap().await.unwrap();
    let mut s = conn.open_uni().await.unwrap();
    s.write_all(&frame_control(FrameKind::Hello, &ControlMessage::Hello { node: id.name.clone(), rank, world }))
        .await
        .unwrap();
    s.finish().unwrap();
    conn
}
