//! Sealed records over a byte stream: what the encrypted TCP data plane ([`super::tcp`]) writes in
//! place of bare frames. Every frame header and every payload piece of at most [`RECORD_BYTES`] is one
//! record, sealed with AES-128-GCM:
//!
//! ```text
//! record = length: u32 LE (of the plaintext) ‖ ciphertext (length bytes) ‖ tag (16 bytes)
//! ```
//!
//! The nonce is the record's number in its direction (a 64-bit counter, never sent); the associated
//! data is the length prefix. Each direction of each connection has its own key, chosen at random by
//! the receiver and handed to the sender over the authenticated, encrypted control transport (the
//! QUIC mesh), so a key is never used on two connections and a nonce never twice under one key. A
//! record that was altered, dropped, repeated or reordered fails to open — its number is not the one
//! the key was sealed with — and closes the connection like any bad frame.
//!
//! Costs: the sender copies each piece into a buffer of its own and seals it there (the copy a
//! socket write makes anyway stays); the receiver reads each payload piece straight into the buffer it
//! is delivered in and opens it in place, so a received payload is copied no more than over a plain
//! socket.

use std::future::Future;

use bytes::Bytes;
use ring::aead::{Aad, LessSafeKey, Nonce, Tag as AeadTag, UnboundKey, AES_128_GCM, NONCE_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::frame_io::{read_segment, FrameSource, PAYLOAD_SEGMENT_BYTES};
use super::stream_mesh::FrameWriter;
use crate::wire::{WireError, HEADER_BYTES};

/// The most plaintext one record carries: a payload is sealed in pieces of this size, each read into
/// a segment buffer of its own on the other side.
pub const RECORD_BYTES: usize = PAYLOAD_SEGMENT_BYTES;
pub const KEY_BYTES: usize = 16;
const TAG_BYTES: usize = 16;
const LENGTH_BYTES: usize = 4;

/// One direction's key, as the receiver hands it to the sender.
#[derive(Clone)]
pub struct RecordKey([u8; KEY_BYTES]);

impl RecordKey {
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> Self {
        RecordKey(bytes)
    }

    pub fn random() -> Result<Self, String> {
        let mut bytes = [0u8; KEY_BYTES];
        rustls::crypto::ring::default_provider()
            .secure_random
            .fill(&mut bytes)
            .map_err(|_| "no randomness for a data-plane key".to_string())?;
        Ok(RecordKey(bytes))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(hex: &str) -> Result<Self, String> {
        let bad = || format!("a data-plane key is {} hex digits; got {} characters", 2 * KEY_BYTES, hex.len());
        if hex.len() != 2 * KEY_BYTES || !hex.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; KEY_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(RecordKey(bytes))
    }

    fn aead(&self) -> LessSafeKey {
        LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &self.0).expect("a 16-byte key is an AES-128 key"))
    }
}

/// The nonces of one direction: record numbers 0, 1, 2, … Running out (2^64 records) is an error,
/// never a wrap.
struct Counter(u64);

impl Counter {
    fn next(&mut self) -> Result<Nonce, WireError> {
        let n = self.0;
        self.0 = n.checked_add(1).ok_or_else(|| WireError::Protocol("record counter exhausted".into()))?;
        let mut nonce = [0u8; NONCE_LEN];
        nonce[NONCE_LEN - 8..].copy_from_slice(&n.to_be_bytes());
        Ok(Nonce::assume_unique_for_key(nonce))
    }
}

/// Writes frames as sealed records.
pub struct SealedWriter<W> {
    inner: W,
    key: LessSafeKey,
    counter: Counter,
    /// Records being sealed, written out when full or at the end of a frame.
    out: Vec<u8>,
}

impl<W> SealedWriter<W> {
    pub fn new(inner: W, key: &RecordKey) -> Self {
        SealedWriter {
            inner,
            key: key.aead(),
            counter: Counter(0),
            out: Vec::with_capacity(RECORD_BYTES + HEADER_BYTES + 2 * (LENGTH_BYTES + TAG_BYTES)),
        }
    }

    /// Appends `plain` to the outgoing buffer as one sealed record.
    fn seal(&mut self, plain: &[u8]) -> std::io::Result<()> {
        debug_assert!(plain.len() <= RECORD_BYTES);
        let length = (plain.len() as u32).to_le_bytes();
        self.out.extend_from_slice(&length);
        let start = self.out.len();
        self.out.extend_from_slice(plain);
        let nonce = self.counter.next().map_err(std::io::Error::other)?;
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(length), &mut self.out[start..])
            .map_err(|_| std::io::Error::other("sealing a record failed"))?;
        self.out.extend_from_slice(tag.as_ref());
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin + Send + 'static> SealedWriter<W> {
    async fn flush_out(&mut self) -> std::io::Result<()> {
        let written = self.inner.write_all(&self.out).await;
        self.out.clear();
        written
    }
}

impl<W: AsyncWrite + Unpin + Send + 'static> FrameWriter for SealedWriter<W> {
    /// The header and the first payload piece go out in one write; every further piece in its own.
    async fn write_frame(&mut self, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
        self.seal(header)?;
        for piece in payload.chunks(RECORD_BYTES) {
            if self.out.len() + piece.len() + LENGTH_BYTES + TAG_BYTES > self.out.capacity() {
                self.flush_out().await?;
            }
            self.seal(piece)?;
        }
        self.flush_out().await
    }

    fn close(&mut self) -> impl Future<Output = std::io::Result<()>> + Send {
        self.inner.shutdown()
    }
}

/// Reads the frames of a [`SealedWriter`], opening each record.
pub struct SealedSource<R> {
    inner: R,
    key: LessSafeKey,
    counter: Counter,
}

impl<R: AsyncRead + Unpin + Send> SealedSource<R> {
    pub fn new(inner: R, key: &RecordKey) -> Self {
        SealedSource { inner, key: key.aead(), counter: Counter(0) }
    }

    /// The next record's plaintext length; `None` at a clean end before its first byte if `may_end`.
    async fn length(&mut self, may_end: bool) -> Result<Option<usize>, WireError> {
        let mut buf = [0u8; LENGTH_BYTES];
        let mut filled = 0;
        while filled < LENGTH_BYTES {
            let n = self.inner.read(&mut buf[filled..]).await.map_err(stream_error)?;
            if n == 0 {
                if filled == 0 && may_end {
                    return Ok(None);
                }
                return Err(WireError::Truncated { needed: LENGTH_BYTES, available: filled });
            }
            filled += n;
        }
        Ok(Some(u32::from_le_bytes(buf) as usize))
    }

    /// Reads the tag that follows a record's ciphertext and opens `ciphertext` in place.
    async fn open(&mut self, length: usize, ciphertext: &mut [u8]) -> Result<(), WireError> {
        let mut tag = [0u8; TAG_BYTES];
        self.inner.read_exact(&mut tag).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => WireError::Truncated { needed: TAG_BYTES, available: 0 },
            _ => stream_error(e),
        })?;
        let number = self.counter.0;
        let nonce = self.counter.next()?;
        let aad = Aad::from((length as u32).to_le_bytes());
        self.key
            .open_in_place_separate_tag(nonce, aad, AeadTag::from(tag), ciphertext, 0..)
            .map_err(|_| WireError::Protocol(format!("record {number} failed authentication")))?;
        Ok(())
    }
}

fn stream_error(e: std::io::Error) -> WireError {
    WireError::Stream(format!("{e} ({e:?})"))
}

impl<R: AsyncRead + Unpin + Send> FrameSource for SealedSource<R> {
    async fn header(&mut self, first: bool) -> Result<Option<[u8; HEADER_BYTES]>, WireError> {
        let Some(length) = self.length(first).await? else {
            return Ok(None);
        };
        if length != HEADER_BYTES {
            return Err(WireError::Protocol(format!("a header record of {length} bytes (expected {HEADER_BYTES})")));
        }
        let mut head = [0u8; HEADER_BYTES];
        self.inner.read_exact(&mut head).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => WireError::Truncated { needed: HEADER_BYTES, available: 0 },
            _ => stream_error(e),
        })?;
        self.open(length, &mut head).await?;
        Ok(Some(head))
    }

    /// Every piece must be as long as the writer cuts them ([`RECORD_BYTES`], the last the rest): a
    /// record that says otherwise is refused before anything is allocated for it.
    async fn payload(&mut self, length: u32) -> Result<Vec<Bytes>, WireError> {
        let length = length as usize;
        if length == 0 {
            return Ok(vec![Bytes::new()]);
        }
        let mut segments = Vec::with_capacity(length.div_ceil(RECORD_BYTES));
        let mut got = 0;
        while got < length {
            let want = (length - got).min(RECORD_BYTES);
            let said = self.length(false).await?.expect("not at a message boundary");
            if said != want {
                return Err(WireError::Protocol(format!(
                    "a payload record of {said} bytes where {want} were due ({got} of {length} read)"
                )));
            }
            let truncated = |have: usize| WireError::Truncated { needed: length, available: got + have };
            let mut segment = read_segment(&mut self.inner, want, truncated).await?;
            self.open(want, segment.as_mut_slice()).await?;
            segments.push(segment.freeze());
            got += want;
        }
        Ok(segments)
    }
}

/// What a [`SealedWriter`] under `key` writes for these frames (each a header and its payload), from
/// record 0: for tests and the fuzz target's seeds.
pub fn seal_frames(key: &RecordKey, frames: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut w = SealedWriter::new(Vec::new(), key);
    for (header, payload) in frames {
        futures::executor::block_on(w.write_frame(header, payload)).expect("writing to memory cannot fail");
    }
    w.inner
}

/// Reads every message of a sealed stream held in memory, under `key`, until it ends cleanly or an
/// error stops it (returned with the messages before it): for tests and the fuzz target.
pub fn read_sealed(
    data: &[u8],
    key: &RecordKey,
    limits: super::FrameLimits,
) -> (Vec<super::ReadOutcome>, Option<WireError>) {
    let mut source = SealedSource::new(data, key);
    let mut got = Vec::new();
    loop {
        match futures::executor::block_on(super::frame_io::read_frames(&mut source, limits)) {
            Ok(super::ReadOutcome::End) => return (got, None),
            Ok(outcome) => got.push(outcome),
            Err(e) => return (got, Some(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::frame_io::{frame_control, frame_parts, read_frames, FrameLimits, ReadOutcome};
    use crate::wire::{ControlMessage, FrameKind, Tag};

    fn limits() -> FrameLimits {
        FrameLimits { frame_bytes_max: 4 << 20, message_frames_max: 16 }
    }

    /// What a [`SealedWriter`] writes for messages of these lengths, and the messages.
    async fn sealed(key: &RecordKey, lengths: &[usize]) -> (Vec<u8>, Vec<Vec<u8>>) {
        let mut w = SealedWriter::new(Vec::new(), key);
        let mut messages = Vec::new();
        for (m, &len) in lengths.iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + m) as u8).collect();
            let tag = Tag { group: 0, epoch: 1, seq: m as u64, step: 0 };
            for (header, range) in frame_parts(tag, len, limits().frame_bytes_max).unwrap() {
                w.write_frame(&header, &data[range]).await.unwrap();
            }
            messages.push(data);
        }
        let goodbye = frame_control(FrameKind::Control, &ControlMessage::Goodbye { rank: 3 });
        w.write_frame(&goodbye[..HEADER_BYTES], &goodbye[HEADER_BYTES..]).await.unwrap();
        (w.inner, messages)
    }

    async fn read_all(wire: &[u8], key: &RecordKey) -> Result<Vec<Vec<u8>>, WireError> {
        let mut source = SealedSource::new(wire, key);
        let mut got = Vec::new();
        loop {
            match read_frames(&mut source, limits()).await? {
                ReadOutcome::Data { payload, .. } => got.push(payload.to_vec()),
                ReadOutcome::Control { message: ControlMessage::Goodbye { rank: 3 }, .. } => return Ok(got),
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// Messages of every shape — empty, short, one record, several records, several frames — come back
    /// whole; the plaintext appears nowhere on the wire.
    #[tokio::test]
    async fn messages_come_back_whole_and_the_wire_does_not_show_them() {
        let key = RecordKey::random().unwrap();
        let lengths = [0, 1, 100, RECORD_BYTES, RECORD_BYTES + 1, 9 << 20 | 5];
        let (wire, messages) = sealed(&key, &lengths).await;
        assert_eq!(read_all(&wire, &key).await.unwrap(), messages);
        let probe = &messages[5][1000..1064];
        assert!(!wire.windows(probe.len()).any(|w| w == probe), "plaintext visible on the wire");
    }

    /// A flipped bit anywhere, a missing or repeated record, or the wrong key: the read fails
    /// (authentication, a length that is not due, or truncation), never returns altered bytes.
    #[tokio::test]
    async fn altered_dropped_repeated_or_foreign_records_are_refused() {
        let key = RecordKey::random().unwrap();
        let (wire, _) = sealed(&key, &[3000, 70_000]).await;
        for at in [0, 2, 10, LENGTH_BYTES + HEADER_BYTES + 3, 200, wire.len() / 2, wire.len() - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 0x20;
            assert!(read_all(&bad, &key).await.is_err(), "bit flipped at {at} accepted");
        }
        let record = LENGTH_BYTES + HEADER_BYTES + TAG_BYTES;
        let dropped = [&wire[..0], &wire[record..]].concat();
        assert!(matches!(read_all(&dropped, &key).await, Err(WireError::Protocol(_))), "a dropped record");
        let repeated = [&wire[..record], &wire[..]].concat();
        assert!(matches!(read_all(&repeated, &key).await, Err(WireError::Protocol(_))), "a repeated record");
        let other = RecordKey::random().unwrap();
        match read_all(&wire, &other).await {
            Err(WireError::Protocol(reason)) => assert!(reason.contains("failed authentication"), "{reason}"),
            r => panic!("another key's records were read: {:?}", r.map(|m| m.len())),
        }
        assert!(matches!(read_all(&wire[..wire.len() - 5], &key).await, Err(WireError::Truncated { .. })));
    }

    /// A record that claims more than is due is refused before it is read: no allocation sized by the peer.
    #[tokio::test]
    async fn a_record_longer_than_due_is_refused() {
        let key = RecordKey::random().unwrap();
        let (mut wire, _) = sealed(&key, &[64]).await;
        let payload_length = LENGTH_BYTES + HEADER_BYTES + TAG_BYTES;
        wire[payload_length..payload_length + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        match read_all(&wire, &key).await {
            Err(WireError::Protocol(reason)) => assert!(reason.contains("where 64 were due"), "{reason}"),
            r => panic!("expected a refusal, got {:?}", r.map(|m| m.len())),
        }
    }

    #[test]
    fn keys_round_trip_through_hex_and_bad_hex_is_refused() {
        let key = RecordKey::random().unwrap();
        assert_eq!(RecordKey::from_hex(&key.to_hex()).unwrap().0, key.0);
        assert_ne!(RecordKey::random().unwrap().0, key.0);
        for bad in ["", "00", &"g".repeat(32), &"é".repeat(16)] {
            assert!(RecordKey::from_hex(bad).is_err(), "{bad:?}");
        }
    }
}
