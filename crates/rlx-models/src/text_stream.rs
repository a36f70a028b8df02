//! Streaming detokenization: generated ids go in one at a time, text that is
//! final comes out.
//!
//! Two things make a token's text not final yet:
//! - A token can end in the middle of a UTF-8 character (byte-level BPE
//!   tokens are byte strings; byte-fallback tokens are single bytes). The
//!   unfinished character is held back until it completes.
//! - With stop strings, text that could be the start of a stop string is held
//!   back until the following text decides. When a stop string completes, the
//!   text before it is returned with [`StreamStep::Stopped`]; the stop string
//!   and anything after it are dropped.
//!
//! With a byte-level decoder alone (GPT-2's, which SmolLM2, LLaMA 3 and Qwen
//! use) every id stands for fixed bytes, so a step appends its id's bytes and
//! passes on the complete characters: the text of the whole stream is exactly
//! what decoding all its ids at once gives. Other decoders decode a small
//! window of ids per step: the open ids (decoded together; a trailing U+FFFD,
//! what the lossy decoder makes of an unfinished character, is held back)
//! plus the group settled just before them (kept as context for decoders
//! whose output depends on the preceding token), so the cost per token does
//! not grow with the length of the generation.

use std::sync::Arc;

use tokenizers::{DecoderWrapper, Tokenizer};

/// Window decoding (decoders other than byte-level): after this many open
/// ids without a character boundary the output is not valid UTF-8 (no
/// character spans more than four bytes); the undecodable bytes are then
/// passed on as U+FFFD instead of being held forever.
const MAX_OPEN_IDS: usize = 32;

const REPLACEMENT: char = '\u{FFFD}';

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamStep {
    /// Text that became final with this step; often empty.
    Text(String),
    /// `stop` completed. `text` is what preceded it and had not been returned
    /// yet. The stream accepts no more ids.
    Stopped { text: String, stop: String },
}

impl StreamStep {
    /// The text to show, whichever the variant.
    pub fn text(&self) -> &str {
        match self {
            StreamStep::Text(t) | StreamStep::Stopped { text: t, .. } => t,
        }
    }

    pub fn is_stopped(&self) -> bool {
        matches!(self, StreamStep::Stopped { .. })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TextStreamError {
    #[error("token id {id} is out of range (the tokenizer has {vocab_size} tokens)")]
    UnknownId { id: u32, vocab_size: usize },
    #[error("decoding failed: {0}")]
    Decode(String),
    #[error("the stream has stopped or finished; start a new one")]
    Ended,
}

/// Incremental decoder over a shared tokenizer. See the module documentation.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    vocab_size: usize,
    /// The context group followed by the open ids.
    ids: Vec<u32>,
    /// `ids[..open]` is the context group; its text has been passed on.
    open: usize,
    /// Length of the decoded context group.
    context_len: usize,
    /// Bytes of the open ids' text (after the context) already passed on.
    passed: usize,
    stop_strings: Vec<String>,
    /// Decoded text held back because it may begin a stop string.
    held: String,
    ended: bool,
    /// The tokenizer's decoder is byte-level alone: ids go to `bytes`.
    byte_level: bool,
    /// Bytes of the ids pushed so far that are not passed on yet: the start
    /// of an unfinished character.
    bytes: Vec<u8>,
}

/// GPT-2's byte alphabet in reverse: the byte each character of a
/// byte-level token stands for, indexed by the character (printable
/// Latin-1 bytes stand for themselves; the others were shifted to U+0100
/// and up, in byte order). 0xFFFF: not a byte character.
fn byte_of_char() -> [u16; 324] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut t = [0xFFFF_u16; 324];
    let mut shifted = 256;
    for b in 0..=255u8 {
        if printable(b) {
            t[b as usize] = b as u16;
        } else {
            t[shifted] = b as u16;
            shifted += 1;
        }
    }
    t
}

static BYTE_OF_CHAR: std::sync::LazyLock<[u16; 324]> = std::sync::LazyLock::new(byte_of_char);

impl TextStream {
    /// `skip_special_tokens` drops special added tokens (`<|im_end|>`, ...)
    /// from the text.
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        let vocab_size = tokenizer.get_vocab_size(true);
        let byte_level = matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        Self {
            byte_level,
            bytes: Vec::new(),
            tokenizer,
            skip_special_tokens,
            vocab_size,
            ids: Vec::new(),
            open: 0,
            context_len: 0,
            passed: 0,
            stop_strings: Vec::new(),
            held: String::new(),
            ended: false,
        }
    }

    /// Whether ids become text by their fixed bytes (a byte-level decoder)
    /// rather than by decoding a window of ids.
    pub fn is_byte_level(&self) -> bool {
        self.byte_level
    }

    /// Stop strings are matched in the decoded text (so with
    /// `skip_special_tokens` a special token's text never matches; stop on its
    /// id instead). Empty strings are ignored.
    pub fn with_stop_strings<I, S>(mut self, stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.stop_strings = stops.into_iter().map(Into::into).filter(|s: &String| !s.is_empty()).collect();
        self
    }

    /// Feeds one generated id and returns the text that became final.
    pub fn push(&mut self, id: u32) -> Result<StreamStep, TextStreamError> {
        if self.ended {
            return Err(TextStreamError::Ended);
        }
        let Some(token) = self.tokenizer.id_to_token(id) else {
            return Err(TextStreamError::UnknownId { id, vocab_size: self.vocab_size });
        };
        let fresh = if self.byte_level {
            self.push_bytes(&token);
            self.complete_chars(false)
        } else {
            self.ids.push(id);
            self.advance(false)?
        };
        Ok(self.release(fresh, false))
    }

    /// Ends the stream: returns everything still held (an unfinished
    /// character as U+FFFD, text that might have begun a stop string), or
    /// `Stopped` if that text completes a stop string.
    pub fn finish(&mut self) -> Result<StreamStep, TextStreamError> {
        if self.ended {
            return Ok(StreamStep::Text(String::new()));
        }
        let fresh = if self.byte_level { self.complete_chars(true) } else { self.advance(true)? };
        self.ended = true;
        Ok(self.release(fresh, true))
    }

    /// Appends a token's bytes as the byte-level decoder reads them: each
    /// character of the token is a byte of GPT-2's alphabet, and a token
    /// with a character outside it (an added token's own text) stands for
    /// its UTF-8. A special token adds nothing when they are skipped.
    fn push_bytes(&mut self, token: &str) {
        if self.skip_special_tokens && self.tokenizer.get_added_vocabulary().is_special_token(token) {
            return;
        }
        let start = self.bytes.len();
        for c in token.chars() {
            match BYTE_OF_CHAR.get(c as usize) {
                Some(&b) if b <= 0xFF => self.bytes.push(b as u8),
                _ => {
                    self.bytes.truncate(start);
                    self.bytes.extend_from_slice(token.as_bytes());
                    return;
                }
            }
        }
    }

    /// Takes the pending bytes up to the last complete character, as
    /// lossy UTF-8 (a byte sequence that no continuation can make valid is
    /// U+FFFD now); `all`: the unfinished end too.
    fn complete_chars(&mut self, all: bool) -> String {
        let mut out = String::new();
        let mut rest = &self.bytes[..];
        loop {
            match std::str::from_utf8(rest) {
                Ok(t) => {
                    out.push_str(t);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    // `good` is UTF-8 (valid_up_to says so).
                    let text = std::str::from_utf8(good);
                    debug_assert!(text.is_ok(), "bytes before valid_up_to are UTF-8");
                    out.push_str(text.unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push(REPLACEMENT);
                            rest = &bad[n..];
                        }
                        None if all => {
                            out.push(REPLACEMENT);
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        self.bytes.drain(..self.bytes.len() - keep);
        out
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TextStreamError> {
        self.tokenizer.decode(ids, self.skip_special_tokens).map_err(|e| TextStreamError::Decode(e.to_string()))
    }

    /// Decodes the window and returns the newly final text; settles the open
    /// ids into the context group when their text ends on a character.
    fn advance(&mut self, force: bool) -> Result<String, TextStreamError> {
        if self.ids.len() == self.open {
            return Ok(String::new());
        }
        let window = self.decode(&self.ids)?;
        // The window's text starts with the context's text for byte-level
        // decoding; a decoder where it does not gets the open ids decoded
        // alone.
        let open_text = match window.get(self.context_len..) {
            Some(t) => t.to_string(),
            None => self.decode(&self.ids[self.open..])?,
        };
        let open_count = self.ids.len() - self.open;
        let unfinished = !force && open_text.ends_with(REPLACEMENT) && open_count < MAX_OPEN_IDS;
        let final_end = if unfinished { open_text.len() - REPLACEMENT.len_utf8() } else { open_text.len() };
        let fresh = open_text.get(self.passed..final_end).unwrap_or_default().to_string();
        self.passed = self.passed.max(final_end);
        if !unfinished {
            // The open ids become the context group for the next step.
            self.ids.drain(..self.open);
            self.open = self.ids.len();
            self.context_len = self.decode(&self.ids)?.len();
            self.passed = 0;
        }
        Ok(fresh)
    }

    /// Applies the stop strings to newly final text.
    fn release(&mut self, fresh: String, at_end: bool) -> StreamStep {
        if self.stop_strings.is_empty() {
            return StreamStep::Text(fresh);
        }
        self.held.push_str(&fresh);
        // Earliest occurrence wins; at equal positions the longer stop string.
        let mut found: Option<(usize, &str)> = None;
        for stop in &self.stop_strings {
            if let Some(pos) = self.held.find(stop.as_str()) {
                let better = match found {
                    None => true,
                    Some((p, s)) => pos < p || (pos == p && stop.len() > s.len()),
                };
                if better {
                    found = Some((pos, stop));
                }
            }
        }
        if let Some((pos, stop)) = found {
            let stop = stop.to_string();
            let mut text = std::mem::take(&mut self.held);
            text.truncate(pos);
            self.ended = true;
            return StreamStep::Stopped { text, stop };
        }
        let keep = if at_end { 0 } else { self.partial_stop_len() };
        let out: String = self.held.drain(..self.held.len() - keep).collect();
        StreamStep::Text(out)
    }

    /// Length of the longest end of `held` that is a proper beginning of some
    /// stop string.
    fn partial_stop_len(&self) -> usize {
        let mut best = 0;
        for stop in &self.stop_strings {
            let longest = (stop.len() - 1).min(self.held.len());
            for k in (best + 1..=longest).rev() {
                if stop.is_char_boundary(k) && self.held.ends_with(&stop[..k]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}
