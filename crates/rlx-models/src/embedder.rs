//! `SentenceEmbedder`: text → one vector per text. Texts are tokenised,
//! sorted by length, grouped into batches and padded to shape buckets; one
//! executable per (batch, seq) bucket is compiled on first use and cached,
//! all of them sharing the one weight store.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rlx::{CompileOptions, CompiledGraph, DType, Device, PrepareOptions, Session, Tensor, Ticket, WeightStore};

use crate::bert::{build_bert_graph, BertGraphOptions, ATTENTION_MASK, INPUT_IDS};
use crate::weights::load_bert_weights;
use crate::{BertConfig, ModelError, Result, SentenceConfig, TextTokenizer};

/// Sequence buckets; a model's own maximum length is added when it is not
/// one of these. Half steps between the powers of two: on a corpus of mixed
/// lengths they cut padded tokens from ~1.39x to ~1.17x those of padding to
/// the longest text, for a few more (cheap, cached) compilations.
pub const SEQ_BUCKETS: &[usize] = &[16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512];

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmbedderOptions {
    /// Storage dtype of weights and activations (f32, f16, bf16); matmuls,
    /// norms and softmax accumulate in f32 either way.
    pub dtype: DType,
    /// Texts per forward pass (the largest batch bucket).
    pub batch_size: usize,
    /// Run the model's exact (erf) GELU as its tanh approximation
    /// ([`CompileOptions::approximate_gelu`]): faster on CUDA, vectors move
    /// slightly. Off by default.
    pub approximate_gelu: bool,
}

impl Default for EmbedderOptions {
    fn default() -> Self {
        EmbedderOptions { dtype: DType::F32, batch_size: 32, approximate_gelu: false }
    }
}

/// What [`SentenceEmbedder::read_parts`] reads from a model directory:
/// everything but the weights.
pub struct EmbedderParts {
    dir: PathBuf,
    config: BertConfig,
    sentence: SentenceConfig,
    tokenizer: TextTokenizer,
}

impl EmbedderParts {
    /// The tokenizer the embedder will use (clone it to tokenise on another thread).
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }
    /// The width of the model's vectors.
    pub fn dim(&self) -> usize {
        self.config.hidden_size
    }
}

/// Cache key: (batch, seq, with hidden states).
type BucketKey = (usize, usize, bool);

pub struct SentenceEmbedder {
    config: BertConfig,
    sentence: SentenceConfig,
    tokenizer: Option<TextTokenizer>,
    session: Session,
    options: EmbedderOptions,
    seq_buckets: Vec<usize>,
    compiled: Mutex<HashMap<BucketKey, CompiledGraph>>,
}

impl SentenceEmbedder {
    /// Loads a sentence-transformers BERT model directory (config.json,
    /// model.safetensors, tokenizer.json, modules.json, 1_Pooling/) with
    /// default options.
    pub fn load(dir: impl AsRef<Path>, device: Device) -> Result<SentenceEmbedder> {
        Self::load_with(dir, device, EmbedderOptions::default())
    }

    pub fn load_with(dir: impl AsRef<Path>, device: Device, options: EmbedderOptions) -> Result<SentenceEmbedder> {
        // Bad options are reported before the directory is read.
        check_options(&options)?;
        Self::load_parts(Self::read_parts(dir)?, device, options)
    }

    /// A model directory's configuration and tokenizer, read without the
    /// weights or a device: a caller can tokenise with
    /// [`EmbedderParts::tokenizer`] while another thread loads the embedder
    /// from the same parts ([`load_parts`](Self::load_parts)).
    pub fn read_parts(dir: impl AsRef<Path>) -> Result<EmbedderParts> {
        let dir = dir.as_ref();
        let (config, sentence, tokenizer) = read_host_parts(dir)?;
        Ok(EmbedderParts { dir: dir.to_path_buf(), config, sentence, tokenizer })
    }

    /// [`load_with`](Self::load_with) from parts already read: only the
    /// weights are read here.
    pub fn load_parts(parts: EmbedderParts, device: Device, options: EmbedderOptions) -> Result<SentenceEmbedder> {
        check_options(&options)?;
        let EmbedderParts { dir, config, sentence, tokenizer } = parts;
        let store = Arc::new(WeightStore::new());
        // The device opens (on a GPU: the driver, the kernels) while the
        // weights are read; they reach the device when the first graph is
        // prepared.
        let (session, loaded) = std::thread::scope(|s| {
            let opening = s.spawn(|| Session::with_weights(device, store.clone()));
            let loaded = load_bert_weights(&dir.join("model.safetensors"), &config, options.dtype, &store);
            (opening.join().unwrap_or_else(|_| Err(rlx::Error::Device(device.to_string(), "opening the device panicked".into()))), loaded)
        });
        loaded?;
        Self::with_session(config, sentence, Some(tokenizer), session?, options)
    }

    /// An embedder over weights already in a store (e.g. [`random_weights`]);
    /// without a tokenizer only [`embed_ids`](Self::embed_ids) works.
    ///
    /// [`random_weights`]: crate::random_weights
    pub fn from_weights(
        config: BertConfig,
        sentence: SentenceConfig,
        tokenizer: Option<TextTokenizer>,
        weights: Arc<WeightStore>,
        device: Device,
        options: EmbedderOptions,
    ) -> Result<SentenceEmbedder> {
        check_options(&options)?;
        Self::with_session(config, sentence, tokenizer, Session::with_weights(device, weights)?, options)
    }

    fn with_session(
        config: BertConfig,
        sentence: SentenceConfig,
        tokenizer: Option<TextTokenizer>,
        mut session: Session,
        options: EmbedderOptions,
    ) -> Result<SentenceEmbedder> {
        // Two slots: embed() submits batch k + 1 before it collects batch
        // k, so the host pads the next batch and unpacks the last while the
        // device runs (one bucket's two calls then need two arenas).
        session.set_prepare_options(PrepareOptions { slots: 2, ..session.prepare_options().clone() });
        let precision = (options.dtype != DType::F32).then_some(options.dtype);
        session.set_compile_options(CompileOptions { precision, approximate_gelu: options.approximate_gelu, ..CompileOptions::default() });
        let max = sentence.max_seq_length.min(config.max_position_embeddings);
        let mut seq_buckets: Vec<usize> = SEQ_BUCKETS.iter().copied().filter(|&b| b < max).collect();
        seq_buckets.push(max);
        Ok(SentenceEmbedder { config, sentence, tokenizer, session, options, seq_buckets, compiled: Mutex::new(HashMap::new()) })
    }

    /// An embedder over the same weights (shared, not copied) with another
    /// batch size; its shape buckets compile on first use.
    pub fn with_batch_size(&self, batch_size: usize) -> Result<SentenceEmbedder> {
        let options = EmbedderOptions { batch_size, ..self.options };
        let weights = self.session.weights().clone();
        Self::from_weights(self.config.clone(), self.sentence.clone(), self.tokenizer.clone(), weights, self.device(), options)
    }

    /// Length of the vectors [`embed`](Self::embed) returns.
    pub fn dim(&self) -> usize {
        self.config.hidden_size
    }

    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    pub fn sentence_config(&self) -> &SentenceConfig {
        &self.sentence
    }

    pub fn options(&self) -> &EmbedderOptions {
        &self.options
    }

    pub fn device(&self) -> Device {
        self.session.device()
    }

    pub fn tokenizer(&self) -> Option<&TextTokenizer> {
        self.tokenizer.as_ref()
    }

    /// One vector per text, in input order (normalised when the model says
    /// so). The empty text is a text: `[CLS] [SEP]`.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.embed_with_progress(texts, &mut |_| {})
    }

    /// [`embed`](Self::embed), calling `progress(n)` after each batch of `n`
    /// texts (e.g. to move a progress bar).
    pub fn embed_with_progress(&self, texts: &[&str], progress: &mut dyn FnMut(usize)) -> Result<Vec<Vec<f32>>> {
        let ids = self.tokenize(texts)?;
        self.embed_ids_with_progress(&ids, progress)
    }

    /// Token ids of each text, as the model sees them.
    pub fn tokenize(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        self.tokenize_counting(texts).map(|(ids, _)| ids)
    }

    /// [`tokenize`](Self::tokenize), and how many texts were longer than the
    /// model's limit and truncated to it.
    pub fn tokenize_counting(&self, texts: &[&str]) -> Result<(Vec<Vec<u32>>, usize)> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| ModelError::Input("this embedder has no tokenizer: use embed_ids".into()))?;
        tok.encode_batch_counting(texts)
    }

    /// The most tokens a text keeps, special tokens included; longer texts
    /// are truncated.
    pub fn max_tokens(&self) -> usize {
        let bucket = self.seq_buckets.last().copied().unwrap_or(0);
        self.tokenizer.as_ref().map_or(bucket, |t| t.max_len().min(bucket))
    }

    /// One vector per id sequence (each with its special tokens), in input
    /// order.
    pub fn embed_ids(&self, ids: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        self.embed_ids_with_progress(ids, &mut |_| {})
    }

    /// Every id sequence must be non-empty, fit the longest bucket and stay
    /// inside the vocabulary.
    fn check_ids<'a>(&self, ids: impl Iterator<Item = &'a [u32]>) -> Result<()> {
        let max = self.seq_buckets.last().copied().unwrap_or(0);
        for (i, row) in ids.enumerate() {
            if row.is_empty() {
                return Err(ModelError::Input(format!("text {i}: no tokens (expected at least [CLS] and [SEP])")));
            }
            if row.len() > max {
                return Err(ModelError::Input(format!("text {i}: {} tokens, the model takes at most {max}", row.len())));
            }
            if let Some(bad) = row.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                return Err(ModelError::Input(format!(
                    "text {i}: token id {bad} is outside the vocabulary (size {})",
                    self.config.vocab_size
                )));
            }
        }
        Ok(())
    }

    /// [`embed_ids`](Self::embed_ids), calling `progress(n)` after each batch
    /// of `n` sequences.
    pub fn embed_ids_with_progress(&self, ids: &[Vec<u32>], progress: &mut dyn FnMut(usize)) -> Result<Vec<Vec<f32>>> {
        let all = self.embed_ids_cancellable(ids, &mut |n| {
            progress(n);
            true
        })?;
        all.ok_or_else(|| ModelError::Input("embedding was cancelled".into()))
    }

    /// [`embed_ids_with_progress`](Self::embed_ids_with_progress) whose
    /// callback may stop the work between batches by returning false (say,
    /// when the reader of the output has gone); `Ok(None)` then.
    pub fn embed_ids_cancellable(&self, ids: &[Vec<u32>], progress: &mut dyn FnMut(usize) -> bool) -> Result<Option<Vec<Vec<f32>>>> {
        self.check_ids(ids.iter().map(|r| r.as_slice()))?;
        // Identical sequences (empty lines, repeated texts) run once and
        // share the vector: a file of a million empty lines costs one row per
        // call, not a million.
        let mut first: HashMap<&[u32], usize> = HashMap::new();
        let mut source: Vec<usize> = Vec::with_capacity(ids.len());
        let mut order: Vec<usize> = Vec::new();
        for (i, row) in ids.iter().enumerate() {
            let at = *first.entry(row.as_slice()).or_insert(i);
            if at == i {
                order.push(i);
            }
            source.push(at);
        }
        let repeats = ids.len() - order.len();
        // Sorting by length keeps the padding inside each batch small.
        order.sort_by_key(|&i| ids[i].len());
        let mut out = vec![Vec::new(); ids.len()];
        // Pipelined: batch k + 1 is padded and submitted before batch k is
        // collected, so the device is not idle while the host works.
        let mut cache = self.lock_cache()?;
        let mut pending: Option<(&[usize], BucketKey, Ticket)> = None;
        // A call still in flight when the work stops (an error, or the
        // caller's stop) is waited out, so its slot is free for the next.
        // On the CPU a padding row costs as much as a text, so a batch that
        // is not full is mostly cut into power-of-two batch buckets instead;
        // a GPU runs a small batch in about the time of a smaller one, so
        // there it is padded.
        let exact = self.device() == Device::Cpu;
        let mut start = 0;
        for len in group_sizes(order.len(), self.options.batch_size, exact) {
            let group = &order[start..start + len];
            start += len;
            let rows: Vec<&[u32]> = group.iter().map(|&i| ids[i].as_slice()).collect();
            let submitted = self.padded(&rows, false).and_then(|(key, i, m)| Ok((key, Self::submit(self.exe(&mut cache, key)?, &i, &m)?)));
            let (key, ticket) = match submitted {
                Ok(kt) => kt,
                Err(e) => {
                    self.drain(&mut cache, pending.take());
                    return Err(e);
                }
            };
            if let Some((g, k, t)) = pending.replace((group, key, ticket)) {
                let done = self.collect(&mut cache, g, k, t, &mut out);
                if done.is_err() || !progress(g.len()) {
                    self.drain(&mut cache, pending.take());
                    return done.map(|_| None);
                }
            }
        }
        if let Some((g, k, t)) = pending.take() {
            self.collect(&mut cache, g, k, t, &mut out)?;
            if !progress(g.len()) {
                return Ok(None);
            }
        }
        drop(cache);
        for (i, &at) in source.iter().enumerate() {
            if at != i {
                out[i] = out[at].clone();
            }
        }
        if repeats > 0 && !progress(repeats) {
            return Ok(None);
        }
        Ok(Some(out))
    }

    /// The hidden states of one id sequence: the embedding-LayerNorm output,
    /// then each layer's output, each `[len][hidden]` row-major (padding
    /// rows removed).
    pub fn hidden_states(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_ids(std::iter::once(ids))?;
        let outs = self.forward(&[ids], true)?;
        let width = ids.len() * self.dim();
        outs.into_iter()
            .skip(1)
            .map(|rows| {
                rows.into_iter()
                    .next()
                    .map(|row| row.into_iter().take(width).collect())
                    .ok_or_else(|| ModelError::Input("the compiled graph returned an empty hidden-state output".into()))
            })
            .collect()
    }

    /// The smallest sequence bucket that holds `len` tokens.
    pub fn seq_bucket(&self, len: usize) -> Option<usize> {
        self.seq_buckets.iter().copied().find(|&b| b >= len)
    }

    /// The batch bucket for `n` texts: the next power of two, at most the
    /// batch size, so few executables cover every batch.
    pub fn batch_bucket(&self, n: usize) -> usize {
        n.next_power_of_two().min(self.options.batch_size).max(n)
    }

    fn lock_cache(&self) -> Result<std::sync::MutexGuard<'_, HashMap<BucketKey, CompiledGraph>>> {
        self.compiled.lock().map_err(|_| ModelError::Input("embedder poisoned by a panic in another thread".into()))
    }

    /// The executable of a bucket, compiled on first use.
    fn exe<'c>(&self, cache: &'c mut HashMap<BucketKey, CompiledGraph>, key: BucketKey) -> Result<&'c mut CompiledGraph> {
        Ok(match cache.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => {
                let (batch, seq, hidden) = key;
                let opts = BertGraphOptions { pooling: self.sentence.pooling, hidden_states: hidden, token_type_ids: false };
                let graph = build_bert_graph(&self.config, batch, seq, &opts)?;
                v.insert(self.session.compile(&graph)?)
            }
        })
    }

    /// Starts one padded batch on its executable.
    fn submit(exe: &mut CompiledGraph, ids: &Tensor, mask: &Tensor) -> Result<Ticket> {
        // The precision policy may store inputs in another dtype; give the
        // executable exactly what its schedule expects.
        let want = |name: &str| exe.schedule().inputs.iter().find(|s| s.name == name).map(|s| s.dtype);
        let ids = match want(INPUT_IDS) {
            Some(d) if d != ids.dtype() => ids.to_dtype(d),
            _ => ids.clone(),
        };
        let mask = match want(ATTENTION_MASK) {
            Some(d) if d != mask.dtype() => mask.to_dtype(d),
            _ => mask.clone(),
        };
        Ok(exe.submit(&[(INPUT_IDS, &ids), (ATTENTION_MASK, &mask)])?)
    }

    /// Waits for a submitted batch and stores its rows' vectors in `out`.
    fn collect(
        &self,
        cache: &mut HashMap<BucketKey, CompiledGraph>,
        group: &[usize],
        key: BucketKey,
        ticket: Ticket,
        out: &mut [Vec<f32>],
    ) -> Result<()> {
        let exe = cache.get_mut(&key).ok_or_else(|| ModelError::Input(format!("bucket {key:?} vanished from the cache")))?;
        let outputs = exe.wait(ticket)?;
        let pooled = unpack(outputs, key.0, group.len())
            .into_iter()
            .next()
            .ok_or_else(|| ModelError::Input("the compiled graph returned no pooled output".into()))?;
        if pooled.len() < group.len() {
            return Err(ModelError::Input(format!("the compiled graph returned {} rows for {} texts", pooled.len(), group.len())));
        }
        for (&i, v) in group.iter().zip(pooled) {
            if let Some(at) = v.iter().position(|x| !x.is_finite()) {
                let hint = if self.options.dtype == DType::F32 { "" } else { " (an activation may have overflowed: try dtype f32)" };
                return Err(ModelError::Input(format!("text {i}: the model's output is not finite ({} at element {at}){hint}", v[at])));
            }
            out[i] = if self.sentence.normalize { l2_normalize(v) } else { v };
        }
        Ok(())
    }

    /// Waits out a call still in flight when the work stops early (its
    /// result is not needed; the slot must be free for the next call).
    fn drain(&self, cache: &mut HashMap<BucketKey, CompiledGraph>, pending: Option<(&[usize], BucketKey, Ticket)>) {
        if let Some((_, key, ticket)) = pending {
            if let Some(exe) = cache.get_mut(&key) {
                let _ = exe.wait(ticket);
            }
        }
    }

    /// Pads `rows` to their bucket: the key and the ids and mask tensors.
    fn padded(&self, rows: &[&[u32]], hidden: bool) -> Result<(BucketKey, Tensor, Tensor)> {
        let longest = rows.iter().map(|r| r.len()).max().unwrap_or(1);
        let seq = self
            .seq_bucket(longest)
            .ok_or_else(|| ModelError::Input(format!("{longest} tokens do not fit the largest bucket {:?}", self.seq_buckets.last())))?;
        let batch = self.batch_bucket(rows.len());
        let mut ids = vec![0i32; batch * seq];
        let mut mask = vec![0f32; batch * seq];
        for (b, row) in rows.iter().enumerate() {
            for (t, &id) in row.iter().enumerate() {
                ids[b * seq + t] = id as i32;
                mask[b * seq + t] = 1.0;
            }
        }
        // Filler rows attend to one position so their mean is defined.
        for b in rows.len()..batch {
            mask[b * seq] = 1.0;
        }
        Ok(((batch, seq, hidden), Tensor::from_i32([batch, seq], &ids)?, Tensor::from_f32([batch, seq], &mask)?))
    }

    /// Runs one padded batch; returns, per graph output, one vector per row
    /// of `rows` (output 0 the pooled vectors, then the hidden states).
    fn forward(&self, rows: &[&[u32]], hidden: bool) -> Result<Vec<Vec<Vec<f32>>>> {
        let (key, ids, mask) = self.padded(rows, hidden)?;
        let mut cache = self.lock_cache()?;
        let exe = self.exe(&mut cache, key)?;
        let ticket = Self::submit(exe, &ids, &mask)?;
        let outputs = exe.wait(ticket)?;
        drop(cache);
        Ok(unpack(outputs, key.0, rows.len()))
    }
}

/// Per graph output, the first `rows` of its `batch` rows as f32 vectors.
fn unpack(outputs: Vec<Tensor>, batch: usize, rows: usize) -> Vec<Vec<Vec<f32>>> {
    outputs
        .into_iter()
        .map(|t| {
            let values = t.to_f32();
            let per_row = values.len() / batch.max(1);
            values.chunks(per_row.max(1)).take(rows).map(|c| c.to_vec()).collect()
        })
        .collect()
}

/// The sizes of the consecutive batches `n` rows run in: full batches of
/// `batch`, then the rest as one batch (padded up to its bucket), or with
/// `exact`, the rest cut into its largest powers of two while at least
/// [`EXACT_MIN`] rows remain, the last few rows one padded batch (more,
/// smaller calls cost more than they save there).
fn group_sizes(n: usize, batch: usize, exact: bool) -> Vec<usize> {
    let batch = batch.max(1);
    let mut sizes = vec![batch; n / batch];
    let mut rest = n % batch;
    while rest > 0 {
        let p = 1usize << (usize::BITS - 1 - rest.leading_zeros());
        if !exact || p == rest || rest < EXACT_MIN {
            sizes.push(rest);
            break;
        }
        sizes.push(p);
        rest -= p;
    }
    sizes
}

/// The fewest rows `group_sizes` cuts into exact batches.
const EXACT_MIN: usize = 8;

/// A model directory's configurations and tokenizer, after checking that it
/// is a directory of supported files.
fn read_host_parts(dir: &Path) -> Result<(BertConfig, SentenceConfig, TextTokenizer)> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(ModelError::format(dir, "is a file, not a model directory (config.json, model.safetensors, tokenizer.json)")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ModelError::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, "model directory does not exist")))
        }
        Err(e) => return Err(ModelError::io(dir, e)),
    }
    check_file_formats(dir)?;
    let config = BertConfig::from_file(&dir.join("config.json"))?;
    let sentence = SentenceConfig::from_dir(dir, &config)?;
    let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json"), sentence.max_seq_length)?;
    Ok((config, sentence, tokenizer))
}

/// A model directory in a format RLX does not read gets "not supported" and
/// the conversion, rather than "no such file" for the file it lacks.
fn check_file_formats(dir: &Path) -> Result<()> {
    let has = |name: &str| dir.join(name).is_file();
    let shown = dir.display();
    if !has("tokenizer.json") && has("vocab.txt") {
        return Err(ModelError::format(
            dir,
            format!(
                "not supported: the tokenizer is only a vocab.txt; RLX reads tokenizer.json. Convert it with transformers: \
                 python3 -c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('{shown}').save_pretrained('{shown}')\""
            ),
        ));
    }
    if !has("model.safetensors") && (has("pytorch_model.bin") || has("pytorch_model.bin.index.json")) {
        return Err(ModelError::format(
            dir,
            format!(
                "not supported: the weights are only a PyTorch pickle (pytorch_model.bin); RLX reads model.safetensors. \
                 Convert them to safetensors with transformers: \
                 python3 -c \"from transformers import AutoModel; AutoModel.from_pretrained('{shown}').save_pretrained('{shown}', safe_serialization=True)\""
            ),
        ));
    }
    Ok(())
}

fn check_options(o: &EmbedderOptions) -> Result<()> {
    if !o.dtype.is_float() {
        return Err(ModelError::Input(format!("dtype {} is not a float type: expected f32, f16 or bf16", o.dtype)));
    }
    if o.batch_size == 0 {
        return Err(ModelError::Input("batch size must be at least 1".into()));
    }
    Ok(())
}

/// `x / max(‖x‖₂, 1e-12)`, as sentence-transformers' Normalize.
pub fn l2_normalize(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt().max(1e-12);
    for x in &mut v {
        *x = (*x as f64 / norm) as f32;
    }
    v
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    (ab / (aa.sqrt() * bb.sqrt())) as f32
}

#[cfg(test)]
mod tests {
    use super::{group_sizes, EXACT_MIN};

    #[test]
    fn batches_cover_every_row_and_exact_ones_need_no_padding() {
        assert_eq!(group_sizes(60, 32, false), vec![32, 28]);
        assert_eq!(group_sizes(60, 32, true), vec![32, 16, 8, 4]);
        assert_eq!(group_sizes(11, 32, true), vec![8, 3], "fewer than 8 rows left: one padded batch");
        assert_eq!(group_sizes(5, 32, true), vec![5]);
        assert_eq!(group_sizes(64, 32, true), vec![32, 32]);
        assert_eq!(group_sizes(0, 32, true), Vec::<usize>::new());
        for batch in [1, 3, 8, 24, 32] {
            for n in 0..200 {
                for exact in [false, true] {
                    let g = group_sizes(n, batch, exact);
                    assert_eq!(g.iter().sum::<usize>(), n, "{n} rows, batch {batch}");
                    assert!(g.iter().all(|&s| s >= 1 && s <= batch));
                    if exact {
                        // Every batch but a last one of under EXACT_MIN rows
                        // is its own bucket: full, or a power of two.
                        let (last, rest) = g.split_last().map_or((0, &[][..]), |(l, r)| (*l, r));
                        assert!(rest.iter().all(|&s| s == batch || s.is_power_of_two()), "{g:?}");
                        assert!(last == batch || last.is_power_of_two() || last < EXACT_MIN, "{g:?}");
                    }
                }
            }
        }
    }
}
