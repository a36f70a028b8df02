//! BERT's tokenizer (BertNormalizer, BertPreTokenizer, WordPiece, `[CLS]
//! … [SEP]`) for texts that are all ASCII, in one pass over the bytes: the
//! `tokenizers` crate's path, which tracks every character's offsets
//! through normalisation, costs about 56 µs for a 37-token line on this
//! project's CPU; this one about 2. [`TextTokenizer`](crate::tokenizer)
//! takes it for ASCII texts that hold no added token (`[MASK]` and the
//! like, matched before normalisation) and hands every other text to the
//! crate. It is built only for a tokenizer.json of exactly that pipeline,
//! and only when it agrees with the crate on a set of probe texts.
//!
//! On ASCII the pipeline is: NUL and the control characters other than
//! tab, newline and carriage return are deleted (clean_text), those three
//! become spaces, letters are lowercased (when the normaliser lowercases;
//! accents and Chinese characters do not occur); words split at spaces and
//! each punctuation character is a word of its own; a word longer than
//! `max_input_chars_per_word` is `[UNK]`, else WordPiece takes the longest
//! vocabulary entry from its start, then the longest `##` entry from
//! there, and so on, and a word where no entry matches is one `[UNK]`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{Model, ModelWrapper, Tokenizer, TruncationDirection};

/// FNV-1a: vocabulary keys are a few bytes, where SipHash's setup dominates.
#[derive(Default)]
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

type Map = HashMap<Box<[u8]>, u32, BuildHasherDefault<Fnv>>;

#[derive(Clone)]
pub(crate) struct AsciiWordPiece {
    /// Entries that start a word.
    words: std::sync::Arc<Map>,
    /// Entries that continue one, without their prefix.
    rest: std::sync::Arc<Map>,
    unk: u32,
    cls: u32,
    sep: u32,
    lowercase: bool,
    max_chars: usize,
    /// Word pieces kept (the ids' limit less `[CLS]` and `[SEP]`).
    keep: usize,
    /// Added tokens' contents, lowercased: a text holding one goes to the
    /// crate.
    added: Vec<Vec<u8>>,
    /// Bytes an added token's match can start at (its first byte in either
    /// case; for a leading space also tab, newline and carriage return,
    /// which normalise to one): a text with none of them holds none.
    starts: [bool; 256],
}

/// Texts the fast path must tokenize as the crate does before it is used:
/// every ASCII byte, punctuation between and inside words, words past the
/// length limit, words with and without vocabulary entries, texts past the
/// ids' limit (each word different, so that which ones are kept shows).
fn probes() -> Vec<String> {
    let all: String = (0u8..128).map(|b| b as char).collect();
    vec![
        String::new(),
        all.clone(),
        all.chars().rev().collect(),
        "Hello, World! It's 3.14 -- isn't it? (yes) [no] {maybe} <a@b.c> #tag $5 100% ~x^y_z|w`v\\u".into(),
        "tab\there\nnew line\r\x0bvertical\x0cfeed\x01ctrl\x7fdel\x00nul  double  space".into(),
        "qwxzzyqv blorptastic unbelievably antidisestablishmentarianism xylophones".into(),
        "a".repeat(99) + " " + &"b".repeat(100) + " " + &"c".repeat(101),
        "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX.".into(),
        "word ".repeat(400),
        (0..600).map(|i| i.to_string()).collect::<Vec<_>>().join(" "),
    ]
}

impl AsciiWordPiece {
    /// The fast path for `tok` (truncated to `max_len` ids), or None when
    /// its pipeline is not BERT's or the two disagree on a probe.
    pub(crate) fn for_tokenizer(tok: &Tokenizer, max_len: usize) -> Option<AsciiWordPiece> {
        let lowercase = match tok.get_normalizer()? {
            NormalizerWrapper::BertNormalizer(n) if n.clean_text => n.lowercase,
            _ => return None,
        };
        if !matches!(tok.get_pre_tokenizer()?, PreTokenizerWrapper::BertPreTokenizer(_)) {
            return None;
        }
        // Truncation keeps the first ids, with no overlap.
        let t = tok.get_truncation()?;
        if t.direction != TruncationDirection::Right || t.stride != 0 || t.max_length != max_len {
            return None;
        }
        let ModelWrapper::WordPiece(wp) = tok.get_model() else { return None };
        let mut words = Map::default();
        let mut rest = Map::default();
        let prefix = wp.continuing_subword_prefix.as_bytes();
        for (piece, id) in wp.get_vocab() {
            let b = piece.as_bytes();
            if let Some(r) = b.strip_prefix(prefix) {
                rest.insert(r.into(), id);
            }
            words.insert(b.into(), id);
        }
        let unk = *words.get(wp.unk_token.as_bytes())?;
        // The special tokens around a text: the crate's encoding of "".
        let empty = tok.encode_fast("", true).ok()?;
        let [cls, sep] = empty.get_ids() else { return None };
        let added: Vec<Vec<u8>> = tok.get_added_tokens_decoder().values().map(|t| t.content.to_ascii_lowercase().into_bytes()).collect();
        let mut starts = [false; 256];
        for &c in added.iter().filter_map(|a| a.first()) {
            starts[c as usize] = true;
            starts[c.to_ascii_uppercase() as usize] = true;
            if c == b' ' {
                for w in [b'\t', b'\n', b'\r'] {
                    starts[w as usize] = true;
                }
            }
        }
        let fast = AsciiWordPiece {
            words: words.into(),
            rest: rest.into(),
            unk,
            cls: *cls,
            sep: *sep,
            lowercase,
            max_chars: wp.max_input_chars_per_word,
            keep: max_len.checked_sub(2)?,
            added,
            starts,
        };
        let agrees = probes().iter().all(|p| {
            let crate_ids = tok.encode_fast(p.as_str(), true).map(|e| e.get_ids().to_vec()).ok();
            fast.encode(p).map(|(ids, _)| ids) == crate_ids
        });
        agrees.then_some(fast)
    }

    /// The ids of `text` and whether word pieces were cut past the limit;
    /// None when the text is not ASCII or holds an added token.
    pub(crate) fn encode(&self, text: &str) -> Option<(Vec<u32>, bool)> {
        let b = text.as_bytes();
        if !b.is_ascii() {
            return None;
        }
        if b.iter().any(|&c| self.starts[c as usize]) {
            // The crate matches added tokens in the raw text or in the
            // normalised one (per token): look in both, ignoring case.
            let norm: Vec<u8> = b
                .iter()
                .filter(|&&c| !matches!(c, 0..=0x08 | 0x0b | 0x0c | 0x0e..=0x1f | 0x7f))
                .map(|&c| if matches!(c, b'\t' | b'\n' | b'\r') { b' ' } else { c })
                .collect();
            let holds = |t: &[u8], a: &[u8]| t.windows(a.len()).any(|w| w.eq_ignore_ascii_case(a));
            if self.added.iter().any(|a| !a.is_empty() && (holds(b, a) || holds(&norm, a))) {
                return None;
            }
        }
        let mut pieces = Vec::with_capacity(b.len() / 4 + 2);
        let mut word: Vec<u8> = Vec::with_capacity(64);
        for &c in b {
            match c {
                b' ' | b'\t' | b'\n' | b'\r' => self.word(&mut word, &mut pieces),
                0..=0x1f | 0x7f => {}
                _ if c.is_ascii_punctuation() => {
                    self.word(&mut word, &mut pieces);
                    word.push(c);
                    self.word(&mut word, &mut pieces);
                }
                _ => word.push(if self.lowercase { c.to_ascii_lowercase() } else { c }),
            }
        }
        self.word(&mut word, &mut pieces);
        let cut = pieces.len() > self.keep;
        pieces.truncate(self.keep);
        let mut ids = Vec::with_capacity(pieces.len() + 2);
        ids.push(self.cls);
        ids.extend_from_slice(&pieces);
        ids.push(self.sep);
        Some((ids, cut))
    }

    /// WordPiece over one word (then emptied).
    fn word(&self, word: &mut Vec<u8>, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if word.len() > self.max_chars {
            out.push(self.unk);
            word.clear();
            return;
        }
        let mark = out.len();
        let mut start = 0;
        while start < word.len() {
            let map = if start == 0 { &self.words } else { &self.rest };
            let Some((end, id)) = (start + 1..=word.len()).rev().find_map(|end| map.get(&word[start..end]).map(|&id| (end, id))) else {
                out.truncate(mark);
                out.push(self.unk);
                break;
            };
            out.push(id);
            start = end;
        }
        word.clear();
    }
}
