//! The matmul choices timed at prepare (src/gemm.rs), kept on disk so that
//! a later process skips the timing: one line per choice in a text file,
//! by default `gemm-choices.txt` beside the compiled kernels
//! (`CudaOptions::gemm_cache`).
//!
//! A line is `<key> lt <8 hex words>` (a cuBLASLt algorithm), where the key
//! is a digest of everything the choice depends on: the device (name,
//! compute capability, SMs), the driver and cuBLASLt versions, this crate's
//! version and the file format, and the shape key. The caller still checks
//! a read choice (cuBLASLt must accept the algorithm), so a stale or edited
//! file costs a re-timing, never a wrong kernel. Lines are appended whole;
//! the last line for a key wins. Unreadable or unwritable files only mean
//! timing again.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// Bumped when what a choice means, or how it is timed, changes.
const FORMAT: u32 = 2;

/// A cuBLASLt algorithm's words, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stored(pub [u64; 8]);

impl Stored {
    fn line(&self, key: &str) -> String {
        format!("{key} lt {}\n", self.0.iter().map(|x| format!("{x:x}")).collect::<Vec<_>>().join(" "))
    }

    /// A line as `line` writes it: a key of `KEY_CHARS` lowercase hex
    /// digits, `lt`, then 8 hex words of at most 16 digits; anything else
    /// is `None`.
    fn parse(line: &str) -> Option<(String, Stored)> {
        let mut f = line.split_ascii_whitespace();
        let key = f.next()?;
        if key.len() != KEY_CHARS || !key.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return None;
        }
        if f.next()? != "lt" {
            return None;
        }
        let mut w = [0u64; 8];
        for d in w.iter_mut() {
            let s = f.next()?;
            if s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            *d = u64::from_str_radix(s, 16).ok()?;
        }
        f.next().is_none().then(|| (key.to_string(), Stored(w)))
    }
}

/// Hex digits in a key (`key` keeps 16 bytes of the digest).
const KEY_CHARS: usize = 32;

/// The most of a choices file that is read: far more than every shape of
/// every model needs (a line is under 200 bytes); the rest of a larger file
/// is ignored rather than read into memory.
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// Every well-formed line of a choices file, key → the algorithm's words
/// (the last line for a key wins). Lines that are not UTF-8, torn by a
/// crash or edited by hand are skipped: a missing choice costs a timing.
pub fn parse_gemm_choices(bytes: &[u8]) -> HashMap<String, [u64; 8]> {
    parse_all(bytes).into_iter().map(|(k, Stored(w))| (k, w)).collect()
}

/// One choice as a line of the file (what `put` appends).
pub fn gemm_choice_line(key: &str, words: [u64; 8]) -> String {
    Stored(words).line(key)
}

fn parse_all(bytes: &[u8]) -> HashMap<String, Stored> {
    bytes.split(|&b| b == b'\n').filter_map(|l| std::str::from_utf8(l).ok()).filter_map(Stored::parse).collect()
}

/// The first `MAX_FILE_BYTES` of `file` (empty when it cannot be read).
fn read_bounded(file: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    if let Ok(f) = std::fs::File::open(file) {
        let _ = f.take(MAX_FILE_BYTES).read_to_end(&mut out);
    }
    out
}

/// Each file's entries, read on its first use in this process.
static LOADED: Mutex<Option<HashMap<PathBuf, HashMap<String, Stored>>>> = Mutex::new(None);

/// The stored choice for `key` in `file`, if it has one.
pub(crate) fn get(file: &Path, key: &str) -> Option<Stored> {
    let mut g = LOADED.lock().ok()?;
    let files = g.get_or_insert_with(HashMap::new);
    let map = files.entry(file.to_path_buf()).or_insert_with(|| parse_all(&read_bounded(file)));
    map.get(key).copied()
}

/// Appends a choice to `file` (creating it and its folder); failures are
/// ignored: the cost is timing again in the next process.
pub(crate) fn put(file: &Path, key: &str, stored: Stored) {
    if let Ok(mut g) = LOADED.lock() {
        if let Some(map) = g.as_mut().and_then(|f| f.get_mut(file)) {
            map.insert(key.to_string(), stored);
        }
    }
    if let Some(dir) = file.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // One write of a whole short line in append mode, so racing processes
    // do not interleave within a line on local file systems (a torn line
    // would only be skipped when read).
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(file) {
        let _ = f.write_all(stored.line(key).as_bytes());
    }
}

/// The file's key for a choice: a digest of the device and library context
/// and of `what` (the shape, as the caller formats it).
pub(crate) fn key(context: &str, what: &str) -> String {
    let mut h = Sha256::new();
    h.update(format!("rlx-cuda {} format {FORMAT}\n{context}\n{what}", env!("CARGO_PKG_VERSION")).as_bytes());
    h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_bad_lines_are_skipped() {
        let a = Stored([1, 0xdead_beef, u64::MAX, 0, 5, 6, 7, 8]);
        let b = Stored([9; 8]);
        let (k1, k2) = (key("c", "one"), key("c", "two"));
        let text = format!(
            "{}{}garbage\n{k1} lt 1 2 3\n{k1} own 64 9 3 2\n\n{k1} lt 1 2 3 4 5 6 7 8 9\nABC lt 1 2 3 4 5 6 7 8\n{}",
            a.line(&k1),
            b.line(&k2),
            b.line(&k1)
        );
        // A line that is not UTF-8 is skipped, not the whole file.
        let mut bytes = b"\xff\xfe lt\n".to_vec();
        bytes.extend_from_slice(text.as_bytes());
        let map = parse_gemm_choices(&bytes);
        assert_eq!(map.len(), 2);
        // The last line for a key wins.
        assert_eq!(map[&k1], b.0);
        assert_eq!(map[&k2], b.0);
        assert_eq!(Stored::parse(&a.line(&k1)), Some((k1.clone(), a)));
        // A 17-digit word would overflow u64; a key of another length is not ours.
        assert_eq!(Stored::parse(&format!("{k1} lt 10000000000000000 0 0 0 0 0 0 0")), None);
        assert_eq!(Stored::parse(&a.line("k1")), None);
    }

    #[test]
    fn keys_depend_on_context_and_shape() {
        let a = key("H200 9.0 132", "cublas 128x768x768");
        assert_eq!(a, key("H200 9.0 132", "cublas 128x768x768"));
        assert_eq!(a.len(), 32);
        assert_ne!(a, key("H100 9.0 132", "cublas 128x768x768"));
        assert_ne!(a, key("H200 9.0 132", "cublas 129x768x768"));
    }
}
