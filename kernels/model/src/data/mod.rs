//! Training data: the byte tokenizer and Hugging Face tokenizers, corpora (synthetic, text, jsonl,
//! token files: troupe's and nanoGPT's `.bin`), the deterministic global sampler, and held-out
//! validation data.

mod corpus;
mod documents;
mod error;
mod ids;
mod python_oracle;
mod sampler;
mod synthetic;
mod token_file;
mod tokenizer;
mod validation;

pub use corpus::{load_corpora, load_corpus, Corpus};
pub use documents::{encode_documents, DocumentFormat, Encoder, Sink};
pub use error::DataError;
pub use python_oracle::tokenizers_oracle;
pub use sampler::{micro_batch_ranges, rank_slice, GlobalSampler, SamplerState};
pub use synthetic::synthetic_text;
pub use token_file::{TokenFileHeader, TokenFileWriter, TOKEN_FILE_HEADER_BYTES, TOKEN_FILE_MAGIC, TOKEN_FILE_VERSION};
pub use tokenizer::HfTokenizer;
pub use validation::{split_tail, EvalWindows};

/// Byte-level tokenizer: token = byte value, vocabulary 256.
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const VOCAB: usize = 256;

    pub fn encode(&self, text: &[u8]) -> Vec<u16> {
        text.iter().map(|&b| u16::from(b)).collect()
    }

    /// Bytes back to text; tokens above 255 (never produced by `encode`) become U+FFFD.
    pub fn decode(&self, tokens: &[u16]) -> String {
        let bytes: Vec<u8> = tokens.iter().map(|&t| u8::try_from(t).unwrap_or(b'?')).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip() {
        let text = "héllo, wörld\n".as_bytes();
        let tokens = ByteTokenizer.encode(text);
        assert_eq!(tokens.len(), text.len());
        assert!(tokens.iter().all(|&t| (t as usize) < ByteTokenizer::VOCAB));
        assert_eq!(ByteTokenizer.decode(&tokens), "héllo, wörld\n");
    }
}
