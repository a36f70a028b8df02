//! Errors: [`ApiError`] is what a client sees (an OpenAI error object with
//! its HTTP status); [`ServeError`] is what stops the server from starting.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client as `{"error": {"message", "type", "code",
/// "param"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`,
    /// `server_error`, …
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// Seconds for `Retry-After` (503 only).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, code, message: message.into(), param: None, retry_after: None }
    }

    /// 400: the request is well-formed HTTP but its content is wrong.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_value", message)
    }

    /// 400 for one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.to_string()), ..Self::invalid(message) }
    }

    /// 400: the body is not JSON.
    pub fn bad_json(detail: impl std::fmt::Display) -> ApiError {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_json", format!("the body is not valid JSON: {detail}"))
    }

    /// 404: no such model (or no model of that kind is loaded).
    pub fn unknown_model(message: impl Into<String>) -> ApiError {
        ApiError { param: Some("model".into()), ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", "model_not_found", message) }
    }

    /// 401: missing or wrong bearer key.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", "invalid_api_key", message)
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> ApiError {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("the request body is larger than the limit of {limit} bytes (--max-body-bytes)"),
        )
    }

    /// 503 with `Retry-After`: the queue is full.
    pub fn overloaded(what: &str, depth: usize) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "queue_full",
                format!("the {what} queue is full ({depth} requests waiting, --max-queue); retry later"),
            )
        }
    }

    /// 503: the server is stopping or a worker has gone.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError { retry_after: Some(1), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "unavailable", message) }
    }

    /// 504: the request ran past the per-request limit.
    pub fn timeout(limit: std::time::Duration) -> ApiError {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "timeout",
            format!("the request took longer than the limit of {} s (--timeout-s)", limit.as_secs_f64()),
        )
    }

    /// 500: the model failed on input it had accepted.
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }

    /// A model error: the caller's input when the model says so, else ours.
    pub fn from_model(e: &rlx_models::ModelError) -> ApiError {
        match e {
            rlx_models::ModelError::Input(m) => Self::invalid(m.clone()),
            other => Self::internal(other.to_string()),
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.code, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// Why the server could not start.
#[derive(Debug)]
pub enum ServeError {
    Options(String),
    /// A model failed to load (the message names the file).
    Load(String),
    Io(std::io::Error),
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServeError::Options(m) => write!(f, "{m}"),
            ServeError::Load(m) => write!(f, "{m}"),
            ServeError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ServeError {}

impl From<std::io::Error> for ServeError {
    fn from(e: std::io::Error) -> Self {
        ServeError::Io(e)
    }
}
