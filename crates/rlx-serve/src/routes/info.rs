//! `GET /health`, `GET /v1/models`, `GET /metrics`, and the answers for
//! unknown paths and methods.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::ApiError;
use crate::state::AppState;

pub async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

pub async fn models(State(s): State<Arc<AppState>>) -> Response {
    let data: Vec<_> =
        s.model_ids().into_iter().map(|id| json!({"id": id, "object": "model", "created": s.started, "owned_by": "rlx"})).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], s.metrics.render()).into_response()
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "not_found",
        ..ApiError::invalid(format!(
            "no route {}: this server answers POST /v1/embeddings, /v1/chat/completions, /v1/completions, /v1/rerank and GET /v1/models, /health, /metrics",
            uri.path()
        ))
    }
}

pub async fn method_not_allowed(uri: Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        code: "method_not_allowed",
        ..ApiError::invalid(format!("{} does not take this method", uri.path()))
    }
}
