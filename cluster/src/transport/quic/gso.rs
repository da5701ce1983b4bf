//! A UDP socket for quinn that never hands the kernel a GSO batch larger than one UDP datagram may be.
//!
//! quinn batches up to 10 equal-sized QUIC packets into one `sendmsg` with `UDP_SEGMENT` (GSO). Linux
//! refuses a GSO send whose total payload exceeds what one UDP datagram can carry (65 507 bytes over
//! IPv4) with `EMSGSIZE`, and quinn-udp treats `EMSGSIZE` as a silently lost packet (it expects it only
//! for oversized MTU probes). Once MTU discovery raises the path MTU above ~6.5 kB — as it does on
//! loopback, where the upper bound is 32 768 — every multi-packet transmit is thrown away without a
//! trace: quinn counts thousands of "lost" packets the kernel never saw, collapses its congestion
//! window, declares MTU black holes, and when the retransmissions and probes are themselves batched,
//! nothing reaches the peer at all until the idle timeout kills the connection.
//!
//! [`GsoSplitSocket`] wraps quinn's own socket and cuts such a transmit into batches that each fit.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// The most payload one UDP datagram (and so one GSO batch) may carry over IPv4: 65 535 − 20 − 8.
/// (IPv6 allows 65 527; the smaller bound serves both.)
pub const UDP_PAYLOAD_MAX_BYTES: usize = 65_507;

/// Splits `transmit` into pieces of whole segments, each at most [`UDP_PAYLOAD_MAX_BYTES`], and
/// calls `send` for each in order (stopping at the first error).
pub fn send_split(transmit: &Transmit<'_>, mut send: impl FnMut(&Transmit<'_>) -> io::Result<()>) -> io::Result<()> {
    let Some(segment) = transmit.segment_size.filter(|_| transmit.contents.len() > UDP_PAYLOAD_MAX_BYTES) else {
        return send(transmit);
    };
    let per_batch = (UDP_PAYLOAD_MAX_BYTES / segment.max(1)).max(1);
    for piece in transmit.contents.chunks(per_batch * segment) {
        let part = Transmit {
            destination: transmit.destination,
            ecn: transmit.ecn,
            contents: piece,
            segment_size: (piece.len() > segment).then_some(segment),
            src_ip: transmit.src_ip,
        };
        // On `WouldBlock` quinn retries the whole transmit once the socket is writable; pieces that
        // already went out are then sent twice, which the peer discards as duplicate packet numbers
        // (cheaper than having loss recovery shrink the window for packets we dropped ourselves).
        send(&part)?;
    }
    Ok(())
}

pub struct GsoSplitSocket {
    inner: Arc<dyn AsyncUdpSocket>,
}

impl GsoSplitSocket {
    pub fn new(inner: Arc<dyn AsyncUdpSocket>) -> Arc<Self> {
        Arc::new(GsoSplitSocket { inner })
    }
}

impl fmt::Debug for GsoSplitSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GsoSplitSocket").field("inner", &self.inner).finish()
    }
}

impl AsyncUdpSocket for GsoSplitSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        send_split(transmit, |t| self.inner.try_send(t))
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(len: usize, segment: Option<usize>) -> Vec<(usize, Option<usize>)> {
        let data = vec![0u8; len];
        let t = Transmit {
            destination: "127.0.0.1:1".parse().unwrap(),
            ecn: None,
            contents: &data,
            segment_size: segment,
            src_ip: None,
        };
        let mut out = Vec::new();
        send_split(&t, |p| {
            out.push((p.contents.len(), p.segment_size));
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn small_batches_pass_through() {
        assert_eq!(sizes(10 * 1452, Some(1452)), vec![(14_520, Some(1452))]);
        assert_eq!(sizes(40_000, None), vec![(40_000, None)]);
    }

    #[test]
    fn large_batches_are_split_into_datagram_sized_pieces() {
        assert_eq!(sizes(10 * 32_768 - 100, Some(32_768)).len(), 10);
        assert!(sizes(10 * 32_768, Some(32_768)).iter().all(|&(n, s)| n == 32_768 && s.is_none()));
        let p = sizes(10 * 16_000 - 7, Some(16_000));
        assert_eq!(p, vec![(64_000, Some(16_000)), (64_000, Some(16_000)), (31_993, Some(16_000))]);
        assert!(p.iter().all(|&(n, _)| n <= UDP_PAYLOAD_MAX_BYTES));
    }
}
