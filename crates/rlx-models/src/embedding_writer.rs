//! Writes embeddings as JSON lines or a `.npy` matrix. A file is written to
//! `FILE.tmp-<pid>` and renamed into place only by [`EmbeddingWriter::finish`];
//! on any error (or a drop without finish) the temporary file is removed, so
//! no half-written output ever looks complete.

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
    file: Option<BufWriter<File>>,
}

impl AtomicFile {
    fn create(tmp: PathBuf, dest: Option<PathBuf>) -> Result<AtomicFile> {
        // Readable too: a spool is copied out of it at the end.
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
        Ok(AtomicFile { tmp, dest, file: Some(BufWriter::new(f)) })
    }

    fn writer(&mut self) -> Result<&mut BufWriter<File>> {
        self.file.as_mut().ok_or_else(|| ModelError::Input("output already closed".into()))
    }

    fn flush(&mut self) -> Result<&mut File> {
        let tmp = self.tmp.clone();
        let w = self.writer()?;
        w.flush().map_err(|e| ModelError::io(&tmp, e))?;
        Ok(w.get_mut())
    }

    /// Renames into place (or, without a destination, leaves the data for
    /// the caller to copy; it is removed on drop).
    fn commit(mut self) -> Result<()> {
        let tmp = self.tmp.clone();
        let f = self.flush()?;
        f.sync_all().map_err(|e| ModelError::io(&tmp, e))?;
        self.file = None;
        if let Some(dest) = self.dest.take() {
            std::fs::rename(&self.tmp, &dest).map_err(|e| ModelError::io(&dest, e))?;
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
    /// Writes to `path` (through `path.tmp-<pid>`).
    pub fn to_file(path: &Path, format: OutputFormat, dim: usize) -> Result<EmbeddingWriter> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp-{}", std::process::id()));
        let f = AtomicFile::create(PathBuf::from(tmp), Some(path.to_path_buf()))?;
        Self::start(Target::File(f), format, dim, path.to_path_buf())
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
                Target::Spool(AtomicFile::create(tmp, None)?, out)
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
        if v.len() != self.dim {
            return Err(ModelError::Input(format!("embedding of length {} written to an output of width {}", v.len(), self.dim)));
        }
        let name = self.name.clone();
        let index = self.rows;
        let format = self.format;
        let out = self.out()?;
        let r = match format {
            OutputFormat::Jsonl => {
                let mut line = String::with_capacity(16 + v.len() * 12);
                line.push_str(&format!("{{\"index\":{index},\"embedding\":["));
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        line.push(',');
                    }
                    // JSON has no NaN/inf; a finite model never makes them.
                    if x.is_finite() {
                        line.push_str(&format!("{x}"));
                    } else {
                        line.push_str("null");
                    }
                }
                line.push_str("]}\n");
                out.write_all(line.as_bytes())
            }
            OutputFormat::Npy => {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                out.write_all(&bytes)
            }
        };
        r.map_err(|e| ModelError::io(&name, e))?;
        self.rows += 1;
        Ok(())
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
