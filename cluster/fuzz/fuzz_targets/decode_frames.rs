//! Any bytes into the frame decoder: it must return frames or an error — never panic, never allocate
//! what a header states. Run from cluster/fuzz:
//! `cargo +nightly fuzz run decode_frames corpus/decode_frames seeds -- -max_total_time=120`
//! (`seeds/`: valid frames of every kind, written by cluster/tests/malformed_frames.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use troupe_cluster::wire::{decode_frames, FrameHeader, HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    let _ = decode_frames(data, 1 << 20, 64);
    if let Some(head) = data.first_chunk::<HEADER_BYTES>() {
        if let Ok(h) = FrameHeader::decode(head, 1 << 20, 64) {
            // Whatever validates must re-encode to the same bytes.
            assert_eq!(&h.encode()[..], &head[..]);
        }
    }
});
