//! The frame header: encode and validate. Validation happens before any payload byte is read or any
//! buffer is sized, so a peer can never make us allocate more than `frame_bytes_max`.

use super::{crc32, WireError};

pub const MAGIC: [u8; 4] = *b"TRPE";
pub const VERSION: u8 = 1;
pub const HEADER_BYTES: usize = 44;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// First frame on a connection: a JSON [`super::ControlMessage::Hello`].
    Hello = 1,
    /// A JSON control message.
    Control = 2,
    /// Raw tensor bytes belonging to a collective or a send/recv.
    Data = 3,
}

impl FrameKind {
    fn from_u8(v: u8) -> Result<Self, WireError> {
        match v {
            1 => Ok(FrameKind::Hello),
            2 => Ok(FrameKind::Control),
            3 => Ok(FrameKind::Data),
            other => Err(WireError::UnknownKind(other)),
        }
    }
}

/// Which collective call and which step of its plan a message belongs to. Two messages with different
/// tags never match; a message whose epoch is below the receiver's fence is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Tag {
    pub group: u32,
    pub epoch: u64,
    pub seq: u64,
    pub step: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub tag: Tag,
    /// This frame's index within its message, and the number of frames of the message.
    pub part_index: u16,
    pub part_count: u16,
    pub length: u32,
}

impl FrameHeader {
    // Layout (little endian): magic 0..4, version 4, kind 5, part_index 6..8, part_count 8..10,
    // reserved 10..12, epoch 12..20, seq 20..28, group 28..32, step 32..36, length 36..40, crc 40..44.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.part_index.to_le_bytes());
        b[8..10].copy_from_slice(&self.part_count.to_le_bytes());
        b[12..20].copy_from_slice(&self.tag.epoch.to_le_bytes());
        b[20..28].copy_from_slice(&self.tag.seq.to_le_bytes());
        b[28..32].copy_from_slice(&self.tag.group.to_le_bytes());
        b[32..36].copy_from_slice(&self.tag.step.to_le_bytes());
        b[36..40].copy_from_slice(&self.length.to_le_bytes());
        let crc = crc32(&b[0..40]);
        b[40..44].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Checks, in order: magic, version, checksum, kind, part numbering, length against the limits.
    pub fn decode(b: &[u8; HEADER_BYTES], frame_bytes_max: u32, message_frames_max: u16) -> Result<Self, WireError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(WireError::UnknownVersion(b[4]));
        }
        let stated = u32::from_le_bytes([b[40], b[41], b[42], b[43]]);
        let computed = crc32(&b[0..40]);
        if stated != computed {
            return Err(WireError::BadChecksum { stated, computed });
        }
        let kind = FrameKind::from_u8(b[5])?;
        if b[10] != 0 || b[11] != 0 {
            return Err(WireError::Protocol("reserved header bytes are not zero".into()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let part_index = u16_at(6);
        let part_count = u16_at(8);
        if part_count > message_frames_max {
            return Err(WireError::TooManyParts { count: part_count, max: message_frames_max });
        }
        if part_count == 0 || part_index >= part_count {
            return Err(WireError::BadPart { index: part_index, count: part_count });
        }
        let length = u32_at(36);
        if length > frame_bytes_max {
            return Err(WireError::Oversized { length, max: frame_bytes_max });
        }
        let tag = Tag { group: u32_at(28), epoch: u64_at(12), seq: u64_at(20), step: u32_at(32) };
        Ok(FrameHeader { kind, tag, part_index, part_count, length })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            tag: Tag { group: 7, epoch: 3, seq: 99, step: 5 },
            part_index: 1,
            part_count: 2,
            length: 1000,
        }
    }

    fn check(mutate: impl Fn(&mut [u8; HEADER_BYTES]), expected: WireError) {
        let mut b = header().encode();
        mutate(&mut b);
        assert_eq!(FrameHeader::decode(&b, 4096, 16), Err(expected));
    }

    fn reseal(b: &mut [u8; HEADER_BYTES]) {
        let crc = crc32(&b[0..40]);
        b[40..44].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn round_trips() {
        assert_eq!(FrameHeader::decode(&header().encode(), 4096, 16), Ok(header()));
    }

    #[test]
    fn every_malformation_is_named() {
        check(|b| b[0] = b'X', WireError::BadMagic(*b"XRPE"));
        check(|b| b[4] = 9, WireError::UnknownVersion(9));
        let good = header().encode();
        let stated = u32::from_le_bytes(good[40..44].try_into().unwrap());
        let mut flipped = good;
        flipped[13] ^= 1;
        let computed = crc32(&flipped[0..40]);
        check(|b| b[13] ^= 1, WireError::BadChecksum { stated, computed });
        check(
            |b| {
                b[5] = 77;
                reseal(b)
            },
            WireError::UnknownKind(77),
        );
        check(
            |b| {
                b[36..40].copy_from_slice(&5000u32.to_le_bytes());
                reseal(b)
            },
            WireError::Oversized { length: 5000, max: 4096 },
        );
        check(
            |b| {
                b[8..10].copy_from_slice(&17u16.to_le_bytes());
                reseal(b)
            },
            WireError::TooManyParts { count: 17, max: 16 },
        );
        check(
            |b| {
                b[6..8].copy_from_slice(&2u16.to_le_bytes());
                reseal(b)
            },
            WireError::BadPart { index: 2, count: 2 },
        );
    }
}
