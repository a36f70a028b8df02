//! A byte-level BPE [`tokenizers::Tokenizer`] built from the tokenizer
//! metadata of a GGUF file (`tokenizer.ggml.*`), so that text is split the way
//! llama.cpp splits it for the same file.
//!
//! The metadata arrives as plain data ([`GgufVocab`]); reading the GGUF
//! container is somebody else's job. Everything here validates its input and
//! returns [`BpeVocabError`] rather than panicking, because GGUF files come
//! from untrusted downloads.
//!
//! What the built tokenizer does:
//! - no normalizer; text is first split on added tokens (control, unknown and
//!   user-defined entries of `tokenizer.ggml.token_type`), so `<|im_start|>`
//!   inside text becomes one id (as llama.cpp does with `parse_special`);
//! - the rest is split by the regular expressions llama.cpp uses for the
//!   file's `tokenizer.ggml.pre`, applied one after the other, each one
//!   keeping both its matches and the text between them as pieces;
//! - each piece is mapped to GPT-2's byte alphabet and merged with the ranked
//!   merges (for the Llama 3 family a piece that is already a token is taken
//!   whole, as llama.cpp does);
//! - BOS/EOS are added by a post-processor only when `add_bos`/`add_eos`;
//! - decoding maps the byte alphabet back to bytes.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::{SpecialToken, TemplateProcessing};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// The values of `tokenizer.ggml.token_type`.
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Tokenizer metadata of a GGUF file, as plain data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`; only `"gpt2"` (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`; `None` means llama.cpp's `"default"`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`; the index is the token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.merges`, each `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.token_type`, one per token (see [`token_type`]).
    pub token_types: Option<Vec<i32>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`. When the key is absent, llama.cpp's
    /// default depends on `pre`: see [`default_add_bos`].
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token` (absent means false).
    pub add_eos: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BpeVocabError {
    #[error("unsupported tokenizer.ggml.model '{0}' (supported: gpt2)")]
    UnsupportedModel(String),
    #[error("unsupported tokenizer.ggml.pre '{pre}' (supported: {supported})")]
    UnsupportedPre { pre: String, supported: String },
    #[error("tokenizer.ggml.tokens is empty")]
    EmptyVocab,
    #[error("tokenizer.ggml.tokens has {0} entries; token ids must fit in u32")]
    TooManyTokens(usize),
    #[error("tokenizer.ggml.tokens: token {id} is empty")]
    EmptyToken { id: u32 },
    #[error("tokenizer.ggml.tokens: '{token}' appears twice, as ids {first} and {second}")]
    DuplicateToken { token: String, first: u32, second: u32 },
    #[error("tokenizer.ggml.token_type has {types} entries for {tokens} tokens")]
    TokenTypeCount { types: usize, tokens: usize },
    #[error("tokenizer.ggml.token_type: token {id} has unknown type {ty}")]
    UnknownTokenType { id: u32, ty: i32 },
    #[error("tokenizer.ggml.merges[{index}] '{merge}' is not two tokens separated by a space")]
    MalformedMerge { index: usize, merge: String },
    #[error("tokenizer.ggml.merges[{index}] '{merge}': '{token}' is not in the vocabulary")]
    MergeUnknownToken { index: usize, merge: String, token: String },
    #[error("{which} token id {id} is out of range (the vocabulary has {n_tokens} tokens)")]
    IdOutOfRange { which: &'static str, id: u32, n_tokens: usize },
    #[error("tokenizer.ggml.add_{which}_token is true but no {which} token id is set")]
    MissingSpecialId { which: &'static str },
    #[error("building the tokenizer failed: {0}")]
    Tokenizers(String),
}

/// llama.cpp's GPT-2 split expression.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// llama.cpp's Llama 3 split expression: the tokenizer.json expression with the
/// case-insensitive contraction group spelled out with character classes.
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's Qwen2 split expression: like Llama 3 but one digit per piece.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `tokenizer.ggml.pre` value splits text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreKind {
    /// llama.cpp's fallback: punctuation runs, then GPT-2, then digit runs,
    /// then groups of three ASCII digits.
    Default,
    Gpt2,
    /// Every digit on its own, then GPT-2 (SmolLM, StarCoder, ...).
    DigitsThenGpt2,
    /// Llama 3; `ignore_merges` says whether a piece that is already a token
    /// is taken whole.
    Llama3 {
        ignore_merges: bool,
    },
    Qwen2,
}

/// The `tokenizer.ggml.pre` values this module understands, with the split
/// they select. Names are llama.cpp's; `"gpt2"` is accepted as well as
/// llama.cpp's `"gpt-2"`.
const PRE_TABLE: &[(&str, PreKind)] = &[
    ("default", PreKind::Default),
    ("gpt-2", PreKind::Gpt2),
    ("gpt2", PreKind::Gpt2),
    ("phi-2", PreKind::Gpt2),
    ("mpt", PreKind::Gpt2),
    ("olmo", PreKind::Gpt2),
    ("smollm", PreKind::DigitsThenGpt2),
    ("starcoder", PreKind::DigitsThenGpt2),
    ("refact", PreKind::DigitsThenGpt2),
    ("codeshell", PreKind::DigitsThenGpt2),
    ("llama3", PreKind::Llama3 { ignore_merges: true }),
    ("llama-v3", PreKind::Llama3 { ignore_merges: true }),
    ("llama-bpe", PreKind::Llama3 { ignore_merges: true }),
    ("falcon3", PreKind::Llama3 { ignore_merges: true }),
    ("dbrx", PreKind::Llama3 { ignore_merges: false }),
    ("smaug-bpe", PreKind::Llama3 { ignore_merges: false }),
    ("qwen2", PreKind::Qwen2),
    ("deepseek-r1-qwen", PreKind::Qwen2),
    ("stablelm2", PreKind::Qwen2),
];

/// The `tokenizer.ggml.pre` values [`build_tokenizer`] accepts.
pub fn supported_pre() -> Vec<&'static str> {
    PRE_TABLE.iter().map(|(name, _)| *name).collect()
}

/// Whether llama.cpp adds BOS for this `pre` when the GGUF has no
/// `tokenizer.ggml.add_bos_token` key (it does for the Llama 3 family).
pub fn default_add_bos(pre: Option<&str>) -> bool {
    matches!(pre, Some("llama3" | "llama-v3" | "llama-bpe" | "falcon3"))
}

fn pre_kind(pre: Option<&str>) -> Result<PreKind, BpeVocabError> {
    let name = pre.unwrap_or("default");
    PRE_TABLE
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, kind)| *kind)
        .ok_or_else(|| BpeVocabError::UnsupportedPre { pre: name.to_string(), supported: supported_pre().join(", ") })
}

fn split_regexes(kind: PreKind) -> Vec<&'static str> {
    match kind {
        PreKind::Default => vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"],
        PreKind::Gpt2 => vec![GPT2_REGEX],
        PreKind::DigitsThenGpt2 => vec![r"\p{N}", GPT2_REGEX],
        PreKind::Llama3 { .. } => vec![LLAMA3_REGEX],
        PreKind::Qwen2 => vec![QWEN2_REGEX],
    }
}

fn tk_err(e: impl std::fmt::Display) -> BpeVocabError {
    BpeVocabError::Tokenizers(e.to_string())
}

/// Splits a GGUF merge line the way llama.cpp does: at the first space after
/// the first byte, so that a left token that is itself a space still parses.
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    // Byte search: ' ' is ASCII, so its position is always a char boundary.
    let pos = merge.as_bytes().iter().skip(1).position(|&b| b == b' ')? + 1;
    let (left, right) = (&merge[..pos], &merge[pos + 1..]);
    (!left.is_empty() && !right.is_empty()).then_some((left, right))
}

fn check_id(which: &'static str, id: Option<u32>, n_tokens: usize) -> Result<(), BpeVocabError> {
    match id {
        Some(id) if id as usize >= n_tokens => Err(BpeVocabError::IdOutOfRange { which, id, n_tokens }),
        _ => Ok(()),
    }
}

/// Builds the tokenizer described in the module documentation.
pub fn build_tokenizer(v: &GgufVocab) -> Result<Tokenizer, BpeVocabError> {
    if v.model != "gpt2" {
        return Err(BpeVocabError::UnsupportedModel(v.model.clone()));
    }
    let kind = pre_kind(v.pre.as_deref())?;
    let n = v.tokens.len();
    if n == 0 {
        return Err(BpeVocabError::EmptyVocab);
    }
    if u32::try_from(n).is_err() {
        return Err(BpeVocabError::TooManyTokens(n));
    }

    let mut vocab = Vocab::with_capacity(n);
    for (id, token) in v.tokens.iter().enumerate() {
        let id = id as u32;
        if token.is_empty() {
            return Err(BpeVocabError::EmptyToken { id });
        }
        if let Some(&first) = vocab.get(token) {
            return Err(BpeVocabError::DuplicateToken { token: token.clone(), first, second: id });
        }
        vocab.insert(token.clone(), id);
    }

    if let Some(types) = &v.token_types {
        if types.len() != n {
            return Err(BpeVocabError::TokenTypeCount { types: types.len(), tokens: n });
        }
        if let Some((id, &ty)) = types.iter().enumerate().find(|(_, &ty)| !(token_type::UNDEFINED..=token_type::BYTE).contains(&ty)) {
            return Err(BpeVocabError::UnknownTokenType { id: id as u32, ty });
        }
    }

    for (which, id) in [("BOS", v.bos), ("EOS", v.eos), ("padding", v.pad), ("unknown", v.unk)] {
        check_id(which, id, n)?;
    }
    if v.add_bos && v.bos.is_none() {
        return Err(BpeVocabError::MissingSpecialId { which: "bos" });
    }
    if v.add_eos && v.eos.is_none() {
        return Err(BpeVocabError::MissingSpecialId { which: "eos" });
    }

    // Validated here, not left to the BPE builder, so that the error names the
    // merge line. A repeated pair keeps its first (highest) rank, as in
    // llama.cpp.
    let mut merges = Vec::with_capacity(v.merges.len());
    let mut seen = std::collections::HashSet::with_capacity(v.merges.len());
    for (index, merge) in v.merges.iter().enumerate() {
        let (left, right) = split_merge(merge).ok_or_else(|| BpeVocabError::MalformedMerge { index, merge: merge.clone() })?;
        let merged = format!("{left}{right}");
        for token in [left, right, merged.as_str()] {
            if !vocab.contains_key(token) {
                return Err(BpeVocabError::MergeUnknownToken { index, merge: merge.clone(), token: token.to_string() });
            }
        }
        if seen.insert((left, right)) {
            merges.push((left.to_string(), right.to_string()));
        }
    }

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(matches!(kind, PreKind::Llama3 { ignore_merges: true }))
        .build()
        .map_err(tk_err)?;
    let mut tokenizer = Tokenizer::new(bpe);

    let mut pre: Vec<PreTokenizerWrapper> = Vec::new();
    for regex in split_regexes(kind) {
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false).map_err(tk_err)?;
        pre.push(split.into());
    }
    // The splitting is done above; ByteLevel only maps bytes to its alphabet.
    pre.push(ByteLevel::new(false, true, false).into());
    tokenizer.with_pre_tokenizer(Some(Sequence::new(pre)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    // llama.cpp matches control and unknown tokens in text when it is asked
    // to parse special tokens, and user-defined tokens always. Control and
    // unknown tokens become special added tokens: matched unless the caller
    // sets `set_encode_special_tokens(true)` (llama.cpp's parse_special =
    // false), dropped by `decode(.., skip_special_tokens = true)`.
    // User-defined ones become ordinary added tokens: always matched, kept
    // when decoding.
    if let Some(types) = &v.token_types {
        let added: Vec<AddedToken> = types
            .iter()
            .zip(&v.tokens)
            .filter_map(|(&ty, text)| match ty {
                token_type::CONTROL | token_type::UNKNOWN => Some(AddedToken::from(text.clone(), true)),
                token_type::USER_DEFINED => Some(AddedToken::from(text.clone(), false).normalized(false)),
                _ => None,
            })
            .collect();
        if !added.is_empty() {
            tokenizer.add_tokens(added).map_err(tk_err)?;
        }
    }

    if v.add_bos || v.add_eos {
        tokenizer.with_post_processor(Some(bos_eos_processor(v)?));
    }
    Ok(tokenizer)
}

/// A post-processor that puts BOS before and/or EOS after each sequence. The
/// template refers to the tokens by the keys "BOS"/"EOS" so that token texts
/// containing spaces or colons cannot confuse the template syntax.
fn bos_eos_processor(v: &GgufVocab) -> Result<TemplateProcessing, BpeVocabError> {
    let mut specials = Vec::new();
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut special = |key: &str, id: u32| -> Result<(), BpeVocabError> {
        let text = v.tokens[id as usize].clone();
        specials.push(SpecialToken::new(key.to_string(), vec![id], vec![text]).map_err(tk_err)?);
        Ok(())
    };
    if let (true, Some(bos)) = (v.add_bos, v.bos) {
        special("BOS", bos)?;
    }
    if let (true, Some(eos)) = (v.add_eos, v.eos) {
        special("EOS", eos)?;
    }
    let (bos, eos) = (v.add_bos, v.add_eos);
    let wrap = |out: &mut Vec<String>, seq: &str, type_suffix: &str| {
        if bos {
            out.push(format!("BOS{type_suffix}"));
        }
        out.push(seq.to_string());
        if eos {
            out.push(format!("EOS{type_suffix}"));
        }
    };
    wrap(&mut single, "$A", "");
    wrap(&mut pair, "$A", "");
    wrap(&mut pair, "$B:1", ":1");
    TemplateProcessing::builder()
        .try_single(single)
        .map_err(tk_err)?
        .try_pair(pair)
        .map_err(tk_err)?
        .special_tokens(specials)
        .build()
        .map_err(tk_err)
}

#[cfg(test)]
mod tests {
    use super::split_merge;

    #[test]
    fn merge_lines_split_after_the_first_byte() {
        assert_eq!(split_merge("a b"), Some(("a", "b")));
        assert_eq!(split_merge("  b"), Some((" ", "b")));
        assert_eq!(split_merge("ab cd ef"), Some(("ab", "cd ef")));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge("a "), None);
        assert_eq!(split_merge(""), None);
        assert_eq!(split_merge("é x"), Some(("é", "x")));
    }
}
