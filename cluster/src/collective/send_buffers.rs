//! Reusing the memory of outgoing collective messages.
//!
//! Every send of a collective step is a fresh copy of a range of the working buffer (the transport
//! owns a message until the peer has it: QUIC keeps it for retransmission until acknowledged). Fresh
//! multi-megabyte allocations come from the kernel as untouched pages, so each one cost a page fault
//! per 4 KiB on first write — on a 64 MiB QUIC all-reduce, more CPU than the copy itself. A
//! communicator keeps the buffers of its recent messages and reuses one once the transport has let
//! go of it (its `Bytes` is unique again): the memory is already mapped and likely still in cache.

use std::sync::Mutex;

use bytes::{Bytes, BytesMut};

use super::Element;

/// Messages shorter than this are allocated afresh: small allocations come from the allocator's
/// free lists, already mapped.
pub const POOLED_BYTES_MIN: usize = 64 << 10;

/// At most this many bytes of buffers are kept for reuse per communicator (beyond it, the oldest are
/// let go): a 64 MiB ring all-reduce keeps about half its buffer's size in flight at n = 2.
pub const KEPT_BYTES_MAX: usize = 128 << 20;

#[derive(Debug, Default)]
pub struct SendBuffers {
    /// Buffers of earlier messages, oldest first; those the transport still holds are not unique.
    kept: Mutex<Vec<Bytes>>,
}

impl SendBuffers {
    /// The wire bytes of `values` as `E`, written into a reused buffer when one is free and large
    /// enough (at most twice the size needed, so a small message never pins a large buffer).
    pub fn encode<E: Element>(&self, values: &[f32]) -> Bytes {
        let len = values.len() * E::BYTES;
        if len < POOLED_BYTES_MIN {
            let mut out = BytesMut::with_capacity(len);
            E::encode_into(values, &mut out);
            return out.freeze();
        }
        let mut out = self.reclaim(len).unwrap_or_else(|| BytesMut::with_capacity(len));
        E::encode_into(values, &mut out);
        let bytes = out.freeze();
        self.keep(bytes.clone());
        bytes
    }

    fn reclaim(&self, len: usize) -> Option<BytesMut> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let at = kept.iter().position(|b| (len..=2 * len).contains(&b.len()) && b.is_unique())?;
        let mut buf = kept.remove(at).try_into_mut().ok()?;
        buf.clear();
        Some(buf)
    }

    fn keep(&self, bytes: Bytes) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.push(bytes);
        let mut total: usize = kept.iter().map(Bytes::len).sum();
        while total > KEPT_BYTES_MAX {
            total -= kept.remove(0).len();
        }
    }

    /// Bytes of buffers kept (in flight or free).
    pub fn kept_bytes(&self) -> usize {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).iter().map(Bytes::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_reused_only_once_the_transport_let_go_of_it() {
        let pool = SendBuffers::default();
        let values = vec![1.5f32; POOLED_BYTES_MIN / 4];
        let first = pool.encode::<f32>(&values);
        let first_at = first.as_ptr();
        // Still held (as a transport would until the peer acknowledged it): a new buffer.
        let second = pool.encode::<f32>(&values);
        assert_ne!(second.as_ptr(), first_at);
        drop(first);
        let other = vec![2.5f32; POOLED_BYTES_MIN / 4];
        let third = pool.encode::<f32>(&other);
        assert_eq!(third.as_ptr(), first_at, "the released buffer is reused");
        assert_eq!(&third[..], bytemuck::cast_slice::<f32, u8>(&other), "with the new contents only");
        assert_eq!(&second[..], bytemuck::cast_slice::<f32, u8>(&values), "a held buffer is never written");
    }

    #[test]
    fn small_and_much_smaller_messages_do_not_take_large_buffers() {
        let pool = SendBuffers::default();
        let big = pool.encode::<f32>(&vec![0f32; POOLED_BYTES_MIN]);
        let big_at = big.as_ptr();
        drop(big);
        let small = pool.encode::<f32>(&[1.0, 2.0]);
        assert_ne!(small.as_ptr(), big_at);
        let quarter = pool.encode::<f32>(&vec![0f32; POOLED_BYTES_MIN / 4]);
        assert_ne!(quarter.as_ptr(), big_at, "a buffer over twice the size needed is not taken");
        assert_eq!(pool.kept_bytes(), 4 * POOLED_BYTES_MIN + POOLED_BYTES_MIN);
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let pool = SendBuffers::default();
        let values = vec![0f32; (KEPT_BYTES_MAX / 4) / 3 + 1];
        let held: Vec<Bytes> = (0..4).map(|_| pool.encode::<f32>(&values)).collect();
        assert!(pool.kept_bytes() <= KEPT_BYTES_MAX);
        assert_eq!(pool.kept_bytes(), 2 * values.len() * 4);
        drop(held);
    }
}
