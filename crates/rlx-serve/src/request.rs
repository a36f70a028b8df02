//! Reading a request body: JSON parsed by hand from a `serde_json` object, so
//! that every wrong field gets a message naming it, what was expected and
//! what was found. Fields the server does not know are ignored, as OpenAI
//! clients send some (`user`, …) that change nothing here; a `null` field
//! counts as absent.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// A request body's top-level fields.
pub struct Fields(Map<String, Value>);

/// The body as a JSON object (413 past the body limit, 400 when not JSON
/// or not an object).
pub fn parse(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Fields, ApiError> {
    let bytes = match body {
        Ok(b) => b,
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => return Err(ApiError::too_large(limit)),
        Err(r) => return Err(ApiError::invalid(format!("could not read the request body: {}", r.body_text()))),
    };
    fields(&bytes)
}

/// A body's bytes as a JSON object (400 when not JSON or not an object).
pub fn fields(bytes: &[u8]) -> Result<Fields, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(Fields(m)),
        Ok(other) => Err(ApiError::invalid(format!("the body must be a JSON object, found {}", kind(&other)))),
        Err(e) => Err(ApiError::bad_json(e)),
    }
}

/// How a JSON value is described in messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(key: &str, expected: &str, found: &Value) -> ApiError {
    ApiError::invalid_param(key, format!("'{key}' must be {expected}, found {}", kind(found)))
}

impl Fields {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn required(&self, key: &str) -> Result<&Value, ApiError> {
        self.get(key).ok_or_else(|| ApiError::invalid_param(key, format!("'{key}' is required")))
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong(key, "a string", v)),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong(key, "a boolean", v)),
        }
    }

    /// A number in `lo..=hi`.
    pub fn f32_in(&self, key: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                if (lo..=hi).contains(&x) {
                    Ok(Some(x))
                } else {
                    Err(ApiError::invalid_param(key, format!("'{key}' must be between {lo} and {hi}, found {n}")))
                }
            }
            Some(v) => Err(wrong(key, "a number", v)),
        }
    }

    /// A whole number in `lo..=hi`.
    pub fn u64_in(&self, key: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
                _ => Err(ApiError::invalid_param(key, format!("'{key}' must be a whole number between {lo} and {hi}, found {n}"))),
            },
            Some(v) => Err(wrong(key, "a number", v)),
        }
    }

    /// `true` for a present, non-null field the server does not implement.
    pub fn refuse(&self, key: &str, why: &str) -> Result<(), ApiError> {
        match self.get(key) {
            None | Some(Value::Bool(false)) => Ok(()),
            Some(_) => Err(ApiError::invalid_param(key, format!("'{key}' is not supported: {why}"))),
        }
    }
}

/// A list of token ids (`[1, 2, 3]`), or `None` when `v` is not one.
pub fn token_ids(v: &Value, key: &str) -> Result<Option<Vec<u32>>, ApiError> {
    let Value::Array(items) = v else { return Ok(None) };
    if !items.first().is_some_and(Value::is_number) {
        return Ok(None);
    }
    items
        .iter()
        .map(|x| match x.as_u64() {
            Some(id) if id <= u32::MAX as u64 => Ok(id as u32),
            _ => Err(ApiError::invalid_param(key, format!("'{key}': token ids must be whole numbers from 0 to {}, found {x}", u32::MAX))),
        })
        .collect::<Result<Vec<u32>, _>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> Result<Fields, ApiError> {
        parse(Ok(Bytes::from(json.to_string())), 100)
    }

    #[test]
    fn bodies_that_are_not_objects_are_refused_with_what_was_found() {
        assert_eq!(fields("{").err().map(|e| e.code), Some("invalid_json"));
        let e = fields("[1]").err().map(|e| e.message).unwrap_or_default();
        assert!(e.contains("found an array"), "{e}");
    }

    #[test]
    fn wrong_types_name_the_field() {
        let f = fields(r#"{"temperature": "hot", "n": 3, "x": null, "t": 5}"#).unwrap_or_else(|e| panic!("{e}"));
        let e = f.f32_in("temperature", 0.0, 2.0).err().unwrap_or_else(|| panic!("accepted"));
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("must be a number, found a string"), "{}", e.message);
        assert!(f.u64_in("n", 1, 1).is_err());
        assert_eq!(f.str("x").ok().flatten(), None);
        assert!(f.f32_in("t", 0.0, 2.0).is_err_and(|e| e.message.contains("between 0 and 2, found 5")));
    }

    #[test]
    fn token_id_lists_are_told_from_other_arrays() {
        let v: Value = serde_json::from_str("[1, 2, 3]").unwrap_or_default();
        assert_eq!(token_ids(&v, "input").ok().flatten(), Some(vec![1, 2, 3]));
        let v: Value = serde_json::from_str(r#"["a"]"#).unwrap_or_default();
        assert_eq!(token_ids(&v, "input").ok().flatten(), None);
        let v: Value = serde_json::from_str("[1, -2]").unwrap_or_default();
        assert!(token_ids(&v, "input").is_err());
    }
}
