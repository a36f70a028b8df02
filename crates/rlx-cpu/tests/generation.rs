//! The kernels generation adds, through thunks on the CPU executable:
//! attention and state writes with one value per batch row (against the
//! already-verified shared-value path, row by row, and a plain reference),
//! quantized matmul and gather (against dequantise-then-f64), and sampling
//! (greedy = argmax, seeded determinism, the filters' supports, and the
//! draw's frequencies against softmax(l / T)).

mod reference;

use rand::Rng;
use reference::*;
use rlx_cpu::quant;
use rlx_ir::{DType, QFormat};
use rlx_runtime::Tensor;
use rlx_schedule::{AttentionThunk, SeqView, Thunk};

/// Attention with a `[B]` valid length equals each row run alone with its
/// own `[1]` valid length.
#[test]
fn attention_per_row_valid_len_matches_row_by_row() {
    for seed in 0..12 {
        let mut r = rng(seed);
        let (batch, kv_heads, group, hd) = (r.random_range(2..5), r.random_range(1..3), r.random_range(1..4), 8 * r.random_range(1..5));
        let heads = kv_heads * group;
        let q_len = if seed % 3 == 0 { 1 } else { r.random_range(1..6) };
        let kv_len = r.random_range(q_len..q_len + 20);
        let valid: Vec<i64> = (0..batch).map(|_| r.random_range(q_len..=kv_len) as i64).collect();
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let q = values(&mut r, batch * q_len * qw, DType::F32);
        let k = values(&mut r, batch * kv_len * kw, DType::F32);
        let v = values(&mut r, batch * kv_len * kw, DType::F32);
        let plan = |b: usize, per_row: bool| {
            let mut p = Plan::new();
            let qb = p.input("q", &[b, q_len, qw], DType::F32);
            let kb = p.input("k", &[b, kv_len, kw], DType::F32);
            let vb = p.input("v", &[b, kv_len, kw], DType::F32);
            let lb = p.input("valid", &[if per_row { b } else { 1 }], DType::I32);
            let out = p.output("out", &[b, q_len, qw], DType::F32);
            let seq = |buf, len: usize, w: usize| SeqView { buf, batch_stride: (len * w) as u64, row_stride: w as u64 };
            p.push(Thunk::Attention(AttentionThunk {
                dtype: DType::F32,
                kv_dtype: DType::F32,
                batch: b,
                heads,
                kv_heads,
                head_dim: hd,
                q_len,
                kv_len,
                scale: 0.3,
                causal: true,
                q: seq(qb, q_len, qw),
                k: seq(kb, kv_len, kw),
                v: seq(vb, kv_len, kw),
                mask: None,
                mask_dtype: DType::I32,
                valid_len: Some(lb),
                valid_len_per_batch: per_row,
                out,
            }));
            p
        };
        let all = plan(batch, true)
            .run(&[
                ("q", &tensor(&[batch, q_len, qw], DType::F32, &q)),
                ("k", &tensor(&[batch, kv_len, kw], DType::F32, &k)),
                ("v", &tensor(&[batch, kv_len, kw], DType::F32, &v)),
                ("valid", &ints(&[batch], DType::I32, &valid)),
            ])
            .expect("per-row attention");
        let got = all[0].to_f32();
        for b in 0..batch {
            let one = plan(1, false)
                .run(&[
                    ("q", &tensor(&[1, q_len, qw], DType::F32, &q[b * q_len * qw..(b + 1) * q_len * qw])),
                    ("k", &tensor(&[1, kv_len, kw], DType::F32, &k[b * kv_len * kw..(b + 1) * kv_len * kw])),
                    ("v", &tensor(&[1, kv_len, kw], DType::F32, &v[b * kv_len * kw..(b + 1) * kv_len * kw])),
                    ("valid", &ints(&[1], DType::I32, &[valid[b]])),
                ])
                .expect("row attention");
            let want: Vec<f64> = one[0].to_f32().iter().map(|&x| x as f64).collect();
            let row = Tensor::from_f32([1, q_len, qw], &got[b * q_len * qw..(b + 1) * q_len * qw]).expect("tensor");
            assert_close(&row, &want, 0.0, &format!("seed {seed} row {b} valid {}", valid[b]));
        }
    }
}

#[test]
fn write_state_per_row_positions() {
    let (batch, max_rows, new_rows, width) = (3, 10, 2, 4);
    let mut p = Plan::new();
    let st = p.state("cache", &[batch, max_rows, width], DType::F32);
    let value = p.input("value", &[batch, new_rows, width], DType::F32);
    let position = p.input("pos", &[batch], DType::I32);
    p.push(Thunk::WriteState {
        dtype: DType::F32,
        value_dtype: DType::F32,
        batch,
        max_rows,
        new_rows,
        width,
        state: st,
        value,
        position,
        positions_per_batch: true,
    });
    let mut exe = p.prepare(1).expect("prepare");
    let mut want = vec![0.0f64; batch * max_rows * width];
    let mut r = rng(9);
    for pos in [[0i64, 3, 8], [2, 0, 5]] {
        let vals = values(&mut r, batch * new_rows * width, DType::F32);
        for b in 0..batch {
            for s in 0..new_rows {
                for c in 0..width {
                    want[(b * max_rows + pos[b] as usize + s) * width + c] = vals[(b * new_rows + s) * width + c];
                }
            }
        }
        exe.run(&[("value", &tensor(&[batch, new_rows, width], DType::F32, &vals)), ("pos", &ints(&[batch], DType::I32, &pos))])
            .expect("write");
    }
    assert_close(&exe.read_state("cache").expect("read"), &want, 0.0, "per-row writes");
    // One row out of range: an error naming it, and no row is written.
    let vals = vec![7.0; batch * new_rows * width];
    let err = exe
        .run(&[("value", &tensor(&[batch, new_rows, width], DType::F32, &vals)), ("pos", &ints(&[batch], DType::I32, &[1, 9, 0]))])
        .expect_err("row 1 does not fit");
    assert!(err.to_string().contains("position 9 (batch row 1)"), "{err}");
    assert_close(&exe.read_state("cache").expect("read"), &want, 0.0, "state untouched by the failed write");
}

/// qmatmul and qgather thunks against dequantise-then-f64.
#[test]
fn quantized_thunks_match_dequantised_reference() {
    for (seed, format) in QFormat::ALL.into_iter().enumerate() {
        let mut r = rng(100 + seed as u64);
        let k = format.block_elems() * r.random_range(1..4);
        let (rows, n) = (r.random_range(1..5), r.random_range(1..40));
        let wf: Vec<f32> = (0..n * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let mut w = vec![];
        for row in wf.chunks(k) {
            w.extend(quant::quantize_row(format, row).expect("quantize"));
        }
        let rb = format.row_bytes(k).expect("row bytes");
        let a: Vec<f32> = (0..rows * k).map(|_| r.random_range(-2.0f32..2.0)).collect();
        let mut p = Plan::new();
        let wb = p.weight("w", Tensor::from_bytes([n, rb], DType::U8, w.clone()).expect("w"));
        let ab = p.input("a", &[rows, k], DType::F32);
        let out = p.output("out", &[rows, n], DType::F32);
        p.push(Thunk::QMatMul {
            format,
            dtype: DType::F32,
            rows,
            n,
            k,
            a: ab,
            lda: k as u64,
            w: wb,
            out,
            norm: None,
            glu: false,
            residual: None,
            scratch: None,
        });
        let got = p.run(&[("a", &Tensor::from_f32([rows, k], &a).expect("a"))]).expect("qmatmul")[0].to_f32();
        // Reference: dequantised rows, f64 dot products.
        let mut deq = vec![0f32; n * k];
        for (j, row) in deq.chunks_mut(k).enumerate() {
            quant::dequantize_row(format, &w[j * rb..(j + 1) * rb], row).expect("dequantize");
        }
        for i in 0..rows {
            for j in 0..n {
                let want: f64 = (0..k).map(|c| a[i * k + c] as f64 * deq[j * k + c] as f64).sum();
                // Activations are rounded to int8 per block: |err| ≤ Σ |w|·amax/254 per block.
                let bound: f64 = (0..k / 32)
                    .map(|blk| {
                        let amax = (0..32).map(|c| a[i * k + blk * 32 + c].abs()).fold(0f32, f32::max) as f64;
                        let sw: f64 = (0..32).map(|c| deq[j * k + blk * 32 + c].abs() as f64).sum();
                        sw * amax / 254.0
                    })
                    .sum::<f64>()
                    * 1.01
                    + 1e-4;
                let d = (got[i * n + j] as f64 - want).abs();
                assert!(d <= bound, "{format} rows {rows} n {n} k {k}: out[{i},{j}] {} vs {want} (|diff| {d} > {bound})", got[i * n + j]);
            }
        }
        // Gather: the dequantised rows, exactly; an id out of range is an error.
        let mut p = Plan::new();
        let tb = p.weight("t", Tensor::from_bytes([n, rb], DType::U8, w.clone()).expect("t"));
        let ids = p.input("ids", &[3], DType::I32);
        let out = p.output("out", &[3, k], DType::F32);
        p.push(Thunk::QGather { format, id_dtype: DType::I32, n: 3, dim: k, vocab: n, table: tb, ids, out });
        let pick = [0i64, (n - 1) as i64, (n / 2) as i64];
        let got = p.run(&[("ids", &ints(&[3], DType::I32, &pick))]).expect("qgather")[0].to_f32();
        for (s, &id) in pick.iter().enumerate() {
            assert_eq!(&got[s * k..(s + 1) * k], &deq[id as usize * k..(id as usize + 1) * k], "{format} gather row {id}");
        }
    }
}

fn sample_plan(batch: usize, vocab: usize, hist: usize) -> Plan {
    let mut p = Plan::new();
    let logits = p.input("logits", &[batch, vocab], DType::F32);
    let fparams = p.input("f", &[batch, 4], DType::F32);
    let iparams = p.input("i", &[batch, 4], DType::I32);
    let history = p.input("hist", &[batch, hist], DType::I32);
    let position = p.input("pos", &[batch], DType::I32);
    let out = p.output("id", &[batch], DType::I32);
    p.push(Thunk::Sample { batch, vocab, history_len: hist, logits, fparams, iparams, history, position, out });
    p
}

struct Draw {
    temp: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    penalty: f32,
    seed: u64,
}

/// `n` draws from the same logits row, one per batch row: row r uses seed
/// `seed + r` at the position after `hist` (the penalty window covers all
/// of `hist`).
fn draws(logits: &[f32], d: &Draw, hist: &[i64], n: usize) -> Vec<i32> {
    let (v, hl) = (logits.len(), hist.len());
    let l: Vec<f32> = (0..n).flat_map(|_| logits.iter().copied()).collect();
    let f: Vec<f32> = (0..n).flat_map(|_| [d.temp, d.top_p, d.min_p, d.penalty]).collect();
    let i: Vec<i64> = (0..n as u64)
        .flat_map(|r| {
            let seed = d.seed.wrapping_add(r);
            [d.top_k as i64, hl as i64, (seed as u32) as i32 as i64, ((seed >> 32) as u32) as i32 as i64]
        })
        .collect();
    let h: Vec<i64> = (0..n).flat_map(|_| hist.iter().copied()).collect();
    let out = sample_plan(n, v, hl)
        .run(&[
            ("logits", &Tensor::from_f32([n, v], &l).expect("l")),
            ("f", &Tensor::from_f32([n, 4], &f).expect("f")),
            ("i", &ints(&[n, 4], DType::I32, &i)),
            ("hist", &ints(&[n, hl], DType::I32, &h)),
            ("pos", &ints(&[n], DType::I32, &vec![hl as i64 - 1; n])),
        ])
        .expect("sample");
    out[0].to_i32()
}

fn softmax(l: &[f32], t: f64) -> Vec<f64> {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = l.iter().map(|&x| ((x as f64 - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

#[test]
fn sampling_greedy_seeds_and_filters() {
    let mut r = rng(5);
    let logits: Vec<f32> = (0..50).map(|_| r.random_range(-3.0f32..3.0)).collect();
    let argmax = (0..50).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).expect("argmax") as i32;
    let base = Draw { temp: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, penalty: 1.0, seed: 42 };
    // Greedy, and top_k = 1, give the argmax at every position.
    assert!(draws(&logits, &Draw { temp: 0.0, ..base }, &[1], 20).iter().all(|&x| x == argmax));
    assert!(draws(&logits, &Draw { top_k: 1, ..base }, &[1], 20).iter().all(|&x| x == argmax));
    // Same seed, same draws; another seed, other draws.
    let a = draws(&logits, &base, &[1], 200);
    assert_eq!(a, draws(&logits, &base, &[1], 200));
    assert_ne!(a, draws(&logits, &Draw { seed: 43, ..base }, &[1], 200));
    // top_k = 5: only the 5 largest appear.
    let mut order: Vec<usize> = (0..50).collect();
    order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
    let top5: Vec<i32> = order[..5].iter().map(|&x| x as i32).collect();
    assert!(draws(&logits, &Draw { top_k: 5, ..base }, &[1], 300).iter().all(|x| top5.contains(x)));
    // top_p: only the smallest prefix reaching p.
    let p = softmax(&logits, 1.0);
    let mut acc = 0.0;
    let nucleus: Vec<i32> = order
        .iter()
        .take_while(|&&x| {
            let keep = acc < 0.5;
            acc += p[x];
            keep
        })
        .map(|&x| x as i32)
        .collect();
    assert!(draws(&logits, &Draw { top_p: 0.5, ..base }, &[1], 300).iter().all(|x| nucleus.contains(x)), "top_p support {nucleus:?}");
    // min_p: only tokens with p ≥ min_p · p_max.
    let pmax = p.iter().cloned().fold(0.0, f64::max);
    let above: Vec<i32> = (0..50).filter(|&x| p[x] >= 0.3 * pmax).map(|x| x as i32).collect();
    assert!(draws(&logits, &Draw { min_p: 0.3, ..base }, &[1], 300).iter().all(|x| above.contains(x)));
    // The repetition penalty moves the argmax off a recent token.
    let mut l2 = logits.clone();
    l2[7] = 10.0;
    l2[8] = 9.0;
    let greedy_pen = Draw { temp: 0.0, penalty: 2.0, ..base };
    assert!(draws(&l2, &greedy_pen, &[7, 3], 1).iter().all(|&x| x == 8), "penalised 7 (10/2 = 5 < 9)");
    assert!(draws(&l2, &greedy_pen, &[3, 4], 1).iter().all(|&x| x == 7), "7 not recent");
}

/// Frequencies of 20,000 draws at temperature 0.7 against softmax(l / 0.7):
/// every token within 5 standard deviations of its expected count.
#[test]
fn sampling_frequencies_follow_softmax() {
    let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 1.5];
    let n = 20_000;
    let got = draws(&logits, &Draw { temp: 0.7, top_k: 0, top_p: 1.0, min_p: 0.0, penalty: 1.0, seed: 3 }, &[0], n);
    let p = softmax(&logits, 0.7);
    for (t, &pt) in p.iter().enumerate() {
        let count = got.iter().filter(|&&x| x == t as i32).count() as f64;
        let (mean, sd) = (n as f64 * pt, (n as f64 * pt * (1.0 - pt)).sqrt());
        assert!((count - mean).abs() <= 5.0 * sd + 1.0, "token {t}: {count} draws, expected {mean:.0} ± {sd:.0}");
    }
}
