//! `POST /v1/rerank` (the Jina/Cohere form llama-server also speaks):
//! documents ordered by the cosine of their embedding with the query's.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::{self, kind, Fields};
use crate::routes::embeddings::{Inputs, Usage};
use crate::routes::within;
use crate::state::AppState;

/// `documents`: strings, or objects with a `text` string.
fn documents(v: &Value, max: usize) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("documents", m);
    let Value::Array(items) = v else { return Err(bad(format!("'documents' must be a list of strings, found {}", kind(v)))) };
    if items.is_empty() {
        return Err(bad("'documents' is an empty list".into()));
    }
    if items.len() > max {
        return Err(bad(format!("{} documents in one request; the limit is {max} (--max-inputs)", items.len())));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, d)| match d.as_str().or_else(|| d.get("text").and_then(Value::as_str)) {
            Some("") => Err(bad(format!("'documents[{i}]' is an empty string"))),
            Some(s) => Ok(s.to_string()),
            None => Err(bad(format!("'documents[{i}]' must be a string or {{\"text\": string}}, found {}", kind(d)))),
        })
        .collect()
}

/// Indices of `scores`, best first (ties: the earlier document).
pub fn ranking(scores: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order
}

/// A `/v1/rerank` body as read, before the model is consulted.
#[derive(Debug)]
pub struct RerankRequest {
    pub query: String,
    pub documents: Vec<String>,
    /// At most `documents.len()`.
    pub top_n: usize,
    pub return_documents: bool,
    pub truncate: bool,
}

impl RerankRequest {
    /// Every field but `model` (checked by the handler first), with at most
    /// `max_inputs` documents.
    pub fn read(f: &Fields, max_inputs: usize) -> Result<RerankRequest, ApiError> {
        let query = match f.required("query")? {
            Value::String(q) if !q.is_empty() => q.clone(),
            Value::String(_) => return Err(ApiError::invalid_param("query", "'query' is an empty string")),
            other => return Err(ApiError::invalid_param("query", format!("'query' must be a string, found {}", kind(other)))),
        };
        let documents = documents(f.required("documents")?, max_inputs)?;
        let top_n = f.u64_in("top_n", 1, u64::MAX)?.map_or(documents.len(), |n| (n.min(documents.len() as u64)) as usize);
        let return_documents = f.bool("return_documents")?.unwrap_or(false);
        let truncate = f.bool("truncate")?.unwrap_or(true);
        Ok(RerankRequest { query, documents, top_n, return_documents, truncate })
    }
}

pub async fn rerank(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    within(s.options.request_timeout, async {
        let f = request::parse(body, s.options.max_body_bytes)?;
        let m = s.embedding_model(f.str("model")?)?;
        let RerankRequest { query, documents: docs, top_n, return_documents, truncate } = RerankRequest::read(&f, s.options.max_inputs)?;

        let texts: Vec<String> = std::iter::once(query).chain(docs.iter().cloned()).collect();
        let ids = m.token_ids(Inputs::Texts(texts), truncate, "documents").await?;
        let tokens = ids.iter().map(Vec::len).sum();
        let vectors = m.batcher.embed(ids).await?;
        let Some((q, d)) = vectors.split_first() else { return Err(ApiError::internal("the embedder returned no vectors")) };
        let scores: Vec<f32> = d.iter().map(|v| rlx_models::cosine(q, v)).collect();
        let results: Vec<Value> = ranking(&scores)
            .into_iter()
            .take(top_n)
            .map(|i| {
                let mut r = json!({"index": i, "relevance_score": scores[i]});
                if return_documents {
                    r["document"] = json!({"text": docs[i]});
                }
                r
            })
            .collect();
        let usage = Usage { prompt_tokens: tokens, total_tokens: tokens };
        Ok(axum::Json(json!({"id": s.response_id("rerank"), "model": m.id, "results": results, "usage": usage})).into_response())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranking_is_best_first_with_stable_ties() {
        assert_eq!(ranking(&[0.1, 0.9, 0.5, 0.9]), vec![1, 3, 2, 0]);
    }

    #[test]
    fn documents_take_strings_or_text_objects() {
        let v = json!(["a", {"text": "b"}]);
        assert_eq!(documents(&v, 10).ok(), Some(vec!["a".to_string(), "b".to_string()]));
        assert!(documents(&json!([]), 10).is_err());
        assert!(documents(&json!([1]), 10).is_err_and(|e| e.message.contains("found a number")));
        assert!(documents(&json!(["a", "b"]), 1).is_err_and(|e| e.message.contains("limit is 1")));
    }
}
