//! The wire protocol, sans-IO: a fixed 44-byte frame header (magic, version, kind, epoch, routing tag,
//! length, header checksum) followed by `length` payload bytes. Control messages are serde JSON;
//! tensor payloads are raw little-endian bytes.

mod checksum;
mod decode;
mod header;
mod message;

pub use checksum::crc32;
pub use decode::{decode_frames, DecodedFrame};
pub use header::{FrameHeader, FrameKind, Tag, HEADER_BYTES, MAGIC, VERSION};
pub use message::{ControlMessage, PeerRole, MESSAGE_BYTES_MAX};

/// Why a frame was refused. Any of these closes the connection it arrived on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("unknown protocol version {0} (this build speaks {VERSION})")]
    UnknownVersion(u8),
    #[error("header checksum mismatch: header says {stated:#010x}, computed {computed:#010x}")]
    BadChecksum { stated: u32, computed: u32 },
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame of {length} bytes exceeds frame_bytes_max = {max}")]
    Oversized { length: u32, max: u32 },
    #[error("message split into {count} frames exceeds message_frames_max = {max}")]
    TooManyParts { count: u16, max: u16 },
    #[error("frame part {index} of {count} is out of range")]
    BadPart { index: u16, count: u16 },
    #[error("truncated frame: {needed} bytes needed, {available} available")]
    Truncated { needed: usize, available: usize },
    #[error("bad control message: {0}")]
    BadControl(String),
    /// The stream or connection failed underneath (not the peer's frame's fault).
    #[error("stream failed: {0}")]
    Stream(String),
    #[error("protocol violation: {0}")]
    Protocol(String),
}
