//! Malformed frames of every kind close the connection that sent them, with the reason; the listener
//! keeps serving the other peers, and no frame makes it allocate what the frame states.

mod support;

use std::time::Duration;

use bytes::Bytes;
use support::{cluster, dial, listener};
use troupe_cluster::transport::quic::CLOSE_PROTOCOL;
use troupe_cluster::transport::{frame_control, frame_message, LossScope};
use troupe_cluster::wire::{crc32, ControlMessage, FrameHeader, FrameKind, Tag, HEADER_BYTES};

fn header(kind: FrameKind, length: u32, part_index: u16, part_count: u16) -> [u8; HEADER_BYTES] {
    FrameHeader { kind, tag: Tag { group: 0, epoch: 1, seq: 0, step: 0 }, part_index, part_count, length }.encode()
}

fn resealed(mut b: [u8; HEADER_BYTES]) -> Vec<u8> {
    let c = crc32(&b[..40]);
    b[40..].copy_from_slice(&c.to_le_bytes());
    b.to_vec()
}

fn cases() -> Vec<(&'static str, &'static str, Vec<Vec<u8>>)> {
    let data = |len: u32| header(FrameKind::Data, len, 0, 1);
    let mut bad_magic = data(4);
    bad_magic[0] = b'X';
    let mut version = data(4);
    version[4] = 99;
    let mut checksum = data(4);
    checksum[20] ^= 0xff;
    let mut kind = data(4);
    kind[5] = 42;
    let oversized = header(FrameKind::Data, u32::MAX, 0, 1);
    let too_many_parts = header(FrameKind::Data, 4, 0, u16::MAX);
    let out_of_order = header(FrameKind::Data, 4, 1, 2);
    let bad_json = [header(FrameKind::Control, 9, 0, 1).to_vec(), b"{not json".to_vec()].concat();
    let second_hello =
        frame_control(FrameKind::Hello, &ControlMessage::Hello { node: "x".into(), rank: 1, world: 2 }).to_vec();
    let dup: Vec<u8> =
        frame_message(Tag { epoch: 1, ..Tag::default() }, Bytes::from_static(&[0; 8]), 1 << 20).unwrap().concat();
    vec![
        ("bad magic", "bad magic", vec![[bad_magic.to_vec(), vec![0; 4]].concat()]),
        ("unknown version", "unknown protocol version", vec![[version.to_vec(), vec![0; 4]].concat()]),
        ("bad checksum", "checksum mismatch", vec![[checksum.to_vec(), vec![0; 4]].concat()]),
        ("unknown kind", "unknown frame kind", vec![[resealed(kind), vec![0; 4]].concat()]),
        ("oversized", "exceeds frame_bytes_max", vec![oversized.to_vec()]),
        ("too many parts", "exceeds message_frames_max", vec![too_many_parts.to_vec()]),
        ("part out of order", "out of range", vec![[out_of_order.to_vec(), vec![0; 4]].concat()]),
        ("truncated header", "truncated", vec![data(4)[..10].to_vec()]),
        ("truncated payload", "truncated", vec![[data(100).to_vec(), vec![0; 50]].concat()]),
        ("bad control json", "bad control message", vec![bad_json]),
        ("hello after hello", "unexpected control message", vec![second_hello]),
        ("duplicate message", "duplicate message", vec![dup.clone(), dup]),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_malformed_frame_closes_its_connection_and_the_listener_keeps_serving() {
    let cases = cases();
    let names: Vec<String> = (0..cases.len() + 2).map(|i| format!("node-{i}")).collect();
    let name_refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &name_refs);
    let (l, addr) = listener(&ids[0], &name_refs);
    let world = names.len() as u32;
    let good = dial(&ids[1], addr, "node-0", 1, world).await;

    for (i, (what, reason, streams)) in cases.iter().enumerate() {
        let rank = i + 2;
        let conn = dial(&ids[rank], addr, "node-0", rank as u32, world).await;
        for bytes in streams {
            let mut s = conn.open_uni().await.unwrap();
            let _ = s.write_all(bytes).await;
            let _ = s.finish();
        }
        let end = tokio::time::timeout(Duration::from_secs(5), conn.closed())
            .await
            .unwrap_or_else(|_| panic!("{what}: connection not closed"));
        match &end {
            quinn::ConnectionError::ApplicationClosed(c) => assert_eq!(c.error_code, CLOSE_PROTOCOL, "{what}: {end}"),
            // The close frame can be overtaken by a stateless reset once the server has drained, or (on
            // an overloaded machine) lost until the client gives up: the server's own record, checked
            // next, says it closed the connection and why.
            quinn::ConnectionError::Reset | quinn::ConnectionError::TimedOut => {}
            other => panic!("{what}: expected the server to close, got {other}"),
        }
        let logged = l.mailbox().lost_reason(rank).unwrap_or_else(|| panic!("{what}: no reason recorded"));
        assert!(logged.contains(reason), "{what}: reason {logged:?} lacks {reason:?}");
        eprintln!("{what}: closed ({end}), server reason: {logged}");

        // The good peer is still served.
        let tag = Tag { group: 0, epoch: 1, seq: i as u64, step: 0 };
        let mut s = good.open_uni().await.unwrap();
        s.write_all(&frame_message(tag, Bytes::from(vec![i as u8; 16]), 1 << 20).unwrap().concat()).await.unwrap();
        s.finish().unwrap();
        let got = l
            .mailbox()
            .recv(1, tag, LossScope::Peer, 5_000)
            .await
            .unwrap_or_else(|e| panic!("after {what}: good peer not served: {e}"));
        assert_eq!(got.to_vec(), vec![i as u8; 16]);
    }
}

/// The fuzz target's seed corpus: valid frames of every kind, so that mutations start past the header
/// CRC (random bytes almost never pass it, and the payload and control-message paths stay unexplored).
fn fuzz_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let tag = Tag { group: 3, epoch: 7, seq: 11, step: 2 };
    let data = |len: usize, frame_max: u32| {
        let payload = Bytes::from((0..len).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>());
        frame_message(tag, payload, frame_max).unwrap().concat()
    };
    let hello = frame_control(FrameKind::Hello, &ControlMessage::Hello { node: "node-a".into(), rank: 1, world: 4 });
    let goodbye = frame_control(FrameKind::Control, &ControlMessage::Goodbye { rank: 1 });
    let abort =
        frame_control(FrameKind::Control, &ControlMessage::Abort { epoch: 7, seq: 11, reason: "peer lost".into() });
    let introduce =
        |role| frame_control(FrameKind::Control, &ControlMessage::Introduce { node: "node-b".into(), role });
    let tcp_hello = frame_control(
        FrameKind::Hello,
        &ControlMessage::TcpHello { rank: 2, world: 4, token: "0123456789abcdef".repeat(4) },
    );
    vec![
        ("hello", hello.to_vec()),
        ("tcp-hello", tcp_hello.to_vec()),
        ("goodbye", goodbye.to_vec()),
        ("abort", abort.to_vec()),
        ("introduce-node", introduce(troupe_cluster::wire::PeerRole::Node).to_vec()),
        ("introduce-client", introduce(troupe_cluster::wire::PeerRole::Client).to_vec()),
        ("data-empty", data(0, 1 << 20)),
        ("data-64", data(64, 1 << 20)),
        ("data-3-parts", data(3000, 1024)),
        ("stream", [hello.to_vec(), data(100, 1 << 20), abort.to_vec(), goodbye.to_vec()].concat()),
    ]
}

fn fuzz_seeds_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds")
}

/// Regenerates cluster/fuzz/seeds: `cargo test -p troupe-cluster --test malformed_frames
/// write_fuzz_seeds -- --ignored` (after a change to the wire format; the test below says when).
#[test]
#[ignore]
fn write_fuzz_seeds() {
    let dir = fuzz_seeds_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in fuzz_seeds() {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

#[test]
fn the_committed_fuzz_seeds_are_the_current_wire_format() {
    for (name, bytes) in fuzz_seeds() {
        let path = fuzz_seeds_dir().join(name);
        let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(committed, bytes, "{name} is stale: regenerate with `-- --ignored write_fuzz_seeds`");
        // With the limits the fuzz target decodes under.
        let frames = troupe_cluster::wire::decode_frames(&committed, 1 << 20, 64).unwrap();
        assert!(!frames.is_empty(), "{name}");
    }
}
