// The parameters of the attention kernels (attention.cu, attention_mma.cu,
// attention_dec.cu): q [batch, q_len, heads·hd] and k/v [batch, kv_len,
// kv_heads·hd] with batch and row strides in elements, an optional key mask
// and per-row valid lengths.
#pragma once
#include "common.cuh"

struct AttnP {
    const void* q; const void* k; const void* v; const void* mask; const int* valid; void* out;
    i64 batch; i64 heads; i64 kv_heads; i64 hd; i64 q_len; i64 kv_len; i64 causal; i64 mask_dt;
    i64 qbs; i64 qrs; i64 kbs; i64 krs; i64 vbs; i64 vrs; double scale; int* err;
    i64 valid_pb;  // valid holds one length per batch row
};
