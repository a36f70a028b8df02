#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rlx_fuzz::gemm_choices(data));
