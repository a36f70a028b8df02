//! Writes embeddings as JSON lines or a `.npy` matrix. A file is written to
//! a temporary file beside it (`.rlx-tmp-<pid>-<n>`, short whatever the
//! name's length) and renamed into place only by [`EmbeddingWriter::finish`];
//! on any error (or a drop without finish) the temporary file is removed, so
//! no half-written output ever looks complete. After
//! [`EmbeddingWriter::remove_temp_files_on_signals`], SIGINT, SIGTERM and
//! SIGHUP remove it too before the process ends.
//!
//! Only regular files are written: a destination that is a symlink is
//! written through (its target is replaced, the link stays), and one that
//! is (or links to) a device, FIFO, socket or directory is refused, since
//! renaming a file over it would replace the node itself.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::{ModelError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// `{"index": i, "embedding": [...]}` per line.
    Jsonl,
    /// One little-endian f32 `[texts, dim]` array.
    Npy,
}

impl OutputFormat {
    pub fn parse(s: &str) -> Option<OutputFormat> {
        match s.to_ascii_lowercase().as_str() {
            "jsonl" | "json" => Some(OutputFormat::Jsonl),
            "npy" => Some(OutputFormat::Npy),
            _ => None,
        }
    }

    /// The format a file name asks for: `.npy`, or `.jsonl` / `.json`;
    /// `None` for any other extension.
    pub fn from_path(path: &Path) -> Option<OutputFormat> {
        path.extension().and_then(|e| e.to_str()).and_then(OutputFormat::parse)
    }

    pub fn name(self) -> &'static str {
        match self {
            OutputFormat::Jsonl => "jsonl",
            OutputFormat::Npy => "npy",
        }
    }
}

/// A file that appears under its name only once complete.
struct AtomicFile {
    tmp: PathBuf,
    dest: Option<PathBuf>,
    /// The name errors give: the user's path, not the temporary one.
    name: PathBuf,
    file: Option<BufWriter<File>>,
    /// Where the signal handler knows the temporary file.
    signal_slot: Option<usize>,
}

impl AtomicFile {
    fn create(tmp: PathBuf, dest: Option<PathBuf>, name: PathBuf) -> Result<AtomicFile> {
        // Known to the signal handler before it exists, so no moment is left
        // in which a signal could strand it.
        let signal_slot = signal_cleanup::register(&tmp);
        // Readable too: a spool is copied out of it at the end.
        let opened = OpenOptions::new().read(true).write(true).create_new(true).open(&tmp);
        let f = match opened {
            Ok(f) => f,
            Err(e) => {
                signal_cleanup::unregister(signal_slot);
                let place = tmp.parent().map(|p| p.display().to_string()).unwrap_or_default();
                let detail = std::io::Error::new(e.kind(), format!("cannot create a temporary file in '{place}': {e}"));
                return Err(ModelError::io(&name, detail));
            }
        };
        Ok(AtomicFile { tmp, dest, name, file: Some(BufWriter::new(f)), signal_slot })
    }

    fn writer(&mut self) -> Result<&mut BufWriter<File>> {
        self.file.as_mut().ok_or_else(|| ModelError::Input("output already closed".into()))
    }

    fn flush(&mut self) -> Result<&mut File> {
        let name = self.name.clone();
        let w = self.writer()?;
        w.flush().map_err(|e| ModelError::io(&name, e))?;
        Ok(w.get_mut())
    }

    /// Renames into place (or, without a destination, leaves the data for
    /// the caller to copy; it is removed on drop).
    fn commit(mut self) -> Result<()> {
        let name = self.name.clone();
        let f = self.flush()?;
        f.sync_all().map_err(|e| ModelError::io(&name, e))?;
        self.file = None;
        if let Some(dest) = self.dest.take() {
            if let Err(e) = std::fs::rename(&self.tmp, &dest) {
                // Dropped below with no destination: remove the temporary.
                self.dest = Some(dest);
                return Err(ModelError::io(&name, e));
            }
            signal_cleanup::unregister(self.signal_slot.take());
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        self.file = None;
        if self.dest.is_some() || self.tmp.exists() {
            // Best effort: nothing sensible to do if removal fails.
            let _ = std::fs::remove_file(&self.tmp);
        }
        signal_cleanup::unregister(self.signal_slot.take());
    }
}

/// Where a file written to `path` must go: `path` itself, or the final
/// target of the symlink(s) it names, which must be a regular file or not
/// exist yet.
fn destination(path: &Path) -> Result<PathBuf> {
    let mut at = path.to_path_buf();
    // The kernel's own limit on links followed.
    for _ in 0..40 {
        let meta = match std::fs::symlink_metadata(&at) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(at),
            Err(e) => return Err(ModelError::io(path, e)),
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            let target = std::fs::read_link(&at).map_err(|e| ModelError::io(path, e))?;
            at = match at.parent() {
                Some(dir) if target.is_relative() => dir.join(target),
                _ => target,
            };
            continue;
        }
        if kind.is_file() {
            return Ok(at);
        }
        let what = crate::error::file_kind(&meta);
        let via = if at == path { String::new() } else { format!(" (through the link to {})", at.display()) };
        return Err(ModelError::format(
            path,
            format!(
                "is {what}{via}, not a regular file: the output is written to a temporary file and renamed over it, which \
                 would replace it; to write into it, leave out --output and redirect stdout"
            ),
        ));
    }
    Err(ModelError::format(path, "too many levels of symbolic links"))
}

/// A temporary name beside `dest`, short whatever `dest`'s length.
fn temp_beside(dest: &Path) -> PathBuf {
    static TEMPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = TEMPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!(".rlx-tmp-{}-{n}", std::process::id());
    match dest.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join(name),
        _ => PathBuf::from(name),
    }
}

/// Temporary files that a signal handler removes before the process dies.
/// The handler may only make async-signal-safe calls, so the paths wait in
/// fixed slots as C strings; a path is leaked (a few bytes per output file)
/// rather than freed while a handler on another thread might read it.
mod signal_cleanup {
    use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

    use super::*;

    const SLOTS: usize = 16;
    static PATHS: [AtomicPtr<libc::c_char>; SLOTS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];
    static INSTALLED: AtomicBool = AtomicBool::new(false);

    /// Remembers `path` for the handler; `None` if every slot is taken (the
    /// file is then still removed on drop, only not on a signal).
    pub(super) fn register(path: &Path) -> Option<usize> {
        use std::os::unix::ffi::OsStrExt;
        let c = CString::new(path.as_os_str().as_bytes()).ok()?.into_raw();
        for (i, slot) in PATHS.iter().enumerate() {
            if slot.compare_exchange(std::ptr::null_mut(), c, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                return Some(i);
            }
        }
        // SAFETY: `c` came from into_raw above and was never shared.
        drop(unsafe { CString::from_raw(c) });
        None
    }

    pub(super) fn unregister(slot: Option<usize>) {
        if let Some(i) = slot {
            PATHS[i].store(std::ptr::null_mut(), Ordering::SeqCst);
        }
    }

    extern "C" fn on_signal(sig: libc::c_int) {
        for slot in &PATHS {
            let p = slot.load(Ordering::SeqCst);
            if !p.is_null() {
                // SAFETY: a registered pointer is a leaked, NUL-terminated
                // CString that is never freed; unlink is async-signal-safe.
                unsafe { libc::unlink(p) };
            }
        }
        // SA_RESETHAND restored the default action: raising the signal again
        // ends the process the way the signal would have.
        // SAFETY: raise is async-signal-safe.
        unsafe { libc::raise(sig) };
    }

    /// Installs the handler for SIGINT, SIGTERM and SIGHUP, except where the
    /// signal is ignored (`nohup`), which stays so.
    pub(super) fn install() {
        if INSTALLED.swap(true, Ordering::SeqCst) {
            return;
        }
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: plain sigaction calls on zero-initialised structs; the
            // handler only calls async-signal-safe functions.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction == libc::SIG_IGN {
                    continue;
                }
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                act.sa_flags = libc::SA_RESETHAND;
                libc::sigemptyset(&mut act.sa_mask);
                libc::sigaction(sig, &act, std::ptr::null_mut());
            }
        }
    }
}

enum Target {
    Stream(BufWriter<Box<dyn Write + Send>>),
    File(AtomicFile),
    /// npy to a stream: the header is only known at the end, so spool to a
    /// temporary file and copy it out then.
    Spool(AtomicFile, Box<dyn Write + Send>),
}

pub struct EmbeddingWriter {
    format: OutputFormat,
    dim: usize,
    rows: u64,
    target: Target,
    /// Where to report errors.
    name: PathBuf,
}

/// Total bytes of the npy preamble (magic, version, length, padded dict).
const NPY_HEADER: usize = 128;

impl EmbeddingWriter {
    /// From now on SIGINT, SIGTERM and SIGHUP remove every temporary file
    /// of a writer that has not finished, then end the process as the
    /// signal would have. For programs (the CLI) that own their signals; a
    /// library embedding RLX leaves them alone.
    pub fn remove_temp_files_on_signals() {
        signal_cleanup::install();
    }

    /// Writes to `path` through a temporary file beside it (see the module
    /// documentation for symlinks and non-regular files).
    pub fn to_file(path: &Path, format: OutputFormat, dim: usize) -> Result<EmbeddingWriter> {
        let dest = destination(path)?;
        let f = AtomicFile::create(temp_beside(&dest), Some(dest), path.to_path_buf())?;
        Self::start(Target::File(f), format, dim, path.to_path_buf())
    }

    /// The temporary file being written, until `finish` renames it (for
    /// tests and messages).
    pub fn temp_path(&self) -> Option<&Path> {
        match &self.target {
            Target::Stream(_) => None,
            Target::File(f) | Target::Spool(f, _) => Some(&f.tmp),
        }
    }

    pub fn to_stdout(format: OutputFormat, dim: usize) -> Result<EmbeddingWriter> {
        Self::to_stream(Box::new(std::io::stdout()), "stdout", format, dim)
    }

    /// Writes to any stream (`name` is for messages). JSON lines go out as
    /// they come; npy is spooled to a temporary file until `finish`.
    pub fn to_stream(out: Box<dyn Write + Send>, name: &str, format: OutputFormat, dim: usize) -> Result<EmbeddingWriter> {
        let target = match format {
            OutputFormat::Jsonl => Target::Stream(BufWriter::new(out)),
            OutputFormat::Npy => {
                static SPOOLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = SPOOLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let tmp = std::env::temp_dir().join(format!("rlx-embed-{}-{n}.npy", std::process::id()));
                Target::Spool(AtomicFile::create(tmp.clone(), None, tmp)?, out)
            }
        };
        Self::start(target, format, dim, PathBuf::from(name))
    }

    fn start(target: Target, format: OutputFormat, dim: usize, name: PathBuf) -> Result<EmbeddingWriter> {
        let mut w = EmbeddingWriter { format, dim, rows: 0, target, name };
        if format == OutputFormat::Npy {
            let h = npy_header(0, dim);
            w.out()?.write_all(&h).map_err(|e| ModelError::io(&w.name, e))?;
        }
        Ok(w)
    }

    fn out(&mut self) -> Result<&mut dyn Write> {
        Ok(match &mut self.target {
            Target::Stream(w) => w,
            Target::File(f) | Target::Spool(f, _) => f.writer()?,
        })
    }

    /// Appends one embedding (the next text's).
    pub fn write(&mut self, v: &[f32]) -> Result<()> {
        self.write_rows(std::slice::from_ref(&v))
    }

    /// Appends embeddings in order (the next texts'). JSON lines are
    /// formatted on all cores, then written in order; nothing is written
    /// when a row is refused (wrong width, or a non-finite value in JSON).
    pub fn write_rows<V: AsRef<[f32]> + Sync>(&mut self, rows: &[V]) -> Result<()> {
        if let Some(v) = rows.iter().find(|v| v.as_ref().len() != self.dim) {
            let n = v.as_ref().len();
            return Err(ModelError::Input(format!("embedding of length {n} written to an output of width {}", self.dim)));
        }
        let first = self.rows;
        let parts: Vec<Vec<u8>> = match self.format {
            OutputFormat::Jsonl => {
                use rayon::prelude::*;
                // Rows in chunks, so a chunk's formatting is worth a task.
                let parts: Vec<Result<Vec<u8>>> = rows
                    .par_chunks(64)
                    .enumerate()
                    .map(|(c, chunk)| {
                        let mut text = String::with_capacity(chunk.len() * (40 + self.dim * 12));
                        for (j, v) in chunk.iter().enumerate() {
                            json_line(&mut text, first + (c * 64 + j) as u64, v.as_ref())?;
                        }
                        Ok(text.into_bytes())
                    })
                    .collect();
                parts.into_iter().collect::<Result<_>>()?
            }
            OutputFormat::Npy => vec![rows.iter().flat_map(|v| v.as_ref().iter().flat_map(|x| x.to_le_bytes())).collect()],
        };
        let name = self.name.clone();
        let out = self.out()?;
        for p in &parts {
            out.write_all(p).map_err(|e| ModelError::io(&name, e))?;
        }
        self.rows += rows.len() as u64;
        Ok(())
    }

    /// Pushes JSON lines written so far to the stream, so a reader sees
    /// each round as it completes (files and npy wait for `finish`).
    pub fn flush(&mut self) -> Result<()> {
        match &mut self.target {
            Target::Stream(w) => w.flush().map_err(|e| ModelError::io(&self.name, e)),
            Target::File(_) | Target::Spool(..) => Ok(()),
        }
    }

    /// Completes the output: fixes the npy header, renames the file into
    /// place. Returns the number of embeddings written.
    pub fn finish(self) -> Result<u64> {
        let EmbeddingWriter { format, dim, rows, target, name } = self;
        match target {
            Target::Stream(mut w) => w.flush().map_err(|e| ModelError::io(&name, e))?,
            Target::File(mut f) => {
                if format == OutputFormat::Npy {
                    let file = f.flush()?;
                    rewrite_npy_header(file, rows, dim).map_err(|e| ModelError::io(&name, e))?;
                }
                f.commit()?;
            }
            Target::Spool(mut f, mut out) => {
                let spool = f.tmp.clone();
                let file = f.flush()?;
                rewrite_npy_header(file, rows, dim).map_err(|e| ModelError::io(&spool, e))?;
                file.seek(SeekFrom::Start(0)).map_err(|e| ModelError::io(&spool, e))?;
                std::io::copy(file, &mut out).map_err(|e| ModelError::io(&name, e))?;
                out.flush().map_err(|e| ModelError::io(&name, e))?;
            }
        }
        Ok(rows)
    }
}

/// One JSON line `{"index":I,"embedding":[...]}` onto `text`: each value
/// in the shortest form that reads back to the same f32 (ryu's: `1e-7`,
/// not `0.0000001`).
fn json_line(text: &mut String, index: u64, v: &[f32]) -> Result<()> {
    use std::fmt::Write as _;
    let _ = write!(text, "{{\"index\":{index},\"embedding\":[");
    let mut num = ryu::Buffer::new();
    for (i, x) in v.iter().enumerate() {
        // JSON has no NaN/inf: refuse rather than write `null`.
        if !x.is_finite() {
            return Err(ModelError::Input(format!("embedding {index} has a non-finite value ({x}) at element {i}: JSON cannot hold it")));
        }
        if i > 0 {
            text.push(',');
        }
        text.push_str(num.format_finite(*x));
    }
    text.push_str("]}\n");
    Ok(())
}

fn rewrite_npy_header(file: &mut File, rows: u64, dim: usize) -> std::io::Result<()> {
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&npy_header(rows, dim))?;
    file.seek(SeekFrom::End(0))?;
    Ok(())
}

/// NPY 1.0 preamble of a fixed size, so the row count can be rewritten in
/// place once known.
fn npy_header(rows: u64, dim: usize) -> Vec<u8> {
    let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}");
    let mut h = Vec::with_capacity(NPY_HEADER);
    h.extend_from_slice(b"\x93NUMPY\x01\x00");
    let len = (NPY_HEADER - 10) as u16;
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    while h.len() < NPY_HEADER - 1 {
        h.push(b' ');
    }
    h.push(b'\n');
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A stream whose bytes the test can read afterwards.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Rows written in uneven batches (across the formatting chunks) come
    /// out in order, numbered from 0, each value reading back to the same
    /// f32 bit for bit; a row with a NaN is refused and nothing of its
    /// batch is written.
    #[test]
    fn json_rows_in_order_and_exact() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let bits = (seed >> 32) as u32;
            let x = f32::from_bits(bits);
            if x.is_finite() {
                x
            } else {
                (bits % 1000) as f32 * 1e-3
            }
        };
        let dim = 5;
        let rows: Vec<Vec<f32>> = (0..300).map(|_| (0..dim).map(|_| next()).collect()).collect();
        let sink = Shared::default();
        let mut w = EmbeddingWriter::to_stream(Box::new(sink.clone()), "test", OutputFormat::Jsonl, dim).unwrap();
        let mut at = 0;
        for n in [1, 63, 130, 0, 106] {
            w.write_rows(&rows[at..at + n]).unwrap();
            at += n;
        }
        let mut bad = rows[0].clone();
        bad[3] = f32::NAN;
        let e = w.write_rows(&[rows[1].clone(), bad]).unwrap_err().to_string();
        assert!(e.contains("embedding 301 has a non-finite value (NaN) at element 3"), "{e}");
        assert_eq!(w.finish().unwrap(), 300);
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 300);
        for (i, line) in lines.iter().enumerate() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["index"], i as u64);
            let got: Vec<f32> = v["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().map_or_else(|| x.to_string(), String::from).parse().unwrap())
                .collect();
            let want_bits: Vec<u32> = rows[i].iter().map(|x| x.to_bits()).collect();
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want_bits, "row {i}: {line}");
        }
    }
}
