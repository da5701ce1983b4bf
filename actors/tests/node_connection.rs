//! A node's connection to the controller (actors/src/runtime/node.rs) when the two ways the node actor
//! hears about it — the dialing task's `NodeMsg::Connected`, and the control endpoint's events — arrive
//! in the other order: the deterministic simulation (chaos-tests/src/sim) found a node that then held a
//! dead connection for good.

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::time::Duration;

use common::wait_for;
use ractor::ActorRef;
use troupe_actors::daemon::{Daemon, NodeConfig};
use troupe_actors::runtime::node::{actor_scope, NodeMsg};
use troupe_cluster::{add_node, init_cluster, TransportConfig};

/// A dial to an address nobody serves gives up after this long (so the test need not wait 10 s).
const CONNECT_TIMEOUT_MS: u64 = 300;

fn config(dir: &Path, name: &str, listen: SocketAddr, join: Option<SocketAddr>) -> NodeConfig {
    NodeConfig {
        name: name.into(),
        listen,
        join,
        data_dir: dir.join(name),
        certs: dir.join("certs"),
        slots: Some(1),
        devices: None,
        torch_threads: 1,
        membership: Default::default(),
        restart: Default::default(),
        transport: TransportConfig { connect_timeout_ms: CONNECT_TIMEOUT_MS, ..TransportConfig::loopback() },
        telemetry: Default::default(),
        allow_plaintext_tcp: false,
        controllers: Vec::new(),
        raft_listen: None,
    }
}

/// A loopback address no socket holds right now.
fn unused_addr() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free UDP port")
}

/// The dialing task reports a connection to the controller that is already gone (its `Lost` came, through
/// the endpoint's event channel, before this report): the node must not take it, or it never dials again
/// — here, it would never join the controller that starts afterwards at the address it dials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_told_of_a_connection_already_gone_dials_again() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    init_cluster(&certs).unwrap();
    for name in ["node-0", "node-1"] {
        add_node(name, &certs).unwrap();
    }
    let controller_addr = unused_addr();
    let local = "127.0.0.1:0".parse().unwrap();
    let node = Daemon::start(config(dir.path(), "node-1", local, Some(controller_addr))).await.unwrap();
    let name = format!("{}/node", actor_scope("node-1", node.addr()));
    let actor: ActorRef<NodeMsg> = ractor::registry::where_is(name).expect("the node actor is registered").into();

    actor.cast(NodeMsg::Connected(controller_addr, Ok("node-0".into()))).unwrap();
    // Every dial started before that report has given up by now.
    tokio::time::sleep(Duration::from_millis(3 * CONNECT_TIMEOUT_MS)).await;
    let controller = Daemon::start(config(dir.path(), "node-0", controller_addr, None)).await.unwrap();
    wait_for(Duration::from_secs(10), "node-1 to join the controller", || async {
        let status = controller.status().await.unwrap();
        status.members.iter().any(|m| m.name == "node-1").then_some(())
    })
    .await;
    node.drain().await.unwrap();
    controller.drain().await.unwrap();
}
