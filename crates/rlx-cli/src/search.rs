//! `rlx search`: the lines of a corpus file most similar to each query, by
//! exact cosine over every line's embedding (see `rlx_models::CorpusIndex`).

use std::fs::File;
use std::io::{BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use rlx_models::{read_npy_f32, CorpusIndex, EmbeddingWriter, Hit, OutputFormat, SentenceEmbedder, TextLines};

use crate::embed::{load, truncation_note, ModelArgs};

#[derive(Args, Debug)]
pub struct SearchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The corpus: a text file, one entry per line (blank lines are never
    /// returned, but count as rows, as `rlx embed -i FILE` counts them).
    #[arg(long)]
    pub corpus: PathBuf,
    /// The corpus's embeddings, as `rlx embed -i CORPUS -o FILE.npy` wrote
    /// them (one float32 row per line), instead of embedding the corpus now.
    #[arg(long, conflicts_with = "save_embeddings")]
    pub embeddings: Option<PathBuf>,
    /// Write the corpus's embeddings to FILE.npy (for --embeddings later).
    #[arg(long)]
    pub save_embeddings: Option<PathBuf>,
    /// Results per query.
    #[arg(long, short = 'k', value_name = "K", default_value_t = 10, value_parser = parse_top_k)]
    pub top_k: usize,
    /// text: a block per query; jsonl: one {"query", "results": [{"line",
    /// "score", "text"}]} object per query.
    #[arg(long, default_value = "text", value_parser = ["text", "jsonl"])]
    pub format: String,
    /// Queries. Without any, one per line from stdin (blank lines skipped).
    pub queries: Vec<String>,
}

pub fn run(args: SearchArgs) -> Result<(), String> {
    let lines = read_corpus(&args.corpus)?;
    let searchable = lines.iter().filter(|l| !l.trim().is_empty()).count();
    if searchable == 0 {
        return Err(format!("corpus {}: no non-blank lines, so there is nothing to search", args.corpus.display()));
    }
    if let Some(p) = &args.save_embeddings {
        if OutputFormat::from_path(p) != Some(OutputFormat::Npy) {
            return Err(format!("--save-embeddings {}: expected a file name ending in .npy", p.display()));
        }
    }
    let embedder = load(&args.model)?;
    let dim = embedder.dim();

    let t0 = Instant::now();
    let corpus: Vec<f32> = match &args.embeddings {
        Some(path) => {
            let m = read_npy_f32(path).map_err(|e| e.to_string())?;
            if m.rows != lines.len() {
                return Err(format!(
                    "--embeddings {}: {} rows, but corpus {} has {} lines (one row per line, blank ones too, as `rlx embed -i {} -o {}` writes)",
                    path.display(),
                    m.rows,
                    args.corpus.display(),
                    lines.len(),
                    args.corpus.display(),
                    path.display()
                ));
            }
            if m.cols != dim {
                return Err(format!(
                    "--embeddings {}: rows of dimension {}, but the model makes vectors of dimension {dim} (were they made with another model?)",
                    path.display(),
                    m.cols
                ));
            }
            m.data
        }
        None => {
            if lines.len() > 10_000 {
                eprintln!("embedding {} corpus lines (save them with --save-embeddings FILE.npy to do this once)", lines.len());
            }
            let flat = embed(&embedder, &lines, "corpus")?;
            eprintln!("embedded {} corpus lines in {:.2} s", lines.len(), t0.elapsed().as_secs_f64());
            if let Some(p) = &args.save_embeddings {
                save(p, &flat, dim)?;
            }
            flat
        }
    };

    let queries = match args.queries.is_empty() {
        false => args.queries.clone(),
        true => read_queries()?,
    };
    if queries.is_empty() {
        eprintln!("note: no queries were given (as arguments or lines on stdin), so there is nothing to search for");
        return Ok(());
    }

    let device = embedder.device();
    let mut index = CorpusIndex::new(&corpus, dim, device).map_err(|e| e.to_string())?;
    drop(corpus);
    index.exclude(lines.iter().enumerate().filter(|(_, l)| l.trim().is_empty()).map(|(i, _)| i));

    let t_embed = Instant::now();
    let q = embed(&embedder, &queries, "queries")?;
    let embed_s = t_embed.elapsed().as_secs_f64();
    let t_search = Instant::now();
    let hits = index.search(&q, args.top_k).map_err(|e| e.to_string())?;
    let search_s = t_search.elapsed().as_secs_f64();

    let mut out = String::new();
    for (query, hits) in queries.iter().zip(&hits) {
        match args.format.as_str() {
            "jsonl" => out.push_str(&jsonl(query, hits, &lines)),
            _ => out.push_str(&text_block(query, hits, &lines)),
        }
    }
    crate::stdout::print(out.trim_end_matches('\n'))?;
    let n = queries.len() as f64;
    eprintln!(
        "searched {} queries over {} rows ({}): {:.1} queries/s (embedding the queries {:.3} s, scoring and top-{} {:.3} s = {:.1} queries/s)",
        queries.len(),
        index.rows(),
        device,
        n / (embed_s + search_s).max(1e-9),
        embed_s,
        args.top_k,
        search_s,
        n / search_s.max(1e-9)
    );
    Ok(())
}

fn parse_top_k(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(k) if k >= 1 => Ok(k),
        _ => Err(format!("expected a whole number of results of at least 1, found '{s}'")),
    }
}

/// Every line of the corpus, as `rlx embed -i` reads it.
fn read_corpus(path: &Path) -> Result<Vec<String>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("corpus {}: {e}", path.display()))?;
    if meta.is_dir() {
        return Err(format!("corpus {} is a directory: expected a text file, one entry per line", path.display()));
    }
    let file = File::open(path).map_err(|e| format!("corpus {}: {e}", path.display()))?;
    TextLines::new(BufReader::new(file), path.display().to_string()).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())
}

fn read_queries() -> Result<Vec<String>, String> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        eprintln!("reading queries from stdin, one per line (Ctrl-D to end)");
    }
    let lines = TextLines::new(stdin.lock(), "stdin").collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    Ok(lines.into_iter().filter(|l| !l.trim().is_empty()).collect())
}

/// The texts' vectors, one row each, flattened.
fn embed(embedder: &SentenceEmbedder, texts: &[String], what: &str) -> Result<Vec<f32>, String> {
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let (ids, truncated) = embedder.tokenize_counting(&refs).map_err(|e| format!("{what}: {e}"))?;
    if let Some(note) = truncation_note(truncated as u64, texts.len() as u64, embedder.max_tokens()) {
        eprintln!("{what}: {note}");
    }
    let vectors = embedder.embed_ids(&ids).map_err(|e| format!("{what}: {e}"))?;
    Ok(vectors.into_iter().flatten().collect())
}

fn save(path: &Path, flat: &[f32], dim: usize) -> Result<(), String> {
    let mut w = EmbeddingWriter::to_file(path, OutputFormat::Npy, dim).map_err(|e| e.to_string())?;
    for row in flat.chunks(dim) {
        w.write(row).map_err(|e| e.to_string())?;
    }
    w.finish().map_err(|e| e.to_string())?;
    eprintln!("saved the corpus embeddings to {}", path.display());
    Ok(())
}

fn text_block(query: &str, hits: &[Hit], lines: &[String]) -> String {
    let mut s = format!("query: {query}\n");
    for (rank, h) in hits.iter().enumerate() {
        s.push_str(&format!("{:>3}. {:.4}  line {}: {}\n", rank + 1, h.score, h.corpus_id + 1, lines[h.corpus_id]));
    }
    s.push('\n');
    s
}

fn jsonl(query: &str, hits: &[Hit], lines: &[String]) -> String {
    let results: Vec<serde_json::Value> =
        hits.iter().map(|h| serde_json::json!({"line": h.corpus_id + 1, "score": h.score, "text": lines[h.corpus_id]})).collect();
    let mut s = serde_json::json!({"query": query, "results": results}).to_string();
    s.push('\n');
    s
}
