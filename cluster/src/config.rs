//! Every limit and timeout of the transport and the collectives, each with its unit in its name.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// Largest payload one frame may carry; a larger announced length closes the connection.
    /// Bigger messages are split into frames of at most this size.
    pub frame_bytes_max: u32,
    /// Most frames one message may be split into (bounds reassembly state per message).
    pub message_frames_max: u16,
    /// Messages buffered per peer that no receive has asked for yet; more closes the connection.
    pub unmatched_messages_max: usize,
    /// No packet from a peer for this long: the connection is dead and the peer is lost.
    pub idle_timeout_ms: u64,
    /// Keep-alive ping interval; must be well under `idle_timeout_ms`.
    pub keep_alive_interval_ms: u64,
    /// How long establishing the mesh may take before it fails.
    pub connect_timeout_ms: u64,
    /// Backstop for any single receive inside a collective (peer loss normally surfaces sooner).
    pub collective_timeout_ms: u64,
    /// QUIC per-stream receive window. Keep ≤ 2 MiB (quinn issue 2809).
    pub stream_receive_window_bytes: u32,
    /// QUIC connection-wide receive window.
    pub connection_receive_window_bytes: u32,
    /// QUIC send window per connection.
    pub send_window_bytes: u64,
    /// Concurrent unidirectional streams a peer may open (one per in-flight message).
    pub concurrent_streams_max: u32,
    /// Upper bound for QUIC path-MTU discovery (1452 is quinn's default; loopback allows ~65 000).
    pub mtu_upper_bound_bytes: u16,
    /// Kernel UDP socket buffer sizes requested (capped by net.core.{r,w}mem_max).
    pub socket_buffer_bytes: usize,
    /// All-reduce below this size uses recursive doubling (latency-optimal); at or above, the ring.
    pub small_message_bytes_max: usize,
    /// Large collectives are cut into slices of about this many bytes, run as a pipeline.
    pub pipeline_slice_bytes: usize,
    /// Same-host transport: each rank's shared-memory slot for collectives (two per rank, in
    /// /dev/shm); 0 runs collectives over the sockets instead. Every rank must use the same value.
    pub shared_memory_slot_bytes: usize,
    /// Beside each node-to-node control connection, a TLS-over-TCP companion on the QUIC port's number:
    /// its end without `close_notify` is the peer process's kernel saying the process died, reported at
    /// once. `false`: no listener, no companion; a dead peer is found by heartbeats and the QUIC idle
    /// timeout only (for networks where that TCP port is closed).
    pub companion_tcp: bool,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            frame_bytes_max: 16 << 20,
            message_frames_max: 4096,
            unmatched_messages_max: 4096,
            idle_timeout_ms: 2_000,
            keep_alive_interval_ms: 400,
            connect_timeout_ms: 10_000,
            collective_timeout_ms: 60_000,
            stream_receive_window_bytes: 2 << 20,
            connection_receive_window_bytes: 64 << 20,
            send_window_bytes: 64 << 20,
            concurrent_streams_max: 1024,
            mtu_upper_bound_bytes: 1452,
            socket_buffer_bytes: 4 << 20,
            small_message_bytes_max: 64 << 10,
            pipeline_slice_bytes: 4 << 20,
            shared_memory_slot_bytes: 1 << 20,
            companion_tcp: true,
        }
    }
}

impl TransportConfig {
    /// Tuned for ranks on one machine talking over the loopback interface (MTU 65 536): QUIC packets
    /// of up to 65 000 bytes (under the 65 507-byte UDP payload limit of IPv4), so that per-packet
    /// costs (crypto setup, headers, syscalls) are paid ~45× less often than at 1 452. A 4 MiB
    /// connection receive window: at a loopback RTT well under a millisecond it still allows several
    /// GB/s, and it bounds what a peer can have in flight to about what the kernel's UDP receive
    /// buffer (`net.core.rmem_max`, often 4 MiB) holds, so a descheduled receiver does not overflow
    /// it (measured: hundreds of packets dropped per benchmark run at 64 MiB, none at 4 MiB).
    pub fn loopback() -> Self {
        TransportConfig { mtu_upper_bound_bytes: 65_000, connection_receive_window_bytes: 4 << 20, ..Self::default() }
    }
}
