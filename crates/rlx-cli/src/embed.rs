//! `rlx embed` (texts → vectors, streamed in batches) and `rlx similarity`.

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rlx::{DType, Device};
use rlx_models::{cosine, EmbedderOptions, EmbeddingWriter, ModelError, OutputFormat, SentenceEmbedder, TextLines, TextTokenizer};

use crate::model_dir::{default_model_dir, fetch_hint, Env};

/// Texts read from a file or stdin per round: bounded memory, and enough
/// texts that sorting by length keeps batches tightly padded.
const TEXTS_PER_ROUND: usize = 8192;

/// Token ids that tokenised rounds waiting for the device may hold (4 bytes
/// each): reading and tokenising run ahead while the device opens and the
/// weights load, and then keep the device fed, within this bound (a round
/// larger than it still goes, alone).
const IDS_AHEAD: usize = 4 << 20;

/// The first round is this small and each next one twice as large up to
/// [`TEXTS_PER_ROUND`], so output starts soon (`| head -1` gets its line, and
/// a reader that leaves is noticed, after a fraction of a second).
const FIRST_ROUND: usize = 32;

/// A round also ends once its texts hold this many bytes, so a file of long
/// lines does not hold [`TEXTS_PER_ROUND`] of them at once.
const BYTES_PER_ROUND: usize = 16 << 20;

/// Work that has run this long gets a progress bar (on a terminal only).
const PROGRESS_AFTER: Duration = Duration::from_secs(2);

#[derive(Args, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json, model.safetensors, tokenizer.json).
    /// Default: $RLX_MODEL_DIR, else models/all-MiniLM-L6-v2 in a repository
    /// checkout around the current directory or the executable, else the one
    /// `rlx fetch` put in the data directory.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Storage dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Texts per forward pass.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Run the model's exact (erf) GELU as its tanh approximation (faster
    /// on CUDA; vectors move slightly).
    #[arg(long)]
    pub approximate_gelu: bool,
}

#[derive(Args, Debug)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Write to FILE instead of stdout (written to a temporary file beside
    /// it and renamed when complete; a symlink is written through; devices
    /// and FIFOs are refused: redirect stdout to them instead).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// jsonl (one {"index", "embedding"} object per line) or npy. Default:
    /// from --output's extension (.npy, .jsonl or .json), else jsonl.
    #[arg(long)]
    pub format: Option<String>,
    /// Read texts from FILE, one per line (every line is a text, the empty
    /// one too).
    #[arg(long, short)]
    pub input: Option<PathBuf>,
    /// Texts to embed. Without any, lines from --input or stdin.
    pub texts: Vec<String>,
}

#[derive(Args, Debug)]
pub struct SimilarityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The first text.
    pub a: String,
    /// The second text.
    pub b: String,
}

pub fn run(args: EmbedArgs) -> Result<(), String> {
    let format = output_format(args.format.as_deref(), args.output.as_deref())?;
    if !args.texts.is_empty() && args.input.is_some() {
        return Err("give texts as arguments or --input FILE, not both".into());
    }
    let (dir, device, options) = resolve(&args.model)?;
    // The tokenizer first: texts are read and tokenised while the pipeline's
    // device thread opens the device and loads the weights.
    let parts = SentenceEmbedder::read_parts(&dir).map_err(|e| e.to_string())?;
    let (tokenizer, dim) = (parts.tokenizer().clone(), parts.dim());
    let load = move || SentenceEmbedder::load_parts(parts, device, options).map_err(|e| e.to_string());
    // A signal must not leave the temporary output (or npy spool) behind.
    EmbeddingWriter::remove_temp_files_on_signals();
    let mut writer = match &args.output {
        Some(p) => EmbeddingWriter::to_file(p, format, dim),
        None => EmbeddingWriter::to_stdout(format, dim),
    }
    .map_err(|e| e.to_string())?;

    let start = Instant::now();
    let mut count = Counts { watch_stdout: args.output.is_none(), ..Counts::default() };
    let mut from_stdin = false;
    let flow = if !args.texts.is_empty() {
        let mut rest = args.texts.as_slice();
        let next = |n: usize| {
            let (round, tail) = rest.split_at(n.min(rest.len()));
            rest = tail;
            Ok(round.to_vec())
        };
        pipeline(&tokenizer, load, next, &mut writer, Progress::new(Some(args.texts.len() as u64)), &mut count)?
    } else if let Some(path) = &args.input {
        let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // Only a regular file can be read twice (counted, then embedded):
        // a pipe (`-i <(...)`) would be drained by the count.
        let is_file = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?.is_file();
        let total = if is_file { Some(count_lines(path)?) } else { None };
        let lines = TextLines::new(BufReader::new(file), path.display().to_string());
        stream(&tokenizer, load_first_if(!is_file, load)?, lines, &mut writer, Progress::new(total), &mut count)?
    } else {
        let stdin = std::io::stdin();
        let typed = stdin.is_terminal();
        from_stdin = true;
        let regular = stdin_is_regular_file(&stdin);
        let lines = TextLines::new(stdin.lock(), "stdin");
        let load = load_first_if(typed || !regular, load)?;
        // No bar over the lines someone is typing.
        let bar = if typed {
            eprintln!("reading texts from stdin, one per line (Ctrl-D to end)");
            Progress::hidden()
        } else {
            Progress::new(None)
        };
        stream(&tokenizer, load, lines, &mut writer, bar, &mut count)?
    };
    let embedder = match flow {
        (Flow::Go, Some(e)) => e,
        _ => {
            stopped_early(count.texts);
            return Ok(());
        }
    };
    match writer.finish() {
        Ok(written) => debug_assert_eq!(written, count.texts),
        Err(e) if count.watch_stdout && is_broken_pipe(&e) => {
            stopped_early(count.texts);
            return Ok(());
        }
        Err(e) => return Err(e.to_string()),
    }
    if from_stdin && count.texts == 0 {
        eprintln!("note: stdin had no lines, so there was nothing to embed (give texts as arguments, --input FILE or lines on stdin)");
    }
    if let Some(note) = truncation_note(count.truncated, count.texts, embedder.max_tokens()) {
        eprintln!("{note}");
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "embedded {} texts in {secs:.2} s ({:.1} texts/s; {}, {}, batch {})",
        count.texts,
        count.texts as f64 / secs.max(1e-9),
        embedder.device(),
        embedder.options().dtype,
        embedder.options().batch_size
    );
    Ok(())
}

pub fn run_similarity(args: SimilarityArgs) -> Result<(), String> {
    let embedder = load(&args.model)?;
    let texts = [args.a.as_str(), args.b.as_str()];
    let (ids, truncated) = embedder.tokenize_counting(&texts).map_err(|e| e.to_string())?;
    let v = embedder.embed_ids(&ids).map_err(|e| e.to_string())?;
    if let Some(note) = truncation_note(truncated as u64, 2, embedder.max_tokens()) {
        eprintln!("{note}");
    }
    crate::stdout::print(&format!("{:.6}", cosine(&v[0], &v[1])))
}

/// The output format: `--format` if given, else what `--output`'s
/// extension says, else JSON lines. A `--format` that contradicts the
/// extension is an error rather than, say, JSON in a file named `.npy`.
pub fn output_format(format: Option<&str>, output: Option<&Path>) -> Result<OutputFormat, String> {
    let given = match format {
        Some(f) => Some(OutputFormat::parse(f).ok_or_else(|| format!("--format '{f}': expected jsonl or npy"))?),
        None => None,
    };
    let implied = output.and_then(OutputFormat::from_path);
    match (given, implied) {
        (Some(g), Some(i)) if g != i => Err(format!(
            "--format {} conflicts with --output {}, whose extension means {}: drop --format or rename the file",
            g.name(),
            output.map(|p| p.display().to_string()).unwrap_or_default(),
            i.name()
        )),
        (Some(f), _) | (None, Some(f)) => Ok(f),
        (None, None) => Ok(OutputFormat::Jsonl),
    }
}

/// The one notice about texts cut to the model's limit, if any were.
pub fn truncation_note(truncated: u64, texts: u64, max_tokens: usize) -> Option<String> {
    let were = if truncated == 1 { "was" } else { "were" };
    (truncated > 0).then(|| {
        format!(
            "note: {truncated} of {texts} texts {were} longer than the model's limit of {max_tokens} tokens and \
             truncated to it (a vector then describes only the start of its text)"
        )
    })
}

#[derive(Default)]
struct Counts {
    texts: u64,
    truncated: u64,
    /// Output goes to stdout: stop when its reader goes away.
    watch_stdout: bool,
}

/// Whether to go on after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Go,
    /// stdout's reader went away (`rlx embed ... | head -1`).
    ReaderGone,
}

/// The end of a run whose output nobody reads any more: not an error (the
/// reader took what it wanted), so exit 0 with a word on stderr.
/// The embedder's loader for the pipeline. Input that may be slow to give
/// its first lines (a pipe, a FIFO, someone typing) has the model loaded
/// here first, so a model that does not load is reported before those
/// lines; otherwise the pipeline loads it while it reads.
type Loader<'a> = Box<dyn FnOnce() -> Result<SentenceEmbedder, String> + Send + 'a>;

fn load_first_if<'a>(slow: bool, load: impl FnOnce() -> Result<SentenceEmbedder, String> + Send + 'a) -> Result<Loader<'a>, String> {
    if slow {
        let embedder = load()?;
        Ok(Box::new(move || Ok(embedder)))
    } else {
        Ok(Box::new(load))
    }
}

/// Whether stdin reads a regular file (`< FILE`), which gives its lines at
/// once, rather than a pipe or a terminal.
fn stdin_is_regular_file(stdin: &std::io::Stdin) -> bool {
    use std::os::fd::AsFd;
    stdin.as_fd().try_clone_to_owned().map(File::from).and_then(|f| f.metadata()).is_ok_and(|m| m.is_file())
}

fn stopped_early(texts: u64) {
    eprintln!("stopped after {texts} texts: stdout was closed");
}

fn is_broken_pipe(e: &ModelError) -> bool {
    matches!(e, ModelError::Io { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe)
}

fn stream<R: BufRead>(
    tokenizer: &TextTokenizer,
    load: impl FnOnce() -> Result<SentenceEmbedder, String> + Send,
    mut lines: TextLines<R>,
    writer: &mut EmbeddingWriter,
    bar: Progress,
    count: &mut Counts,
) -> Result<(Flow, Option<SentenceEmbedder>), String> {
    pipeline(tokenizer, load, |n| lines.next_batch_within(n, BYTES_PER_ROUND).map_err(|e| e.to_string()), writer, bar, count)
}

/// One round's texts, tokenised, on its way to the device.
struct Round {
    /// 1-based index of its first text in the input.
    first: u64,
    ids: Vec<Vec<u32>>,
}

/// Embeds rounds of texts in three stages that overlap: this thread reads
/// and tokenises rounds ahead (`next(n)` gives up to n texts, none at the
/// end; rounds grow from [`FIRST_ROUND`] to [`TEXTS_PER_ROUND`]; those
/// waiting hold at most [`IDS_AHEAD`] ids) while a second thread loads the embedder
/// (`load`) and then drives the device through round k, and a third writes
/// round k - 1. Output order is input order. The stages stop together when
/// the input ends, on the first error, or when stdout's reader goes away.
/// Returns how it ended and the embedder (None when the output's reader
/// went away first).
fn pipeline(
    tokenizer: &TextTokenizer,
    load: impl FnOnce() -> Result<SentenceEmbedder, String> + Send,
    mut next: impl FnMut(usize) -> Result<Vec<String>, String>,
    writer: &mut EmbeddingWriter,
    mut bar: Progress,
    count: &mut Counts,
) -> Result<(Flow, Option<SentenceEmbedder>), String> {
    let watch = count.watch_stdout;
    let stop = &AtomicBool::new(false);
    let stopped = move || stop.load(Ordering::Relaxed) || (watch && crate::stdout::reader_gone());
    let place = |first: u64, n: usize, e: &dyn std::fmt::Display| format!("texts {first} to {}: {e}", first + n as u64 - 1);
    // Ids in rounds sent and not yet taken by the device thread.
    let ahead = &(Mutex::new(0usize), Condvar::new());
    let (read, embedded, written) = std::thread::scope(|s| {
        let (tok_tx, tok_rx) = sync_channel::<Round>(TEXTS_PER_ROUND);
        let (vec_tx, vec_rx) = sync_channel::<Vec<Vec<f32>>>(1);
        let bar = &mut bar;
        let device = s.spawn(move || -> Result<(Flow, SentenceEmbedder), String> {
            let embedder = load().inspect_err(|_| stop.store(true, Ordering::Relaxed))?;
            for r in tok_rx {
                {
                    let mut queued = ahead.0.lock().unwrap_or_else(|e| e.into_inner());
                    *queued = queued.saturating_sub(r.ids.iter().map(Vec::len).sum());
                    ahead.1.notify_one();
                }
                // Between batches: is anyone still reading stdout?
                let vectors = embedder
                    .embed_ids_cancellable(&r.ids, &mut |n| {
                        bar.advance(n as u64);
                        !stopped()
                    })
                    .map_err(|e| place(r.first, r.ids.len(), &e));
                let vectors = match vectors {
                    Ok(Some(v)) => v,
                    Ok(None) => return Ok((if stop.load(Ordering::Relaxed) { Flow::Go } else { Flow::ReaderGone }, embedder)),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                };
                if vec_tx.send(vectors).is_err() {
                    break;
                }
            }
            Ok((Flow::Go, embedder))
        });
        let output = s.spawn(move || -> (u64, Result<Flow, String>) {
            let mut n = 0u64;
            let fail = |e: ModelError| {
                stop.store(true, Ordering::Relaxed);
                if watch && is_broken_pipe(&e) {
                    Ok(Flow::ReaderGone)
                } else {
                    Err(e.to_string())
                }
            };
            for vectors in vec_rx {
                if let Err(e) = writer.write_rows(&vectors) {
                    return (n, fail(e));
                }
                n += vectors.len() as u64;
                if let Err(e) = writer.flush() {
                    return (n, fail(e));
                }
            }
            (n, Ok(Flow::Go))
        });
        let mut read: Result<(), String> = Ok(());
        let (mut round, mut first, mut truncated) = (FIRST_ROUND, 1u64, 0u64);
        while !stopped() {
            let texts = match next(round) {
                Ok(t) if t.is_empty() => break,
                Ok(t) => t,
                Err(e) => {
                    read = Err(e);
                    break;
                }
            };
            let refs: Vec<&str> = texts.iter().map(|t| t.as_str()).collect();
            let ids = match tokenizer.encode_batch_counting(&refs) {
                Ok((ids, t)) => {
                    truncated += t as u64;
                    ids
                }
                Err(e) => {
                    read = Err(place(first, texts.len(), &e));
                    break;
                }
            };
            let n = ids.len();
            // Wait while the rounds ahead hold too many ids (a device thread
            // that has stopped takes none: the send below then fails).
            let size: usize = ids.iter().map(Vec::len).sum();
            {
                let mut queued = ahead.0.lock().unwrap_or_else(|e| e.into_inner());
                while *queued > 0 && *queued + size > IDS_AHEAD && !stopped() && !device.is_finished() {
                    queued = ahead.1.wait_timeout(queued, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
                }
                *queued += size;
            }
            if tok_tx.send(Round { first, ids }).is_err() {
                break;
            }
            first += n as u64;
            round = (round * 2).min(TEXTS_PER_ROUND);
        }
        drop(tok_tx);
        count.truncated += truncated;
        let embedded = device.join().unwrap_or_else(|_| Err("the embedding thread panicked".into()));
        let written = output.join().unwrap_or_else(|_| (0, Err("the output thread panicked".into())));
        (read, embedded, written)
    });
    bar.finish();
    count.texts += written.0;
    // The first failure in input order: output (the earliest texts), then
    // the device, then reading (the latest); a reader that went away ends
    // the run quietly whatever came after.
    if written.1? == Flow::ReaderGone {
        return Ok((Flow::ReaderGone, None));
    }
    let (flow, embedder) = embedded?;
    if flow == Flow::ReaderGone {
        return Ok((Flow::ReaderGone, Some(embedder)));
    }
    read?;
    Ok((Flow::Go, Some(embedder)))
}

pub fn load(m: &ModelArgs) -> Result<SentenceEmbedder, String> {
    let (dir, device, options) = resolve(m)?;
    SentenceEmbedder::load_with(&dir, device, options).map_err(|e| e.to_string())
}

/// The model directory, device and options that `--model`, `--device`,
/// `--dtype`, `--batch-size` and `--approximate-gelu` name.
fn resolve(m: &ModelArgs) -> Result<(PathBuf, Device, EmbedderOptions), String> {
    let device: Device = m.device.parse().map_err(|e: rlx::Error| e.to_string())?;
    let dtype = match DType::parse(&m.dtype) {
        Some(d) if d.is_float() => d,
        _ => return Err(format!("--dtype '{}': expected f32, f16 or bf16", m.dtype)),
    };
    if m.batch_size == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    let env = Env::process();
    let dir = match &m.model {
        Some(d) => {
            check_model_dir(d, &env)?;
            d.clone()
        }
        None => default_model_dir(&env)?,
    };
    Ok((dir, device, EmbedderOptions { dtype, batch_size: m.batch_size, approximate_gelu: m.approximate_gelu }))
}

/// `--model DIR` must be a directory; a file, a dangling link or a link loop
/// each get their own message (only a missing path suggests fetching).
fn check_model_dir(d: &Path, env: &Env) -> Result<(), String> {
    let shown = d.display();
    match std::fs::metadata(d) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(format!(
            "--model {shown} is a file, not a directory: expected a model directory holding config.json, model.safetensors and tokenizer.json"
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::symlink_metadata(d) {
            Ok(_) => Err(format!("--model {shown} is a symbolic link to a path that does not exist")),
            Err(_) => Err(format!("model directory {shown} does not exist; {}", fetch_hint(env))),
        },
        Err(e) => Err(format!("--model {shown}: {e}")),
    }
}

fn count_lines(path: &Path) -> Result<u64, String> {
    let mut f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (mut n, mut last, mut buf) = (0u64, b'\n', vec![0u8; 1 << 16]);
    loop {
        let k = f.read(&mut buf).map_err(|e| format!("{}: {e}", path.display()))?;
        if k == 0 {
            break;
        }
        n += buf[..k].iter().filter(|&&b| b == b'\n').count() as u64;
        last = buf[k - 1];
    }
    // A last line without a newline is a text too.
    Ok(n + (last != b'\n') as u64)
}

/// A progress bar that stays hidden unless stderr is a terminal and the work
/// has already taken [`PROGRESS_AFTER`]: short runs print nothing, long ones
/// (a big file, a slow device, a cold kernel cache) show how far they are.
struct Progress {
    bar: ProgressBar,
    start: Instant,
    terminal: bool,
    shown: bool,
}

impl Progress {
    fn new(total: Option<u64>) -> Progress {
        let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::hidden());
        let template = match total {
            Some(_) => "{bar:40} {pos}/{len} texts {per_sec} eta {eta}",
            None => "{spinner} {pos} texts {per_sec}",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        Progress { bar, start: Instant::now(), terminal: std::io::stderr().is_terminal(), shown: false }
    }

    fn hidden() -> Progress {
        Progress { terminal: false, ..Progress::new(None) }
    }

    fn advance(&mut self, n: u64) {
        self.bar.inc(n);
        if !self.shown && show_progress(self.start.elapsed(), self.terminal) {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            self.shown = true;
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Whether a bar belongs on screen after `elapsed` of work.
fn show_progress(elapsed: Duration, stderr_is_terminal: bool) -> bool {
    stderr_is_terminal && elapsed >= PROGRESS_AFTER
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_follows_the_extension_unless_told_and_conflicts_are_errors() {
        let f = |format: Option<&str>, out: Option<&str>| output_format(format, out.map(Path::new));
        assert_eq!(f(None, None), Ok(OutputFormat::Jsonl));
        assert_eq!(f(None, Some("x.npy")), Ok(OutputFormat::Npy));
        assert_eq!(f(None, Some("x.NPY")), Ok(OutputFormat::Npy));
        assert_eq!(f(None, Some("x.jsonl")), Ok(OutputFormat::Jsonl));
        assert_eq!(f(None, Some("x.json")), Ok(OutputFormat::Jsonl));
        assert_eq!(f(None, Some("vectors.bin")), Ok(OutputFormat::Jsonl));
        assert_eq!(f(Some("npy"), Some("vectors.bin")), Ok(OutputFormat::Npy));
        assert_eq!(f(Some("npy"), None), Ok(OutputFormat::Npy));
        assert_eq!(f(Some("npy"), Some("x.npy")), Ok(OutputFormat::Npy));
        let e = f(Some("jsonl"), Some("x.npy")).err().unwrap_or_default();
        assert!(e.contains("conflicts") && e.contains("x.npy") && e.contains("npy"), "{e}");
        assert!(f(Some("npy"), Some("x.jsonl")).is_err());
        let e = f(Some("csv"), None).err().unwrap_or_default();
        assert!(e.contains("--format 'csv'"), "{e}");
    }

    #[test]
    fn truncation_note_counts_and_stays_quiet_otherwise() {
        assert_eq!(truncation_note(0, 10, 256), None);
        let n = truncation_note(3, 10, 256).unwrap_or_default();
        assert!(n.contains("3 of 10 texts were longer") && n.contains("256 tokens") && n.contains("truncated"), "{n}");
        assert!(truncation_note(1, 1, 128).unwrap_or_default().contains("1 of 1 texts was longer"));
    }

    #[test]
    fn progress_shows_only_on_a_terminal_after_two_seconds() {
        assert!(!show_progress(Duration::from_millis(1999), true));
        assert!(show_progress(Duration::from_secs(2), true));
        assert!(!show_progress(Duration::from_secs(60), false));
    }
}
