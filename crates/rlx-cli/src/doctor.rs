/// Prints what the CUDA backend finds on this machine (never fails: absence
/// is reported as such, and a stdout that cannot be written has no reader to
/// tell).
pub fn run() {
    let _ = crate::stdout::print(&format!("rlx {}\n{}", env!("CARGO_PKG_VERSION"), rlx::backends::cuda_doctor()));
}
