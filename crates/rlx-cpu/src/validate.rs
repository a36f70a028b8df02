//! Prepare-time checks: every thunk is one this backend runs, and every
//! index its kernel will derive from dims and strides stays inside the
//! operand's `BufRef`, which stays inside its memory space. After this the
//! kernels can trust the schedule.

use rlx_ir::DType;
use rlx_schedule::operands::{check_operands, operands};
use rlx_schedule::Thunk;

use crate::memory::Mem;

fn float(dtype: DType, what: &str) -> Result<(), String> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be f32, f16 or bf16, found {dtype}"))
    }
}

/// The structural checks (dtypes, dims) that decide `Backend::supports`.
pub fn check_thunk(t: &Thunk) -> Result<(), String> {
    match t {
        Thunk::MatMul(mm) => float(mm.dtype, "matmul dtype"),
        Thunk::Binary { out_shape, a_strides, b_strides, .. } => {
            if a_strides.len() != out_shape.len() || b_strides.len() != out_shape.len() {
                return Err(format!("binary: {} dims but {} and {} strides", out_shape.len(), a_strides.len(), b_strides.len()));
            }
            Ok(())
        }
        Thunk::Activation { dtype, .. } => float(*dtype, "activation dtype"),
        Thunk::Norm { dtype, .. } => float(*dtype, "norm dtype"),
        Thunk::Softmax { dtype, .. } => float(*dtype, "softmax dtype"),
        Thunk::Reduce { dtype, .. } => float(*dtype, "reduce dtype"),
        Thunk::ArgMax { len, .. } => {
            if *len == 0 {
                return Err("argmax over an empty axis".into());
            }
            Ok(())
        }
        Thunk::TopK { len, k, .. } => {
            if k > len {
                return Err(format!("topk: k = {k} is larger than the axis ({len})"));
            }
            Ok(())
        }
        Thunk::Gather { dtype, id_dtype, .. } => {
            float(*dtype, "gather table dtype")?;
            if !id_dtype.is_int() {
                return Err(format!("gather ids must be i32 or i64, found {id_dtype}"));
            }
            Ok(())
        }
        Thunk::Copy { shape, src_strides, dst_strides, .. } => {
            if src_strides.len() != shape.len() || dst_strides.len() != shape.len() {
                return Err(format!("copy: {} dims but {} and {} strides", shape.len(), src_strides.len(), dst_strides.len()));
            }
            Ok(())
        }
        Thunk::Cast { .. } => Ok(()),
        Thunk::Attention(a) => {
            float(a.dtype, "attention dtype")?;
            float(a.kv_dtype, "attention key/value dtype")?;
            if a.kv_heads == 0 || a.heads % a.kv_heads != 0 {
                return Err(format!("attention: heads ({}) must be a multiple of kv_heads ({})", a.heads, a.kv_heads));
            }
            Ok(())
        }
        Thunk::AttentionAppend(t) => {
            let a = &t.attn;
            check_thunk(&Thunk::Attention(a.clone()))?;
            if t.rope.is_some() && a.head_dim % 2 != 0 {
                return Err(format!("attention_append: RoPE needs an even head_dim, found {}", a.head_dim));
            }
            Ok(())
        }
        Thunk::FeedForward(f) => {
            f.roles()?;
            f.parts.iter().try_for_each(check_thunk)
        }
        Thunk::Rope { dtype, head_dim, .. } => {
            float(*dtype, "rope dtype")?;
            if head_dim % 2 != 0 {
                return Err(format!("rope: head_dim must be even, found {head_dim}"));
            }
            Ok(())
        }
        Thunk::SwiGlu { dtype, .. } => float(*dtype, "swiglu dtype"),
        Thunk::MaskedMean { dtype, mask_dtype, out_dtype, .. } => {
            float(*dtype, "masked_mean dtype")?;
            float(*mask_dtype, "masked_mean mask dtype")?;
            float(*out_dtype, "masked_mean output dtype")
        }
        Thunk::EmbedNorm { dtype, id_dtype, addends, rows, .. } => {
            float(*dtype, "embed_norm dtype")?;
            if !id_dtype.is_int() {
                return Err(format!("embed_norm: ids must be i32 or i64, found {id_dtype}"));
            }
            match addends.iter().find(|(_, n)| *n == 0 || rows % n != 0) {
                Some((_, n)) => Err(format!("embed_norm: an addend of {n} rows does not repeat over {rows} rows")),
                None => Ok(()),
            }
        }
        Thunk::WriteState { dtype, value_dtype, .. } => {
            if dtype != value_dtype && !(dtype.is_float() && value_dtype.is_float()) {
                return Err(format!("write_state: a {value_dtype} value cannot be written into a {dtype} state"));
            }
            Ok(())
        }
        Thunk::QMatMul { dtype, format, k, .. } => {
            if *dtype != DType::F32 {
                return Err(format!("qmatmul on {dtype} activations (f32 only on the CPU)"));
            }
            match format.row_bytes(*k) {
                Some(_) => Ok(()),
                None => Err(format!("qmatmul: K = {k} is not a multiple of {format}'s block of {}", format.block_elems())),
            }
        }
        Thunk::QGather { id_dtype, format, dim, .. } => {
            if !id_dtype.is_int() {
                return Err(format!("qgather ids must be i32 or i64, found {id_dtype}"));
            }
            match format.row_bytes(*dim) {
                Some(_) => Ok(()),
                None => Err(format!("qgather: dim {dim} is not a multiple of {format}'s block of {}", format.block_elems())),
            }
        }
        Thunk::Sample { vocab, .. } => {
            if *vocab == 0 {
                return Err("sample over an empty vocabulary".into());
            }
            Ok(())
        }
    }
}

/// Structural checks, every operand inside its memory space and aligned
/// for its element type, and the backend-neutral operand checks
/// (`rlx_schedule::operands`).
pub fn validate_thunk(t: &Thunk, mem: &Mem) -> Result<(), String> {
    check_thunk(t)?;
    for op in operands(t) {
        mem.check(&op.buf, op.align).map_err(|e| format!("operand {}: {e}", op.what))?;
    }
    check_operands(t)
}
