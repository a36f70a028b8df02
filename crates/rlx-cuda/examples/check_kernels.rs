//! CI check without a GPU: compile every kernels/*.cu to a CUBIN through the
//! same code path the backend uses. Usage: check_kernels [sm_XY] (default sm_90).
fn main() {
    let arch = std::env::args().nth(1).unwrap_or_else(|| "sm_90".into());
    let digits = arch.trim_start_matches("sm_");
    let parsed = match (digits.get(..digits.len().saturating_sub(1)), digits.get(digits.len().saturating_sub(1)..)) {
        (Some(a), Some(b)) => a.parse::<i32>().ok().zip(b.parse::<i32>().ok()),
        _ => None,
    };
    let Some(cc) = parsed else {
        eprintln!("check_kernels: expected an architecture like sm_90, found {arch:?}");
        std::process::exit(2);
    };
    let opts = match rlx_cuda::CudaOptions::from_env() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("check_kernels: {e}");
            std::process::exit(2);
        }
    };
    // A fresh cache directory per run, so every file really compiles.
    let dir = std::env::temp_dir().join(format!("rlx-check-kernels-{}", std::process::id()));
    let res = rlx_cuda::check_kernels(cc, &rlx_cuda::CudaOptions { kernel_cache: dir.clone(), ..opts });
    let _ = std::fs::remove_dir_all(&dir);
    match res {
        Ok(files) => {
            for (f, name, n) in files {
                println!("ok  {f}: {n} bytes of {name} CUBIN");
            }
        }
        Err(e) => {
            eprintln!("check_kernels: {e}");
            std::process::exit(1);
        }
    }
}
