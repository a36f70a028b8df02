/// Prints what the CUDA backend finds on this machine (never fails: absence
/// is reported as such).
pub fn run() {
    println!("rlx {}", env!("CARGO_PKG_VERSION"));
    println!("{}", rlx::backends::cuda_doctor());
}
