//! A decoder's text side: its tokenizer, chat template and end-of-sequence
//! tokens from a GGUF file or a Hugging Face folder, and [`PromptEncoder`].

use super::*;

/// A decoder's tokenizer and chat template: prompts to token ids. Cheap to
/// clone and usable from any thread, so prompts can be tokenized where
/// they arrive rather than on the thread that owns the [`Generator`].
#[derive(Clone)]
pub struct PromptEncoder {
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) template: Option<Arc<ChatTemplate>>,
}

impl std::fmt::Debug for PromptEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptEncoder").field("chat_template", &self.template.is_some()).finish_non_exhaustive()
    }
}

impl PromptEncoder {
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Token ids of raw text (no template; special tokens in the text are
    /// matched, BOS added where the model asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, true).map_err(|e| ModelError::Input(format!("tokenizing the prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The chat template applied to `messages` with the generation prompt.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String> {
        let t = self.template.as_ref().ok_or_else(|| ModelError::Input("this model has no chat template; use a raw prompt".into()))?;
        t.render(messages, true).map_err(|e| ModelError::Input(format!("chat template: {e}")))
    }

    /// Token ids of a chat prompt (template applied; no BOS added beyond
    /// what the template writes).
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        let text = self.render_chat(messages)?;
        let enc = self.tokenizer.encode(text.as_str(), false).map_err(|e| ModelError::Input(format!("tokenizing the chat prompt: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }
}

fn tok_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer { path: path.to_path_buf(), detail: e.to_string() }
}

/// The tokenizer, chat template and end-of-sequence ids of a GGUF file.
pub fn gguf_text(path: &Path) -> Result<(Tokenizer, Option<ChatTemplate>, Vec<u32>)> {
    let f = GgufFile::open(path).map_err(|e| ModelError::format(path, e.to_string()))?;
    let g = |e: crate::gguf::GgufError| tok_err(path, e);
    let opt_u32 = |k: &str| f.get_opt_u32(k).map_err(g);
    let vocab = GgufVocab {
        model: f.get_str("tokenizer.ggml.model").map_err(g)?.to_string(),
        pre: f.get_opt_str("tokenizer.ggml.pre").map_err(g)?.map(str::to_string),
        tokens: f.get_str_array("tokenizer.ggml.tokens").map_err(g)?.to_vec(),
        merges: if f.contains_key("tokenizer.ggml.merges") {
            f.get_str_array("tokenizer.ggml.merges").map_err(g)?.to_vec()
        } else {
            vec![]
        },
        token_types: if f.contains_key("tokenizer.ggml.token_type") {
            Some(f.get_i32_array("tokenizer.ggml.token_type").map_err(g)?.into_owned())
        } else {
            None
        },
        bos: opt_u32("tokenizer.ggml.bos_token_id")?,
        eos: opt_u32("tokenizer.ggml.eos_token_id")?,
        pad: opt_u32("tokenizer.ggml.padding_token_id")?,
        unk: opt_u32("tokenizer.ggml.unknown_token_id")?,
        add_bos: f
            .get_opt_bool("tokenizer.ggml.add_bos_token")
            .map_err(g)?
            .unwrap_or_else(|| crate::bpe_vocab::default_add_bos(f.get_opt_str("tokenizer.ggml.pre").ok().flatten())),
        add_eos: f.get_opt_bool("tokenizer.ggml.add_eos_token").map_err(g)?.unwrap_or(false),
    };
    let tokenizer = build_tokenizer(&vocab).map_err(|e| tok_err(path, e))?;
    let name = |id: Option<u32>| id.and_then(|i| vocab.tokens.get(i as usize)).cloned().unwrap_or_default();
    let template = match f.get_opt_str("tokenizer.chat_template").map_err(g)? {
        Some(src) => Some(ChatTemplate::new(src, &name(vocab.bos), &name(vocab.eos)).map_err(|e| tok_err(path, e))?),
        None => None,
    };
    let mut eos: Vec<u32> = vocab.eos.into_iter().collect();
    // Chat models end a turn with their end-of-turn token even where the
    // file's eos is another one.
    for t in ["<|im_end|>", "<|eot_id|>", "<|end|>"] {
        if let Some(id) = vocab.tokens.iter().position(|x| x == t) {
            if !eos.contains(&(id as u32)) {
                eos.push(id as u32);
            }
        }
    }
    Ok((tokenizer, template, eos))
}

pub(super) fn hf_text(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>, Vec<u32>)> {
    let tp = dir.join("tokenizer.json");
    // The checked parser: the tokenizers crate panics on some malformed files.
    let text = std::fs::read_to_string(&tp).map_err(|e| tok_err(&tp, e))?;
    let tokenizer = crate::tokenizer::parse_tokenizer_json(&text).map_err(|e| tok_err(&tp, e))?;
    let cp = dir.join("tokenizer_config.json");
    let cfg: serde_json::Value = match std::fs::read_to_string(&cp) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| ModelError::format(&cp, format!("not valid JSON: {e}")))?,
        Err(_) => serde_json::Value::Null,
    };
    let tok_str = |v: &serde_json::Value| v.as_str().map(str::to_string).or_else(|| v["content"].as_str().map(str::to_string));
    let (bos, eos_s) = (tok_str(&cfg["bos_token"]).unwrap_or_default(), tok_str(&cfg["eos_token"]).unwrap_or_default());
    let template = match cfg["chat_template"].as_str() {
        Some(src) => Some(ChatTemplate::new(src, &bos, &eos_s).map_err(|e| tok_err(&cp, e))?),
        None => None,
    };
    let eos = [eos_s.as_str(), "<|im_end|>", "<|eot_id|>"].iter().filter_map(|t| tokenizer.token_to_id(t)).collect();
    Ok((tokenizer, template, eos))
}
