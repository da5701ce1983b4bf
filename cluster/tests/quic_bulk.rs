//! Bulk traffic over real QUIC (two transports in one process, loopback profile): many large messages in
//! both directions at once, receives deliberately delayed. Regression test for the stall where quinn's
//! GSO batches above 64 KiB (10 packets × a discovered MTU of 32 768) were refused by the kernel with
//! EMSGSIZE and silently dropped, until the connection went silent and hit the idle timeout.

mod support;

use std::net::UdpSocket;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use troupe_cluster::transport::quic::{PeerInfo, QuicTransport};
use troupe_cluster::transport::{LossScope, Transport};
use troupe_cluster::wire::Tag;

const MESSAGES: u32 = 48;
const MESSAGE_BYTES: usize = 4 << 20;

fn payload(from: usize, i: u32) -> Bytes {
    let seed = (from as u32) * 1000 + i;
    Bytes::from((0..MESSAGE_BYTES).map(|k| (k as u32).wrapping_mul(31).wrapping_add(seed) as u8).collect::<Vec<_>>())
}

async fn exchange(t: Arc<QuicTransport>) -> Duration {
    let peer = 1 - t.rank();
    let started = Instant::now();
    let sends = async {
        for i in 0..MESSAGES {
            t.send(peer, Tag { epoch: 1, seq: i as u64, ..Tag::default() }, payload(t.rank(), i)).await.unwrap();
        }
    };
    let recvs = async {
        // Nobody asks for the messages for a while: the transport must keep reading regardless.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for i in 0..MESSAGES {
            let got = t.recv(peer, Tag { epoch: 1, seq: i as u64, ..Tag::default() }, LossScope::Peer, 60_000).await;
            let got = got.unwrap_or_else(|e| panic!("rank {} message {i}: {e}", t.rank()));
            assert!(got.to_vec() == payload(peer, i), "rank {} message {i} corrupted", t.rank());
        }
    };
    tokio::join!(sends, recvs);
    started.elapsed()
}

#[test]
fn many_large_messages_both_ways_with_delayed_reads() {
    let dir = tempfile::tempdir().unwrap();
    let ids = support::cluster(dir.path(), &["a", "b"]);
    let sockets: Vec<UdpSocket> = (0..2).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    let roster: Vec<PeerInfo> = ["a", "b"]
        .iter()
        .zip(&sockets)
        .map(|(n, s)| PeerInfo { name: n.to_string(), addr: s.local_addr().unwrap() })
        .collect();
    drop(sockets);
    // The default idle timeout (2 s): the stall showed up as both sides timing out.
    let config = support::config();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let connects =
            ids.iter().enumerate().map(|(rank, id)| QuicTransport::connect(id, rank, roster.clone(), config.clone()));
        let ts: Vec<Arc<QuicTransport>> =
            futures::future::try_join_all(connects).await.unwrap().into_iter().map(Arc::new).collect();
        let handles: Vec<_> = ts.iter().map(|t| tokio::spawn(exchange(t.clone()))).collect();
        for h in handles {
            let took = h.await.unwrap();
            eprintln!("exchange took {took:?}");
        }
        for t in &ts {
            let peer = 1 - t.rank();
            let path = t.listener().connection(peer).unwrap().stats().path;
            eprintln!("rank {} path: {path:?}", t.rank());
            // Dropped GSO batches made quinn see bursts of lost large packets and declare MTU black holes.
            assert_eq!(path.black_holes_detected, 0, "rank {}: {path:?}", t.rank());
            assert!(path.current_mtu > 1452, "rank {}: MTU discovery collapsed: {path:?}", t.rank());
        }
        futures::future::join_all(ts.iter().map(|t| t.shutdown())).await;
    });
}
