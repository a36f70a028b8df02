use std::fmt;
use std::str::FromStr;

use crate::Error;

/// Where a session runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;
    /// `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, Error> {
        let l = s.trim().to_ascii_lowercase();
        if l == "cpu" {
            return Ok(Device::Cpu);
        }
        if l == "cuda" || l == "gpu" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = l.strip_prefix("cuda:") {
            if let Ok(n) = n.parse() {
                return Ok(Device::Cuda(n));
            }
        }
        Err(Error::Device(s.to_string(), "expected 'cpu', 'cuda' or 'cuda:N'".into()))
    }
}
