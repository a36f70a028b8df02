//! `tokenizer.json` through the `tokenizers` crate, set up the way
//! sentence-transformers calls it: no padding (we pad to shape buckets
//! ourselves) and truncation at the model's `max_seq_length`, whatever the
//! file has baked in (MiniLM's file says pad and truncate to 128).

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationParams};

use crate::{ModelError, Result};

pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    max_len: usize,
}

impl TextTokenizer {
    /// Loads `tokenizer.json`; texts are truncated to `max_len` ids, special
    /// tokens included.
    pub fn from_file(path: &Path, max_len: usize) -> Result<TextTokenizer> {
        if !path.exists() {
            return Err(ModelError::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file")));
        }
        let err = |e: Box<dyn std::error::Error + Send + Sync>| ModelError::Tokenizer { path: path.to_path_buf(), detail: e.to_string() };
        let mut inner = Tokenizer::from_file(path).map_err(err)?;
        let trunc = TruncationParams { max_length: max_len, ..inner.get_truncation().cloned().unwrap_or_default() };
        inner.with_padding(None);
        inner.with_truncation(Some(trunc)).map_err(err)?;
        Ok(TextTokenizer { inner, path: path.to_path_buf(), max_len })
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Token ids of one text with `[CLS]` … `[SEP]`, truncated.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, true)
            .map_err(|e| ModelError::Tokenizer { path: self.path.clone(), detail: format!("encoding {}: {e}", preview(text)) })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of many texts (tokenised in parallel), in input order.
    pub fn encode_batch(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        self.encode_batch_counting(texts).map(|(ids, _)| ids)
    }

    /// [`encode_batch`](Self::encode_batch), and how many of the texts were
    /// longer than `max_len` and cut to it.
    pub fn encode_batch_counting(&self, texts: &[&str]) -> Result<(Vec<Vec<u32>>, usize)> {
        let encs = self.inner.encode_batch_fast(texts.to_vec(), true).map_err(|e| ModelError::Tokenizer {
            path: self.path.clone(),
            detail: format!("encoding a batch of {} texts: {e}", texts.len()),
        })?;
        // Truncation moves the cut tokens into the overflow encodings.
        let truncated = encs.iter().filter(|e| !e.get_overflowing().is_empty()).count();
        Ok((encs.iter().map(|e| e.get_ids().to_vec()).collect(), truncated))
    }

    /// WordPiece strings of one text (for debugging and tests).
    pub fn tokens(&self, text: &str) -> Result<Vec<String>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| ModelError::Tokenizer { path: self.path.clone(), detail: format!("encoding {}: {e}", preview(text)) })?;
        Ok(enc.get_tokens().to_vec())
    }
}

/// The start of a text for error messages.
pub(crate) fn preview(text: &str) -> String {
    let mut s: String = text.chars().take(40).collect();
    if s.len() < text.len() {
        s.push('…');
    }
    format!("{s:?}")
}
