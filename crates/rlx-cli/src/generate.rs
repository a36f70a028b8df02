//! `rlx generate` and `rlx chat`: text generation with a LLaMA-family
//! decoder (a GGUF file or a Hugging Face directory).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use clap::Args;
use rlx::{DType, Device};
use rlx_models::{Generator, GeneratorOptions, Message, SamplingParams, StopReason};

use crate::model_dir::{default_generation_model, Env};

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face directory (config.json, model.safetensors,
    /// tokenizer.json). Default: models/SmolLM2-135M-Instruct.Q4_1.gguf in the
    /// repository or the per-user data directory (see `rlx fetch`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Cache size in tokens (prompt and reply together), at most the model's context.
    #[arg(long, default_value_t = 4096)]
    pub ctx_size: usize,
    /// KV cache dtype: auto (f16 on a GPU, f32 on the CPU), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub kv_dtype: String,
}

/// `--kv-dtype`: `auto` (None: the device's default) or a float dtype.
pub fn parse_kv_dtype(s: &str) -> Result<Option<DType>, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    match DType::parse(s) {
        Some(d) if d.is_float() => Ok(Some(d)),
        _ => Err(format!("--kv-dtype '{s}': expected auto, f32, f16 or bf16")),
    }
}

#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// New tokens at most.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 40)]
    pub top_k: i32,
    /// 1 = off.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// 1 = off; applies to the last 64 tokens.
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Same seed, same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep going past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: 64,
            seed: self.seed,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
        }
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Raw text to continue (no chat template).
    #[arg(long, conflicts_with = "chat")]
    pub prompt: Option<String>,
    /// A user message, formatted with the model's chat template.
    #[arg(long)]
    pub chat: Option<String>,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// text: stream the reply; json: one object with ids, text and speeds.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// System message for the whole conversation.
    #[arg(long)]
    pub system: Option<String>,
}

/// The default GGUF: the repository's models/ (here or above the current
/// directory or the executable), then the per-user data directory.
pub(crate) fn default_model() -> Result<PathBuf, String> {
    default_generation_model(&Env::process())
}

fn load(m: &ModelArgs) -> Result<Generator, String> {
    let path = match &m.model {
        Some(p) => p.clone(),
        None => default_model()?,
    };
    if !path.exists() {
        return Err(format!("{}: no such file or directory", path.display()));
    }
    let device: Device = m.device.parse().map_err(|e: rlx::Error| e.to_string())?;
    let opts = GeneratorOptions { ctx_size: m.ctx_size, kv_dtype: parse_kv_dtype(&m.kv_dtype)?, ..Default::default() };
    Generator::load_with(&path, device, opts).map_err(|e| e.to_string())
}

fn describe(r: Option<&StopReason>) -> &'static str {
    match r {
        Some(StopReason::Eos) => "end of sequence",
        Some(StopReason::StopString(_)) => "stop string",
        Some(StopReason::MaxTokens) | None => "max tokens",
        Some(StopReason::ContextFull) => "context full",
    }
}

fn out_err(e: std::io::Error) -> String {
    format!("stdout: {e}")
}

/// Writes and flushes `text`; `Ok(false)` when the reader has gone away
/// (`rlx generate … | head`), which ends the generation quietly.
fn emit(out: &mut impl Write, text: &str) -> Result<bool, String> {
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(out_err(e)),
    }
}

pub fn run_generate(a: GenerateArgs) -> Result<(), String> {
    let mut g = load(&a.model)?;
    let params = a.sampling.params();
    let prompt_ids = match (&a.prompt, &a.chat) {
        (Some(p), None) => g.encode(p),
        (None, Some(c)) => {
            let mut msgs = vec![];
            if let Some(s) = &a.system {
                msgs.push(Message::new("system", s.as_str()));
            }
            msgs.push(Message::new("user", c.as_str()));
            g.encode_chat(&msgs)
        }
        _ => return Err("give --prompt TEXT (raw) or --chat TEXT (with the chat template)".into()),
    }
    .map_err(|e| e.to_string())?;
    let json = a.format == "json";
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut text = String::new();
    let mut gen = g.generate_ids(&prompt_ids, &params).map_err(|e| e.to_string())?;
    let mut reader_gone = false;
    for piece in gen.by_ref() {
        let p = piece.map_err(|e| e.to_string())?;
        if json {
            text.push_str(&p.text);
        } else if !emit(&mut out, &p.text)? {
            reader_gone = true;
            break;
        }
    }
    let (ids, stats, reason) = (gen.ids().to_vec(), gen.stats().clone(), describe(gen.stop_reason()));
    drop(gen);
    if reader_gone {
        eprintln!("[stopped after {} new tokens: stdout was closed]", ids.len());
        return Ok(());
    }
    if json {
        let obj = serde_json::json!({
            "prompt_ids": prompt_ids,
            "ids": ids,
            "text": text,
            "prefill_tok_s": stats.prefill_tok_s(),
            "decode_tok_s": stats.decode_tok_s(),
        });
        emit(&mut out, &format!("{obj}\n"))?;
    } else if !reader_gone {
        emit(&mut out, "\n")?;
    }
    eprintln!(
        "[{} prompt tokens, prefill {:.1} tok/s; {} new tokens, decode {:.1} tok/s; stopped: {reason}]",
        stats.prompt_tokens,
        stats.prefill_tok_s(),
        stats.generated,
        stats.decode_tok_s()
    );
    Ok(())
}

/// An interactive conversation on stdin/stdout. The KV cache is kept between
/// turns, so each turn only prefills its new tokens; when the conversation
/// outgrows the context, its oldest turns are dropped (the system message is
/// kept). Commands: /reset starts over, /exit (or end of input) quits.
pub fn run_chat(a: ChatArgs) -> Result<(), String> {
    let mut g = load(&a.model)?;
    if !g.has_chat_template() {
        return Err("this model has no chat template (tokenizer.chat_template); use `rlx generate --prompt`".into());
    }
    let params = a.sampling.params();
    let mut messages: Vec<Message> = a.system.iter().map(|s| Message::new("system", s.as_str())).collect();
    let start = messages.clone();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin());
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        let line = line.trim_end();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = start.clone();
                eprintln!("[conversation cleared]");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new("user", line));
        let mut reply = String::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let mut gen = g.chat(&messages, &params).map_err(|e| e.to_string())?;
        for piece in gen.by_ref() {
            let p = piece.map_err(|e| e.to_string())?;
            reply.push_str(&p.text);
            if !emit(&mut out, &p.text)? {
                return Ok(());
            }
        }
        let s = gen.stats().clone();
        drop(gen);
        if !emit(&mut out, "\n")? {
            return Ok(());
        }
        eprintln!(
            "[{} prompt tokens ({} from the cache), {:.1} tok/s prefill; {} new, {:.1} tok/s decode]",
            s.prompt_tokens,
            s.cached_tokens,
            s.prefill_tok_s(),
            s.generated,
            s.decode_tok_s()
        );
        messages.push(Message::new("assistant", reply));
    }
    Ok(())
}
