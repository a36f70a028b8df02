//! Renders a model's chat template (`tokenizer.chat_template`, Jinja) into a
//! prompt, the way Hugging Face's `apply_chat_template` does: blocks trimmed
//! (`trim_blocks`, `lstrip_blocks`), `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token` and `raise_exception` available, Python string and
//! dict methods (`.strip()`, `.startswith()`, `.items()`, ...) working, and a
//! `tojson` filter that writes what Python's `json.dumps` writes.
//!
//! Templates come from model files, which are untrusted: every render runs
//! with an instruction budget (fuel), a nesting limit and a cap on the output
//! size, and templates cannot include or import other templates. Failures are
//! [`ChatTemplateError`]s, never hangs.
//!
//! A template can build values nested as deeply as its fuel allows (about one
//! level per instruction, e.g. `[[[...x...]]]` in a loop), and minijinja
//! recurses when it prints, compares or drops them. So each render runs on its
//! own thread whose stack is sized from the fuel (see
//! [`ChatTemplateLimits::stack_bytes`]); the stack is reserved address space,
//! of which only what a render touches is backed by memory.
//!
//! Known gap: the budgets bound instructions and output, not the size of
//! intermediate strings, so a template that keeps doubling a string it never
//! prints can still allocate a lot (minijinja caps `'x' * n` at 100 MB, but not
//! `~` concatenation).

use std::io;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// Resource limits for one render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatTemplateLimits {
    /// Largest template source accepted, in bytes.
    pub max_source_bytes: usize,
    /// Instructions one render may execute. Real templates spend tens to a
    /// couple of hundred per message. The render thread's stack grows with
    /// it (see [`stack_bytes`](Self::stack_bytes)).
    pub fuel: u64,
    /// minijinja's nesting counter limit (loops and ifs count 1, macro calls
    /// more); minijinja caps it at 500 in any case.
    pub recursion_limit: usize,
    /// Largest rendered prompt, in bytes.
    pub max_output_bytes: usize,
}

impl Default for ChatTemplateLimits {
    /// Real chat templates are a few KB; the fuel covers well over a
    /// thousand messages while a runaway template fails within a fraction of
    /// a second.
    fn default() -> Self {
        Self { max_source_bytes: 1 << 20, fuel: 300_000, recursion_limit: 100, max_output_bytes: 16 << 20 }
    }
}

/// Stack one level of value nesting can take while minijinja prints or
/// compares it: measured at about 400 bytes with minijinja optimised and
/// 1.8 KB unoptimised, rounded up.
const STACK_PER_FUEL: u64 = if cfg!(debug_assertions) { 2048 } else { 512 };

impl ChatTemplateLimits {
    /// The render thread's stack: enough for values nested as deeply as the
    /// fuel can make them, plus room for the engine itself.
    pub fn stack_bytes(&self) -> usize {
        let bytes = self.fuel.saturating_mul(STACK_PER_FUEL).saturating_add(4 << 20);
        usize::try_from(bytes).unwrap_or(usize::MAX)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template is {len} bytes; the limit is {limit}")]
    SourceTooLarge { len: usize, limit: usize },
    #[error("chat template does not parse: {0}")]
    Syntax(String),
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    #[error("chat template ran out of fuel (more than {fuel} instructions)")]
    OutOfFuel { fuel: u64 },
    #[error("chat template output exceeds {limit} bytes")]
    OutputTooLarge { limit: usize },
    #[error("rendering the chat template failed: {0}")]
    Render(String),
    #[error("could not start the chat template thread ({stack_bytes} bytes of stack): {message}")]
    Thread { stack_bytes: usize, message: String },
}

/// The payload of `raise_exception(msg)`, carried as the error's source so
/// that it can be told apart from engine errors.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

const TEMPLATE_NAME: &str = "chat_template";

/// Deepest value `tojson` serialises; a template can build arbitrarily deep
/// lists, and the serialiser recurses.
const MAX_JSON_DEPTH: usize = 128;

/// A compiled chat template with the special-token strings it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    limits: ChatTemplateLimits,
}

#[derive(Serialize)]
struct RenderContext<'a> {
    messages: &'a [Message],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

impl ChatTemplate {
    /// Compiles `source` with [`ChatTemplateLimits::default`].
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, ChatTemplateError> {
        Self::with_limits(source, bos, eos, ChatTemplateLimits::default())
    }

    pub fn with_limits(source: &str, bos: &str, eos: &str, limits: ChatTemplateLimits) -> Result<Self, ChatTemplateError> {
        if source.len() > limits.max_source_bytes {
            return Err(ChatTemplateError::SourceTooLarge { len: source.len(), limit: limits.max_source_bytes });
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(limits.fuel));
        env.set_recursion_limit(limits.recursion_limit);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(|e| ChatTemplateError::Syntax(describe(&e)))?;
        Ok(Self { env, bos: bos.to_string(), eos: eos.to_string(), limits })
    }

    pub fn limits(&self) -> ChatTemplateLimits {
        self.limits
    }

    /// Renders the conversation; with `add_generation_prompt` the template
    /// appends the header of the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, ChatTemplateError> {
        let stack_bytes = self.limits.stack_bytes();
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(stack_bytes)
                .spawn_scoped(scope, || self.render_here(messages, add_generation_prompt))
                .map_err(|e| ChatTemplateError::Thread { stack_bytes, message: e.to_string() })?;
            worker.join().unwrap_or_else(|_| Err(ChatTemplateError::Render("the template engine panicked".into())))
        })
    }

    /// Renders on the calling thread; every value the template made is
    /// dropped before this returns.
    fn render_here(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, ChatTemplateError> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| ChatTemplateError::Render(describe(&e)))?;
        let ctx = RenderContext { messages, add_generation_prompt, bos_token: &self.bos, eos_token: &self.eos };
        let mut out = CappedWriter { buf: Vec::new(), limit: self.limits.max_output_bytes, exceeded: false };
        let result = template.render_captured_to(ctx, &mut out).map(drop);
        if out.exceeded {
            return Err(ChatTemplateError::OutputTooLarge { limit: self.limits.max_output_bytes });
        }
        if let Err(e) = result {
            return Err(self.classify(&e));
        }
        String::from_utf8(out.buf).map_err(|e| ChatTemplateError::Render(e.to_string()))
    }

    fn classify(&self, e: &Error) -> ChatTemplateError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
        while let Some(s) = source {
            if let Some(raised) = s.downcast_ref::<Raised>() {
                return ChatTemplateError::Raised(raised.0.clone());
            }
            source = s.source();
        }
        match e.kind() {
            ErrorKind::OutOfFuel => ChatTemplateError::OutOfFuel { fuel: self.limits.fuel },
            _ => ChatTemplateError::Render(describe(e)),
        }
    }
}

/// minijinja's message, which names the template line.
fn describe(e: &Error) -> String {
    e.to_string()
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, "raise_exception was called").with_source(Raised(message)))
}

/// Collects the output and refuses to grow past `limit`.
struct CappedWriter {
    buf: Vec<u8>,
    limit: usize,
    exceeded: bool,
}

impl io::Write for CappedWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len().saturating_add(data.len()) > self.limit {
            self.exceeded = true;
            return Err(io::Error::other("chat template output limit reached"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `tojson` as templates written for Python expect it: `json.dumps(value,
/// ensure_ascii=False, indent=indent)`, i.e. `", "`/`": "` separators without
/// indent, `","`/`": "` with it, keys in insertion order, non-ASCII kept.
/// (minijinja's own `tojson` escapes HTML characters and uses compact
/// separators, which would change prompts.)
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from(out))
}

fn write_json(out: &mut String, value: &Value, indent: Option<usize>, depth: usize) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(ErrorKind::InvalidOperation, "tojson: value nested too deeply"));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&format!("{f:?}"));
                }
            }
        }
        ValueKind::String => push_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(s) => push_json_string(out, s),
                    None => push_json_string(out, &key.to_string()),
                }
                out.push_str(": ");
                write_json(out, &value.get_item(key)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialise a value of kind {}", value.kind()))),
    }
    Ok(())
}

fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}
