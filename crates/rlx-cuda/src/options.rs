//! Every setting of the CUDA backend: one `CudaOptions`, the `cuda` part of
//! the facade's `rlx::Options` (whose `from_env` reads the environment for a
//! session), passed to `CudaBackend::with_options` and down to each
//! executable it prepares. `CudaBackend::new` reads the environment itself
//! for callers of this crate alone. Nothing else here reads it.
//!
//! | variable | type | default | meaning |
//! |---|---|---|---|
//! | `RLX_REPLAY` | flag | on | CUDA: replay each executable's recorded CUDA graphs; off = launch kernels one by one (eager). Replay needs `PrepareOptions::replay` as well |
//! | `RLX_TRACE` | flag | off | CUDA (diagnostic): per call, host time of each phase (check, stage, launch, record, wait, copy-out); at prepare, the replay segments and each timed matmul choice |
//! | `RLX_PROFILE` | flag | off | CUDA (diagnostic): device time per thunk kind (CUDA events between eager launches) |
//! | `RLX_GRAPH_DUMP` | flag | off | CUDA (diagnostic): print every node of each recorded graph (kind, grid, block, shared memory, parameter bytes, cluster, kernel) |
//! | `RLX_FFN` | flag | on | CUDA (sm_90+): the compiler's fused feed-forward blocks (`Thunk::FeedForward`, with the attention output projection and norm before them where they matched) are supported and run as one kernel where its width rule applies (src/ffn.rs `eligible`); off, they run as their parts |
//! | `RLX_GEMM` | `timed` or `heuristic` | `timed` | CUDA matmuls (cuBLASLt): `timed` times the algorithm per shape at prepare for GEMMs of at most 1024 rows (cuBLASLt's first answer above); `heuristic` takes cuBLASLt's first answer everywhere, nothing timed |
//! | `RLX_GEMM_CACHE` | path, or `0` | `gemm-choices.txt` in the kernel cache folder | CUDA: the file that keeps timed matmul choices for later processes; `0` or empty: no file |
//! | `RLX_L2_PERSIST` | flag | off | CUDA (sm_80+, replay): the activation arena's accesses persist in the device's largest L2 set-aside. Process-wide by nature: the set-aside is a context limit, and while an executable's lines hold it every other kernel of the process has less L2 |
//! | `RLX_CUDA_CACHE` | path | `$HOME/.cache/rlx/cuda` | CUDA: the compiled-kernel cache folder. Process-wide: kernels compile when a device is first opened |
//! | `RLX_CUDA_INCLUDE` | path | unset | CUDA: the folder with `cuda_fp16.h` / `cuda_bf16.h` for NVRTC (else `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`, or a pip `nvidia/cu13/include` beside `libnvrtc` on `LD_LIBRARY_PATH`). Process-wide |
//! | `RLX_PTXAS_VERBOSE` | flag | off | CUDA (kernel development): ptxas prints each kernel's registers, shared memory and spills when it compiles. Process-wide |
//!
//! A flag is `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no` (any
//! case); an unset or empty variable takes the default; any other value is
//! an error that names the variable and the value.

use std::path::PathBuf;

use rlx_runtime::{Result, RuntimeError};

/// How a MatMul thunk's cuBLASLt algorithm is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulChoice {
    /// Timed per shape at prepare among cuBLASLt's heuristic answers and
    /// their split-K variants, for GEMMs of at most 1024 rows (above that
    /// the first answer); kept for the process and in the choice file.
    Timed,
    /// cuBLASLt's first heuristic answer, nothing timed.
    Heuristic,
    /// cuBLASLt's i-th timing candidate (the first answer if there are
    /// fewer), nothing timed or kept: tests run every candidate this way.
    /// Not settable from the environment.
    Candidate(usize),
}

/// The CUDA backend's settings. `from_env` reads them; `Default` is what an
/// empty environment gives.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaOptions {
    /// Replay recorded CUDA graphs (`RLX_REPLAY`); false: eager launches.
    pub replay: bool,
    /// Host time per call phase and the prepare decisions on stderr (`RLX_TRACE`).
    pub trace: bool,
    /// Device time per thunk kind on stderr, eager launches (`RLX_PROFILE`).
    pub profile: bool,
    /// Every node of each recorded graph on stderr (`RLX_GRAPH_DUMP`).
    pub graph_dump: bool,
    /// Fused feed-forward blocks are supported and run as one kernel where
    /// it applies (`RLX_FFN`); off, they run as their parts.
    pub ffn_fusion: bool,
    /// How matmul algorithms are chosen (`RLX_GEMM`).
    pub matmul: MatmulChoice,
    /// The file of timed matmul choices; None: none is read or written
    /// (`RLX_GEMM_CACHE`).
    pub gemm_cache: Option<PathBuf>,
    /// The activation arena persists in L2's set-aside (`RLX_L2_PERSIST`).
    pub l2_persist: bool,
    /// Where compiled kernels are cached (`RLX_CUDA_CACHE`).
    pub kernel_cache: PathBuf,
    /// Where NVRTC finds the half-precision headers, before the usual
    /// places (`RLX_CUDA_INCLUDE`).
    pub cuda_include: Option<PathBuf>,
    /// ptxas reports registers and spills per kernel (`RLX_PTXAS_VERBOSE`).
    pub ptxas_verbose: bool,
}

/// `$HOME/.cache/rlx/cuda` (`/tmp/.cache/rlx/cuda` without a home).
fn default_kernel_cache() -> PathBuf {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".cache/rlx/cuda")
}

impl Default for CudaOptions {
    fn default() -> Self {
        let kernel_cache = default_kernel_cache();
        CudaOptions {
            replay: true,
            trace: false,
            profile: false,
            graph_dump: false,
            ffn_fusion: true,
            matmul: MatmulChoice::Timed,
            gemm_cache: Some(kernel_cache.join("gemm-choices.txt")),
            l2_persist: false,
            kernel_cache,
            cuda_include: None,
            ptxas_verbose: false,
        }
    }
}

impl CudaOptions {
    /// The options from the process environment (`RLX_*`, table above).
    pub fn from_env() -> Result<CudaOptions> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// As `from_env`, with `get` standing in for the environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<CudaOptions> {
        let mut o = CudaOptions::default();
        let set = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let flag = |name: &str, default: bool| set(name).map_or(Ok(default), |v| parse_flag(name, &v));
        o.replay = flag("RLX_REPLAY", o.replay)?;
        o.trace = flag("RLX_TRACE", o.trace)?;
        o.profile = flag("RLX_PROFILE", o.profile)?;
        o.graph_dump = flag("RLX_GRAPH_DUMP", o.graph_dump)?;
        o.ffn_fusion = flag("RLX_FFN", o.ffn_fusion)?;
        o.l2_persist = flag("RLX_L2_PERSIST", o.l2_persist)?;
        o.ptxas_verbose = flag("RLX_PTXAS_VERBOSE", o.ptxas_verbose)?;
        if let Some(v) = set("RLX_GEMM") {
            o.matmul = parse_matmul("RLX_GEMM", &v)?;
        }
        if let Some(v) = set("RLX_CUDA_CACHE") {
            o.kernel_cache = PathBuf::from(v.trim());
            o.gemm_cache = Some(o.kernel_cache.join("gemm-choices.txt"));
        }
        if let Some(v) = get("RLX_GEMM_CACHE") {
            o.gemm_cache = parse_optional_path(&v);
        }
        o.cuda_include = set("RLX_CUDA_INCLUDE").map(|v| PathBuf::from(v.trim()));
        Ok(o)
    }
}

fn bad(name: &str, value: &str, expected: &str) -> RuntimeError {
    RuntimeError::backend("cuda", format!("{name}={value:?}: expected {expected}"))
}

/// A flag: 1/true/on/yes or 0/false/off/no, any case.
/// (The project's one flag grammar, `rlx_runtime::env`.)
pub(crate) fn parse_flag(name: &str, value: &str) -> Result<bool> {
    rlx_runtime::env::parse_flag(name, value)
}

/// `timed` or `heuristic`, any case.
fn parse_matmul(name: &str, value: &str) -> Result<MatmulChoice> {
    match value.trim().to_ascii_lowercase().as_str() {
        "timed" => Ok(MatmulChoice::Timed),
        "heuristic" => Ok(MatmulChoice::Heuristic),
        _ => Err(bad(name, value, "timed or heuristic")),
    }
}

/// A path, or none for `0` or an empty value.
fn parse_optional_path(value: &str) -> Option<PathBuf> {
    match value.trim() {
        "" | "0" => None,
        v => Some(PathBuf::from(v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Result<CudaOptions> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        CudaOptions::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn flags_take_every_spelling_and_refuse_anything_else() {
        for on in ["1", "true", "TRUE", "On", "yes", " yes "] {
            assert!(with(&[("RLX_TRACE", on)]).unwrap_or_else(|e| panic!("{e}")).trace, "{on}");
        }
        for off in ["0", "false", "Off", "NO"] {
            assert!(!with(&[("RLX_REPLAY", off)]).unwrap_or_else(|e| panic!("{e}")).replay, "{off}");
        }
        let e = with(&[("RLX_PROFILE", "2")]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("RLX_PROFILE") && e.contains("\"2\""), "{e}");
        // Empty is unset: the default.
        assert!(with(&[("RLX_REPLAY", "")]).unwrap_or_else(|e| panic!("{e}")).replay);
    }

    #[test]
    fn an_empty_environment_gives_the_defaults() {
        let o = with(&[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o, CudaOptions::default());
        assert!(o.replay && o.ffn_fusion && !o.trace && !o.l2_persist);
        assert_eq!(o.matmul, MatmulChoice::Timed);
        assert_eq!(o.gemm_cache, Some(o.kernel_cache.join("gemm-choices.txt")));
    }

    #[test]
    fn values_parse_as_their_types() {
        let o =
            with(&[("RLX_GEMM", "Heuristic"), ("RLX_CUDA_CACHE", "/k"), ("RLX_CUDA_INCLUDE", "/inc")]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.matmul, MatmulChoice::Heuristic);
        assert_eq!(o.kernel_cache, PathBuf::from("/k"));
        assert_eq!(o.gemm_cache, Some(PathBuf::from("/k/gemm-choices.txt")), "the choice file follows the kernel cache");
        assert_eq!(o.cuda_include, Some(PathBuf::from("/inc")));
        let o = with(&[("RLX_CUDA_CACHE", "/k"), ("RLX_GEMM_CACHE", "/c.txt")]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.gemm_cache, Some(PathBuf::from("/c.txt")));
        for none in ["0", ""] {
            assert_eq!(with(&[("RLX_GEMM_CACHE", none)]).unwrap_or_else(|e| panic!("{e}")).gemm_cache, None, "{none:?}");
        }
        let e = with(&[("RLX_GEMM", "own")]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("RLX_GEMM") && e.contains("own"), "{e}");
    }

    /// Every `RLX_*` name the crate's source mentions is read here and
    /// listed in the table above, or is a test-only variable.
    #[test]
    fn every_variable_in_the_source_is_in_the_table() {
        let table = include_str!("options.rs").split("\n\n").next().unwrap_or("");
        let test_only = ["RLX_REQUIRE_GPU", "RLX_TEST_DRY_RUN"];
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{dir}: {e}")).flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for (i, _) in text.match_indices("\"RLX_") {
                let name: String =
                    text[i + 1..].chars().take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_').collect();
                // A whole string literal: a variable's name, not a prefix of other text.
                if name.len() > 4 && text[i + 1 + name.len()..].starts_with('"') {
                    names.push((name, entry.path()));
                }
            }
        }
        assert!(names.len() >= 11, "{names:?}");
        for (name, file) in names {
            if test_only.contains(&name.as_str()) {
                continue;
            }
            assert!(table.contains(&format!("| `{name}` |")), "{}: {name} is not in the options table", file.display());
        }
    }
}
