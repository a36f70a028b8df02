//! Kernel compilation: NVRTC turns each `kernels/*.cu` into a CUBIN for the
//! device's own architecture, cached on disk under a key that changes with
//! anything that could change the binary.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys as nv;
use rlx_runtime::Result;
use sha2::{Digest, Sha256};

use crate::driver::err;
use crate::kernel_cache;
use crate::options::CudaOptions;

/// Our headers, given to NVRTC in memory: (file name, text).
pub(crate) const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("quant.cuh", include_str!("../kernels/quant.cuh")),
    ("attention.cuh", include_str!("../kernels/attention.cuh")),
];

/// The text of `source` with the text of every header of ours it includes
/// (where parameter structs may be defined).
pub(crate) fn with_headers(source: &str) -> String {
    let mut all = source.to_string();
    for (name, text) in HEADERS {
        if source.contains(&format!("#include \"{name}\"")) {
            all.push('\n');
            all.push_str(text);
        }
    }
    all
}

/// The kernel files every device loads when it opens: (file name, text).
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
    ("rows.cu", include_str!("../kernels/rows.cu")),
    ("indexed.cu", include_str!("../kernels/indexed.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    ("attention_dec.cu", include_str!("../kernels/attention_dec.cu")),
    ("attention_mma.cu", include_str!("../kernels/attention_mma.cu")),
];

/// The fused feed-forward block (src/ffn.rs), compiled for each width pair
/// (H, I) a schedule runs, the first time it needs it ([`ffn_source`]).
pub const FFN_SOURCE: &str = include_str!("../kernels/ffn.cu");

/// Width pairs `compile_all` compiles the fused feed-forward kernel at:
/// MiniLM's, and one other the tiling takes.
pub const FFN_CHECK_WIDTHS: [(usize, usize); 2] = [(384, 1536), (256, 1024)];

/// kernels/ffn.cu for widths (H, I): its `FFN_H` and `FFN_I` defined ahead
/// of the text (so they are part of the kernel cache's key).
pub fn ffn_source(h: usize, i: usize) -> String {
    format!("#define FFN_H {h}\n#define FFN_I {i}\n{FFN_SOURCE}")
}

/// The generation step's kernels (src/decode.rs): compiled and loaded the
/// first time a schedule has a quantized matmul or gather, a sample, or an
/// integer binary op.
/// Separate files so that a cold start compiles them on parallel threads.
pub const DECODE_SOURCES: &[(&str, &str)] = &[
    ("decode.cu", include_str!("../kernels/decode.cu")),
    ("qmma.cu", include_str!("../kernels/qmma.cu")),
    ("qlib.cu", include_str!("../kernels/qlib.cu")),
    ("sample.cu", include_str!("../kernels/sample.cu")),
];

/// The trapping kernel of the fault-injection test hook: compiled and
/// loaded only when the hook is used.
pub const FAULT_SOURCES: &[(&str, &str)] = &[("fault.cu", include_str!("../kernels/fault.cu"))];

/// Kernel files compiled as several NVRTC programs, one per part of their
/// instantiations (`KERNEL_PART` defined to the part's number; `IN_PART`
/// in kernels/common.cuh), on parallel threads: a cold start waits for the
/// slowest part instead of the slowest file. (file name, parts.)
pub const PARTS: &[(&str, usize)] =
    &[("attention.cu", 4), ("attention_dec.cu", 8), ("attention_mma.cu", 4), ("decode.cu", 3), ("qmma.cu", 3)];

/// A program to compile: (file name, text, architecture to compile it
/// for, and which part of the file it is: `None` for the whole file).
pub type Source = (&'static str, String, String, Option<usize>);

/// One program per part of each file (one for a file not in [`PARTS`]),
/// for architecture `sm_<cc>`.
fn programs(files: &[(&'static str, &'static str)], cc: (i32, i32)) -> Vec<Source> {
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let mut out = Vec::new();
    for (f, text) in files {
        match PARTS.iter().find(|(name, _)| name == f) {
            // `#line 1`: NVRTC's messages give the file's own line numbers.
            Some((_, parts)) => {
                out.extend((0..*parts).map(|p| (*f, format!("#define KERNEL_PART {p}\n#line 1\n{text}"), arch.clone(), Some(p))))
            }
            None => out.push((*f, text.to_string(), arch.clone(), None)),
        }
    }
    out
}

/// The programs of the files a device of compute capability `cc` loads when it opens.
pub fn sources_for(cc: (i32, i32)) -> Vec<Source> {
    programs(SOURCES, cc)
}

/// The generation step's programs for a device of compute capability `cc`.
pub fn decode_sources_for(cc: (i32, i32)) -> Vec<Source> {
    programs(DECODE_SOURCES, cc)
}

/// The fault-injection kernel's program for a device of compute capability `cc`.
pub fn fault_sources_for(cc: (i32, i32)) -> Vec<Source> {
    programs(FAULT_SOURCES, cc)
}

/// `compile_cubin` for every program at once, one thread each (NVRTC
/// programs are independent): the CUBINs in input order, or the first
/// program's error. Where some were not in the disk cache, says on stderr
/// how many were compiled and how long it took.
pub fn compile_many(files: &[Source], opts: &CudaOptions) -> Result<Vec<Vec<u8>>> {
    let t0 = std::time::Instant::now();
    let done: Vec<(Vec<u8>, bool)> = std::thread::scope(|scope| {
        let jobs: Vec<_> = files.iter().map(|(f, src, arch, _)| scope.spawn(move || cubin_or_cached(f, src, arch, opts))).collect();
        jobs.into_iter()
            .zip(files)
            .map(|(j, (f, ..))| j.join().unwrap_or_else(|_| Err(err(format!("{f}: the compile thread panicked")))))
            .collect::<Result<_>>()
    })?;
    let compiled = done.iter().filter(|(_, c)| *c).count();
    if compiled > 0 {
        eprintln!("rlx-cuda: compiled {compiled} kernel programs in {:.1} s", t0.elapsed().as_secs_f64());
    }
    Ok(done.into_iter().map(|(cubin, _)| cubin).collect())
}

/// Whether this process has said that it compiles kernels (once).
static ANNOUNCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    crate::libs::present(crate::libs::Lib::Nvrtc)
}

pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(err(missing_nvrtc()));
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: out-pointers to locals; the library is present.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { nv::nvrtcVersion(&mut a, &mut b) }))
        .map_err(|_| err(missing_nvrtc()))?;
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(err(format!("nvrtcVersion failed: {r:?}")));
    }
    Ok((a, b))
}

fn missing_nvrtc() -> String {
    "libnvrtc (NVRTC, CUDA 13) was not found: install the CUDA toolkit or the pip wheel nvidia-cuda-nvrtc, \
     and put its lib folder (e.g. /usr/local/cuda/lib64) on LD_LIBRARY_PATH"
        .into()
}

/// The folder holding cuda_fp16.h / cuda_bf16.h: `first` (RLX_CUDA_INCLUDE),
/// $CUDA_HOME/include, $CUDA_PATH/include, /usr/local/cuda/include, or a pip
/// `nvidia/cu13/include` next to the loaded libnvrtc.
pub fn find_include_dir(first: Option<&Path>) -> Result<PathBuf> {
    let mut tried: Vec<PathBuf> = Vec::new();
    let mut cands: Vec<PathBuf> = first.map(Path::to_path_buf).into_iter().collect();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            cands.push(Path::new(&d).join("include"));
        }
    }
    cands.push(PathBuf::from("/usr/local/cuda/include"));
    // pip wheels: lib/ and include/ are siblings under nvidia/cu13.
    if let Ok(paths) = std::env::var("LD_LIBRARY_PATH") {
        for p in paths.split(':').filter(|p| !p.is_empty()) {
            if let Some(parent) = Path::new(p).parent() {
                cands.push(parent.join("include"));
            }
        }
    }
    for c in cands {
        if c.join("cuda_fp16.h").is_file() && c.join("cuda_bf16.h").is_file() {
            return Ok(c);
        }
        tried.push(c);
    }
    let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    Err(err(format!(
        "cuda_fp16.h / cuda_bf16.h not found (NVRTC needs them for half types); looked in: {}. \
         Set RLX_CUDA_INCLUDE or CUDA_HOME, or install the headers of the pip wheel nvidia-cuda-runtime",
        tried.join(", ")
    )))
}

/// SHA-256 over the half-precision headers NVRTC includes from the
/// toolkit (whichever of them exist), read once per folder per process.
fn toolkit_headers_digest(include: &Path) -> [u8; 32] {
    static CACHE: std::sync::Mutex<Vec<(PathBuf, [u8; 32])>> = std::sync::Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, d)) = cache.iter().find(|(p, _)| p == include) {
        return *d;
    }
    let mut h = Sha256::new();
    for name in ["cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"] {
        h.update(name.as_bytes());
        h.update(std::fs::read(include.join(name)).unwrap_or_default());
    }
    let d: [u8; 32] = h.finalize().into();
    cache.push((include.to_path_buf(), d));
    d
}

fn nvrtc_options(arch: &str, include: &Path, ptxas_verbose: bool) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), format!("-I{}", include.display()), "--std=c++17".into()];
    // ptxas prints each kernel's registers, shared memory and spills.
    if ptxas_verbose {
        o.push("--ptxas-options=-v".into());
    }
    o
}

/// Compiles (or loads from the disk cache in `cfg.kernel_cache`) one source
/// file to a CUBIN for `arch` (`sm_90`, `sm_89`, ...).
pub fn compile_cubin(file: &str, source: &str, arch: &str, cfg: &CudaOptions) -> Result<Vec<u8>> {
    cubin_or_cached(file, source, arch, cfg).map(|(cubin, _)| cubin)
}

/// `compile_cubin`, and whether it compiled (the cache had no good copy).
/// The first compile of the process says so on stderr: a cold cache costs
/// seconds to tens of seconds, once per machine.
fn cubin_or_cached(file: &str, source: &str, arch: &str, cfg: &CudaOptions) -> Result<(Vec<u8>, bool)> {
    let version = nvrtc_version()?;
    let include = find_include_dir(cfg.cuda_include.as_deref())?;
    let opts = nvrtc_options(arch, &include, cfg.ptxas_verbose);
    // The parameter structs' sizes and offsets, checked against their Rust twins.
    let source = &format!("{source}\n{}", crate::params::asserts(&with_headers(source)));
    let mut h = Sha256::new();
    let headers = HEADERS.iter().map(|(_, text)| *text);
    for part in [source.as_str(), &opts.join(" "), &format!("{arch} {version:?}")].into_iter().chain(headers) {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    // The toolkit's half/bf16 headers by content, not just by folder: an
    // updated toolkit in the same place must not reuse stale CUBINs.
    h.update(toolkit_headers_digest(&include));
    h.update(kernel_cache::FORMAT.as_bytes());
    let key: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    let path = cfg.kernel_cache.join(kernel_cache::file_name(file, arch, &key));
    // A file that fails the host-side checks (cut short, edited, another
    // format) is compiled again and replaced, never handed to the driver.
    if let Ok(bytes) = std::fs::read(&path) {
        if let Ok(cubin) = kernel_cache::decode(&bytes) {
            return Ok((cubin.to_vec(), false));
        }
    }
    if !ANNOUNCED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "rlx-cuda: compiling CUDA kernels for {arch} with NVRTC (once per machine and version; kept in {})",
            cfg.kernel_cache.display()
        );
    }
    let cubin = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compile_uncached(file, source, &opts)))
        .map_err(|_| err(missing_nvrtc()))??;
    // The cache is an optimisation: failing to write it is not an error.
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, kernel_cache::encode(&cubin)).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((cubin, true))
}

fn compile_uncached(file: &str, source: &str, opts: &[String]) -> Result<Vec<u8>> {
    let bad = |what: &str| err(format!("{file}: {what} contains a NUL byte"));
    let src = CString::new(source).map_err(|_| bad("source"))?;
    let name = CString::new(file).map_err(|_| bad("name"))?;
    let hsrc: Vec<CString> =
        HEADERS.iter().map(|(_, t)| CString::new(*t)).collect::<std::result::Result<_, _>>().map_err(|_| bad("a header"))?;
    let hname: Vec<CString> =
        HEADERS.iter().map(|(n, _)| CString::new(*n)).collect::<std::result::Result<_, _>>().map_err(|_| bad("a header name"))?;
    let copts: Vec<CString> =
        opts.iter().map(|o| CString::new(o.as_str())).collect::<std::result::Result<_, _>>().map_err(|_| bad("an option"))?;
    let opt_ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let headers: Vec<*const c_char> = hsrc.iter().map(|c| c.as_ptr()).collect();
    let names: Vec<*const c_char> = hname.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string; prog is destroyed below.
    unsafe {
        let r = nv::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), headers.len() as i32, headers.as_ptr(), names.as_ptr());
        if r != nv::nvrtcResult::NVRTC_SUCCESS {
            return Err(err(format!("{file}: nvrtcCreateProgram failed: {r:?}")));
        }
        let r = nv::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let mut log_len = 0usize;
        nv::nvrtcGetProgramLogSize(prog, &mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        nv::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
        let log = CStr::from_bytes_until_nul(&log).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        let out = if r != nv::nvrtcResult::NVRTC_SUCCESS {
            Err(err(format!("{file}: NVRTC compile failed ({r:?}) with options {opts:?}:\n{log}")))
        } else {
            let mut n = 0usize;
            let r = nv::nvrtcGetCUBINSize(prog, &mut n);
            let mut bin = vec![0u8; n];
            if r == nv::nvrtcResult::NVRTC_SUCCESS
                && n > 0
                && nv::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char) == nv::nvrtcResult::NVRTC_SUCCESS
            {
                if opts.iter().any(|o| o == "--ptxas-options=-v") {
                    eprintln!("{file} ({}):\n{log}", opts[0]);
                }
                Ok(bin)
            } else {
                Err(err(format!("{file}: NVRTC produced no CUBIN ({r:?})")))
            }
        };
        nv::nvrtcDestroyProgram(&mut prog);
        out
    }
}

/// Compiles every kernel file for a device of compute capability `arch`
/// without a GPU (the CI check); returns (file, architecture, CUBIN bytes).
pub fn compile_all(arch: (i32, i32), opts: &CudaOptions) -> Result<Vec<(&'static str, String, usize)>> {
    let files: Vec<Source> = sources_for(arch).into_iter().chain(decode_sources_for(arch)).chain(fault_sources_for(arch)).collect();
    let bins = compile_many(&files, opts)?;
    let mut out: Vec<(&'static str, String, usize)> = files
        .into_iter()
        .zip(bins)
        .map(|((file, _, arch, part), bin)| (file, part.map_or(arch.clone(), |p| format!("{arch} part {p}")), bin.len()))
        .collect();
    let sm = format!("sm_{}{}", arch.0, arch.1);
    for (h, i) in FFN_CHECK_WIDTHS {
        let bin = compile_cubin("ffn.cu", &ffn_source(h, i), &sm, opts)?;
        out.push(("ffn.cu", format!("{sm} H {h} I {i}"), bin.len()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The part numbers a kernel file's text selects with `IN_PART(n)`.
    fn parts_in(text: &str) -> std::collections::BTreeSet<usize> {
        text.split("IN_PART(").skip(1).filter_map(|rest| rest.split(')').next()?.trim().parse().ok()).collect()
    }

    /// Each split file selects exactly parts 0..n (a part the list misses
    /// would leave its kernels out of every program), and no other file
    /// selects any.
    #[test]
    fn parts_cover_every_instantiation() {
        let files: Vec<&(&str, &str)> = SOURCES.iter().chain(DECODE_SOURCES).chain(FAULT_SOURCES).collect();
        for (name, n) in PARTS {
            let text = files.iter().find(|(f, _)| f == name).unwrap_or_else(|| panic!("{name} is in PARTS but not a kernel file")).1;
            assert_eq!(parts_in(text), (0..*n).collect(), "{name}: IN_PART numbers against PARTS");
        }
        for (name, text) in &files {
            if !PARTS.iter().any(|(f, _)| f == name) {
                assert!(parts_in(text).is_empty(), "{name} selects parts but is not in PARTS");
            }
        }
        let progs = sources_for((9, 0));
        assert_eq!(progs.iter().filter(|(f, ..)| *f == "attention_dec.cu").count(), 8);
        assert!(progs.iter().all(|(_, text, arch, part)| arch == "sm_90" && (part.is_none() || text.starts_with("#define KERNEL_PART "))));
    }
}
