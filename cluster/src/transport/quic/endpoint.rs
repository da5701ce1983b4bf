//! Building a tuned quinn endpoint (server and client roles) from a [`TransportConfig`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{EndpointConfig, IdleTimeout, MtuDiscoveryConfig, VarInt};

use super::gso::GsoSplitSocket;
use crate::identity::{client_config, server_config, NodeIdentity};
use crate::{ClusterError, TransportConfig};

/// After a suspected MTU black hole (bursts of large packets lost, e.g. to a full socket buffer on a
/// loaded host), how soon discovery may try large packets again (quinn's default is a minute).
const MTU_BLACK_HOLE_COOLDOWN_MS: u64 = 2_000;

pub fn quinn_transport_config(cfg: &TransportConfig) -> Result<quinn::TransportConfig, ClusterError> {
    let mut t = quinn::TransportConfig::default();
    let idle = IdleTimeout::try_from(Duration::from_millis(cfg.idle_timeout_ms))
        .map_err(|e| ClusterError::Tls(format!("idle_timeout_ms: {e}")))?;
    t.max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(Duration::from_millis(cfg.keep_alive_interval_ms)))
        .stream_receive_window(VarInt::from_u32(cfg.stream_receive_window_bytes))
        .receive_window(VarInt::from_u32(cfg.connection_receive_window_bytes))
        .send_window(cfg.send_window_bytes)
        .max_concurrent_uni_streams(VarInt::from_u32(cfg.concurrent_streams_max))
        .max_concurrent_bidi_streams(VarInt::from_u32(0))
        // Streams go out in the order they were written, each whole, rather than round-robin: a
        // collective's slices are messages its peer reduces as each one completes, so finishing the
        // first while the next arrives overlaps the reduction with the transfer (round-robin finishes
        // every message of a step at about the same time, and the peer idles, then reduces, then
        // idles again).
        .send_fairness(false)
        .enable_segmentation_offload(true);
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(cfg.mtu_upper_bound_bytes).black_hole_cooldown(Duration::from_millis(MTU_BLACK_HOLE_COOLDOWN_MS));
    t.mtu_discovery_config(Some(mtu));
    Ok(t)
}

fn udp_socket(addr: SocketAddr, buffer_bytes: usize) -> Result<std::net::UdpSocket, ClusterError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let io = |what: &str, e| ClusterError::io(format!("{what} UDP socket {addr}"), e);
    let socket =
        Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(|e| io("creating", e))?;
    // Best effort: the kernel caps these at net.core.{r,w}mem_max.
    let _ = socket.set_recv_buffer_size(buffer_bytes);
    let _ = socket.set_send_buffer_size(buffer_bytes);
    socket.bind(&addr.into()).map_err(|e| io("binding", e))?;
    Ok(socket.into())
}

/// An endpoint that accepts connections (requiring a client certificate from the cluster CA) and
/// dials with this node's certificate.
pub fn bind_endpoint(
    id: &NodeIdentity,
    addr: SocketAddr,
    cfg: &TransportConfig,
) -> Result<quinn::Endpoint, ClusterError> {
    let transport = Arc::new(quinn_transport_config(cfg)?);
    let server_crypto = QuicServerConfig::try_from(server_config(id)?).map_err(|e| ClusterError::Tls(e.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport.clone());
    let client_crypto = QuicClientConfig::try_from(client_config(id)?).map_err(|e| ClusterError::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport);

    let mut endpoint_cfg = EndpointConfig::default();
    endpoint_cfg
        .max_udp_payload_size(cfg.mtu_upper_bound_bytes.max(1200))
        .map_err(|e| ClusterError::Tls(format!("mtu_upper_bound_bytes: {e}")))?;
    let socket = udp_socket(addr, cfg.socket_buffer_bytes)?;
    let runtime: Arc<dyn quinn::Runtime> = Arc::new(quinn::TokioRuntime);
    let start_err = |e| ClusterError::io(format!("starting QUIC endpoint on {addr}"), e);
    let socket = GsoSplitSocket::new(runtime.wrap_udp_socket(socket).map_err(start_err)?);
    let mut endpoint =
        quinn::Endpoint::new_with_abstract_socket(endpoint_cfg, Some(server), socket, runtime).map_err(start_err)?;
    endpoint.set_default_client_config(client);
    Ok(endpoint)
}
