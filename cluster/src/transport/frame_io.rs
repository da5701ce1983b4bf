//! Reading whole messages (one or more frames) from a byte stream — a QUIC stream or a Unix socket —
//! with every check of [`crate::wire`]. Memory grows with bytes actually received, capped per frame
//! by `frame_bytes_max`; a stated length alone never sizes an allocation.

use std::future::Future;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::Payload;
use crate::wire::{ControlMessage, FrameHeader, FrameKind, Tag, WireError, HEADER_BYTES, MESSAGE_BYTES_MAX};

#[derive(Clone, Copy, Debug)]
pub struct FrameLimits {
    pub frame_bytes_max: u32,
    pub message_frames_max: u16,
}

impl From<&crate::TransportConfig> for FrameLimits {
    fn from(c: &crate::TransportConfig) -> Self {
        FrameLimits { frame_bytes_max: c.frame_bytes_max, message_frames_max: c.message_frames_max }
    }
}

#[derive(Debug)]
pub enum ReadOutcome {
    Data {
        tag: Tag,
        payload: Payload,
    },
    Control {
        kind: FrameKind,
        message: ControlMessage,
    },
    /// The stream ended cleanly between messages.
    End,
}

/// First bytes of a read: before any byte a clean end; after some, truncation.
async fn read_header<R: AsyncRead + Unpin>(r: &mut R, first: bool) -> Result<Option<[u8; HEADER_BYTES]>, WireError> {
    let mut buf = [0u8; HEADER_BYTES];
    let mut filled = 0;
    while filled < HEADER_BYTES {
        let n = r.read(&mut buf[filled..]).await.map_err(|e| WireError::Stream(format!("{e} ({e:?})")))?;
        if n == 0 {
            if filled == 0 && first {
                return Ok(None);
            }
            return Err(WireError::Truncated { needed: HEADER_BYTES, available: filled });
        }
        filled += n;
    }
    Ok(Some(buf))
}

/// Payloads are read in segments of at most this many bytes (a multiple of 8): memory grows with what
/// arrived, and a long payload is never copied over to grow one buffer.
pub(crate) const PAYLOAD_SEGMENT_BYTES: usize = 1 << 20;

/// Segments at least this long are read into buffers of the [`SEGMENTS`] pool; shorter ones (control
/// messages, small collectives) into a buffer of their own size.
const POOLED_SEGMENT_BYTES_MIN: usize = 64 << 10;

/// Free segment buffers kept for reuse, process-wide: at most this many (of [`PAYLOAD_SEGMENT_BYTES`]
/// each, so 32 MiB). A buffer dropped while the pool is full is freed.
const POOLED_SEGMENTS_MAX: usize = 32;

/// Buffers of [`PAYLOAD_SEGMENT_BYTES`] that received segments give back once the last reference to
/// them is dropped. Without it every segment was a fresh 1 MiB allocation — memory the kernel maps on
/// first write, a page fault per 4 KiB: 15 % of the CPU of an all-reduce over TCP (perf, 2 cores).
static SEGMENTS: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

fn segment_buffer() -> Vec<u8> {
    let reused = SEGMENTS.lock().unwrap_or_else(|p| p.into_inner()).pop();
    reused.unwrap_or_else(|| Vec::with_capacity(PAYLOAD_SEGMENT_BYTES))
}

/// A received segment in a pooled buffer; its buffer goes back to the pool when dropped.
struct PooledSegment(Vec<u8>);

impl AsRef<[u8]> for PooledSegment {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PooledSegment {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.0);
        buf.clear();
        let mut free = SEGMENTS.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < POOLED_SEGMENTS_MAX {
            free.push(buf);
        }
    }
}

/// Reads exactly `want` bytes (at most [`PAYLOAD_SEGMENT_BYTES`]) into a pooled buffer for long
/// segments, a buffer of its own size for short ones; a stream that ends first is
/// `truncated(bytes it gave)`.
async fn read_segment<R: AsyncRead + Unpin>(
    r: &mut R,
    want: usize,
    truncated: impl Fn(usize) -> WireError,
) -> Result<Bytes, WireError> {
    debug_assert!(want <= PAYLOAD_SEGMENT_BYTES);
    let stream_error = |e: std::io::Error| WireError::Stream(format!("{e} ({e:?})"));
    let mut limited = r.take(want as u64);
    if want >= POOLED_SEGMENT_BYTES_MIN {
        let mut buf = segment_buffer();
        while buf.len() < want {
            if limited.read_buf(&mut buf).await.map_err(stream_error)? == 0 {
                return Err(truncated(buf.len()));
            }
        }
        Ok(Bytes::from_owner(PooledSegment(buf)))
    } else {
        let mut buf = BytesMut::with_capacity(want);
        while buf.len() < want {
            if limited.read_buf(&mut buf).await.map_err(stream_error)? == 0 {
                return Err(truncated(buf.len()));
            }
        }
        Ok(buf.freeze())
    }
}

async fn read_payload<R: AsyncRead + Unpin>(r: &mut R, length: u32) -> Result<Vec<Bytes>, WireError> {
    let length = length as usize;
    if length == 0 {
        return Ok(vec![Bytes::new()]);
    }
    let mut segments = Vec::with_capacity(length.div_ceil(PAYLOAD_SEGMENT_BYTES));
    let mut got = 0;
    while got < length {
        let want = (length - got).min(PAYLOAD_SEGMENT_BYTES);
        let truncated = |have: usize| WireError::Truncated { needed: length, available: got + have };
        segments.push(read_segment(r, want, truncated).await?);
        got += want;
    }
    Ok(segments)
}

/// Reads exactly `length` payload bytes as one or more segments.
pub type SegmentReader<R> = for<'a> fn(&'a mut R, u32) -> BoxFuture<'a, Result<Vec<Bytes>, WireError>>;

fn read_segments<R: AsyncRead + Unpin + Send>(r: &mut R, length: u32) -> BoxFuture<'_, Result<Vec<Bytes>, WireError>> {
    Box::pin(read_payload(r, length))
}

/// Reads the next message. Control messages are single-frame and at most `MESSAGE_BYTES_MAX`.
pub async fn read_message<R: AsyncRead + Unpin + Send>(
    r: &mut R,
    limits: FrameLimits,
) -> Result<ReadOutcome, WireError> {
    read_message_with(r, limits, read_segments::<R>).await
}

/// [`read_message`] with the payload bytes read by `segments` (e.g. zero-copy chunks of a QUIC stream).
pub async fn read_message_with<R: AsyncRead + Unpin + Send>(
    r: &mut R,
    limits: FrameLimits,
    segments: SegmentReader<R>,
) -> Result<ReadOutcome, WireError> {
    read_frames(&mut StreamSource { r, segments }, limits).await
}

/// Where frames come from: their headers and payload bytes, in order: a byte stream whose payloads
/// are read by a function of its own ([`StreamSource`]: a QUIC stream's chunks), or as they come
/// ([`PlainSource`]: a socket, or a TLS stream over one).
pub(crate) trait FrameSource: Send {
    /// The next frame header; `None` if the stream ended cleanly before it and `first` (between messages).
    fn header(&mut self, first: bool) -> impl Future<Output = Result<Option<[u8; HEADER_BYTES]>, WireError>> + Send;

    /// Exactly `length` payload bytes, as one or more segments (one empty segment for none).
    fn payload(&mut self, length: u32) -> impl Future<Output = Result<Vec<Bytes>, WireError>> + Send;
}

/// A byte stream whose headers are read as they are and whose payloads by `segments`.
struct StreamSource<'r, R> {
    r: &'r mut R,
    segments: SegmentReader<R>,
}

impl<R: AsyncRead + Unpin + Send> FrameSource for StreamSource<'_, R> {
    async fn header(&mut self, first: bool) -> Result<Option<[u8; HEADER_BYTES]>, WireError> {
        read_header(self.r, first).await
    }

    async fn payload(&mut self, length: u32) -> Result<Vec<Bytes>, WireError> {
        (self.segments)(self.r, length).await
    }
}

/// A byte stream of its own, read as it is (a socket's reading half).
pub(crate) struct PlainSource<R>(pub R);

impl<R: AsyncRead + Unpin + Send> FrameSource for PlainSource<R> {
    async fn header(&mut self, first: bool) -> Result<Option<[u8; HEADER_BYTES]>, WireError> {
        read_header(&mut self.0, first).await
    }

    async fn payload(&mut self, length: u32) -> Result<Vec<Bytes>, WireError> {
        read_payload(&mut self.0, length).await
    }
}

/// Reads the next message from `source`, with every check of [`crate::wire`]. Control messages are
/// single-frame and at most `MESSAGE_BYTES_MAX`.
pub(crate) async fn read_frames<S: FrameSource>(source: &mut S, limits: FrameLimits) -> Result<ReadOutcome, WireError> {
    let Some(head) = source.header(true).await? else {
        return Ok(ReadOutcome::End);
    };
    let first = FrameHeader::decode(&head, limits.frame_bytes_max, limits.message_frames_max)?;
    if first.part_index != 0 {
        return Err(WireError::BadPart { index: first.part_index, count: first.part_count });
    }
    if first.kind != FrameKind::Data {
        if first.part_count != 1 || first.length > MESSAGE_BYTES_MAX {
            return Err(WireError::BadControl(format!(
                "control frame of {} bytes in {} parts",
                first.length, first.part_count
            )));
        }
        let body = source.payload(first.length).await?.concat();
        return Ok(ReadOutcome::Control { kind: first.kind, message: ControlMessage::decode(&body)? });
    }
    let mut parts = source.payload(first.length).await?;
    for index in 1..first.part_count {
        let head = source.header(false).await?.expect("not first");
        let h = FrameHeader::decode(&head, limits.frame_bytes_max, limits.message_frames_max)?;
        if h.kind != FrameKind::Data || h.tag != first.tag || h.part_count != first.part_count || h.part_index != index
        {
            return Err(WireError::Protocol(format!("frame {h:?} interrupts message {:?} at part {index}", first.tag)));
        }
        parts.extend(source.payload(h.length).await?);
    }
    Ok(ReadOutcome::Data { tag: first.tag, payload: Payload { segments: parts } })
}

/// The frames of a message of `len` payload bytes: each one's header and the range of the payload it
/// carries, at most `frame_bytes_max` bytes (rounded down to a multiple of 8 so that every part but the
/// last holds whole elements of any dtype). An empty message is one empty frame.
pub fn frame_parts(tag: Tag, len: usize, frame_bytes_max: u32) -> Result<Vec<(Bytes, Range<usize>)>, WireError> {
    let part_max = ((frame_bytes_max as usize) & !7).max(8);
    let count = len.div_ceil(part_max).max(1);
    let part_count = u16::try_from(count).map_err(|_| WireError::TooManyParts { count: u16::MAX, max: u16::MAX })?;
    Ok((0..count)
        .map(|i| {
            let range = i * part_max..((i + 1) * part_max).min(len);
            let h = FrameHeader {
                kind: FrameKind::Data,
                tag,
                part_index: i as u16,
                part_count,
                length: range.len() as u32,
            };
            (Bytes::copy_from_slice(&h.encode()), range)
        })
        .collect())
}

/// Splits a message into frames ([`frame_parts`]). Returns header+payload chunks ready to write without
/// copying the payload.
pub fn frame_message(tag: Tag, payload: Bytes, frame_bytes_max: u32) -> Result<Vec<Bytes>, WireError> {
    let parts = frame_parts(tag, payload.len(), frame_bytes_max)?;
    Ok(parts.into_iter().flat_map(|(header, range)| [header, payload.slice(range)]).collect())
}

pub fn frame_control(kind: FrameKind, message: &ControlMessage) -> Bytes {
    let body = message.encode();
    let h = FrameHeader { kind, tag: Tag::default(), part_index: 0, part_count: 1, length: body.len() as u32 };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(&body);
    Bytes::from(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> FrameLimits {
        FrameLimits { frame_bytes_max: 16 << 20, message_frames_max: 8 }
    }

    /// A long payload comes back whole, in segments of at most PAYLOAD_SEGMENT_BYTES that are each a
    /// multiple of 8 bytes but the last; a short one in one segment.
    #[tokio::test]
    async fn payloads_arrive_whole_in_bounded_segments() {
        let tag = Tag { group: 1, epoch: 2, seq: 3, step: 4 };
        for len in [0, 5, PAYLOAD_SEGMENT_BYTES, 2 * PAYLOAD_SEGMENT_BYTES + PAYLOAD_SEGMENT_BYTES / 2 + 3] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let wire: Vec<u8> = frame_message(tag, Bytes::from(payload.clone()), 16 << 20).unwrap().concat();
            let ReadOutcome::Data { tag: got_tag, payload: got } =
                read_message(&mut &wire[..], limits()).await.unwrap()
            else {
                panic!("not a data message");
            };
            assert_eq!(got_tag, tag);
            assert_eq!(got.to_vec(), payload, "{len} bytes");
            assert_eq!(got.segments.len(), len.div_ceil(PAYLOAD_SEGMENT_BYTES).max(1), "{len} bytes");
            let (last, rest) = got.segments.split_last().unwrap();
            assert!(rest.iter().all(|s| s.len() == PAYLOAD_SEGMENT_BYTES) && last.len() <= PAYLOAD_SEGMENT_BYTES);
        }
    }

    /// A stream that ends inside a payload is a truncation that says how much arrived.
    #[tokio::test]
    async fn a_payload_cut_short_is_truncated() {
        let len = PAYLOAD_SEGMENT_BYTES + 100;
        let wire: Vec<u8> = frame_message(Tag::default(), Bytes::from(vec![7u8; len]), 16 << 20).unwrap().concat();
        let cut = &wire[..wire.len() - 40];
        match read_message(&mut &cut[..], limits()).await {
            Err(WireError::Truncated { needed, available }) => assert_eq!((needed, available), (len, len - 40)),
            other => panic!("expected a truncation, got {other:?}"),
        }
    }
}
