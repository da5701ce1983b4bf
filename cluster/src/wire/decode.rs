//! Decoding a whole byte buffer into frames, sans-IO. The streaming readers in `transport` apply the
//! same checks frame by frame; this form is what the fuzz target drives.

use super::{ControlMessage, FrameHeader, FrameKind, WireError, HEADER_BYTES};

#[derive(Debug, PartialEq)]
pub struct DecodedFrame<'a> {
    pub header: FrameHeader,
    pub payload: &'a [u8],
    pub control: Option<ControlMessage>,
}

/// Splits `bytes` into frames, validating every header and every control payload. Never allocates
/// in proportion to a length the bytes state; never panics.
pub fn decode_frames(
    bytes: &[u8],
    frame_bytes_max: u32,
    message_frames_max: u16,
) -> Result<Vec<DecodedFrame<'_>>, WireError> {
    let mut frames = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let Some((head, body)) = rest.split_first_chunk::<HEADER_BYTES>() else {
            return Err(WireError::Truncated { needed: HEADER_BYTES, available: rest.len() });
        };
        let header = FrameHeader::decode(head, frame_bytes_max, message_frames_max)?;
        let length = header.length as usize;
        if body.len() < length {
            return Err(WireError::Truncated { needed: length, available: body.len() });
        }
        let (payload, after) = body.split_at(length);
        let control = match header.kind {
            FrameKind::Hello | FrameKind::Control => Some(ControlMessage::decode(payload)?),
            FrameKind::Data => None,
        };
        frames.push(DecodedFrame { header, payload, control });
        rest = after;
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Tag;

    fn frame(kind: FrameKind, payload: &[u8]) -> Vec<u8> {
        let h = FrameHeader { kind, tag: Tag::default(), part_index: 0, part_count: 1, length: payload.len() as u32 };
        let mut v = h.encode().to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn decodes_a_sequence() {
        let hello = ControlMessage::Hello { node: "a".into(), rank: 0, world: 2 };
        let mut bytes = frame(FrameKind::Hello, &hello.encode());
        bytes.extend(frame(FrameKind::Data, &[1, 2, 3]));
        let frames = decode_frames(&bytes, 1024, 4).unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].control, Some(hello));
        assert_eq!(frames[1].payload, &[1, 2, 3]);
    }

    #[test]
    fn truncation_is_reported() {
        let bytes = frame(FrameKind::Data, &[1, 2, 3]);
        assert_eq!(decode_frames(&bytes[..10], 1024, 4), Err(WireError::Truncated { needed: 44, available: 10 }));
        assert_eq!(decode_frames(&bytes[..45], 1024, 4), Err(WireError::Truncated { needed: 3, available: 1 }));
    }

    #[test]
    fn bad_control_json_is_refused() {
        let bytes = frame(FrameKind::Control, b"{not json");
        assert!(matches!(decode_frames(&bytes, 1024, 4), Err(WireError::BadControl(_))));
    }
}
