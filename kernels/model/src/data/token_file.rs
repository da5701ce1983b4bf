//! Token files: what `troupe data prepare` writes and `data.kind = "bin"` reads, beside nanoGPT's
//! headerless uint16 `.bin` files.
//!
//! troupe's token file, every field little-endian:
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic, the ASCII `TROUPETK` |
//! | 8 | 4 | version, 1 |
//! | 12 | 4 | token width in bytes: 2 (uint16) while the vocabulary has at most 65,536 tokens, else 4 (uint32) |
//! | 16 | 8 | the vocabulary size of the tokenizer that wrote it (every id is below it) |
//! | 24 | 8 | the number of tokens |
//! | 32 | width × tokens | the ids |
//!
//! A file that does not start with the magic is a nanoGPT file: uint16 ids and nothing else. Such a file
//! whose first four ids spell the magic is refused unless the rest of the header holds, length included
//! (the odds of that for real data are below 2⁻⁶⁴).

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::ids::Ids;
use super::DataError;

pub const TOKEN_FILE_MAGIC: [u8; 8] = *b"TROUPETK";
pub const TOKEN_FILE_VERSION: u32 = 1;
pub const TOKEN_FILE_HEADER_BYTES: usize = 32;

/// What a token file's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenFileHeader {
    /// 2 (uint16) or 4 (uint32).
    pub width_bytes: u32,
    pub vocab_size: u64,
    pub tokens: u64,
}

impl TokenFileHeader {
    /// The header of a file of `tokens` ids from a vocabulary of `vocab_size`: uint16 while it fits.
    pub fn for_vocab(vocab_size: usize, tokens: u64) -> Self {
        let width_bytes = if vocab_size <= 1 << 16 { 2 } else { 4 };
        Self { width_bytes, vocab_size: vocab_size as u64, tokens }
    }

    fn to_bytes(self) -> [u8; TOKEN_FILE_HEADER_BYTES] {
        let mut out = [0; TOKEN_FILE_HEADER_BYTES];
        out[..8].copy_from_slice(&TOKEN_FILE_MAGIC);
        out[8..12].copy_from_slice(&TOKEN_FILE_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.width_bytes.to_le_bytes());
        out[16..24].copy_from_slice(&self.vocab_size.to_le_bytes());
        out[24..32].copy_from_slice(&self.tokens.to_le_bytes());
        out
    }

    /// The header of a file of `len` bytes that starts with the magic, or what is wrong with it.
    fn parse(bytes: &[u8]) -> Result<Self, String> {
        let len = bytes.len();
        if len < TOKEN_FILE_HEADER_BYTES {
            return Err(format!("is {len} bytes, too short for its {TOKEN_FILE_HEADER_BYTES}-byte header"));
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != TOKEN_FILE_VERSION {
            return Err(format!("has version {version}; this troupe reads version {TOKEN_FILE_VERSION}"));
        }
        let header = Self { width_bytes: u32_at(12), vocab_size: u64_at(16), tokens: u64_at(24) };
        if header.width_bytes != 2 && header.width_bytes != 4 {
            return Err(format!(
                "has a token width of {} bytes; 2 (uint16) or 4 (uint32) expected",
                header.width_bytes
            ));
        }
        if header.width_bytes == 2 && header.vocab_size > 1 << 16 {
            return Err(format!("holds uint16 tokens for a vocabulary of {}", header.vocab_size));
        }
        let expected = header.tokens.checked_mul(u64::from(header.width_bytes)).and_then(|b| b.checked_add(32));
        if expected != Some(len as u64) {
            return Err(format!(
                "is {len} bytes where its header promises {} tokens of {} bytes after the {TOKEN_FILE_HEADER_BYTES}-byte header: truncated or appended to?",
                header.tokens, header.width_bytes
            ));
        }
        Ok(header)
    }
}

/// A token file's ids, and its header if it has one (nanoGPT files have none).
#[derive(Debug)]
pub(crate) struct TokenFile {
    pub header: Option<TokenFileHeader>,
    pub ids: Ids,
}

/// Decodes the bytes of the token file at `path`: troupe's (starting with the magic) or nanoGPT's.
pub(crate) fn read_token_file(path: &Path, bytes: &[u8]) -> Result<TokenFile, DataError> {
    if !bytes.starts_with(&TOKEN_FILE_MAGIC) {
        if !bytes.len().is_multiple_of(2) {
            return Err(DataError::OddLength { path: path.to_owned(), bytes: bytes.len() });
        }
        let ids: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        return Ok(TokenFile { header: None, ids: Ids::U16(ids.into()) });
    }
    let header =
        TokenFileHeader::parse(bytes).map_err(|problem| DataError::BadHeader { path: path.to_owned(), problem })?;
    let body = &bytes[TOKEN_FILE_HEADER_BYTES..];
    let ids = if header.width_bytes == 2 {
        Ids::U16(body.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
    } else {
        Ids::from_u32(body.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    };
    Ok(TokenFile { header: Some(header), ids })
}

/// Writes a token file as the ids arrive: into `PATH.partial`, renamed to `PATH` by [`finish`] once the
/// header holds the count and the data is on disk; dropped unfinished, it removes the partial file.
///
/// [`finish`]: TokenFileWriter::finish
#[derive(Debug)]
pub struct TokenFileWriter {
    path: PathBuf,
    partial: PathBuf,
    out: Option<BufWriter<File>>,
    header: TokenFileHeader,
}

impl TokenFileWriter {
    pub fn create(path: &Path, vocab_size: usize) -> Result<Self, DataError> {
        let mut name = path.file_name().unwrap_or_default().to_owned();
        name.push(".partial");
        let partial = path.with_file_name(name);
        let header = TokenFileHeader::for_vocab(vocab_size, 0);
        let write_error = |source| DataError::Write { path: path.to_owned(), source };
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&partial).map_err(write_error)?);
        out.write_all(&header.to_bytes()).map_err(write_error)?;
        Ok(Self { path: path.to_owned(), partial, out: Some(out), header })
    }

    pub fn header(&self) -> TokenFileHeader {
        self.header
    }

    /// Appends `ids`, each below the vocabulary size given to [`create`](Self::create).
    pub fn push(&mut self, ids: &[u32]) -> Result<(), DataError> {
        let vocab = self.header.vocab_size;
        assert!(ids.iter().all(|&t| u64::from(t) < vocab), "an id outside the writer's vocabulary of {vocab}");
        let mut bytes = Vec::with_capacity(ids.len() * self.header.width_bytes as usize);
        if self.header.width_bytes == 2 {
            ids.iter().for_each(|&t| bytes.extend_from_slice(&(t as u16).to_le_bytes()));
        } else {
            ids.iter().for_each(|&t| bytes.extend_from_slice(&t.to_le_bytes()));
        }
        let out = self.out.as_mut().expect("not finished");
        out.write_all(&bytes).map_err(|source| DataError::Write { path: self.path.clone(), source })?;
        self.header.tokens += ids.len() as u64;
        Ok(())
    }

    /// Writes the count into the header, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<TokenFileHeader, DataError> {
        let write_error = |source| DataError::Write { path: self.path.clone(), source };
        let mut file = self.out.take().expect("not finished").into_inner().map_err(|e| write_error(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(write_error)?;
        file.write_all(&self.header.to_bytes()).map_err(write_error)?;
        file.sync_all().map_err(write_error)?;
        std::fs::rename(&self.partial, &self.path).map_err(write_error)?;
        Ok(self.header)
    }
}

impl Drop for TokenFileWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, vocab: usize, ids: &[u32]) -> PathBuf {
        let path = dir.join("tokens.bin");
        let mut writer = TokenFileWriter::create(&path, vocab).unwrap();
        writer.push(&ids[..ids.len() / 2]).unwrap();
        writer.push(&ids[ids.len() / 2..]).unwrap();
        let header = writer.finish().unwrap();
        assert_eq!(header.tokens, ids.len() as u64);
        path
    }

    fn read(path: &Path) -> Result<TokenFile, DataError> {
        read_token_file(path, &std::fs::read(path).unwrap())
    }

    #[test]
    fn token_files_round_trip_in_the_width_their_vocabulary_needs() {
        let dir = tempfile::tempdir().unwrap();
        for (vocab, width) in [(256, 2), (65_536, 2), (65_537, 4), (151_936, 4)] {
            let ids: Vec<u32> = (0..1000).map(|i| (i * 7919) % vocab as u32).collect();
            let path = write(dir.path(), vocab, &ids);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), 32 + 1000 * width);
            assert!(!dir.path().join("tokens.bin.partial").exists());
            let file = read(&path).unwrap();
            let header = file.header.unwrap();
            assert_eq!((header.width_bytes as u64, header.vocab_size, header.tokens), (width, vocab as u64, 1000));
            assert_eq!((0..1000).map(|i| file.ids.get(i)).collect::<Vec<_>>(), ids, "vocab {vocab}");
        }
    }

    #[test]
    fn headerless_files_are_nanogpt_uint16() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nano.bin");
        std::fs::write(&path, [1u8, 0, 0xff, 0xff, 7, 1]).unwrap();
        let file = read(&path).unwrap();
        assert!(file.header.is_none());
        assert_eq!((0..3).map(|i| file.ids.get(i)).collect::<Vec<_>>(), [1, 65_535, 263]);
    }

    #[test]
    fn a_bad_header_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let good = std::fs::read(write(dir.path(), 300, &[1, 2, 3, 4])).unwrap();
        let path = dir.path().join("bad.bin");
        let patched = |at: usize, value: &[u8]| {
            let mut bytes = good.clone();
            bytes[at..at + value.len()].copy_from_slice(value);
            bytes
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..20].to_vec(), "too short for its 32-byte header"),
            (good[..good.len() - 1].to_vec(), "promises 4 tokens of 2 bytes"),
            ([good.as_slice(), &[0, 0]].concat(), "truncated or appended to"),
            (patched(8, &2u32.to_le_bytes()), "version 2"),
            (patched(12, &3u32.to_le_bytes()), "token width of 3 bytes"),
            (patched(16, &100_000u64.to_le_bytes()), "uint16 tokens for a vocabulary of 100000"),
        ];
        for (bytes, needle) in cases {
            std::fs::write(&path, bytes).unwrap();
            let message = read(&path).unwrap_err().to_string();
            assert!(message.contains(needle) && message.contains("bad.bin"), "{message:?} lacks {needle:?}");
        }
    }

    #[test]
    fn an_unfinished_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.bin");
        let mut writer = TokenFileWriter::create(&path, 256).unwrap();
        writer.push(&[1, 2, 3]).unwrap();
        drop(writer);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
