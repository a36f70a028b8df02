//! Texts, one per line, read in bounded batches so an input larger than
//! memory streams through. Every line is a text, the empty one too; a line
//! that is not UTF-8 is an error naming its number.

use std::io::BufRead;
use std::path::PathBuf;

use crate::{ModelError, Result};

pub struct TextLines<R> {
    reader: R,
    /// File name or "stdin", for messages.
    source: String,
    line: u64,
    done: bool,
    buf: Vec<u8>,
}

impl<R: BufRead> TextLines<R> {
    pub fn new(reader: R, source: impl Into<String>) -> Self {
        TextLines { reader, source: source.into(), line: 0, done: false, buf: Vec::new() }
    }

    /// Lines read so far.
    pub fn lines_read(&self) -> u64 {
        self.line
    }

    /// Up to `max` next texts; an empty vector at the end of the input.
    pub fn next_batch(&mut self, max: usize) -> Result<Vec<String>> {
        self.next_batch_within(max, usize::MAX)
    }

    /// Up to `max` next texts, stopping early once they hold `max_bytes`
    /// (so a round of very long lines stays bounded; one line is always
    /// taken whole). An empty vector at the end of the input.
    pub fn next_batch_within(&mut self, max: usize, max_bytes: usize) -> Result<Vec<String>> {
        let mut out = Vec::with_capacity(max.min(4096));
        let mut bytes = 0usize;
        while out.len() < max && bytes < max_bytes {
            match self.next_line()? {
                Some(t) => {
                    bytes = bytes.saturating_add(t.len());
                    out.push(t);
                }
                None => break,
            }
        }
        Ok(out)
    }

    fn next_line(&mut self) -> Result<Option<String>> {
        if self.done {
            return Ok(None);
        }
        self.buf.clear();
        let n =
            self.reader.read_until(b'\n', &mut self.buf).map_err(|e| ModelError::Io { path: PathBuf::from(&self.source), source: e })?;
        if n == 0 {
            self.done = true;
            return Ok(None);
        }
        self.line += 1;
        if self.buf.last() == Some(&b'\n') {
            self.buf.pop();
            // CRLF files: the CR belongs to the line ending, not the text.
            if self.buf.last() == Some(&b'\r') {
                self.buf.pop();
            }
        }
        // The buffer becomes the text (no copy of a long line).
        match String::from_utf8(std::mem::take(&mut self.buf)) {
            Ok(s) => Ok(Some(s)),
            Err(e) => Err(ModelError::Input(format!(
                "{} line {}: not valid UTF-8 (bad byte at column {})",
                self.source,
                self.line,
                e.utf8_error().valid_up_to() + 1
            ))),
        }
    }
}

impl<R: BufRead> Iterator for TextLines<R> {
    type Item = Result<String>;
    fn next(&mut self) -> Option<Result<String>> {
        self.next_line().transpose()
    }
}
