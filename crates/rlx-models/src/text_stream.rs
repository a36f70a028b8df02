//! Streaming detokenization: generated ids go in one at a time, text that is
//! final comes out.
//!
//! Two things make a token's text not final yet:
//! - Byte-level BPE tokens are byte strings, so a token can end in the middle
//!   of a UTF-8 character. The ids that are still open are decoded together
//!   and a trailing U+FFFD (what the lossy decoder makes of an unfinished
//!   character) is held back until the character completes.
//! - With stop strings, text that could be the start of a stop string is held
//!   back until the following text decides. When a stop string completes, the
//!   text before it is returned with [`StreamStep::Stopped`]; the stop string
//!   and anything after it are dropped.
//!
//! Only a small window of ids is decoded per step: the open ids plus the group
//! settled just before them (kept as context for decoders whose output depends
//! on the preceding token), so the cost per token does not grow with the
//! length of the generation.

use std::sync::Arc;

use tokenizers::Tokenizer;

/// After this many open ids without a character boundary the output is not
/// valid UTF-8 (no character spans more than four bytes); the undecodable
/// bytes are then passed on as U+FFFD instead of being held forever.
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
}

impl TextStream {
    /// `skip_special_tokens` drops special added tokens (`<|im_end|>`, ...)
    /// from the text.
    pub fn new(tokenizer: Arc<Tokenizer>, skip_special_tokens: bool) -> Self {
        let vocab_size = tokenizer.get_vocab_size(true);
        Self {
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
        if self.tokenizer.id_to_token(id).is_none() {
            return Err(TextStreamError::UnknownId { id, vocab_size: self.vocab_size });
        }
        self.ids.push(id);
        let fresh = self.advance(false)?;
        Ok(self.release(fresh, false))
    }

    /// Ends the stream: returns everything still held (an unfinished
    /// character as U+FFFD, text that might have begun a stop string), or
    /// `Stopped` if that text completes a stop string.
    pub fn finish(&mut self) -> Result<StreamStep, TextStreamError> {
        if self.ended {
            return Ok(StreamStep::Text(String::new()));
        }
        let fresh = self.advance(true)?;
        self.ended = true;
        Ok(self.release(fresh, true))
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
