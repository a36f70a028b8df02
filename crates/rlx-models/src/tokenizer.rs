//! `tokenizer.json` through the `tokenizers` crate, set up the way
//! sentence-transformers calls it: no padding (we pad to shape buckets
//! ourselves) and truncation at the model's `max_seq_length`, whatever the
//! file has baked in (MiniLM's file says pad and truncate to 128).
//!
//! Only the first `max_len` tokens of a text are used, and the tokenizer's
//! working memory is about 85 bytes per input byte, so a text is cut before
//! it is tokenised: after [`TextTokenizer::input_budget`] bytes that can
//! make a token (whitespace and control characters do not count). Every
//! token covers at most `token_bytes` of them (the longest vocabulary entry,
//! or for WordPiece a whole word of up to `max_input_chars_per_word`
//! characters that became `[UNK]`), and the budget is twice what `max_len`
//! such tokens take plus one more, so the tokens kept are those of the whole
//! text: the words before the cut already make more than `max_len` tokens,
//! and a word cut in the middle but still longer than WordPiece's limit is
//! `[UNK]` either way. A text cut this way counts as truncated. (Characters
//! that a normaliser deletes, such as long runs of combining accents, do
//! count; a text made mostly of them is cut sooner than its tokens say.)

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationParams};

use crate::{ModelError, Result};

#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    max_len: usize,
    /// Token-making bytes of a text handed to the tokenizer at most.
    budget: usize,
}

impl TextTokenizer {
    /// Loads `tokenizer.json`; texts are truncated to `max_len` ids, special
    /// tokens included.
    pub fn from_file(path: &Path, max_len: usize) -> Result<TextTokenizer> {
        let text = crate::error::read_regular_file(path)?;
        let err = |e: Box<dyn std::error::Error + Send + Sync>| ModelError::Tokenizer { path: path.to_path_buf(), detail: e.to_string() };
        let mut inner = parse_tokenizer_json(&text).map_err(|detail| ModelError::Tokenizer { path: path.to_path_buf(), detail })?;
        let trunc = TruncationParams { max_length: max_len, ..inner.get_truncation().cloned().unwrap_or_default() };
        inner.with_padding(None);
        inner.with_truncation(Some(trunc)).map_err(err)?;
        let longest = inner.get_vocab(true).keys().map(|t| t.len()).max().unwrap_or(0);
        let whole_word = match inner.get_model() {
            tokenizers::ModelWrapper::WordPiece(wp) => wp.max_input_chars_per_word.saturating_mul(4),
            _ => 0,
        };
        let budget = input_budget(max_len, longest.max(whole_word).max(4));
        Ok(TextTokenizer { inner, path: path.to_path_buf(), max_len, budget })
    }

    /// Bytes that can make a token that a text keeps before it is cut
    /// (see the module documentation).
    pub fn input_budget(&self) -> usize {
        self.budget
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Token ids of one text with `[CLS]` … `[SEP]`, truncated.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let text = &text[..cut_point(text, self.budget)];
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
        let ends: Vec<usize> = texts.iter().map(|t| cut_point(t, self.budget)).collect();
        let cut: Vec<&str> = texts.iter().zip(&ends).map(|(t, &end)| &t[..end]).collect();
        let encs = self.inner.encode_batch_fast(cut, true).map_err(|e| ModelError::Tokenizer {
            path: self.path.clone(),
            detail: format!("encoding a batch of {} texts: {e}", texts.len()),
        })?;
        // Truncation moves the cut tokens into the overflow encodings.
        let truncated =
            encs.iter().zip(texts.iter().zip(&ends)).filter(|(e, (t, &end))| !e.get_overflowing().is_empty() || end < t.len()).count();
        Ok((encs.iter().map(|e| e.get_ids().to_vec()).collect(), truncated))
    }

    /// WordPiece strings of one text (for debugging and tests).
    pub fn tokens(&self, text: &str) -> Result<Vec<String>> {
        let text = &text[..cut_point(text, self.budget)];
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| ModelError::Tokenizer { path: self.path.clone(), detail: format!("encoding {}: {e}", preview(text)) })?;
        Ok(enc.get_tokens().to_vec())
    }
}

/// A tokenizer from the text of a tokenizer.json. The tokenizers crate
/// panics on some malformed files (a JSON syntax error inside the
/// `decoder` section hits an `expect`), so the text is first checked to be
/// JSON at all, and any panic left is caught and reported as an error.
pub(crate) fn parse_tokenizer_json(text: &str) -> std::result::Result<Tokenizer, String> {
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    check_post_processor(&json["post_processor"])?;
    let tokenizer = match std::panic::catch_unwind(|| text.parse::<Tokenizer>()) {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("not a tokenizer.json the tokenizers library can read (it panicked while parsing)".into()),
    };
    // A trial run: a tokenizer that panics on these would panic on a user's
    // text later, mid-run.
    let trial = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ["", "a", "Hello, world!"].iter().all(|t| tokenizer.encode_fast(*t, true).is_ok())
    }));
    match trial {
        Ok(_) => Ok(tokenizer),
        Err(_) => Err("the tokenizers library panics when encoding with this tokenizer.json".into()),
    }
}

/// The tokenizers crate trusts a TemplateProcessing post-processor read
/// from JSON: a special token its template names but its `special_tokens`
/// lack, or a second sequence in the single template, panics at the first
/// encode. Checked here with a message instead (nested Sequence
/// post-processors too).
fn check_post_processor(p: &serde_json::Value) -> std::result::Result<(), String> {
    use serde_json::Value;
    // By shape, not by "type": the crate reads post-processors untagged, so
    // a misspelt type still becomes a TemplateProcessing.
    let kind = if p.get("processors").is_some() {
        Some("Sequence")
    } else if p.get("single").is_some() || p.get("special_tokens").is_some() {
        Some("TemplateProcessing")
    } else {
        None
    };
    match kind {
        Some("Sequence") => {
            for inner in p["processors"].as_array().map(|a| a.as_slice()).unwrap_or_default() {
                check_post_processor(inner)?;
            }
            Ok(())
        }
        Some("TemplateProcessing") => {
            let specials = p["special_tokens"].as_object();
            if let Some(map) = specials {
                for (name, t) in map {
                    let (ids, tokens) = (t["ids"].as_array().map_or(0, Vec::len), t["tokens"].as_array().map_or(0, Vec::len));
                    if ids != tokens {
                        return Err(format!("post_processor: special token '{name}' has {ids} ids but {tokens} tokens"));
                    }
                }
            }
            for which in ["single", "pair"] {
                // Each piece: {"SpecialToken": {"id": ..}} or {"Sequence": {"id": "A"|"B"}},
                // or in the string form "[CLS]:0 $A:0 [SEP]:0".
                let pieces: Vec<(bool, String)> = match &p[which] {
                    Value::Array(items) => items
                        .iter()
                        .filter_map(|piece| {
                            if let Some(id) = piece["SpecialToken"]["id"].as_str() {
                                Some((true, id.to_string()))
                            } else {
                                piece["Sequence"]["id"].as_str().map(|id| (false, id.to_string()))
                            }
                        })
                        .collect(),
                    Value::String(t) => t
                        .split_whitespace()
                        .map(|w| {
                            let name = w.rsplit_once(':').map_or(w, |(n, _)| n);
                            match name.strip_prefix('$') {
                                Some(seq) => (false, if seq.eq_ignore_ascii_case("b") { "B".to_string() } else { "A".to_string() }),
                                None => (true, name.to_string()),
                            }
                        })
                        .collect(),
                    _ => vec![],
                };
                for (special, id) in pieces {
                    if special && !specials.is_some_and(|m| m.contains_key(&id)) {
                        return Err(format!(
                            "post_processor: the {which} template names special token '{id}', which its special_tokens do not define"
                        ));
                    }
                    if !special && which == "single" && id == "B" {
                        return Err("post_processor: the single template uses a second sequence ($B)".into());
                    }
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Twice the token-making bytes that `max_len` tokens of at most
/// `token_bytes` each can cover, plus one more token.
fn input_budget(max_len: usize, token_bytes: usize) -> usize {
    max_len.saturating_mul(token_bytes).saturating_mul(2).saturating_add(token_bytes)
}

/// The byte length of the prefix of `text` that holds `budget` bytes of
/// characters other than whitespace and control characters (the whole text
/// if it has fewer); always a character boundary.
fn cut_point(text: &str, budget: usize) -> usize {
    if text.len() <= budget {
        return text.len();
    }
    let mut counted = 0usize;
    for (i, c) in text.char_indices() {
        if counted >= budget {
            return i;
        }
        if !c.is_whitespace() && !c.is_control() {
            counted += c.len_utf8();
        }
    }
    text.len()
}

/// The start of a text for error messages.
pub(crate) fn preview(text: &str) -> String {
    let mut s: String = text.chars().take(40).collect();
    if s.len() < text.len() {
        s.push('…');
    }
    format!("{s:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_counts_only_token_making_bytes_and_keeps_characters_whole() {
        assert_eq!(cut_point("short", 10), 5);
        assert_eq!(cut_point("abcdefghij", 4), 4);
        // Whitespace and control characters are free: the cut moves past them.
        assert_eq!(cut_point("a  \t\u{1}b  cdef", 3), "a  \t\u{1}b  c".len());
        // Three-byte characters are never split.
        let t = "日本語の文章";
        let end = cut_point(t, 4);
        assert!(t.is_char_boundary(end) && end == 6, "{end}");
        assert_eq!(input_budget(256, 400), 256 * 400 * 2 + 400);
        assert_eq!(input_budget(usize::MAX, 400), usize::MAX);
    }
}
