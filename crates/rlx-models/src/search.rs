//! Exact semantic search: the cosine of every query against every corpus
//! row, with sentence-transformers' `util.semantic_search` semantics.
//!
//! Queries and corpus rows are L2-normalised on the host; the score matrix
//! `queries [Q, D] × corpusᵀ` is one compiled RLX graph run on the device,
//! with the corpus as weights, in chunks of rows (one matmul and one output
//! per chunk). Top-k selection runs on the host, queries spread over the
//! cores, while the device scores the next batch of queries: scores
//! descending, equal scores by lower corpus row first.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use rayon::prelude::*;
use rlx::{CompiledGraph, DType, Device, Graph, Session, Tensor, Ticket};

use crate::embedder::l2_normalize;
use crate::{ModelError, Result};

/// Queries scored by one run at most; a smaller batch runs in the next
/// power-of-two bucket.
pub const MAX_QUERY_BATCH: usize = 64;

/// Corpus rows per chunk (one matmul each), bounding any one output.
pub const DEFAULT_CHUNK_ROWS: usize = 32768;

/// The most bytes one batch's scores may take for a search to keep two
/// batches in flight (each call in flight holds its own scores): 128 MiB,
/// a corpus of up to 524,288 rows.
const PIPELINED_SCORE_BYTES: usize = 128 << 20;

const QUERIES: &str = "queries";

/// One result: a corpus row and its cosine similarity to the query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub corpus_id: usize,
    pub score: f32,
}

/// A corpus of vectors on a device, ready to be searched.
pub struct CorpusIndex {
    session: Session,
    rows: usize,
    dim: usize,
    chunk_rows: usize,
    chunks: usize,
    /// Calls in flight at once: 2 pipelines the batches.
    slots: usize,
    /// Rows never returned (e.g. blank lines of a text corpus).
    excluded: Vec<bool>,
    /// One executable per query bucket.
    compiled: HashMap<usize, CompiledGraph>,
}

fn chunk_name(c: usize) -> String {
    format!("corpus.{c}")
}

impl CorpusIndex {
    /// `vectors` is `[rows, dim]` row-major; rows are normalised here.
    pub fn new(vectors: &[f32], dim: usize, device: Device) -> Result<CorpusIndex> {
        Self::with_chunk_rows(vectors, dim, device, DEFAULT_CHUNK_ROWS)
    }

    /// [`new`](Self::new) with at most `chunk_rows` corpus rows per matmul
    /// (the last chunk is padded with zero rows, which are never returned).
    pub fn with_chunk_rows(vectors: &[f32], dim: usize, device: Device, chunk_rows: usize) -> Result<CorpusIndex> {
        Self::build(vectors, dim, device, chunk_rows, PIPELINED_SCORE_BYTES)
    }

    /// `with_chunk_rows`, pipelining batches when one batch's scores take
    /// at most `pipelined_bytes`.
    fn build(vectors: &[f32], dim: usize, device: Device, chunk_rows: usize, pipelined_bytes: usize) -> Result<CorpusIndex> {
        if dim == 0 || chunk_rows == 0 {
            return Err(ModelError::Input(format!("search: dimension ({dim}) and chunk rows ({chunk_rows}) must be at least 1")));
        }
        if !vectors.len().is_multiple_of(dim) {
            return Err(ModelError::Input(format!("search: {} values are not whole rows of dimension {dim}", vectors.len())));
        }
        let rows = vectors.len() / dim;
        if rows == 0 {
            return Err(ModelError::Input("search: the corpus has no rows".into()));
        }
        if let Some(i) = vectors.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::Input(format!("search: corpus row {} holds a value that is not finite", i / dim)));
        }
        // As many chunks as `chunk_rows` asks for, of equal size, so the
        // last one is padded by fewer rows than there are chunks.
        let chunks = rows.div_ceil(chunk_rows);
        let chunk_rows = rows.div_ceil(chunks);
        let mut session = Session::new(device)?;
        // Two calls in flight (one batch's scores come back while the next
        // batch's run) where a second set of scores costs little.
        let slots = if MAX_QUERY_BATCH * chunks * chunk_rows * 4 <= pipelined_bytes { 2 } else { 1 };
        session.set_prepare_options(rlx::PrepareOptions { slots, ..session.prepare_options().clone() });
        for c in 0..chunks {
            let mut block = vec![0f32; chunk_rows * dim];
            let first = c * chunk_rows;
            let take = chunk_rows.min(rows - first);
            for r in 0..take {
                let row = l2_normalize(vectors[(first + r) * dim..(first + r + 1) * dim].to_vec());
                block[r * dim..(r + 1) * dim].copy_from_slice(&row);
            }
            session.set_weight(&chunk_name(c), Tensor::from_f32([chunk_rows, dim], &block)?)?;
        }
        Ok(CorpusIndex { session, rows, dim, chunk_rows, chunks, slots, excluded: vec![false; rows], compiled: HashMap::new() })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows that results never contain (out-of-range ids are ignored).
    pub fn exclude(&mut self, rows: impl IntoIterator<Item = usize>) {
        for r in rows {
            if let Some(x) = self.excluded.get_mut(r) {
                *x = true;
            }
        }
    }

    /// The `top_k` best rows for each query (`queries` is `[Q, dim]`
    /// row-major), best first; fewer when fewer rows are searchable.
    pub fn search(&mut self, queries: &[f32], top_k: usize) -> Result<Vec<Vec<Hit>>> {
        let dim = self.dim;
        if top_k == 0 {
            return Err(ModelError::Input("search: top_k must be at least 1".into()));
        }
        if !queries.len().is_multiple_of(dim) {
            return Err(ModelError::Input(format!("search: {} query values are not whole rows of dimension {dim}", queries.len())));
        }
        let mut out = Vec::with_capacity(queries.len() / dim);
        // A batch still in flight when something fails is waited out, so
        // its slot is free for the next search.
        let mut pending = None;
        let done = self.run_batches(queries, top_k, &mut pending, &mut out);
        if let (Err(_), Some((bucket, t, _))) = (&done, pending) {
            let _ = self.compiled.get_mut(&bucket).map(|exe| exe.wait(t));
        }
        done.map(|()| out)
    }

    /// Scores `queries` batch by batch and appends their top `k` to `out`;
    /// with two slots batch k + 1 is submitted before batch k's top-k runs.
    /// `pending`: the batch in flight (bucket, ticket, queries).
    fn run_batches(
        &mut self,
        queries: &[f32],
        k: usize,
        pending: &mut Option<(usize, Ticket, usize)>,
        out: &mut Vec<Vec<Hit>>,
    ) -> Result<()> {
        for batch in queries.chunks(MAX_QUERY_BATCH * self.dim) {
            // One slot: the batch before is collected first.
            if self.slots < 2 {
                if let Some(p) = pending.take() {
                    self.collect(p, k, out)?;
                }
            }
            let (bucket, ticket) = self.submit_scores(batch)?;
            if let Some(p) = pending.replace((bucket, ticket, batch.len() / self.dim)) {
                self.collect(p, k, out)?;
            }
        }
        match pending.take() {
            Some(p) => self.collect(p, k, out),
            None => Ok(()),
        }
    }

    /// Waits for a batch of `n` queries scored by the `bucket` executable
    /// and appends each query's top `k`, selected on every core.
    fn collect(&mut self, (bucket, ticket, n): (usize, Ticket, usize), k: usize, out: &mut Vec<Vec<Hit>>) -> Result<()> {
        let exe = self.compiled.get_mut(&bucket).ok_or_else(|| ModelError::Input(format!("search: bucket {bucket} vanished")))?;
        let outputs = exe.wait(ticket)?;
        if outputs.len() != self.chunks || outputs.iter().any(|t| t.numel() != bucket * self.chunk_rows) {
            return Err(ModelError::Input(format!(
                "search: the score graph returned {} outputs for {} chunks of [{bucket}, {}]",
                outputs.len(),
                self.chunks,
                self.chunk_rows
            )));
        }
        let scores: Vec<Vec<f32>> = outputs.iter().map(|t| t.to_f32()).collect();
        let sel = Selection { rows: self.rows, chunk_rows: self.chunk_rows, excluded: &self.excluded };
        out.par_extend((0..n).into_par_iter().map(|q| sel.top_k(&scores, q, k)));
        Ok(())
    }

    /// Starts scoring a batch of queries: per chunk, the `[bucket,
    /// chunk_rows]` scores of its queries (rows past the batch are
    /// padding). Returns the bucket and the call's ticket.
    fn submit_scores(&mut self, batch: &[f32]) -> Result<(usize, Ticket)> {
        let dim = self.dim;
        let n = batch.len() / dim;
        let bucket = n.next_power_of_two().min(MAX_QUERY_BATCH);
        let mut input = vec![0f32; bucket * dim];
        for (q, row) in batch.chunks(dim).enumerate() {
            if let Some(i) = row.iter().position(|x| !x.is_finite()) {
                return Err(ModelError::Input(format!("search: query holds a value that is not finite ({})", row[i])));
            }
            input[q * dim..(q + 1) * dim].copy_from_slice(&l2_normalize(row.to_vec()));
        }
        let input = Tensor::from_f32([bucket, dim], &input)?;
        let exe = match self.compiled.entry(bucket) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let graph = score_graph(bucket, dim, self.chunk_rows, self.chunks)?;
                v.insert(self.session.compile(&graph)?)
            }
        };
        Ok((bucket, exe.submit(&[(QUERIES, &input)])?))
    }
}

/// What top-k selection needs of an index.
struct Selection<'a> {
    rows: usize,
    chunk_rows: usize,
    excluded: &'a [bool],
}

impl Selection<'_> {
    /// Query `q`'s best `k` rows from the per-chunk scores.
    fn top_k(&self, scores: &[Vec<f32>], q: usize, k: usize) -> Vec<Hit> {
        // A bounded heap whose top is the worst hit kept so far.
        let mut heap: BinaryHeap<Worst> = BinaryHeap::with_capacity(k.min(self.rows) + 1);
        // Once the heap is full, the worst score kept: anything below it is
        // out at one comparison.
        let mut floor = f32::NEG_INFINITY;
        for (c, chunk) in scores.iter().enumerate() {
            let first = c * self.chunk_rows;
            let row = &chunk[q * self.chunk_rows..(q + 1) * self.chunk_rows];
            for (r, &score) in row.iter().enumerate() {
                let id = first + r;
                if score < floor || id >= self.rows || self.excluded[id] {
                    continue;
                }
                let hit = Worst(Hit { corpus_id: id, score });
                if heap.len() < k {
                    heap.push(hit);
                } else if heap.peek().is_some_and(|w| rank(&hit.0, &w.0) == Ordering::Less) {
                    heap.pop();
                    heap.push(hit);
                } else {
                    continue;
                }
                if heap.len() == k {
                    floor = heap.peek().map_or(floor, |w| w.0.score);
                }
            }
        }
        let mut hits: Vec<Hit> = heap.into_iter().map(|w| w.0).collect();
        hits.sort_by(rank);
        hits
    }
}

/// Result order: higher scores first, equal scores by lower row.
fn rank(a: &Hit, b: &Hit) -> Ordering {
    b.score.total_cmp(&a.score).then(a.corpus_id.cmp(&b.corpus_id))
}

/// Heap order: the worse hit is the greater.
struct Worst(Hit);

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Worst {}
impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        rank(&self.0, &other.0)
    }
}

/// `queries [bucket, dim]` against each corpus chunk `[chunk_rows, dim]`:
/// one output `[bucket, chunk_rows]` per chunk.
fn score_graph(bucket: usize, dim: usize, chunk_rows: usize, chunks: usize) -> Result<Graph> {
    let mut g = Graph::new();
    let q = g.input(QUERIES, [bucket, dim], DType::F32)?;
    for c in 0..chunks {
        let corpus = g.param(&chunk_name(c), [chunk_rows, dim], DType::F32)?;
        let scores = g.matmul_t(q, corpus)?;
        g.output(scores)?;
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_break_by_lower_row_and_excluded_rows_never_return() {
        // Rows 0, 2 and 3 are the same direction: equal scores.
        let v = [1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 0.0, -1.0, 0.0];
        let mut idx = CorpusIndex::with_chunk_rows(&v, 2, Device::Cpu, 2).unwrap_or_else(|e| panic!("{e}"));
        let hits = idx.search(&[1.0, 0.0], 3).unwrap_or_else(|e| panic!("{e}"));
        let ids: Vec<usize> = hits[0].iter().map(|h| h.corpus_id).collect();
        assert_eq!(ids, vec![0, 2, 3]);
        idx.exclude([2]);
        let hits = idx.search(&[1.0, 0.0], 10).unwrap_or_else(|e| panic!("{e}"));
        let ids: Vec<usize> = hits[0].iter().map(|h| h.corpus_id).collect();
        assert_eq!(ids, vec![0, 3, 1, 4], "all searchable rows, padding rows never");
        assert_eq!(hits[0][3].score, -1.0);
        assert!(idx.search(&[1.0, 0.0], 0).is_err());
        assert!(idx.search(&[1.0, 0.0, 1.0], 1).is_err());
    }

    #[test]
    fn one_slot_and_two_give_the_same_hits_and_survive_a_bad_batch() {
        // 150 random rows of 8, 150 queries: three batches (64, 64, 22).
        let mut state = 0x2545_f491_u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let (rows, dim, nq) = (150, 8, 150);
        let corpus: Vec<f32> = (0..rows * dim).map(|_| next()).collect();
        let mut queries: Vec<f32> = (0..nq * dim).map(|_| next()).collect();
        let mut one = CorpusIndex::build(&corpus, dim, Device::Cpu, 64, 0).unwrap_or_else(|e| panic!("{e}"));
        let mut two = CorpusIndex::build(&corpus, dim, Device::Cpu, 64, usize::MAX).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((one.slots, two.slots), (1, 2));
        let a = one.search(&queries, 7).unwrap_or_else(|e| panic!("{e}"));
        let b = two.search(&queries, 7).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.len(), nq);
        assert_eq!(a, b);
        // A query that is not finite in the second batch: an error, and the
        // index still answers afterwards.
        queries[70 * dim] = f32::NAN;
        for idx in [&mut one, &mut two] {
            assert!(idx.search(&queries, 7).is_err());
            assert_eq!(idx.search(&queries[..64 * dim], 7).unwrap_or_else(|e| panic!("{e}")), a[..64].to_vec());
        }
    }
}
