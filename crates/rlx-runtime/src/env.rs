//! The grammar of `RLX_*` settings read from the environment, shared by
//! every crate that reads one (README's "Options" table lists them all).
//! An empty value counts as unset; a value that does not parse is an error
//! naming the variable, never a silent default.

use crate::{Result, RuntimeError};

fn bad(name: &str, value: &str, expected: &str) -> RuntimeError {
    RuntimeError::Input { name: name.to_string(), detail: format!("environment value {value:?}: expected {expected}") }
}

/// A flag: 1/true/on/yes or 0/false/off/no, any case.
pub fn parse_flag(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => Err(bad(name, value, "a flag: 1, true, on, yes, 0, false, off or no")),
    }
}

/// The variable's value when set and not empty.
pub fn var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()).filter(|v| !v.trim().is_empty())
}

/// A flag from the environment; `default` when unset.
pub fn flag(name: &str, default: bool) -> Result<bool> {
    var(name).map_or(Ok(default), |v| parse_flag(name, &v))
}

#[cfg(test)]
mod tests {
    use super::parse_flag;

    #[test]
    fn flags_take_every_spelling_and_refuse_anything_else() {
        for v in ["1", "true", "ON", " yes "] {
            assert!(parse_flag("RLX_TRACE", v).expect(v));
        }
        for v in ["0", "False", "off", "NO"] {
            assert!(!parse_flag("RLX_TRACE", v).expect(v));
        }
        let e = parse_flag("RLX_TRACE", "2").expect_err("2 is not a flag").to_string();
        assert!(e.contains("RLX_TRACE") && e.contains("\"2\""), "{e}");
    }
}
