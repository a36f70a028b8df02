//! `rlx search` and the library's `CorpusIndex` on the CPU: results against
//! a plain f64 brute-force cosine reference, saved embeddings against
//! embedding from text, and bad input refused with the documented exit
//! codes (README, "Exit codes").

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Output, Stdio};

use common::{model_dir, path_str, rlx, rlx_command, stderr, temp_dir};
use rlx::Device;
use rlx_models::{CorpusIndex, Hit, SentenceEmbedder};

/// A small deterministic generator (xorshift64*), uniform in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Every row's cosine to `q` in f64, best first, equal scores by lower row.
fn brute_force(corpus: &[f32], dim: usize, q: &[f32], skip: &[usize]) -> Vec<(usize, f64)> {
    let norm = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt().max(1e-12);
    let qn = norm(q);
    let mut all: Vec<(usize, f64)> = corpus
        .chunks(dim)
        .enumerate()
        .filter(|(i, _)| !skip.contains(i))
        .map(|(i, row)| (i, row.iter().zip(q).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() / (norm(row) * qn)))
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all
}

/// `got` is the reference's top-k: same length, scores within `tol` of the
/// reference at each rank, and every row returned scoring (in f64) within
/// `tol` of the reference at its rank (rows may swap only in a near-tie).
fn assert_top_k(got: &[Hit], reference: &[(usize, f64)], k: usize, tol: f64, what: &str) {
    assert_eq!(got.len(), k.min(reference.len()), "{what}: result count");
    for (rank, h) in got.iter().enumerate() {
        let (want_id, want) = reference[rank];
        assert!((h.score as f64 - want).abs() <= tol, "{what} rank {rank}: score {} vs reference {want}", h.score);
        if h.corpus_id != want_id {
            let own = reference.iter().find(|r| r.0 == h.corpus_id).map(|r| r.1).unwrap_or(f64::NAN);
            assert!(
                (own - want).abs() <= tol,
                "{what} rank {rank}: row {} (reference score {own}) instead of row {want_id} ({want})",
                h.corpus_id
            );
        }
    }
    let mut ids: Vec<usize> = got.iter().map(|h| h.corpus_id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), got.len(), "{what}: a row returned twice");
}

#[test]
fn corpus_index_equals_an_f64_brute_force_cosine_on_random_vectors() {
    let (rows, dim, queries) = (1001, 48, 70);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // Rows of varied norms (cosine must not depend on them) and a few exact
    // copies, whose equal scores must come back lower row first.
    let mut corpus: Vec<f32> = (0..rows * dim).map(|i| rng.next() * (1.0 + (i / dim % 7) as f32)).collect();
    for (dup, of) in [(500, 3), (900, 3), (77, 12)] {
        let src = corpus[of * dim..(of + 1) * dim].to_vec();
        corpus[dup * dim..(dup + 1) * dim].copy_from_slice(&src);
    }
    let mut q: Vec<f32> = (0..queries * dim).map(|_| rng.next()).collect();
    // Query 0 points exactly at row 3 (and so at its duplicates 500 and 900).
    q[..dim].copy_from_slice(&corpus[3 * dim..4 * dim]);

    // At most 300 rows a chunk: four matmuls of 251 rows, the last padded
    // with 3 zero rows.
    let mut index = CorpusIndex::with_chunk_rows(&corpus, dim, Device::Cpu, 300).unwrap_or_else(|e| panic!("{e}"));
    for k in [1, 15, 1001, 5000] {
        let hits = index.search(&q, k).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(hits.len(), queries);
        for (i, h) in hits.iter().enumerate() {
            let reference = brute_force(&corpus, dim, &q[i * dim..(i + 1) * dim], &[]);
            assert_top_k(h, &reference, k, 1e-5, &format!("query {i} top-{k}"));
        }
    }
    let best: Vec<usize> = index.search(&q[..dim], 3).unwrap_or_else(|e| panic!("{e}"))[0].iter().map(|h| h.corpus_id).collect();
    assert_eq!(best, vec![3, 500, 900], "equal scores come back lower row first");

    index.exclude([3, 500]);
    let hits = index.search(&q, 20).unwrap_or_else(|e| panic!("{e}"));
    for (i, h) in hits.iter().enumerate() {
        let reference = brute_force(&corpus, dim, &q[i * dim..(i + 1) * dim], &[3, 500]);
        assert_top_k(h, &reference, 20, 1e-5, &format!("query {i} with rows excluded"));
    }
    assert!(index.search(&q, 0).is_err(), "top_k 0");
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    p
}

const CORPUS: &str = "A man is eating food.
A man is eating a piece of bread.
The girl is carrying a baby.
A man is riding a horse.

A woman is playing violin.
Two men pushed carts through the woods.
A man is riding a white horse on an enclosed ground.
A monkey is playing drums.
A cheetah is running behind its prey.
The stock market fell sharply on Monday.
Rust is a systems programming language.
";

const QUERIES: [&str; 3] =
    ["A man is eating pasta.", "Someone in a gorilla costume is playing a set of drums.", "A cheetah chases prey on across a field."];

fn succeeded(o: &Output) -> String {
    let e = stderr(o);
    assert!(o.status.success() && !e.contains("panicked"), "{:?}: {e}", o.status);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// One query's results: (line, score, text) each.
type QueryResults = (String, Vec<(usize, f64, String)>);

/// The results of `rlx search --format jsonl`, per query.
fn parse_jsonl(out: &str) -> Vec<QueryResults> {
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            let hits = v["results"]
                .as_array()
                .unwrap_or_else(|| panic!("no results: {l}"))
                .iter()
                .map(|h| {
                    let line = h["line"].as_u64().unwrap_or_else(|| panic!("no line: {l}")) as usize;
                    (line, h["score"].as_f64().unwrap_or(f64::NAN), h["text"].as_str().unwrap_or_default().to_string())
                })
                .collect();
            (v["query"].as_str().unwrap_or_default().to_string(), hits)
        })
        .collect()
}

#[test]
fn rlx_search_on_a_real_corpus_equals_brute_force_cosine_of_the_embeddings() {
    let Some(model) = model_dir("rlx_search_on_a_real_corpus_equals_brute_force_cosine_of_the_embeddings") else { return };
    let dir = temp_dir("search-real");
    let corpus = write(&dir, "corpus.txt", CORPUS);
    let saved = dir.join("saved.npy");
    let mut args = vec!["search", "--model", path_str(&model), "--corpus", path_str(&corpus), "--format", "jsonl", "-k", "4"];
    args.extend(["--save-embeddings", path_str(&saved)]);
    args.extend(QUERIES);
    let out = succeeded(&rlx(&args));
    let got = parse_jsonl(&out);
    assert_eq!(got.len(), QUERIES.len());

    // The reference: the library's embeddings, brute-force cosine in f64.
    let embedder = SentenceEmbedder::load(&model, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let lines: Vec<&str> = CORPUS.lines().collect();
    let corpus_vectors: Vec<f32> = embedder.embed(&lines).unwrap_or_else(|e| panic!("{e}")).concat();
    let blank: Vec<usize> = lines.iter().enumerate().filter(|(_, l)| l.trim().is_empty()).map(|(i, _)| i).collect();
    assert_eq!(blank, vec![4]);
    for ((query, hits), want_query) in got.iter().zip(QUERIES) {
        assert_eq!(query, want_query);
        let q = embedder.embed(&[want_query]).unwrap_or_else(|e| panic!("{e}")).remove(0);
        let reference = brute_force(&corpus_vectors, embedder.dim(), &q, &blank);
        let as_hits: Vec<Hit> = hits.iter().map(|(line, score, _)| Hit { corpus_id: line - 1, score: *score as f32 }).collect();
        assert_top_k(&as_hits, &reference, 4, 1e-5, query);
        for (line, _, text) in hits {
            assert_eq!(text, lines[line - 1], "the text of line {line}");
        }
    }
    // Sanity of the meaning, not only of the arithmetic.
    assert_eq!(got[0].1[0].0, 1, "{out}");
    assert_eq!(got[1].1[0].0, 9, "{out}");
    assert_eq!(got[2].1[0].0, 10, "{out}");

    // The saved embeddings, and the ones `rlx embed` writes, give the same answers.
    let mut again = vec!["search", "--model", path_str(&model), "--corpus", path_str(&corpus), "--format", "jsonl", "-k", "4"];
    again.extend(["--embeddings", path_str(&saved)]);
    again.extend(QUERIES);
    assert_eq!(succeeded(&rlx(&again)), out, "--embeddings of --save-embeddings");
    let embedded = dir.join("embedded.npy");
    succeeded(&rlx(&["embed", "--model", path_str(&model), "-i", path_str(&corpus), "-o", path_str(&embedded)]));
    let from_embed = parse_jsonl(&succeeded(&rlx(&[
        "search",
        "--model",
        path_str(&model),
        "--corpus",
        path_str(&corpus),
        "--embeddings",
        path_str(&embedded),
        "--format",
        "jsonl",
        "-k",
        "4",
        QUERIES[0],
        QUERIES[1],
        QUERIES[2],
    ])));
    for (a, b) in from_embed.iter().zip(&got) {
        let lines_a: Vec<usize> = a.1.iter().map(|h| h.0).collect();
        let lines_b: Vec<usize> = b.1.iter().map(|h| h.0).collect();
        assert_eq!(lines_a, lines_b, "{}", a.0);
        for (x, y) in a.1.iter().zip(&b.1) {
            assert!((x.1 - y.1).abs() <= 1e-6, "{}: {} vs {}", a.0, x.1, y.1);
        }
    }

    // Queries from stdin, blank lines skipped; the text format.
    let mut child = rlx_command()
        .args(["search", "--model", path_str(&model), "--corpus", path_str(&corpus), "--embeddings", path_str(&saved), "-k", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("no stdin"));
    stdin.write_all(format!("{}\n\n{}\n", QUERIES[0], QUERIES[2]).as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    drop(stdin);
    let text = succeeded(&child.wait_with_output().unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(text.matches("query: ").count(), 2, "{text}");
    assert!(text.starts_with(&format!("query: {}\n  1. ", QUERIES[0])), "{text}");
    assert!(text.contains("line 10: A cheetah is running behind its prey."), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An npy file of `rows` × `cols` values of dtype `descr` (4 or 8 bytes).
fn npy(path: &Path, descr: &str, rows: usize, cols: usize) {
    let size = if descr.ends_with('8') { 8 } else { 4 };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}").into_bytes();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(b' ');
    }
    h.push(b'\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(h.len() as u16).to_le_bytes());
    bytes.extend_from_slice(&h);
    bytes.extend(std::iter::repeat_n(0u8, rows * cols * size));
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("{e}"));
}

/// Exit `code`, one `error:` line first that names every needle, no panic.
fn refused(o: &Output, code: i32, needles: &[&str]) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(code), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    let first = e.lines().next().unwrap_or_default();
    assert!(first.starts_with("error: "), "the first line is the error: {e}");
    for n in needles {
        assert!(first.contains(n), "expected {n:?} in the error line: {first}");
    }
    if code == 1 {
        assert_eq!(e.lines().count(), 1, "one line: {e}");
    }
    assert!(o.stdout.is_empty(), "no results on an error");
}

#[test]
fn bad_search_input_is_refused_with_one_line_and_the_documented_code() {
    let Some(model) = model_dir("bad_search_input_is_refused_with_one_line_and_the_documented_code") else { return };
    let dir = temp_dir("search-bad");
    let corpus = write(&dir, "corpus.txt", "first line\n\nthird line\n");
    let m = path_str(&model);
    let c = path_str(&corpus);
    let search = |extra: &[&str]| {
        let mut a = vec!["search", "--model", m];
        a.extend_from_slice(extra);
        a.push("a query");
        rlx(&a)
    };

    let missing = dir.join("missing.txt");
    refused(&search(&["--corpus", path_str(&missing)]), 1, &["corpus", "missing.txt", "No such file"]);
    refused(&search(&["--corpus", path_str(&dir)]), 1, &["is a directory"]);
    let blank = write(&dir, "blank.txt", "\n  \n\n");
    refused(&search(&["--corpus", path_str(&blank)]), 1, &["blank.txt", "no non-blank lines"]);
    let empty = write(&dir, "empty.txt", "");
    refused(&search(&["--corpus", path_str(&empty)]), 1, &["empty.txt", "no non-blank lines"]);
    let bad_utf8 = dir.join("latin1.txt");
    std::fs::write(&bad_utf8, b"caf\xe9\n").unwrap_or_else(|e| panic!("{e}"));
    refused(&search(&["--corpus", path_str(&bad_utf8)]), 1, &["latin1.txt line 1", "UTF-8"]);

    // Saved embeddings that do not fit the corpus or the model.
    let rows = dir.join("rows.npy");
    npy(&rows, "<f4", 2, 384);
    refused(&search(&["--corpus", c, "--embeddings", path_str(&rows)]), 1, &["rows.npy", "2 rows", "3 lines"]);
    let dims = dir.join("dims.npy");
    npy(&dims, "<f4", 3, 100);
    refused(&search(&["--corpus", c, "--embeddings", path_str(&dims)]), 1, &["dims.npy", "dimension 100", "dimension 384"]);
    let f64s = dir.join("f64.npy");
    npy(&f64s, "<f8", 3, 384);
    refused(&search(&["--corpus", c, "--embeddings", path_str(&f64s)]), 1, &["f64.npy", "dtype <f8", "float32"]);
    let not_npy = write(&dir, "text.npy", "just some text, not an array\n");
    refused(&search(&["--corpus", c, "--embeddings", path_str(&not_npy)]), 1, &["text.npy", "not a .npy file"]);
    refused(&search(&["--corpus", c, "--embeddings", path_str(&dir.join("absent.npy"))]), 1, &["absent.npy"]);
    refused(&search(&["--corpus", c, "--save-embeddings", path_str(&dir.join("out.txt"))]), 1, &["out.txt", ".npy"]);

    // Usage errors: exit 2 with clap's message.
    let o = search(&["--corpus", c, "--top-k", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--top-k") && stderr(&o).contains("at least 1, found '0'"), "{}", stderr(&o));
    let o = rlx(&["search", "a query"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--corpus"), "{}", stderr(&o));
    let o = search(&["--corpus", c, "--embeddings", path_str(&rows), "--save-embeddings", path_str(&dir.join("x.npy"))]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
