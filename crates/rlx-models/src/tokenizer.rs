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

use rayon::prelude::*;
use tokenizers::{Tokenizer, TruncationParams};

use crate::ascii_wordpiece::AsciiWordPiece;
use crate::{ModelError, Result};

#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    path: PathBuf,
    max_len: usize,
    /// Token-making bytes of a text handed to the tokenizer at most.
    budget: usize,
    /// BERT's pipeline for ASCII texts in one pass (src/ascii_wordpiece.rs),
    /// where the file is that pipeline.
    fast: Option<AsciiWordPiece>,
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
        let fast = AsciiWordPiece::for_tokenizer(&inner, max_len);
        Ok(TextTokenizer { inner, path: path.to_path_buf(), max_len, budget, fast })
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
        if let Some((ids, _)) = self.fast.as_ref().and_then(|f| f.encode(text)) {
            return Ok(ids);
        }
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
        // The fast path's texts, in parallel; the rest through the crate.
        let fast: Vec<Option<(Vec<u32>, bool)>> = match &self.fast {
            Some(f) => cut.par_iter().with_min_len(64).map(|t| f.encode(t)).collect(),
            None => vec![None; cut.len()],
        };
        let slow: Vec<&str> = cut.iter().zip(&fast).filter(|(_, f)| f.is_none()).map(|(t, _)| *t).collect();
        let mut encs = if slow.is_empty() {
            Vec::new()
        } else {
            self.inner.encode_batch_fast(slow, true).map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                detail: format!("encoding a batch of {} texts: {e}", texts.len()),
            })?
        }
        .into_iter();
        let (mut ids, mut truncated) = (Vec::with_capacity(texts.len()), 0);
        for ((f, t), &end) in fast.into_iter().zip(texts).zip(&ends) {
            let (v, cut_tokens) = match f {
                Some(x) => x,
                None => {
                    let e = encs.next().ok_or_else(|| ModelError::Tokenizer {
                        path: self.path.clone(),
                        detail: "the tokenizer returned fewer encodings than texts".into(),
                    })?;
                    // Truncation moves the cut tokens into the overflow encodings.
                    (e.get_ids().to_vec(), !e.get_overflowing().is_empty())
                }
            };
            truncated += (cut_tokens || end < t.len()) as usize;
            ids.push(v);
        }
        Ok((ids, truncated))
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
    use rand::{Rng, SeedableRng};

    /// A small BERT tokenizer.json: every ASCII letter, digit and
    /// punctuation character but `~` and `q`, their `##` forms but `##q`,
    /// a few longer pieces; words of up to 20 characters.
    fn tiny_bert(lowercase: bool) -> String {
        let mut vocab: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].iter().map(|s| s.to_string()).collect();
        for c in (b'!'..=b'~').filter(|&c| c != b'~' && c != b'q') {
            vocab.push((c as char).to_string());
            if c.is_ascii_alphanumeric() {
                vocab.push(format!("##{}", c as char));
            }
        }
        for w in ["the", "quick", "brown", "un", "##believ", "##able", "##ing", "hello", "world", "Hello", "##llo"] {
            vocab.push(w.to_string());
        }
        let entries: Vec<String> =
            vocab.iter().enumerate().map(|(i, t)| format!("{}: {i}", serde_json::to_string(t).unwrap_or_default())).collect();
        let added: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                format!(r#"{{"id": {i}, "content": "{t}", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}"#)
            })
            .collect();
        format!(
            r###"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{}],
            "normalizer": {{"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true, "strip_accents": null, "lowercase": {lowercase}}},
            "pre_tokenizer": {{"type": "BertPreTokenizer"}},
            "post_processor": {{"type": "BertProcessing", "sep": ["[SEP]", 3], "cls": ["[CLS]", 2]}},
            "decoder": {{"type": "WordPiece", "prefix": "##", "cleanup": true}},
            "model": {{"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 20, "vocab": {{{}}}}}}}"###,
            added.join(", "),
            entries.join(", ")
        )
    }

    /// Random texts: mostly letters and spaces, with digits, punctuation,
    /// control characters and long runs; in some, added tokens and
    /// non-ASCII characters.
    fn random_texts(seed: u64, n: usize) -> Vec<String> {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let len = r.random_range(0..400);
                // One text in six may hold added tokens and non-ASCII characters.
                let exotic = r.random_bool(1.0 / 6.0);
                let mut t = String::new();
                while t.len() < len {
                    match r.random_range(0..100) {
                        89 | 90 if !exotic => t.push(' '),
                        0..=54 => t.push((if r.random_bool(0.2) { b'A' } else { b'a' } + r.random_range(0..26)) as char),
                        55..=69 => t.push(' '),
                        70..=77 => t.push((b'!' + r.random_range(0..15)) as char),
                        78..=82 => t.push((b'0' + r.random_range(0..10)) as char),
                        83..=87 => t.push(r.random_range(0u8..32) as char),
                        88 => t.push('\u{7f}'),
                        89 => t.push_str(["[MASK]", "[mask]", "[CLS]", "[sep"][r.random_range(0..4)]),
                        90 => t.push(['é', 'ß', '日', '\u{301}', '\u{a0}'][r.random_range(0..5)]),
                        91 => t.push_str(&"x".repeat(r.random_range(15..30))),
                        _ => t.push((b'[' + r.random_range(0..6)) as char),
                    }
                }
                t
            })
            .collect()
    }

    /// The one-pass ASCII path gives the ids and truncation counts the
    /// crate gives, one text at a time and in batches.
    fn same_as_the_crate(tok: &TextTokenizer, texts: &[String], what: &str) {
        assert!(tok.fast.is_some(), "{what}: the fast path was not taken up");
        let slow = TextTokenizer { fast: None, ..tok.clone() };
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let (a, ta) = tok.encode_batch_counting(&refs).unwrap_or_else(|e| panic!("{what}: {e}"));
        let (b, tb) = slow.encode_batch_counting(&refs).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (i, t) in refs.iter().enumerate() {
            assert_eq!(a[i], b[i], "{what}: text {i} {t:?}");
            assert_eq!(tok.encode(t).ok(), Some(b[i].clone()), "{what}: text {i} alone");
        }
        assert_eq!(ta, tb, "{what}: truncated texts");
        let fast = refs.iter().filter(|t| tok.fast.as_ref().is_some_and(|f| f.encode(t).is_some())).count();
        assert!(fast * 3 > refs.len(), "{what}: only {fast} of {} texts took the fast path", refs.len());
    }

    #[test]
    fn the_ascii_path_equals_the_tokenizers_crate() {
        let dir = std::env::temp_dir().join(format!("rlx-tiny-bert-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        for (lowercase, max_len) in [(true, 16), (false, 16), (true, 512)] {
            let path = dir.join(format!("tokenizer-{lowercase}-{max_len}.json"));
            std::fs::write(&path, tiny_bert(lowercase)).unwrap_or_else(|e| panic!("{e}"));
            let tok = TextTokenizer::from_file(&path, max_len).unwrap_or_else(|e| panic!("{e}"));
            same_as_the_crate(&tok, &random_texts(7 + max_len as u64, 3000), &format!("tiny, lowercase {lowercase}, max_len {max_len}"));
        }
        // A file that truncates from the left is not BERT's usual pipeline:
        // every text goes through the crate.
        let left = tiny_bert(true).replacen(
            r#""truncation": null"#,
            r#""truncation": {"direction": "Left", "max_length": 16, "strategy": "LongestFirst", "stride": 0}"#,
            1,
        );
        let path = dir.join("tokenizer-left.json");
        std::fs::write(&path, left).unwrap_or_else(|e| panic!("{e}"));
        let tok = TextTokenizer::from_file(&path, 16).unwrap_or_else(|e| panic!("{e}"));
        assert!(tok.fast.is_none(), "left truncation took the fast path");
        let _ = std::fs::remove_dir_all(&dir);
        // The real MiniLM tokenizer, on the embedding benchmark's corpus and
        // random texts.
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let file = root.join("models/all-MiniLM-L6-v2/tokenizer.json");
        if !file.is_file() {
            assert!(std::env::var("RLX_REQUIRE_MODELS").as_deref() != Ok("1"), "{} is missing", file.display());
            eprintln!("SKIPPED the MiniLM half: {} is missing (run scripts/fetch-models)", file.display());
            return;
        }
        let corpus = std::fs::read_to_string(root.join("bench/embed-corpus.txt")).unwrap_or_else(|e| panic!("{e}"));
        let mut texts: Vec<String> = corpus.lines().map(String::from).collect();
        texts.extend(random_texts(11, 3000));
        for max_len in [128, 256] {
            let tok = TextTokenizer::from_file(&file, max_len).unwrap_or_else(|e| panic!("{e}"));
            same_as_the_crate(&tok, &texts, &format!("MiniLM, max_len {max_len}"));
        }
    }

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
