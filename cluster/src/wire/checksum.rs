//! CRC-32 of frame headers: CRC-32/ISO-HDLC (IEEE 802.3, reflected, polynomial 0xEDB88320), computed by
//! `crc32fast`. Part of the wire format: the known vectors below pin it.

pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn known_vectors() {
        assert_eq!(super::crc32(b""), 0);
        assert_eq!(super::crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(super::crc32(b"The quick brown fox jumps over the lazy dog"), 0x414F_A339);
    }
}
