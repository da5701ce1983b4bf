//! Any bytes into the frame decoder: it must return frames or an error — never panic, never allocate
//! what a header states. Run: `cd cluster/fuzz && cargo fuzz run decode_frames -- -max_total_time=120`.
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
