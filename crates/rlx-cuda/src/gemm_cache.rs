//! The matmul choices timed at prepare (src/gemm.rs), kept on disk so that
//! a later process skips the timing: one line per choice in a text file,
//! by default `gemm-choices.txt` beside the compiled kernels
//! (`$RLX_CUDA_CACHE`, else `~/.cache/rlx/cuda`).
//!
//! A line is `<key> lt <8 hex words>` (a cuBLASLt algorithm) or
//! `<key> own <columns> <warps> <split> <multicast>` (an own tiling), where
//! the key is a digest of everything the choice depends on: the device
//! (name, compute capability, SMs), the driver and cuBLASLt versions, this
//! crate's version and the file format, the policy, and the shape key. The
//! caller still checks a read choice (cuBLASLt must accept the algorithm,
//! the tiling must be a candidate), so a stale or edited file costs a
//! re-timing, never a wrong kernel. Lines are appended whole; the last line
//! for a key wins. Unreadable or unwritable files only mean timing again.
//!
//! `set_gemm_cache` or RLX_GEMM_CACHE (a file path, or `0` for none)
//! choose the file.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// Bumped when what a choice means, or how it is timed, changes.
const FORMAT: u32 = 1;

/// A choice as stored: a cuBLASLt algorithm's words, or an own tiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    Lt([u64; 8]),
    Own([usize; 4]),
}

impl Stored {
    fn line(&self, key: &str) -> String {
        match self {
            Stored::Lt(w) => format!("{key} lt {}\n", w.iter().map(|x| format!("{x:x}")).collect::<Vec<_>>().join(" ")),
            Stored::Own(c) => format!("{key} own {} {} {} {}\n", c[0], c[1], c[2], c[3]),
        }
    }

    fn parse(line: &str) -> Option<(String, Stored)> {
        let mut f = line.split_ascii_whitespace();
        let key = f.next()?.to_string();
        let kind = f.next()?;
        let rest: Vec<&str> = f.collect();
        let stored = match kind {
            "lt" if rest.len() == 8 => {
                let mut w = [0u64; 8];
                for (d, s) in w.iter_mut().zip(&rest) {
                    *d = u64::from_str_radix(s, 16).ok()?;
                }
                Stored::Lt(w)
            }
            "own" if rest.len() == 4 => {
                let mut c = [0usize; 4];
                for (d, s) in c.iter_mut().zip(&rest) {
                    *d = s.parse().ok()?;
                }
                Stored::Own(c)
            }
            _ => return None,
        };
        Some((key, stored))
    }
}

/// Every well-formed line of `text` (the last one for a key wins).
fn parse_all(text: &str) -> HashMap<String, Stored> {
    text.lines().filter_map(Stored::parse).collect()
}

/// Where the file is: `set_gemm_cache` (Some(None) = no file), else RLX_GEMM_CACHE.
static OVERRIDE: Mutex<Option<Option<PathBuf>>> = Mutex::new(None);

/// The file later prepares read timed matmul choices from and append new
/// ones to; `None`: neither (every process times again). Overrides
/// `RLX_GEMM_CACHE`.
pub fn set_gemm_cache(path: Option<PathBuf>) {
    if let Ok(mut g) = OVERRIDE.lock() {
        *g = Some(path);
    }
    forget();
}

fn path() -> Option<PathBuf> {
    if let Some(p) = OVERRIDE.lock().ok().and_then(|g| g.clone()) {
        return p;
    }
    match std::env::var_os("RLX_GEMM_CACHE") {
        Some(v) if v == "0" || v.is_empty() => None,
        Some(v) => Some(PathBuf::from(v)),
        None => Some(crate::nvrtc::cache_dir().join("gemm-choices.txt")),
    }
}

/// The file's entries, read on first use (and again after `forget`).
static LOADED: Mutex<Option<HashMap<String, Stored>>> = Mutex::new(None);

/// Drops what was read, so the next lookup reads the file again.
pub(crate) fn forget() {
    if let Ok(mut g) = LOADED.lock() {
        *g = None;
    }
}

/// The stored choice for `key`, if the file has one.
pub(crate) fn get(key: &str) -> Option<Stored> {
    let mut g = LOADED.lock().ok()?;
    let map = g.get_or_insert_with(|| path().and_then(|p| std::fs::read_to_string(p).ok()).map(|t| parse_all(&t)).unwrap_or_default());
    map.get(key).copied()
}

/// Appends a choice to the file (creating it and its folder); failures are
/// ignored: the cost is timing again in the next process.
pub(crate) fn put(key: &str, stored: Stored) {
    if let Ok(mut g) = LOADED.lock() {
        if let Some(map) = g.as_mut() {
            map.insert(key.to_string(), stored);
        }
    }
    let Some(p) = path() else { return };
    if let Some(dir) = p.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // One write of a whole short line in append mode, so racing processes
    // do not interleave within a line on local file systems (a torn line
    // would only be skipped when read).
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&p) {
        let _ = f.write_all(stored.line(key).as_bytes());
    }
}

/// The file's key for a choice: a digest of the device and library context
/// and of `what` (policy and shape, as the caller formats them).
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
        let lt = Stored::Lt([1, 0xdead_beef, u64::MAX, 0, 5, 6, 7, 8]);
        let own = Stored::Own([64, 9, 3, 2]);
        let text = format!(
            "{}{}garbage\nabc lt 1 2 3\nabc own 1 2 x 4\n\n{}",
            lt.line("k1"),
            own.line("k2"),
            Stored::Own([32, 8, 1, 1]).line("k1")
        );
        let map = parse_all(&text);
        assert_eq!(map.len(), 2);
        // The last line for a key wins.
        assert_eq!(map["k1"], Stored::Own([32, 8, 1, 1]));
        assert_eq!(map["k2"], own);
        assert_eq!(Stored::parse(&lt.line("k")), Some(("k".to_string(), lt)));
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
