//! The HTTP handlers, one file per API family.

pub mod completions;
pub mod embeddings;
pub mod info;
pub mod rerank;

use std::future::Future;
use std::time::Duration;

use crate::error::ApiError;

/// `fut`, or 504 when it runs past `limit`.
pub async fn within<T>(limit: Duration, fut: impl Future<Output = Result<T, ApiError>>) -> Result<T, ApiError> {
    tokio::time::timeout(limit, fut).await.unwrap_or_else(|_| Err(ApiError::timeout(limit)))
}
