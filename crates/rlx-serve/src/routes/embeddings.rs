//! `POST /v1/embeddings` (OpenAI's schema) and the embedding path that
//! `/v1/rerank` shares: inputs → token ids (tokenized off the reactor) →
//! the batcher → vectors.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde::Serialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::request::{self, kind, token_ids, Fields};
use crate::routes::within;
use crate::state::{AppState, EmbeddingModel};

/// What a request asks to embed.
#[derive(Debug)]
pub enum Inputs {
    Texts(Vec<String>),
    /// Token ids as the model sees them (`[CLS] … [SEP]` included).
    Ids(Vec<Vec<u32>>),
}

impl Inputs {
    pub fn len(&self) -> usize {
        match self {
            Inputs::Texts(t) => t.len(),
            Inputs::Ids(i) => i.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `input`: a string, a list of strings, a list of token ids or a list of
/// token-id lists; not empty, at most `max` items, no empty string.
pub fn parse_inputs(v: &Value, key: &str, max: usize) -> Result<Inputs, ApiError> {
    let bad = |m: String| ApiError::invalid_param(key, m);
    let inputs = match v {
        Value::String(s) => Inputs::Texts(vec![s.clone()]),
        Value::Array(items) if items.is_empty() => return Err(bad(format!("'{key}' is an empty list: give at least one input"))),
        Value::Array(items) => match &items[0] {
            Value::String(_) => Inputs::Texts(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| match x {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(bad(format!("'{key}[{i}]' must be a string like the first item, found {}", kind(other)))),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Value::Number(_) => Inputs::Ids(vec![token_ids(v, key)?.unwrap_or_default()]),
            Value::Array(_) => Inputs::Ids(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| match token_ids(x, &format!("{key}[{i}]"))? {
                        Some(ids) => Ok(ids),
                        None if x.as_array().is_some_and(Vec::is_empty) => Err(bad(format!("'{key}[{i}]' is an empty token list"))),
                        None => Err(bad(format!("'{key}[{i}]' must be a list of token ids, found {}", kind(x)))),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            other => {
                return Err(bad(format!(
                    "'{key}' must be a string, a list of strings, a list of token ids or a list of token-id lists; found a list of {}s",
                    kind(other).trim_start_matches("a ").trim_start_matches("an ")
                )))
            }
        },
        other => {
            return Err(bad(format!(
                "'{key}' must be a string, a list of strings, a list of token ids or a list of token-id lists; found {}",
                kind(other)
            )))
        }
    };
    if inputs.len() > max {
        return Err(bad(format!("{} inputs in one request; the limit is {max} (--max-inputs)", inputs.len())));
    }
    if let Inputs::Texts(t) = &inputs {
        if let Some(i) = t.iter().position(String::is_empty) {
            return Err(bad(format!("'{key}[{i}]' is an empty string")));
        }
    }
    Ok(inputs)
}

impl EmbeddingModel {
    /// Token ids for `inputs`: texts are tokenized (truncated to the model's
    /// limit as `rlx embed` does, unless `truncate` is false: then 400); id
    /// lists are checked against the vocabulary and, when too long, keep
    /// their first `limit - 1` ids and their last (the `[SEP]`).
    pub async fn token_ids(&self, inputs: Inputs, truncate: bool, key: &str) -> Result<Vec<Vec<u32>>, ApiError> {
        let limit = self.embedder.max_tokens();
        match inputs {
            Inputs::Texts(texts) => {
                let embedder = self.embedder.clone();
                let key = key.to_string();
                tokio::task::spawn_blocking(move || {
                    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
                    let (ids, cut) = embedder.tokenize_counting(&refs).map_err(|e| ApiError::from_model(&e))?;
                    if cut > 0 && !truncate {
                        let first = refs.iter().position(|t| embedder.tokenize_counting(&[t]).is_ok_and(|(_, n)| n > 0)).unwrap_or(0);
                        return Err(ApiError::invalid_param(
                            &key,
                            format!(
                                "{cut} of {} inputs (the first: {key}[{first}]) are longer than the model's limit of {limit} tokens and 'truncate' is false",
                                refs.len()
                            ),
                        ));
                    }
                    Ok(ids)
                })
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing: {e}")))?
            }
            Inputs::Ids(mut rows) => {
                let vocab = self.embedder.config().vocab_size;
                for (i, row) in rows.iter_mut().enumerate() {
                    if row.is_empty() {
                        return Err(ApiError::invalid_param(key, format!("'{key}[{i}]' is an empty token list")));
                    }
                    if let Some(bad) = row.iter().find(|&&t| t as usize >= vocab) {
                        return Err(ApiError::invalid_param(
                            key,
                            format!("'{key}[{i}]': token id {bad} is outside the vocabulary (size {vocab})"),
                        ));
                    }
                    if row.len() > limit {
                        if !truncate {
                            return Err(ApiError::invalid_param(
                                key,
                                format!(
                                    "'{key}[{i}]' has {} tokens, more than the model's limit of {limit}, and 'truncate' is false",
                                    row.len()
                                ),
                            ));
                        }
                        let last = row[row.len() - 1];
                        row.truncate(limit - 1);
                        row.push(last);
                    }
                }
                Ok(rows)
            }
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Item {
    object: &'static str,
    embedding: Vector,
    index: usize,
}

#[derive(Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

#[derive(Serialize)]
struct EmbeddingsResponse<'a> {
    object: &'static str,
    data: Vec<Item>,
    model: &'a str,
    usage: Usage,
}

/// Little-endian f32 bytes, base64 (what the `openai` client decodes).
fn to_base64(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A `/v1/embeddings` body as read, before the model is consulted.
#[derive(Debug)]
pub struct EmbeddingsRequest {
    pub base64: bool,
    /// `dimensions` as given: the handler compares it with the model's.
    pub dimensions: Option<Value>,
    pub truncate: bool,
    pub inputs: Inputs,
}

impl EmbeddingsRequest {
    /// Every field but `model` (checked by the handler first), with at most
    /// `max_inputs` inputs.
    pub fn read(f: &Fields, max_inputs: usize) -> Result<EmbeddingsRequest, ApiError> {
        let base64 = match f.str("encoding_format")? {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "encoding_format",
                    format!("'encoding_format' must be 'float' or 'base64', found '{other}'"),
                ))
            }
        };
        let dimensions = f.get("dimensions").cloned();
        let truncate = f.bool("truncate")?.unwrap_or(true);
        let inputs = parse_inputs(f.required("input")?, "input", max_inputs)?;
        Ok(EmbeddingsRequest { base64, dimensions, truncate, inputs })
    }
}

pub async fn embeddings(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    within(s.options.request_timeout, async {
        let f: Fields = request::parse(body, s.options.max_body_bytes)?;
        let m = s.embedding_model(f.str("model")?)?;
        let req = EmbeddingsRequest::read(&f, s.options.max_inputs)?;
        let dim = m.embedder.dim();
        if let Some(d) = &req.dimensions {
            if d.as_u64() != Some(dim as u64) {
                return Err(ApiError::invalid_param(
                    "dimensions",
                    format!(
                        "'dimensions' is not supported: this model's embeddings have {dim} dimensions and cannot be shortened (found {d})"
                    ),
                ));
            }
        }
        let ids = m.token_ids(req.inputs, req.truncate, "input").await?;
        let tokens = ids.iter().map(Vec::len).sum();
        let vectors = m.batcher.embed(ids).await?;
        let base64 = req.base64;
        let data = vectors
            .into_iter()
            .enumerate()
            .map(|(index, v)| Item {
                object: "embedding",
                embedding: if base64 { Vector::Base64(to_base64(&v)) } else { Vector::Float(v) },
                index,
            })
            .collect();
        let resp = EmbeddingsResponse { object: "list", data, model: &m.id, usage: Usage { prompt_tokens: tokens, total_tokens: tokens } };
        Ok(axum::Json(resp).into_response())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Inputs, ApiError> {
        let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}"));
        parse_inputs(&v, "input", 3)
    }

    #[test]
    fn every_openai_input_shape_is_read() {
        assert!(matches!(parse(r#""a""#), Ok(Inputs::Texts(t)) if t == ["a"]));
        assert!(matches!(parse(r#"["a", "b"]"#), Ok(Inputs::Texts(t)) if t == ["a", "b"]));
        assert!(matches!(parse("[101, 102]"), Ok(Inputs::Ids(i)) if i == [vec![101, 102]]));
        assert!(matches!(parse("[[101, 102], [101, 7, 102]]"), Ok(Inputs::Ids(i)) if i.len() == 2 && i[1] == [101, 7, 102]));
    }

    #[test]
    fn wrong_inputs_say_what_is_wrong() {
        let msg = |json: &str| parse(json).err().map(|e| e.message).unwrap_or_else(|| panic!("{json} accepted"));
        assert!(msg("[]").contains("empty list"));
        assert!(msg(r#"["a", 1]"#).contains("'input[1]' must be a string"));
        assert!(msg(r#"["a", ""]"#).contains("'input[1]' is an empty string"));
        assert!(msg("5").contains("found a number"));
        assert!(msg(r#"[{"a": 1}]"#).contains("found a list of objects"));
        assert!(msg(r#"["a", "b", "c", "d"]"#).contains("limit is 3"));
        assert!(msg("[[1], []]").contains("'input[1]' is an empty token list"));
    }

    #[test]
    fn base64_is_little_endian_f32() {
        // 1.0f32 = 0x3f800000 → bytes 00 00 80 3f.
        assert_eq!(to_base64(&[1.0]), "AACAPw==");
    }
}
