//! Text generation with a LLaMA-family decoder: [`Generator`].
//!
//! A generator compiles one decode step (recorded once, run for every
//! position: the token and position come from device state) and prefill
//! steps per prompt-length bucket, all bound to one shared state set (the
//! KV cache, token history, next token and position; see `llama.rs`).
//!
//! Decode is pipelined: the sampled token is written to state by the step
//! that sampled it, so step t+1 is submitted before step t's token has been
//! read; tokens reach the host as the steps' outputs. Steps that ran past a
//! stop are waited for and discarded — their cache rows lie past the kept
//! tokens and are overwritten by the next prompt.
//!
//! The cache is kept between calls: a prompt that starts with the tokens
//! already in the cache (the previous turns of a chat) only prefills what is
//! new.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rlx::{CompiledGraph, DType, Device, Session, StateSet, Tensor, Ticket};
use tokenizers::Tokenizer;

use crate::bpe_vocab::{build_tokenizer, GgufVocab};
use crate::chat_template::{ChatTemplate, Message};
use crate::gguf::GgufFile;
use crate::llama::{build_step_graph, io, LlamaConfig, LlamaWeights, StepShape, WeightKind};
use crate::text_stream::{StreamStep, TextStream};
use crate::{ModelError, Result};

mod generation;
mod joint;
mod text;

pub use generation::Generation;
use text::hf_text;
pub use text::{gguf_text, PromptEncoder};

/// How a generator is built.
#[derive(Debug, Clone)]
pub struct GeneratorOptions {
    /// Cache rows (tokens of prompt and reply together); at most the model's
    /// context length.
    pub ctx_size: usize,
    /// Prompt-length buckets compiled for prefill (on first use). A prompt
    /// is fed in chunks of these sizes, chosen to pad it the least
    /// (`plan_chunk`); past the largest, in chunks of the largest.
    pub prefill_buckets: Vec<usize>,
    /// Decode steps in flight at once (pipeline depth, at least 1).
    pub pipeline: usize,
    /// Also return each step's logits (tests and tools; costs a copy of the
    /// vocabulary-sized row per token).
    pub logits: bool,
    /// Dequantise block-quantized weights to f32 at load (the reference
    /// path; 4–8× the memory and slower).
    pub dequantize: bool,
    /// Sequences decoded side by side by the batch API
    /// ([`Generator::add_sequence`], [`Generator::step_batch`]).
    pub batch: usize,
    /// Replay each step from its recorded device graph (CUDA); false
    /// launches every kernel one by one (debugging; the same bits).
    pub replay: bool,
    /// The KV cache's dtype (f32, f16 or bf16); `None`: f16 on a GPU (half
    /// the memory, and half the bytes a decode step's attention reads), f32
    /// on the CPU.
    pub kv_dtype: Option<DType>,
}

impl Default for GeneratorOptions {
    fn default() -> Self {
        GeneratorOptions {
            ctx_size: 4096,
            prefill_buckets: vec![16, 32, 64, 128, 256],
            pipeline: 2,
            logits: false,
            dequantize: false,
            batch: 1,
            replay: true,
            kv_dtype: None,
        }
    }
}

/// The KV cache dtype when the options name none: f16 on a GPU, f32 on the CPU.
pub fn default_kv_dtype(device: Device) -> DType {
    match device {
        Device::Cuda(_) => DType::F16,
        Device::Cpu => DType::F32,
    }
}

/// Per-request sampling settings (llama.cpp's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// ≤ 0: greedy (argmax).
    pub temperature: f32,
    /// 0: off.
    pub top_k: i32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// 1: off.
    pub repeat_penalty: f32,
    /// Tokens the penalty looks back over.
    pub repeat_last_n: i32,
    pub seed: u64,
    /// New tokens at most.
    pub max_tokens: usize,
    /// Generation stops before any of these strings; they are not returned.
    pub stop: Vec<String>,
    /// Keep going past the end-of-sequence token.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            max_tokens: 256,
            stop: vec![],
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    /// Argmax decoding, no penalties.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..Default::default() }
    }

    fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(ModelError::Input(format!("sampling: {what}")));
        if self.temperature.is_nan() {
            return bad("temperature is NaN");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad(&format!("top_p must be in 0..=1, found {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(&format!("min_p must be in 0..=1, found {}", self.min_p));
        }
        if self.repeat_penalty.is_nan() || self.repeat_penalty <= 0.0 {
            return bad(&format!("repeat_penalty must be positive, found {}", self.repeat_penalty));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1");
        }
        if self.top_k < 0 || self.repeat_last_n < 0 {
            return bad(&format!("top_k ({}) and repeat_last_n ({}) must be >= 0", self.top_k, self.repeat_last_n));
        }
        Ok(())
    }

    fn f_row(&self) -> [f32; 4] {
        [self.temperature, self.top_p, self.min_p, self.repeat_penalty]
    }

    fn i_row(&self) -> [i32; 4] {
        [self.top_k, self.repeat_last_n, self.seed as u32 as i32, (self.seed >> 32) as u32 as i32]
    }
}

/// Step overhead of a prefill chunk in prompt-token equivalents (the
/// weights are read once per step), for `plan_chunk`.
const CHUNK_OVERHEAD: usize = 4;

/// A prompt's first new token and its logits (when the generator returns
/// logits).
type FirstToken = (u32, Option<Vec<f32>>);

/// A prefill step over several slots at once (`Generator::add_sequences`)
/// feeds at most this many tokens (width × chunk), which bounds its
/// activation memory.
const JOINT_PREFILL_TOKENS: usize = 4096;

/// A prefill step's fixed cost in prompt-token equivalents on a GPU, for
/// choosing between prefilling prompts side by side and one at a time
/// (`Generator::add_sequences`). Fitted to SmolLM2-135M on an H100 (`rlx
/// bench`, many-row matmuls through cuBLASLt): a 128-token prefill step
/// took 2.8 ms and one of 32 prompts × 128 tokens side by side 12.7 ms, so
/// a step costs about 1,000 tokens' time on top of ~2.5 µs a token. On the
/// CPU a step's cost is its tokens (`CHUNK_OVERHEAD`).
const GPU_STEP_OVERHEAD: usize = 1024;

/// The bucket of the next prefill chunk for `remaining` prompt tokens with
/// `room` cache rows left: of the plans that cover the tokens with buckets
/// (each fitting the room), the one that processes the fewest padded
/// tokens, counting `CHUNK_OVERHEAD` per step; past the largest bucket, the
/// largest. Without a bucket that fits, one token at a time.
fn plan_chunk(buckets: &[usize], remaining: usize, room: usize) -> usize {
    let fits: Vec<usize> = buckets.iter().copied().filter(|&b| b <= room).collect();
    let Some(&largest) = fits.last() else { return 1 };
    if remaining >= largest {
        return largest;
    }
    // cost[r]: the cheapest plan for r tokens (r < largest), and its first bucket.
    let mut cost = vec![(0usize, 0usize); remaining + 1];
    for r in 1..=remaining {
        // Ties go to the larger bucket first.
        cost[r] = fits
            .iter()
            .map(|&b| (b + CHUNK_OVERHEAD + if b >= r { 0 } else { cost[r - b].0 }, b))
            .min_by_key(|&(c, b)| (c, std::cmp::Reverse(b)))
            .unwrap_or((usize::MAX, largest));
    }
    cost[remaining].1
}

/// The `[B, 4]` sampling inputs, one row per slot (`None`: a free slot).
fn sampling_tensors(rows: &[Option<&SamplingParams>]) -> Result<(Tensor, Tensor)> {
    let off = SamplingParams::greedy();
    let f: Vec<f32> = rows.iter().flat_map(|p| p.unwrap_or(&off).f_row()).collect();
    let i: Vec<i32> = rows.iter().flat_map(|p| p.unwrap_or(&off).i_row()).collect();
    Ok((Tensor::from_f32([rows.len(), 4], &f)?, Tensor::from_i32([rows.len(), 4], &i)?))
}

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The end-of-sequence token.
    Eos,
    /// One of the stop strings.
    StopString(String),
    /// `max_tokens` new tokens.
    MaxTokens,
    /// The cache is full.
    ContextFull,
}

/// One streamed step: the text that became final and the token it came with.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub token: u32,
    /// The logits the token was sampled from, with `GeneratorOptions::logits`.
    pub logits: Option<Vec<f32>>,
}

/// Counters of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache (not prefilled again).
    pub cached_tokens: usize,
    pub generated: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Host time of the decode steps after the prompt: submitting them and
    /// handling their tokens (reading, detokenizing, stop checks), waits
    /// on the device excluded.
    pub host_time: Duration,
}

impl GenerationStats {
    /// Mean host time per decode step in µs (see `host_time`).
    pub fn host_us_per_step(&self) -> f64 {
        if self.generated < 2 {
            0.0
        } else {
            self.host_time.as_secs_f64() * 1e6 / (self.generated - 1) as f64
        }
    }
    pub fn prefill_tok_s(&self) -> f64 {
        let n = (self.prompt_tokens - self.cached_tokens) as f64;
        if self.prefill_time.is_zero() {
            0.0
        } else {
            n / self.prefill_time.as_secs_f64()
        }
    }
    /// Tokens after the first (which prefill produced) per second of decode.
    pub fn decode_tok_s(&self) -> f64 {
        if self.decode_time.is_zero() || self.generated < 2 {
            0.0
        } else {
            (self.generated - 1) as f64 / self.decode_time.as_secs_f64()
        }
    }
}

/// A LLaMA-family model ready to generate (see the module docs).
pub struct Generator {
    session: Session,
    config: LlamaConfig,
    kinds: std::collections::HashMap<String, WeightKind>,
    text: PromptEncoder,
    eos: Vec<u32>,
    states: Arc<StateSet>,
    opts: GeneratorOptions,
    /// Prefill steps by (slot, bucket): one row, on the slot's row of the
    /// shared states (`Session::compile_shared_at`).
    prefill: BTreeMap<(usize, usize), CompiledGraph>,
    /// Prefill steps over slots `0..w` at once, by (width `w`, chunk size)
    /// (`add_sequences`): the width is the decode width that holds the
    /// highest slot being prefilled.
    joint_prefill: BTreeMap<(usize, usize), CompiledGraph>,
    /// Decode steps by batch width: a step over slots `0..w` runs at the
    /// smallest width that holds them, on the first rows of the shared
    /// states (batch is their outermost dimension).
    decode: BTreeMap<usize, CompiledGraph>,
    /// Per slot: the tokens whose keys and values are in its cache rows, by
    /// position from 0. A new prompt in the slot (either API; the
    /// single-sequence one runs in slot 0) prefills only what follows the
    /// prefix it shares with them.
    kv: Vec<Vec<u32>>,
    /// Per slot: tokens in the cache (the position of its next token).
    slot_pos: Vec<usize>,
    /// Per slot: the batch API's sequence there, if any.
    slots: Vec<Option<BatchSequence>>,
}

/// A sequence of the batch API.
struct BatchSequence {
    params: SamplingParams,
    stream: TextStream,
    ids: Vec<u32>,
}

/// What one slot produced in a batch step.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchEvent {
    pub slot: usize,
    pub piece: Piece,
    /// Set when the sequence ended with this token; its slot is free again.
    pub finished: Option<StopReason>,
    /// On a sequence's first event: its prompt tokens whose keys and values
    /// were already in the slot's cache (a prefix shared with what the slot
    /// held before), so were not prefilled again. 0 on later events.
    pub cached_tokens: usize,
}

/// One prompt's result from [`Generator::generate_many`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutput {
    /// The new tokens (an end-of-sequence token that ended it included).
    pub ids: Vec<u32>,
    pub text: String,
    pub stop: Option<StopReason>,
}

/// Adds a batch event to the output of the prompt that owns its slot.
fn record(out: &mut [BatchOutput], owner: &mut [Option<usize>], ev: BatchEvent) {
    let Some(i) = owner.get(ev.slot).copied().flatten() else { return };
    let o = &mut out[i];
    o.ids.push(ev.piece.token);
    o.text.push_str(&ev.piece.text);
    if ev.finished.is_some() {
        o.stop = ev.finished;
        owner[ev.slot] = None;
    }
}

impl Generator {
    /// Loads a GGUF file or a Hugging Face directory (`config.json`,
    /// `model.safetensors`, `tokenizer.json`).
    pub fn load(path: impl AsRef<Path>, device: Device) -> Result<Generator> {
        Self::load_with(path, device, GeneratorOptions::default())
    }

    pub fn load_with(path: impl AsRef<Path>, device: Device, opts: GeneratorOptions) -> Result<Generator> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
        let (weights, (tokenizer, template, eos)) = if meta.is_dir() {
            (LlamaWeights::from_hf_dir(path)?, hf_text(path)?)
        } else {
            (LlamaWeights::from_gguf(path)?, gguf_text(path)?)
        };
        Self::from_parts(weights, tokenizer, template, eos, device, opts)
    }

    /// A generator over weights and a tokenizer already loaded.
    pub fn from_parts(
        weights: LlamaWeights,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        eos: Vec<u32>,
        device: Device,
        mut opts: GeneratorOptions,
    ) -> Result<Generator> {
        let weights = if opts.dequantize { weights.dequantized()? } else { weights };
        let config = weights.config;
        if opts.ctx_size < 2 {
            return Err(ModelError::Input(format!("ctx-size {} is too small (at least 2)", opts.ctx_size)));
        }
        opts.ctx_size = opts.ctx_size.min(config.max_context);
        opts.pipeline = opts.pipeline.max(1);
        opts.batch = opts.batch.clamp(1, 4096);
        let kv_dtype = opts.kv_dtype.unwrap_or_else(|| default_kv_dtype(device));
        if !kv_dtype.is_float() {
            return Err(ModelError::Input(format!("KV cache dtype must be f32, f16 or bf16, found {kv_dtype}")));
        }
        opts.kv_dtype = Some(kv_dtype);
        opts.prefill_buckets.retain(|&b| b > 0);
        opts.prefill_buckets.sort_unstable();
        opts.prefill_buckets.dedup();
        if opts.prefill_buckets.is_empty() {
            opts.prefill_buckets.push(16);
        }
        let mut session = Session::new(device)?;
        let mut po = session.prepare_options().clone();
        po.slots = opts.pipeline;
        po.replay = opts.replay;
        session.set_prepare_options(po);
        for (name, t) in weights.tensors {
            session.set_weight(&name, t)?;
        }
        let opts_batch = opts.batch;
        let mut g = Generator {
            session,
            config,
            kinds: weights.kinds,
            text: PromptEncoder { tokenizer: Arc::new(tokenizer), template: template.map(Arc::new) },
            eos,
            states: StateSet::new(),
            opts,
            prefill: BTreeMap::new(),
            joint_prefill: BTreeMap::new(),
            decode: BTreeMap::new(),
            kv: vec![vec![]; opts_batch],
            slot_pos: vec![0; opts_batch],
            slots: (0..opts_batch).map(|_| None).collect(),
        };
        // Compile the full-width decode step now: load errors show at load
        // time, and it makes the shared states at their full size, which
        // the narrower steps use the first rows of.
        g.decode_exe(opts_batch)?;
        Ok(g)
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.text.tokenizer
    }

    /// The model's tokenizer and chat template, shareable with other
    /// threads (a server tokenizes requests on its handlers' threads).
    pub fn prompt_encoder(&self) -> PromptEncoder {
        self.text.clone()
    }

    pub fn ctx_size(&self) -> usize {
        self.opts.ctx_size
    }

    /// The KV cache's dtype (the option, or the device's default).
    pub fn kv_dtype(&self) -> DType {
        self.opts.kv_dtype.unwrap_or(DType::F32)
    }

    pub fn has_chat_template(&self) -> bool {
        self.text.has_chat_template()
    }

    /// See [`PromptEncoder::encode`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.text.encode(text)
    }

    /// See [`PromptEncoder::render_chat`].
    pub fn render_chat(&self, messages: &[Message]) -> Result<String> {
        self.text.render_chat(messages)
    }

    /// See [`PromptEncoder::encode_chat`].
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.text.encode_chat(messages)
    }

    /// The batch width of a step whose highest slot in use is `top`: the
    /// smallest power of two past it, at most the batch.
    fn width_for(&self, top: usize) -> usize {
        (top + 1).next_power_of_two().min(self.opts.batch)
    }

    /// A step of `batch` rows of `seq` tokens (a decode step, or a prefill
    /// chunk), compiled over the shared states at state block `block`.
    fn compile_step(&self, batch: usize, seq: usize, decode: bool, block: u64) -> Result<CompiledGraph> {
        let shape = StepShape { batch, seq, decode, ctx: self.opts.ctx_size, logits: self.opts.logits, kv_dtype: self.kv_dtype() };
        let graph = build_step_graph(&self.config, &self.kinds, shape)?;
        Ok(self.session.compile_shared_at(&graph, &self.states, block)?)
    }

    fn decode_exe(&mut self, width: usize) -> Result<&mut CompiledGraph> {
        if !self.decode.contains_key(&width) {
            let exe = self.compile_step(width, 1, true, 0)?;
            self.decode.insert(width, exe);
        }
        self.decode.get_mut(&width).ok_or_else(|| ModelError::Input("decode step missing".into()))
    }

    fn prefill_exe(&mut self, slot: usize, bucket: usize) -> Result<&mut CompiledGraph> {
        if !self.prefill.contains_key(&(slot, bucket)) {
            let exe = self.compile_step(1, bucket, false, slot as u64)?;
            self.prefill.insert((slot, bucket), exe);
        }
        self.prefill.get_mut(&(slot, bucket)).ok_or_else(|| ModelError::Input("prefill step missing".into()))
    }

    /// Compiles (and on a GPU records) now every step executable the batch
    /// API would otherwise compile on first use: the decode step of each
    /// width it runs (powers of two up to the batch), for every slot the
    /// prefill chunk of every bucket that fits the context, and the prefill
    /// over several slots at once (`add_sequences`) at each width and chunk
    /// it takes. A server
    /// calls it before taking requests, so the first burst of prompts does
    /// not wait for compiles. Returns how many were compiled; the ones
    /// already there are kept.
    pub fn prepare_steps(&mut self) -> Result<usize> {
        let before = self.decode.len() + self.prefill.len() + self.joint_prefill.len();
        // The step widths: powers of two below the batch, and the batch.
        let batch = self.opts.batch.max(1);
        let widths: Vec<usize> = (0..usize::BITS).map(|e| 1usize << e).take_while(|&w| w < batch).chain([batch]).collect();
        for &w in &widths {
            self.decode_exe(w)?;
        }
        let buckets: Vec<usize> = self.opts.prefill_buckets.iter().copied().filter(|&b| b <= self.opts.ctx_size).collect();
        for slot in 0..batch {
            for &b in &buckets {
                self.prefill_exe(slot, b)?;
            }
        }
        // The joint prefill at each width of two rows and more and every
        // chunk it takes away from the context's end (its last round takes
        // the smallest that holds what is left).
        for &w in widths.iter().filter(|&&w| w >= 2) {
            for &b in buckets.iter().filter(|&&b| w * b <= JOINT_PREFILL_TOKENS) {
                self.joint_prefill_exe(w, b)?;
            }
        }
        Ok(self.decode.len() + self.prefill.len() + self.joint_prefill.len() - before)
    }

    /// Feeds `ids[from..]` (positions `from..`) of the sequence in `slot`
    /// through prefill chunks and returns the first sampled token (and its
    /// logits). Each chunk is a one-row step on the slot's row of the
    /// shared states, so prefilling one sequence costs the same whatever
    /// the other slots hold.
    fn prefill_from(&mut self, slot: usize, ids: &[u32], from: usize, params: &SamplingParams) -> Result<(u32, Option<Vec<f32>>)> {
        let (f, i) = sampling_tensors(&[Some(params)])?;
        let (f, i) = (&f, &i);
        let mut at = from;
        let mut last = None;
        while at < ids.len() {
            let remaining = ids.len() - at;
            let bucket = plan_chunk(&self.opts.prefill_buckets, remaining, self.opts.ctx_size - at);
            let n = remaining.min(bucket);
            let mut chunk: Vec<i32> = ids[at..at + n].iter().map(|&t| t as i32).collect();
            chunk.resize(bucket, chunk.last().copied().unwrap_or(0));
            let pos: Vec<i32> = (0..bucket).map(|j| (at + j) as i32).collect();
            let t = |shape: &[usize], v: &[i32]| Tensor::from_i32(shape.to_vec(), v);
            let (ids_t, pos_t) = (t(&[1, bucket], &chunk)?, t(&[1, bucket], &pos)?);
            let (start, valid, last_row, next_pos, row) = (
                t(&[1], &[at as i32])?,
                t(&[1], &[(at + bucket) as i32])?,
                t(&[1], &[n as i32 - 1])?,
                t(&[1], &[(at + n) as i32])?,
                t(&[1], &[0])?,
            );
            let exe = self.prefill_exe(slot, bucket)?;
            let out = exe.run(&[
                (io::IDS, &ids_t),
                (io::POSITIONS, &pos_t),
                (io::START, &start),
                (io::VALID, &valid),
                (io::LAST_ROW, &last_row),
                (io::NEXT_POS, &next_pos),
                (io::SLOT_ROW, &row),
                (io::FPARAMS, f),
                (io::IPARAMS, i),
            ])?;
            last = Some(out);
            at += n;
        }
        let out = last.ok_or_else(|| ModelError::Input("empty prompt".into()))?;
        let token =
            out.first().and_then(|t| t.to_i32().first().copied()).ok_or_else(|| ModelError::Input("prefill returned no token".into()))?;
        let v = self.config.vocab;
        let logits = out.get(1).map(|l| l.to_f32()[..v].to_vec());
        self.slot_pos[slot] = ids.len();
        Ok((token as u32, logits))
    }

    /// Prefills `prompt` into `slot` after the prefix it shares with the
    /// slot's cached tokens (at least its last token is fed again: its
    /// logits give the first new token) and records the prompt as the
    /// slot's cached tokens, or forgets them on an error. Returns the tokens
    /// reused, the first new token and its logits.
    fn prefill_reusing(&mut self, slot: usize, prompt: &[u32], params: &SamplingParams) -> Result<(usize, u32, Option<Vec<f32>>)> {
        let common = self.kv[slot].iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1);
        let first = self.prefill_from(slot, prompt, common, params);
        self.kv[slot] = if first.is_ok() { prompt.to_vec() } else { vec![] };
        let (token, logits) = first?;
        Ok((common, token, logits))
    }

    fn check_prompt(&self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        params.check()?;
        if prompt.is_empty() {
            return Err(ModelError::Input("the prompt is empty (no tokens)".into()));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(ModelError::Input(format!("token id {bad} is outside the vocabulary of {}", self.config.vocab)));
        }
        if prompt.len() >= self.opts.ctx_size {
            return Err(ModelError::Input(format!(
                "the prompt has {} tokens; the context holds {} (raise --ctx-size, up to the model's {})",
                prompt.len(),
                self.opts.ctx_size,
                self.config.max_context
            )));
        }
        Ok(())
    }

    /// Prefills `prompt` into a free slot with its own sampling settings;
    /// returns the slot and the first new token. Later tokens come from
    /// [`step_batch`](Self::step_batch), which advances every sequence at
    /// once; a sequence leaves when it ends or on
    /// [`remove_sequence`](Self::remove_sequence), and its slot takes the
    /// next one. A sequence takes the lowest free slot. Its prompt is
    /// prefilled by one-row steps on its slot's row of the shared states;
    /// decode steps run the rows of the lowest slots up to the highest one
    /// in use, rounded up to a power of two (the others write where it is
    /// harmless), so a lone sequence costs one row.
    pub fn add_sequence(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<BatchEvent> {
        self.check_prompt(prompt, params)?;
        let slot = self.slots.iter().position(Option::is_none).ok_or_else(|| {
            ModelError::Input(format!("all {} slots hold a sequence; remove one or wait for one to finish", self.opts.batch))
        })?;
        let (cached_tokens, token, logits) = self.prefill_reusing(slot, prompt, params)?;
        self.start_sequence(slot, params, cached_tokens, (token, logits))
    }

    /// Puts a prefilled sequence in `slot` and records its first token.
    fn start_sequence(&mut self, slot: usize, params: &SamplingParams, cached_tokens: usize, first: FirstToken) -> Result<BatchEvent> {
        let (token, logits) = first;
        let stream = TextStream::new(self.text.tokenizer.clone(), true).with_stop_strings(params.stop.clone());
        self.slots[slot] = Some(BatchSequence { params: params.clone(), stream, ids: vec![] });
        let (text, finished) = self.accept(slot, token)?;
        Ok(BatchEvent { slot, piece: Piece { text, token, logits }, finished, cached_tokens })
    }

    /// Records a slot's new token; ends the sequence when it should stop.
    fn accept(&mut self, slot: usize, token: u32) -> Result<(String, Option<StopReason>)> {
        let (ctx, eos) = (self.opts.ctx_size, self.eos.contains(&token));
        let pos = self.slot_pos[slot];
        let seq = self.slots[slot].as_mut().ok_or_else(|| ModelError::Input(format!("slot {slot} holds no sequence")))?;
        seq.ids.push(token);
        let err = |e: crate::text_stream::TextStreamError| ModelError::Input(e.to_string());
        let (mut text, mut reason) = (String::new(), None);
        if eos && !seq.params.ignore_eos {
            reason = Some(StopReason::Eos);
        } else {
            match seq.stream.push(token).map_err(err)? {
                StreamStep::Stopped { text: t, stop } => {
                    text = t;
                    reason = Some(StopReason::StopString(stop));
                }
                StreamStep::Text(t) => text = t,
            }
            if reason.is_none() && seq.ids.len() >= seq.params.max_tokens {
                reason = Some(StopReason::MaxTokens);
            } else if reason.is_none() && pos + 1 >= ctx {
                reason = Some(StopReason::ContextFull);
            }
        }
        if reason.is_some() {
            if !matches!(reason, Some(StopReason::StopString(_))) {
                text.push_str(seq.stream.finish().map_err(err)?.text());
            }
            self.slots[slot] = None;
        }
        Ok((text, reason))
    }

    /// One decode step for every sequence of the batch API; returns each
    /// one's new token. Free slots below the highest one in use ride along
    /// masked.
    pub fn step_batch(&mut self) -> Result<Vec<BatchEvent>> {
        let active: Vec<usize> = (0..self.opts.batch).filter(|&r| self.slots[r].is_some()).collect();
        let Some(&top) = active.last() else {
            return Ok(vec![]);
        };
        let w = self.width_for(top);
        let rows: Vec<Option<&SamplingParams>> = self.slots[..w].iter().map(|s| s.as_ref().map(|x| &x.params)).collect();
        let (f, i) = sampling_tensors(&rows)?;
        let mask: Vec<i32> = self.slots[..w].iter().map(|s| s.is_some() as i32).collect();
        let step = Tensor::from_i32([w], &mask)?;
        let v = self.config.vocab;
        // The token each sequence feeds this step: its last one.
        let fed: Vec<Option<u32>> = active.iter().map(|&r| self.slots[r].as_ref().and_then(|x| x.ids.last().copied())).collect();
        let out = match self.decode_exe(w)?.run(&[(io::FPARAMS, &f), (io::IPARAMS, &i), (io::STEP, &step)]) {
            Ok(out) => out,
            Err(e) => {
                // What the running slots' caches hold is unknown now.
                active.iter().for_each(|&r| self.kv[r].clear());
                return Err(e.into());
            }
        };
        for (&r, t) in active.iter().zip(fed) {
            match t {
                Some(t) => self.kv[r].push(t),
                None => self.kv[r].clear(),
            }
        }
        let tokens = out.first().map(|t| t.to_i32()).ok_or_else(|| ModelError::Input("decode returned no token".into()))?;
        let logits = out.get(1).map(|l| l.to_f32());
        let mut events = Vec::with_capacity(active.len());
        for slot in active {
            self.slot_pos[slot] += 1;
            let token =
                *tokens.get(slot).ok_or_else(|| ModelError::Input(format!("the decode step returned no token for slot {slot}")))? as u32;
            let (text, finished) = self.accept(slot, token)?;
            let logits = logits.as_ref().map(|l| l[slot * v..(slot + 1) * v].to_vec());
            events.push(BatchEvent { slot, piece: Piece { text, token, logits }, finished, cached_tokens: 0 });
        }
        Ok(events)
    }

    /// Generates a continuation of every prompt (token ids), with the
    /// settings of the same index, `batch` sequences at a time: when one
    /// ends, its slot takes the next prompt, so the batch stays full while
    /// prompts remain. Returns each prompt's new tokens, text and stop
    /// reason, in the prompts' order. Every prompt is checked before any
    /// runs; on an error the sequences this call started are removed.
    /// Needs the batch API's slots free.
    pub fn generate_many(&mut self, prompts: &[Vec<u32>], params: &[SamplingParams]) -> Result<Vec<BatchOutput>> {
        if prompts.len() != params.len() {
            return Err(ModelError::Input(format!("{} prompts but {} sampling settings", prompts.len(), params.len())));
        }
        if self.active_sequences() > 0 {
            return Err(ModelError::Input(format!("{} sequences of the batch API are still running", self.active_sequences())));
        }
        for (i, (p, s)) in prompts.iter().zip(params).enumerate() {
            self.check_prompt(p, s).map_err(|e| ModelError::Input(format!("prompt {i}: {e}")))?;
        }
        let mut out: Vec<BatchOutput> = prompts.iter().map(|_| BatchOutput::default()).collect();
        let mut owner: Vec<Option<usize>> = vec![None; self.opts.batch];
        let mut next = 0;
        let run = (|| -> Result<()> {
            loop {
                while next < prompts.len() && self.active_sequences() < self.opts.batch {
                    let ev = self.add_sequence(&prompts[next], &params[next])?;
                    owner[ev.slot] = Some(next);
                    next += 1;
                    record(&mut out, &mut owner, ev);
                }
                if self.active_sequences() == 0 {
                    return Ok(());
                }
                for ev in self.step_batch()? {
                    record(&mut out, &mut owner, ev);
                }
            }
        })();
        if let Err(e) = run {
            for slot in 0..self.opts.batch {
                self.remove_sequence(slot);
            }
            return Err(e);
        }
        Ok(out)
    }

    /// Ends the sequence in `slot` (e.g. its client went away).
    pub fn remove_sequence(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    /// Sequences of the batch API now running.
    pub fn active_sequences(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Starts generating after raw text `prompt` (no chat template).
    pub fn generate(&mut self, prompt: &str, params: &SamplingParams) -> Result<Generation<'_>> {
        let ids = self.encode(prompt)?;
        self.generate_ids(&ids, params)
    }

    /// Starts generating a reply to `messages` with the model's chat
    /// template. When the conversation and `max_tokens` do not fit the
    /// context, the oldest turns after the system message are dropped until
    /// they do (an error when even the last message alone does not fit).
    pub fn chat(&mut self, messages: &[Message], params: &SamplingParams) -> Result<Generation<'_>> {
        let (first, rest) = match messages.split_first() {
            Some((m, rest)) if m.role == "system" => (Some(m.clone()), rest),
            _ => (None, messages),
        };
        let budget = self.opts.ctx_size.saturating_sub(params.max_tokens.min(self.opts.ctx_size / 2));
        let mut skip = 0;
        let ids = loop {
            let kept: Vec<Message> = first.iter().cloned().chain(rest[skip..].iter().cloned()).collect();
            let ids = self.encode_chat(&kept)?;
            if ids.len() <= budget || skip + 1 >= rest.len() {
                break ids;
            }
            skip += 1;
        };
        self.generate_ids(&ids, params)
    }

    /// Starts generating after the given prompt token ids.
    /// Runs in slot 0; the batch API must hold no sequences meanwhile.
    pub fn generate_ids(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<Generation<'_>> {
        self.check_prompt(prompt, params)?;
        if self.active_sequences() > 0 {
            return Err(ModelError::Input(format!("{} batch sequences are running; finish or remove them first", self.active_sequences())));
        }
        let (f, i) = sampling_tensors(&[Some(params)])?;
        let t0 = Instant::now();
        let (common, first, logits) = self.prefill_reusing(0, prompt, params)?;
        let prefill_time = t0.elapsed();
        let stream = TextStream::new(self.text.tokenizer.clone(), true).with_stop_strings(params.stop.clone());
        // Slot 0 alone: the width-1 steps.
        let step = Tensor::from_i32([1], &[1])?;
        Ok(Generation {
            stats: GenerationStats { prompt_tokens: prompt.len(), cached_tokens: common, prefill_time, ..Default::default() },
            gen: self,
            params: params.clone(),
            stream,
            f,
            i,
            step,
            pending: VecDeque::new(),
            next: Some((first, logits)),
            submitted: 0,
            waited: Duration::ZERO,
            done: None,
            ids: vec![],
            decode_start: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Follows `plan_chunk` to the end: (tokens processed with padding, steps).
    fn follow(buckets: &[usize], mut remaining: usize, room: usize) -> (usize, usize) {
        let (mut done, mut steps) = (0, 0);
        while remaining > 0 {
            let b = plan_chunk(buckets, remaining, room);
            done += b;
            steps += 1;
            remaining = remaining.saturating_sub(b);
        }
        (done, steps)
    }

    #[test]
    fn prefill_chunks_pad_the_least() {
        let b = [16, 32, 64, 128, 256];
        assert_eq!(plan_chunk(&b, 45, 4096), 32, "45 = 32 + 16 pads 3, not 19");
        assert_eq!(plan_chunk(&b, 20, 4096), 32, "one 32 beats two 16s with the step overhead");
        assert_eq!(plan_chunk(&b, 1000, 4096), 256);
        assert_eq!(plan_chunk(&b, 300, 100), 64, "only buckets that fit the room");
        assert_eq!(plan_chunk(&b, 5, 10), 1, "no bucket fits");
        // Against every plan (brute force over first choices), for every
        // prompt length up to the largest bucket.
        fn best(b: &[usize], r: usize) -> usize {
            b.iter().map(|&x| x + CHUNK_OVERHEAD + if x >= r { 0 } else { best(b, r - x) }).min().unwrap_or(0)
        }
        let small = [16, 32, 64];
        for r in 1..=64 {
            let (done, steps) = follow(&small, r, 4096);
            assert!(done >= r);
            assert_eq!(done + CHUNK_OVERHEAD * steps, best(&small, r), "{r} tokens");
        }
    }
}
