//! Token-level kernels against f64 references: rotary embeddings (both
//! layouts, shared and per-batch positions, strided input), embedding
//! gather (and its out-of-range error), state writes (and the position
//! error). f32 tolerance 1e-5, f16/bf16 1e-2.

mod reference;

use rand::Rng;
use reference::*;
use rlx_ir::{DType, RopeMode};
use rlx_schedule::{SeqView, Thunk};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn rope_random() {
    for seed in 0..24 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let mode = if seed % 2 == 0 { RopeMode::RotateHalf } else { RopeMode::Interleaved };
        let (batch, seq, heads) = (r.random_range(1..3), r.random_range(1..20), r.random_range(1..4));
        let hd = 2 * r.random_range(1..17);
        let per_batch = r.random_bool(0.5);
        let theta = [10000.0f32, 500000.0][r.random_range(0..2)];
        let w = heads * hd;
        // x is a narrow of a wider row (e.g. q out of a QKV projection).
        let row = w + 5;
        let x = values(&mut r, batch * seq * row, dtype);
        let npos = if per_batch { batch * seq } else { seq };
        let pos: Vec<i64> = (0..npos).map(|_| r.random_range(0..4000)).collect();
        // Every third seed scales the frequencies (llama3-style factors).
        let factors: Option<Vec<f64>> = (seed % 3 == 0).then(|| (0..hd / 2).map(|_| r.random_range(1.0..8.0f32) as f64).collect());
        let mut p = Plan::new();
        let xb = p.input("x", &[batch, seq, row], dtype);
        let pb = p.input("pos", &[npos], DType::I32);
        let fb = factors.as_ref().map(|_| p.input("factors", &[hd / 2], DType::F32));
        let out = p.output("y", &[batch, seq, w], dtype);
        p.push(Thunk::Rope {
            dtype,
            mode,
            theta,
            batch,
            seq,
            heads,
            head_dim: hd,
            x: SeqView { buf: xb, batch_stride: (seq * row) as u64, row_stride: row as u64 },
            positions: pb,
            positions_per_batch: per_batch,
            out,
            freq_factors: fb,
        });
        let mut want = vec![0.0; batch * seq * w];
        for b in 0..batch {
            for s in 0..seq {
                let ps = pos[if per_batch { b * seq + s } else { s }] as f64;
                for h in 0..heads {
                    let xi = |d: usize| x[(b * seq + s) * row + h * hd + d];
                    let o = (b * seq + s) * w + h * hd;
                    for i in 0..hd / 2 {
                        let f = factors.as_ref().map_or(1.0, |f| f[i]);
                        let ang = ps * (theta as f64).powf(-2.0 * i as f64 / hd as f64) / f;
                        let (sn, cs) = ang.sin_cos();
                        let (a, bb) = match mode {
                            RopeMode::RotateHalf => (i, i + hd / 2),
                            RopeMode::Interleaved => (2 * i, 2 * i + 1),
                        };
                        want[o + a] = xi(a) * cs - xi(bb) * sn;
                        want[o + bb] = xi(bb) * cs + xi(a) * sn;
                    }
                }
            }
        }
        let xt = tensor(&[batch, seq, row], dtype, &x);
        let pt = ints(&[npos], DType::I32, &pos);
        let mut ins = vec![("x", &xt), ("pos", &pt)];
        let ft = factors.as_ref().map(|f| tensor(&[hd / 2], DType::F32, f));
        if let Some(ft) = &ft {
            ins.push(("factors", ft));
        }
        let got = p.run(&ins).expect("rope runs");
        assert_close(
            &got[0],
            &want,
            tol(dtype, TOL_ELEMENTWISE),
            &format!("rope seed {seed} {dtype} {mode:?} per_batch {per_batch} factors {}", factors.is_some()),
        );
    }
}

fn gather_plan(dtype: DType, id_dtype: DType, n: usize, dim: usize, vocab: usize, table: &[f64]) -> Plan {
    let mut p = Plan::new();
    let tb = p.weight("table", tensor(&[vocab, dim], dtype, table));
    let ids = p.input("ids", &[n], id_dtype);
    let out = p.output("y", &[n, dim], dtype);
    p.push(Thunk::Gather { dtype, id_dtype, n, dim, vocab, table: tb, ids, out });
    p
}

#[test]
fn gather_random() {
    for seed in 0..12 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let id_dtype = if seed % 2 == 0 { DType::I32 } else { DType::I64 };
        let (n, dim, vocab) = (r.random_range(1..50), r.random_range(1..70), r.random_range(1..100));
        let table = values(&mut r, vocab * dim, dtype);
        let ids: Vec<i64> = (0..n).map(|_| r.random_range(0..vocab as i64)).collect();
        let want: Vec<f64> = ids.iter().flat_map(|&i| table[i as usize * dim..(i as usize + 1) * dim].to_vec()).collect();
        let got = gather_plan(dtype, id_dtype, n, dim, vocab, &table).run(&[("ids", &ints(&[n], id_dtype, &ids))]).expect("gather runs");
        assert_close(&got[0], &want, 0.0, &format!("gather seed {seed}"));
    }
}

#[test]
fn gather_bad_id_is_an_error() {
    let table = values(&mut rng(1), 10 * 4, DType::F32);
    for bad in [10i64, -1] {
        let p = gather_plan(DType::F32, DType::I64, 3, 4, 10, &table);
        let err = p.run(&[("ids", &ints(&[3], DType::I64, &[2, bad, 3]))]).expect_err("id out of range");
        let msg = err.to_string();
        assert!(msg.contains(&format!("id {bad}")) && msg.contains("position 1") && msg.contains("size 10"), "{msg}");
    }
}

fn state_plan(batch: usize, max_rows: usize, new_rows: usize, width: usize) -> Plan {
    let mut p = Plan::new();
    let st = p.state("cache", &[batch, max_rows, width], DType::F32);
    let value = p.input("value", &[batch, new_rows, width], DType::F32);
    let position = p.input("pos", &[1], DType::I32);
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
        positions_per_batch: false,
    });
    p
}

#[test]
fn write_state_appends_over_calls() {
    let (batch, max_rows, width) = (2, 9, 3);
    let mut exe = state_plan(batch, max_rows, 2, width).prepare(2).expect("prepare");
    let mut want = vec![0.0f64; batch * max_rows * width];
    let mut r = rng(4);
    for pos in [0usize, 2, 4, 7] {
        let vals = values(&mut r, batch * 2 * width, DType::F32);
        for b in 0..batch {
            for s in 0..2 {
                for c in 0..width {
                    want[(b * max_rows + pos + s) * width + c] = vals[(b * 2 + s) * width + c];
                }
            }
        }
        let v = tensor(&[batch, 2, width], DType::F32, &vals);
        exe.run(&[("value", &v), ("pos", &ints(&[1], DType::I32, &[pos as i64]))]).expect("write runs");
    }
    let state = exe.read_state("cache").expect("read state");
    assert_close(&state, &want, 0.0, "state after four writes");
    exe.reset_state().expect("reset");
    assert_close(&exe.read_state("cache").expect("read"), &vec![0.0; want.len()], 0.0, "state after reset");
}

#[test]
fn write_state_past_capacity_is_an_error() {
    let mut exe = state_plan(1, 4, 2, 3).prepare(1).expect("prepare");
    let v = tensor(&[1, 2, 3], DType::F32, &[1.0; 6]);
    for pos in [3i64, -1] {
        let err = exe.run(&[("value", &v), ("pos", &ints(&[1], DType::I32, &[pos]))]).expect_err("out of capacity");
        let msg = err.to_string();
        assert!(msg.contains(&format!("position {pos}")) && msg.contains("4 rows"), "{msg}");
    }
    // The executable still works after the error.
    exe.run(&[("value", &v), ("pos", &ints(&[1], DType::I32, &[2]))]).expect("in range");
}

/// Integer state (e.g. a token history) is written like any other.
#[test]
fn write_state_of_integers() {
    let mut p = Plan::new();
    let st = p.state("tokens", &[1, 4, 1], DType::I64);
    let value = p.input("value", &[1, 1, 1], DType::I64);
    let position = p.input("pos", &[1], DType::I32);
    p.push(Thunk::WriteState {
        dtype: DType::I64,
        value_dtype: DType::I64,
        batch: 1,
        max_rows: 4,
        new_rows: 1,
        width: 1,
        state: st,
        value,
        position,
        positions_per_batch: false,
    });
    let mut exe = p.prepare(1).expect("prepare");
    for (pos, tok) in [(0i64, 101i64), (1, 1 << 40), (3, -5)] {
        exe.run(&[("value", &ints(&[1, 1, 1], DType::I64, &[tok])), ("pos", &ints(&[1], DType::I32, &[pos]))]).expect("write");
    }
    assert_eq!(exe.read_state("tokens").expect("read"), ints(&[1, 4, 1], DType::I64, &[101, 1 << 40, 0, -5]));
}
