//! Reading whole messages (one or more frames) from a byte stream — a QUIC stream or a Unix socket —
//! with every check of [`crate::wire`]. Memory grows with bytes actually received, capped per frame
//! by `frame_bytes_max`; a stated length alone never sizes an allocation.

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

const INITIAL_PAYLOAD_CAPACITY_BYTES: usize = 1 << 20;

async fn read_payload<R: AsyncRead + Unpin>(r: &mut R, length: u32) -> Result<Bytes, WireError> {
    let length = length as usize;
    let mut buf = Vec::with_capacity(length.min(INITIAL_PAYLOAD_CAPACITY_BYTES));
    let got =
        r.take(length as u64).read_to_end(&mut buf).await.map_err(|e| WireError::Stream(format!("{e} ({e:?})")))?;
    if got < length {
        return Err(WireError::Truncated { needed: length, available: got });
    }
    Ok(Bytes::from(buf))
}

/// Reads exactly `length` payload bytes as one or more segments.
pub type SegmentReader<R> = for<'a> fn(&'a mut R, u32) -> BoxFuture<'a, Result<Vec<Bytes>, WireError>>;

fn read_one_segment<R: AsyncRead + Unpin + Send>(
    r: &mut R,
    length: u32,
) -> BoxFuture<'_, Result<Vec<Bytes>, WireError>> {
    Box::pin(async move { Ok(vec![read_payload(r, length).await?]) })
}

/// Reads the next message. Control messages are single-frame and at most `MESSAGE_BYTES_MAX`.
pub async fn read_message<R: AsyncRead + Unpin + Send>(
    r: &mut R,
    limits: FrameLimits,
) -> Result<ReadOutcome, WireError> {
    read_message_with(r, limits, read_one_segment::<R>).await
}

/// [`read_message`] with the payload bytes read by `segments` (e.g. zero-copy chunks of a QUIC stream).
pub async fn read_message_with<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: FrameLimits,
    segments: SegmentReader<R>,
) -> Result<ReadOutcome, WireError> {
    let Some(head) = read_header(r, true).await? else {
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
        let body = segments(r, first.length).await?.concat();
        return Ok(ReadOutcome::Control { kind: first.kind, message: ControlMessage::decode(&body)? });
    }
    let mut parts = segments(r, first.length).await?;
    for index in 1..first.part_count {
        let head = read_header(r, false).await?.expect("not first");
        let h = FrameHeader::decode(&head, limits.frame_bytes_max, limits.message_frames_max)?;
        if h.kind != FrameKind::Data || h.tag != first.tag || h.part_count != first.part_count || h.part_index != index
        {
            return Err(WireError::Protocol(format!("frame {h:?} interrupts message {:?} at part {index}", first.tag)));
        }
        parts.extend(segments(r, h.length).await?);
    }
    Ok(ReadOutcome::Data { tag: first.tag, payload: Payload { segments: parts } })
}

/// Splits a message into frames of at most `frame_bytes_max` bytes (rounded down to a multiple of 8 so
/// that every segment but the last holds whole elements of any dtype). Returns header+payload chunks
/// ready to write without copying the payload.
pub fn frame_message(tag: Tag, payload: Bytes, frame_bytes_max: u32) -> Result<Vec<Bytes>, WireError> {
    let part_max = ((frame_bytes_max as usize) & !7).max(8);
    let count = payload.len().div_ceil(part_max).max(1);
    let part_count = u16::try_from(count).map_err(|_| WireError::TooManyParts { count: u16::MAX, max: u16::MAX })?;
    let mut out = Vec::with_capacity(2 * count);
    for i in 0..count {
        let part = payload.slice(i * part_max..((i + 1) * part_max).min(payload.len()));
        let h = FrameHeader { kind: FrameKind::Data, tag, part_index: i as u16, part_count, length: part.len() as u32 };
        out.push(Bytes::copy_from_slice(&h.encode()));
        out.push(part);
    }
    Ok(out)
}

pub fn frame_control(kind: FrameKind, message: &ControlMessage) -> Bytes {
    let body = message.encode();
    let h = FrameHeader { kind, tag: Tag::default(), part_index: 0, part_count: 1, length: body.len() as u32 };
    let mut v = h.encode().to_vec();
    v.extend_from_slice(&body);
    Bytes::from(v)
}

pub async fn write_chunks<W: AsyncWrite + Unpin>(w: &mut W, chunks: &[Bytes]) -> std::io::Result<()> {
    for c in chunks {
        w.write_all(c).await?;
    }
    Ok(())
}
