//! Run-time CPU feature dispatch for the f32 row loops.
//!
//! The crate is compiled for baseline x86-64 (SSE2), so a plain loop only
//! vectorises 4 lanes wide. `multiversion!` compiles a function body three
//! times — for AVX-512 (x86-64-v4), AVX2 + FMA (v3) and baseline — and
//! picks one per call from the CPU's features (cached by std after the
//! first check). Bodies are ordinary safe Rust; the only unsafe here is
//! calling a `#[target_feature]` function, which is sound because the
//! feature was detected first.

/// Defines `fn $name(args) -> ret` whose body is compiled per feature level.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                if std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512dq")
                    && std::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the features v4 is compiled for were detected.
                    return unsafe { v4($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
                    // SAFETY: as above, for v3.
                    return unsafe { v3($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
pub(crate) use multiversion;
