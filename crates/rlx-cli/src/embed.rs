//! `rlx embed` (texts → vectors, streamed in batches) and `rlx similarity`.

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rlx::{DType, Device};
use rlx_models::{cosine, EmbedderOptions, EmbeddingWriter, OutputFormat, SentenceEmbedder, TextLines};

/// Where the default model lives, relative to the repository root.
const DEFAULT_MODEL: &str = "models/all-MiniLM-L6-v2";

/// Texts read from a file or stdin per round: bounded memory, and enough
/// texts that sorting by length keeps batches tightly padded.
const TEXTS_PER_ROUND: usize = 1024;

/// Inputs larger than this get a progress bar (drawn only on a terminal).
const PROGRESS_ABOVE: u64 = 1000;

#[derive(Args, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json, model.safetensors, tokenizer.json).
    /// Default: $RLX_MODEL_DIR, else models/all-MiniLM-L6-v2 found from the
    /// current directory or the executable's.
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
    /// Write to FILE instead of stdout (written to FILE.tmp-<pid>, renamed
    /// when complete).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// jsonl (one {"index", "embedding"} object per line) or npy.
    #[arg(long, default_value = "jsonl")]
    pub format: String,
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
    pub a: String,
    pub b: String,
}

pub fn run(args: EmbedArgs) -> Result<(), String> {
    let format = OutputFormat::parse(&args.format).ok_or_else(|| format!("--format '{}': expected jsonl or npy", args.format))?;
    if !args.texts.is_empty() && args.input.is_some() {
        return Err("give texts as arguments or --input FILE, not both".into());
    }
    let embedder = load(&args.model)?;
    let mut writer = match &args.output {
        Some(p) => EmbeddingWriter::to_file(p, format, embedder.dim()),
        None => EmbeddingWriter::to_stdout(format, embedder.dim()),
    }
    .map_err(|e| e.to_string())?;

    let start = Instant::now();
    let mut done = 0u64;
    if !args.texts.is_empty() {
        let bar = progress(Some(args.texts.len() as u64));
        for chunk in args.texts.chunks(TEXTS_PER_ROUND) {
            done += embed_round(&embedder, chunk, &mut writer, &bar)?;
        }
        bar.finish_and_clear();
    } else if let Some(path) = &args.input {
        let total = count_lines(path)?;
        let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let lines = TextLines::new(BufReader::new(file), path.display().to_string());
        done = stream(&embedder, lines, &mut writer, progress(Some(total)))?;
    } else {
        let stdin = std::io::stdin();
        if stdin.is_terminal() {
            eprintln!("reading texts from stdin, one per line (Ctrl-D to end)");
        }
        let lines = TextLines::new(stdin.lock(), "stdin");
        done = stream(&embedder, lines, &mut writer, progress(None))?;
    }
    let written = writer.finish().map_err(|e| e.to_string())?;
    debug_assert_eq!(written, done);
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "embedded {done} texts in {secs:.2} s ({:.1} texts/s; {}, {}, batch {})",
        done as f64 / secs.max(1e-9),
        embedder.device(),
        embedder.options().dtype,
        embedder.options().batch_size
    );
    Ok(())
}

pub fn run_similarity(args: SimilarityArgs) -> Result<(), String> {
    let embedder = load(&args.model)?;
    let v = embedder.embed(&[args.a.as_str(), args.b.as_str()]).map_err(|e| e.to_string())?;
    println!("{:.6}", cosine(&v[0], &v[1]));
    Ok(())
}

fn stream<R: BufRead>(
    embedder: &SentenceEmbedder,
    mut lines: TextLines<R>,
    writer: &mut EmbeddingWriter,
    bar: ProgressBar,
) -> Result<u64, String> {
    let mut done = 0;
    loop {
        let texts = lines.next_batch(TEXTS_PER_ROUND).map_err(|e| e.to_string())?;
        if texts.is_empty() {
            break;
        }
        done += embed_round(embedder, &texts, writer, &bar)?;
    }
    bar.finish_and_clear();
    Ok(done)
}

fn embed_round(embedder: &SentenceEmbedder, texts: &[String], writer: &mut EmbeddingWriter, bar: &ProgressBar) -> Result<u64, String> {
    let refs: Vec<&str> = texts.iter().map(|s| s.as_str()).collect();
    let vectors = embedder.embed_with_progress(&refs, &mut |n| bar.inc(n as u64)).map_err(|e| e.to_string())?;
    for v in &vectors {
        writer.write(v).map_err(|e| e.to_string())?;
    }
    Ok(vectors.len() as u64)
}

fn load(m: &ModelArgs) -> Result<SentenceEmbedder, String> {
    let device: Device = m.device.parse().map_err(|e: rlx::Error| e.to_string())?;
    let dtype = match DType::parse(&m.dtype) {
        Some(d) if d.is_float() => d,
        _ => return Err(format!("--dtype '{}': expected f32, f16 or bf16", m.dtype)),
    };
    if m.batch_size == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    let dir = match &m.model {
        Some(d) => {
            if !d.is_dir() {
                return Err(format!("model directory {} does not exist{}", d.display(), fetch_hint()));
            }
            d.clone()
        }
        None => default_model_dir()?,
    };
    SentenceEmbedder::load_with(&dir, device, EmbedderOptions { dtype, batch_size: m.batch_size, approximate_gelu: m.approximate_gelu })
        .map_err(|e| e.to_string())
}

fn fetch_hint() -> String {
    format!(" (fetch the default model with scripts/fetch-models, which writes {DEFAULT_MODEL}/)")
}

/// $RLX_MODEL_DIR, else models/all-MiniLM-L6-v2 in the current directory,
/// the executable's directory, or any of their parents.
pub fn default_model_dir() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("RLX_MODEL_DIR") {
        let d = PathBuf::from(d);
        if d.is_dir() {
            return Ok(d);
        }
        return Err(format!("RLX_MODEL_DIR is {}, which is not a directory{}", d.display(), fetch_hint()));
    }
    let mut bases = vec![];
    if let Ok(cwd) = std::env::current_dir() {
        bases.push(cwd);
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        bases.push(dir);
    }
    for base in &bases {
        for anc in base.ancestors() {
            let c = anc.join(DEFAULT_MODEL);
            if c.join("config.json").is_file() {
                return Ok(c);
            }
        }
    }
    let looked: Vec<String> = bases.iter().map(|b| b.display().to_string()).collect();
    Err(format!(
        "no model found: RLX_MODEL_DIR is not set and {DEFAULT_MODEL}/ is not under {} or their parents. \
         Run scripts/fetch-models in the RLX repository to fetch it, or pass --model DIR",
        looked.join(" or ")
    ))
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

fn progress(total: Option<u64>) -> ProgressBar {
    let show = total.is_none_or(|t| t > PROGRESS_ABOVE);
    if !show {
        return ProgressBar::hidden();
    }
    // indicatif draws nothing when stderr is not a terminal.
    match total {
        Some(t) => {
            let bar = ProgressBar::with_draw_target(Some(t), ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} texts {per_sec} eta {eta}") {
                bar.set_style(style);
            }
            bar
        }
        None => {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{spinner} {pos} texts {per_sec}") {
                bar.set_style(style);
            }
            bar
        }
    }
}
