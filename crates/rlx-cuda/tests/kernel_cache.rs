//! The compiled-kernel cache on disk: damaged files (cut short, a flipped
//! byte, a bare CUBIN of the older format, garbage, empty) are compiled
//! again and replaced, never handed to the driver. Needs NVRTC only, no GPU
//! (skips without it unless RLX_REQUIRE_GPU=1).

use std::path::{Path, PathBuf};

use rlx_cuda::kernel_cache;
use rlx_cuda::CudaOptions;

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
        .collect();
    v.sort();
    v
}

#[test]
fn damaged_cache_files_are_recompiled_and_replaced() {
    let dir = std::env::temp_dir().join(format!("rlx-kernel-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = match CudaOptions::from_env() {
        Ok(o) => CudaOptions { kernel_cache: dir.clone(), ..o },
        Err(e) => panic!("{e}"),
    };
    let first = match rlx_cuda::check_kernels((9, 0), &opts) {
        Ok(f) => f,
        Err(e) if std::env::var("RLX_REQUIRE_GPU").is_ok_and(|v| v == "1") => panic!("RLX_REQUIRE_GPU=1 but NVRTC failed: {e}"),
        Err(e) => {
            eprintln!("skipping GPU test: no usable NVRTC: {e}");
            return;
        }
    };
    let files = cache_files(&dir);
    assert_eq!(files.len(), first.len(), "one cache file per kernel file: {files:?}");
    let good: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).collect();
    for (p, bytes) in files.iter().zip(&good) {
        assert!(kernel_cache::decode(bytes).is_ok(), "{} as written does not decode: {:?}", p.display(), kernel_cache::decode(bytes));
    }

    // Five kinds of damage, one per file (cycling when there are more files).
    for (i, (p, bytes)) in files.iter().zip(&good).enumerate() {
        let cubin = kernel_cache::decode(bytes).map(<[u8]>::to_vec).unwrap_or_default();
        let damaged: Vec<u8> = match i % 5 {
            0 => bytes[..bytes.len() / 2].to_vec(),
            1 => {
                let mut b = bytes.clone();
                b[bytes.len() / 3] ^= 0x40;
                b
            }
            2 => cubin,
            3 => b"not a cubin at all".to_vec(),
            _ => vec![],
        };
        assert!(kernel_cache::decode(&damaged).is_err(), "damage {i} still decodes");
        std::fs::write(p, damaged).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }

    let second = rlx_cuda::check_kernels((9, 0), &opts).unwrap_or_else(|e| panic!("compiling over a damaged cache: {e}"));
    assert_eq!(second, first, "the same CUBIN sizes after recompiling");
    for (p, bytes) in files.iter().zip(&good) {
        let now = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert_eq!(&now, bytes, "{} was not rewritten with the same CUBIN", p.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
