//! The CPU backend's settings: one `CpuOptions`, read from the environment
//! by `from_lookup` (the facade's `rlx::Options::from_env` is the one place
//! that calls it with the process environment) or built in code and given
//! to `CpuBackend::with_options`.
//!
//! | variable | type | default | meaning |
//! |---|---|---|---|
//! | `RLX_PROFILE` | flag | off | CPU (diagnostic): host time per thunk kind after every call |
//! | `RLX_CPU_PIN` | flag | on | CPU: pin one worker per CPU. Process-wide by nature: the shared pool starts once, with the first backend's setting |

use rlx_runtime::Result;

/// The CPU backend's settings; `Default` is what an empty environment gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuOptions {
    /// Host time per thunk kind on stderr after every call (`RLX_PROFILE`).
    pub profile: bool,
    /// Workers pinned one per CPU (`RLX_CPU_PIN`).
    pub pin: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions { profile: false, pin: true }
    }
}

impl CpuOptions {
    /// The options from `get`, which stands in for the environment (an
    /// unset or empty value takes the default; a bad flag is an error
    /// naming the variable).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<CpuOptions> {
        let d = CpuOptions::default();
        let flag = |name: &str, default: bool| {
            get(name).filter(|v| !v.trim().is_empty()).map_or(Ok(default), |v| rlx_runtime::env::parse_flag(name, &v))
        };
        Ok(CpuOptions { profile: flag("RLX_PROFILE", d.profile)?, pin: flag("RLX_CPU_PIN", d.pin)? })
    }
}

#[cfg(test)]
mod tests {
    use super::CpuOptions;

    #[test]
    fn options_from_a_lookup() {
        assert_eq!(CpuOptions::from_lookup(|_| None).ok(), Some(CpuOptions::default()));
        let o = CpuOptions::from_lookup(|n| (n == "RLX_PROFILE").then(|| "on".to_string())).expect("valid");
        assert!(o.profile && o.pin);
        let o = CpuOptions::from_lookup(|n| (n == "RLX_CPU_PIN").then(|| "0".to_string())).expect("valid");
        assert!(!o.pin);
        let e = CpuOptions::from_lookup(|n| (n == "RLX_CPU_PIN").then(|| "maybe".to_string())).expect_err("bad flag").to_string();
        assert!(e.contains("RLX_CPU_PIN") && e.contains("maybe"), "{e}");
    }
}
