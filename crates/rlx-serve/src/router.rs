//! The routes and the layers around them: the body limit, the bearer key on
//! `/v1/`, and the request counters.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::error::ApiError;
use crate::routes::{completions, embeddings, info, rerank};
use crate::state::AppState;

pub fn build(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/rerank", post(rerank::rerank))
        .route("/v1/models", get(info::models))
        .route_layer(middleware::from_fn_with_state(state.clone(), check_key));
    Router::new()
        .merge(v1)
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .fallback(info::not_found)
        .method_not_allowed_fallback(info::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .layer(DefaultBodyLimit::max(state.options.max_body_bytes))
        .with_state(state)
}

/// Equal without an early exit: the time depends on the expected key's
/// length only, not on where a guess first differs.
pub fn same_key(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = given.len() ^ expected.len();
    for (i, &e) in expected.iter().enumerate() {
        diff |= (given.get(i).copied().unwrap_or(0) ^ e) as usize;
    }
    std::hint::black_box(diff) == 0
}

/// The credentials of `Bearer <token>` (the scheme is case-insensitive).
fn bearer(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token)
}

async fn check_key(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = &s.options.api_key else { return next.run(req).await };
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer);
    match given {
        Some(g) if same_key(g.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => ApiError::unauthorized("the API key is not valid").into_response(),
        None => ApiError::unauthorized("this server needs an API key: send 'Authorization: Bearer KEY'").into_response(),
    }
}

/// Requests by route and status, and the time to the response head.
async fn count(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let start = Instant::now();
    let resp = next.run(req).await;
    s.metrics.request(&route, resp.status().as_u16(), start.elapsed());
    resp
}

#[cfg(test)]
mod tests {
    use super::{bearer, same_key};

    #[test]
    fn keys_match_only_when_equal() {
        assert!(same_key(b"secret", b"secret"));
        assert!(!same_key(b"secreT", b"secret"));
        assert!(!same_key(b"secret1", b"secret"));
        assert!(!same_key(b"secre", b"secret"));
        assert!(!same_key(b"", b"secret"));
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer"), None);
    }
}
