//! The by-value parameter struct of every kernel, as a `#[repr(C)]` Rust
//! twin of the struct of the same name in kernels/*.cu. A launch takes a
//! twin (`Params::new`), never loose words, and three checks keep the two
//! sides equal:
//! - `asserts` appends `static_assert`s of each twin's size and field
//!   offsets to every kernel file that defines the struct, so NVRTC (at run
//!   time and in scripts/check-kernels) refuses a file that drifted;
//! - a unit test compares each twin's field names, in order, with the C
//!   declaration;
//! - at load, each function's parameter size from the driver
//!   (`cuFuncGetParamInfo`) is compared with the twin at every launch step
//!   built for it (src/launch.rs `Op::kernel`).
//!
//! Pointers are `u64` device addresses (0 for null), `i64` is C's
//! `long long`, `f64` C's `double`: every field is 8 bytes, so no struct
//! has padding.

use bytemuck::{Pod, Zeroable};

/// Elements of the fixed shape and stride arrays (`MAX_RANK` in kernels/common.cuh).
pub(crate) const MAX_RANK: usize = 8;
/// Copies per `copy_many` launch (`COPY_MANY` in kernels/elementwise.cu).
pub(crate) const COPY_MANY: usize = 8;

/// A kernel parameter struct with a C twin of the same name and layout.
pub(crate) trait KernelParams: Pod {
    /// The C struct's name.
    const NAME: &'static str;
    /// Each field's name and byte offset, in declaration order.
    const FIELDS: &'static [(&'static str, usize)];
}

/// Declares the twins and `TWINS`, the list of (name, size, fields).
macro_rules! kernel_params {
    ($( $(#[$doc:meta])* struct $name:ident { $($field:ident : $ty:ty),* $(,)? } )*) => {
        $(
            $(#[$doc])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
            pub(crate) struct $name { $(pub $field: $ty),* }

            impl KernelParams for $name {
                const NAME: &'static str = stringify!($name);
                const FIELDS: &'static [(&'static str, usize)] = &[$((stringify!($field), std::mem::offset_of!($name, $field))),*];
            }
        )*

        /// Every twin: (name, size in bytes, fields).
        pub(crate) const TWINS: &[(&str, usize, &[(&str, usize)])] =
            &[$((stringify!($name), std::mem::size_of::<$name>(), <$name as KernelParams>::FIELDS)),*];
    };
}

kernel_params! {
    /// Attention (kernels/attention.cu, kernels/attention_mma.cu).
    struct AttnP {
        q: u64, k: u64, v: u64, mask: u64, valid: u64, out: u64,
        batch: i64, heads: i64, kv_heads: i64, hd: i64, q_len: i64, kv_len: i64, causal: i64, mask_dt: i64,
        qbs: i64, qrs: i64, kbs: i64, krs: i64, vbs: i64, vrs: i64, scale: f64, err: u64, valid_pb: i64,
    }
    /// A decode step's attention with its KV-cache append (kernels/attention_dec.cu `attention_app*`).
    struct AttnAppP {
        q: u64, kn: u64, vn: u64, kc: u64, vc: u64, wpos: u64, rpos: u64, factors: u64,
        valid: u64, mask: u64, out: u64, err: u64,
        batch: i64, heads: i64, kv_heads: i64, hd: i64, kv_len: i64, mask_dt: i64,
        qbs: i64, knbs: i64, vnbs: i64, kbs: i64, krs: i64, vbs: i64, vrs: i64,
        wpos_pb: i64, rpos_pb: i64, valid_pb: i64, rope: i64, theta: f64, scale: f64,
        part: u64, cnt: u64, chunk: i64,
    }
    /// Broadcasting binary ops (kernels/elementwise.cu `binary*`).
    struct BinaryP {
        a: u64, b: u64, out: u64, n: i64, rank: i64, op: i64,
        shape: [i64; MAX_RANK], sa: [i64; MAX_RANK], sb: [i64; MAX_RANK],
    }
    /// Activations.
    struct ActP { x: u64, out: u64, n: i64, act: i64 }
    /// The matmul epilogue cuBLASLt cannot fuse.
    struct EpilogueP { out: u64, res: u64, n: i64, act: i64 }
    /// Casts between any two element types.
    struct CastP { src: u64, dst: u64, n: i64, from: i64, to: i64 }
    /// Strided copies.
    struct CopyP {
        src: u64, dst: u64, n: i64, rank: i64, esize: i64,
        shape: [i64; MAX_RANK], ss: [i64; MAX_RANK], ds: [i64; MAX_RANK],
    }
    /// Pitched fills (memset nodes made kernels).
    struct FillP { dst: u64, pitch: i64, width: i64, height: i64, value: i64, esize: i64 }
    /// L2 prefetches of weights.
    struct PrefetchP { ptr: u64, bytes: i64 }
    /// The trapping kernel of the fault-injection hook (kernels/fault.cu).
    struct TrapP { when: i64 }
    /// Up to `COPY_MANY` byte copies and one flag store.
    struct CopyManyP { n: i64, fill: u64, fill_value: i64, dst: [u64; COPY_MANY], src: [u64; COPY_MANY], bytes: [i64; COPY_MANY] }
    /// SwiGLU.
    struct SwiGluP { gate: u64, up: u64, out: u64, rows: i64, cols: i64, gs: i64, us: i64 }
    /// The fused feed-forward block (kernels/ffn.cu); the tail fields are
    /// zero for the kernel without the output projection.
    struct FfnRowsP {
        x: u64, w1: u64, b1: u64, w2: u64, b2: u64, res1: u64, res2: u64, gamma: u64, beta: u64, out: u64,
        m: i64, lda: i64, rows: i64, rms: i64, eps: f64,
        xa: u64, wo: u64, bo: u64, res0a: u64, res0: u64, g1: u64, be1: u64, out1: u64, lda_a: i64, rms1: i64, eps1: f64,
    }
    /// Row gathers (kernels/indexed.cu).
    struct GatherP { table: u64, ids: u64, out: u64, err: u64, n: i64, dim: i64, vocab: i64, id64: i64, esize: i64 }
    /// State writes.
    struct WriteStateP {
        state: u64, value: u64, pos: u64, err: u64, batch: i64, max_rows: i64, new_rows: i64, width: i64, esize: i64, per_batch: i64, from: i64,
        to: i64,
    }
    /// Rotary position embeddings.
    struct RopeP {
        x: u64, pos: u64, out: u64, factors: u64, batch: i64, seq: i64, heads: i64, hd: i64, xbs: i64, xrs: i64, mode: i64, per_batch: i64,
        theta: f64,
    }
    /// LayerNorm / RmsNorm (kernels/rows.cu).
    struct NormP { x: u64, res: u64, gamma: u64, beta: u64, out: u64, rows: i64, cols: i64, rms: i64, eps: f64 }
    /// The fused embedding gather, adds and LayerNorm.
    struct EmbedNormP {
        table: u64, ids: u64, add0: u64, add1: u64, gamma: u64, beta: u64, out: u64, err: u64,
        rows: i64, cols: i64, vocab: i64, id64: i64, rows0: i64, rows1: i64, eps: f64,
    }
    /// Softmax, reductions and argmax along one axis.
    struct AxisP { x: u64, out: u64, outer: i64, len: i64, inner: i64, op: i64 }
    /// The masked mean over a sequence.
    struct MaskedMeanP { x: u64, mask: u64, out: u64, batch: i64, seq: i64, dim: i64, mask_dt: i64, out_dt: i64 }
    /// Matmuls over block-quantized weights (kernels/decode.cu, qmma.cu).
    struct QMatMulP {
        a: u64, w: u64, out: u64, gamma: u64, res: u64, rows: i64, n: i64, k: i64, lda: i64, row_bytes: i64, glu: i64, eps: f64,
    }
    /// A library quantized matmul's activations in 16 bits, normed or not (kernels/qlib.cu).
    struct QPrepP { a: u64, gamma: u64, out: u64, rows: i64, k: i64, lda: i64, eps: f64 }
    /// Weights decoded into 16-bit rows (kernels/qlib.cu).
    struct QDequantP { w: u64, out: u64, n: i64, k: i64, row_bytes: i64 }
    /// SwiGLU over a library quantized matmul's products (kernels/qlib.cu).
    struct QGluP { g: u64, out: u64, res: u64, rows: i64, n: i64 }
    /// Embedding gathers from block-quantized tables.
    struct QGatherP { table: u64, ids: u64, out: u64, err: u64, n: i64, dim: i64, vocab: i64, id64: i64, row_bytes: i64, fmt: i64 }
    /// Integer binary ops.
    struct IntBinaryP {
        a: u64, b: u64, out: u64, err: u64, n: i64, rank: i64, op: i64, wide: i64,
        shape: [i64; MAX_RANK], sa: [i64; MAX_RANK], sb: [i64; MAX_RANK],
    }
    /// Next-token sampling.
    struct SampleP {
        logits: u64, fparams: u64, iparams: u64, history: u64, pos: u64, out: u64, err: u64,
        batch: i64, vocab: i64, hist_len: i64, bitmap_words: i64,
    }
}

/// A count or size as the kernels' `long long` (saturating: no size
/// reaches it).
pub(crate) fn i(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A shape or stride list as a fixed, zero-padded array.
pub(crate) fn arr(v: impl IntoIterator<Item = u64>) -> [i64; MAX_RANK] {
    let mut a = [0i64; MAX_RANK];
    for (d, x) in a.iter_mut().zip(v) {
        *d = x as i64;
    }
    a
}

/// One kernel's parameter struct as it is handed to the driver: made only
/// from a twin, so its bytes are a whole C struct.
#[derive(Clone, Debug)]
pub(crate) struct Params {
    /// The struct's bytes in 8-byte words (every twin is a multiple of 8).
    words: Vec<u64>,
    pub name: &'static str,
}

impl Params {
    pub fn new<T: KernelParams>(p: &T) -> Params {
        let bytes = bytemuck::bytes_of(p);
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Params { words, name: T::NAME }
    }
    /// The struct's size in bytes.
    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }
    /// Where the struct starts (kernelParams[0] of a launch).
    pub fn as_ptr(&self) -> *const u64 {
        self.words.as_ptr()
    }
}

/// What `asserts` builds on: a tag array per pointee type (whose element
/// addresses are distinct constants) and `RLX_TWIN_V(S, F, K)`, a value of
/// field F's type (its element type for an array) that encodes K. NVRTC has
/// no `offsetof`, so the checks initialise a constexpr copy of the struct
/// positionally, with K for the K-th field of the Rust twin, and read each
/// field back by name: a field out of place reads another field's K.
const ASSERT_HELPERS: &str = "\
template <class T> __device__ T rlx_twin_tag[64];
template <class T> struct RlxTwinBase { typedef T type; };
template <class T> struct RlxTwinBase<const T> { typedef T type; };
template <> struct RlxTwinBase<void> { typedef char type; };
template <> struct RlxTwinBase<const void> { typedef char type; };
template <class F, int K> struct RlxTwinVal { static constexpr F v = F(K); };
template <class T, int K> struct RlxTwinVal<T*, K> { static constexpr T* v = rlx_twin_tag<typename RlxTwinBase<T>::type> + K; };
template <class A> struct RlxTwinElem { typedef A type; };
template <class T, decltype(sizeof(0)) N> struct RlxTwinElem<T[N]> { typedef T type; };
#define RLX_TWIN_V(S, F, K) RlxTwinVal<RlxTwinElem<decltype(S::F)>::type, K>::v
";

/// Each field of a twin: (name, offset, size in bytes).
fn field_sizes(size: usize, fields: &[(&'static str, usize)]) -> Vec<(&'static str, usize, usize)> {
    fields.iter().enumerate().map(|(k, &(f, off))| (f, off, fields.get(k + 1).map_or(size, |n| n.1) - off)).collect()
}

/// Compile-time checks that each struct `source` defines has its Rust
/// twin's layout: the size, each field's size, and each field's place in
/// the declaration order (which, with every field 8 bytes or an array of
/// them, fixes every offset). Appended to the file before NVRTC compiles it.
pub(crate) fn asserts(source: &str) -> String {
    let mut out = String::new();
    for (name, size, fields) in TWINS {
        if !source.contains(&format!("struct {name} {{")) {
            continue;
        }
        if out.is_empty() {
            out.push_str("// Layout checks against the Rust twins (src/params.rs).\n");
            out.push_str(ASSERT_HELPERS);
        }
        let fields = field_sizes(*size, fields);
        let init: Vec<String> = fields
            .iter()
            .enumerate()
            .map(|(k, (f, _, sz))| {
                let v = format!("RLX_TWIN_V({name}, {f}, {k})");
                if *sz > 8 {
                    format!("{{{v}}}")
                } else {
                    v
                }
            })
            .collect();
        out.push_str(&format!("constexpr {name} rlx_twin_{name}{{{}}};\n", init.join(", ")));
        out.push_str(&format!("static_assert(sizeof({name}) == {size}, \"{name}: {size} bytes in its Rust twin (src/params.rs)\");\n"));
        for (k, (f, off, sz)) in fields.iter().enumerate() {
            let read = if *sz > 8 { format!("rlx_twin_{name}.{f}[0]") } else { format!("rlx_twin_{name}.{f}") };
            out.push_str(&format!(
                "static_assert(sizeof({name}::{f}) == {sz} && {read} == RLX_TWIN_V({name}, {f}, {k}), \"{name}.{f}: field {k}, {sz} bytes at byte {off}, in its Rust twin (src/params.rs)\");\n"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `struct <Name>P { ... };` of the kernel files: (name, field
    /// names in order).
    fn c_structs() -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        for (file, text) in crate::nvrtc::SOURCES
            .iter()
            .chain(&[("ffn.cu", crate::nvrtc::FFN_SOURCE)])
            .chain(crate::nvrtc::DECODE_SOURCES)
            .chain(crate::nvrtc::FAULT_SOURCES)
            .chain(crate::nvrtc::HEADERS)
        {
            let code: String = text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
            let mut rest = code.as_str();
            while let Some(at) = rest.find("struct ") {
                rest = &rest[at + 7..];
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                let after = rest[name.len()..].trim_start();
                if !name.ends_with('P') || !after.starts_with('{') {
                    continue;
                }
                let body = &after[1..after.find("};").unwrap_or_else(|| panic!("{file}: struct {name} has no end"))];
                let fields = body
                    .split(';')
                    .map(|d| d.split('[').next().unwrap_or("").trim())
                    .filter(|d| !d.is_empty())
                    .map(|d| d.rsplit(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or("").to_string())
                    .collect();
                out.push((name, fields));
            }
        }
        out
    }

    #[test]
    fn every_kernel_struct_has_a_twin_with_the_same_fields() {
        let structs = c_structs();
        assert!(structs.len() >= TWINS.len(), "{structs:?}");
        for (name, fields) in &structs {
            let Some((_, _, twin)) = TWINS.iter().find(|t| t.0 == name) else { panic!("struct {name} has no Rust twin in src/params.rs") };
            let twin: Vec<&str> = twin.iter().map(|f| f.0).collect();
            assert_eq!(fields, &twin, "{name}: C fields against its Rust twin");
        }
        for (name, ..) in TWINS {
            assert!(structs.iter().any(|s| s.0 == *name), "twin {name} has no struct in kernels/*.cu");
        }
    }

    #[test]
    fn asserts_cover_each_defined_struct_and_no_other() {
        assert_eq!(asserts("struct Other { int x; };"), "");
        let a = asserts("struct NormP {\n    const void* x;\n};\nstruct BinaryP { int y; };");
        assert!(a.contains("sizeof(NormP) == 72"), "{a}");
        assert!(a.contains("sizeof(NormP::eps) == 8 && rlx_twin_NormP.eps == RLX_TWIN_V(NormP, eps, 8)"), "{a}");
        assert!(a.contains("sizeof(BinaryP::sb) == 64 && rlx_twin_BinaryP.sb[0] == RLX_TWIN_V(BinaryP, sb, 8)"), "{a}");
        assert!(a.contains("{RLX_TWIN_V(BinaryP, shape, 6)}"), "{a}");
        assert!(!a.contains("AttnP"), "{a}");
        assert_eq!(a.matches("template <class T> __device__ T rlx_twin_tag").count(), 1, "helpers once per file");
    }

    #[test]
    fn params_hold_the_struct_bytes() {
        let p = Params::new(&PrefetchP { ptr: 0x1000, bytes: 77 });
        assert_eq!((p.bytes(), p.name), (16, "PrefetchP"));
        // SAFETY: as_ptr points at the two words of a live Vec.
        let words = unsafe { std::slice::from_raw_parts(p.as_ptr(), 2) };
        assert_eq!(words, [0x1000, 77]);
    }
}
