//! Any bytes into the encrypted TCP data plane's record reader, under a known key: it must return
//! messages or an error — never panic, never allocate what a record states before its length is
//! checked, never return a message whose records did not open. Run from cluster/fuzz:
//! `cargo +nightly fuzz run open_sealed corpus/open_sealed seeds -- -max_total_time=120`
//! (`seeds/sealed-stream`: a valid sealed stream under this key, written by cluster/tests/malformed_frames.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use troupe_cluster::transport::sealed::{read_sealed, RecordKey};
use troupe_cluster::transport::FrameLimits;

const KEY: [u8; 16] = *b"troupe-fuzz-key!";

fuzz_target!(|data: &[u8]| {
    let limits = FrameLimits { frame_bytes_max: 1 << 20, message_frames_max: 64 };
    let _ = read_sealed(data, &RecordKey::from_bytes(KEY), limits);
});
