//! Whole-graph parity on the GPU: a bert-base-shaped encoder with seeded
//! random weights, CUDA (replay and eager) against the CPU backend with the
//! same weights; replay and eager must be bit-identical. Skips without a GPU
//! unless RLX_REQUIRE_GPU=1 (the GPU machine), where it must run.

mod common;

use common::gpu;
use rlx::{CompileOptions, DType, Device, PrepareOptions, Session, Tensor};
use rlx_models::{build_bert_graph, random_weights, BertConfig, BertGraphOptions};

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn bert_base_random_weights_cuda_vs_cpu_replay_vs_eager() {
    if !gpu("bert_base_random_weights_cuda_vs_cpu_replay_vs_eager") {
        return;
    }
    let cfg = BertConfig::bert_base();
    let (b, s) = (2, 128);
    let store = random_weights(&cfg, 7, DType::F32).expect("weights");
    let opts = BertGraphOptions { hidden_states: false, ..BertGraphOptions::default() };
    let graph = build_bert_graph(&cfg, b, s, &opts).expect("graph");
    let ids: Vec<i32> = (0..b * s).map(|i| ((i * 7919 + 13) % cfg.vocab_size) as i32).collect();
    // Second row padded after 77 tokens: the key-padding path runs.
    let mask: Vec<f32> = (0..b * s).map(|i| if i / s == 1 && i % s >= 77 { 0.0 } else { 1.0 }).collect();
    let ids = Tensor::from_i32([b, s], &ids).expect("ids");
    let mask = Tensor::from_f32([b, s], &mask).expect("mask");
    let inputs = [("input_ids", &ids), ("attention_mask", &mask)];

    let cpu = Session::with_weights(Device::Cpu, store.clone()).expect("cpu session");
    let want = cpu.compile(&graph).expect("cpu compile").run(&inputs).expect("cpu run")[0].to_f32();

    for (precision, min_cos, max_abs) in [(None, 0.999999, 2e-3f32), (Some(DType::F16), 0.9995, 5e-2), (Some(DType::BF16), 0.998, 1.5e-1)] {
        let mut outs = vec![];
        for replay in [true, false] {
            let mut s = Session::with_weights(Device::Cuda(0), store.clone()).expect("cuda session");
            s.set_compile_options(CompileOptions { precision, ..CompileOptions::default() });
            s.set_prepare_options(PrepareOptions { replay, ..PrepareOptions::default() });
            let mut exe = s.compile(&graph).expect("cuda compile");
            // Several calls: a replayed graph must give the same bytes every time.
            let first = exe.run(&inputs).expect("cuda run")[0].clone();
            let again = exe.run(&inputs).expect("cuda run")[0].clone();
            assert_eq!(first.bytes(), again.bytes(), "{precision:?} replay={replay}: repeated calls differ");
            outs.push(first);
        }
        assert_eq!(outs[0].bytes(), outs[1].bytes(), "{precision:?}: replay and eager outputs are not bit-identical");
        let got = outs[0].to_f32();
        let worst =
            got.iter().zip(&want).map(|(g, w)| (g - w).abs()).map(|d| if d.is_nan() { f32::INFINITY } else { d }).fold(0f32, f32::max);
        let cos = (0..b)
            .map(|r| cosine(&got[r * cfg.hidden_size..(r + 1) * cfg.hidden_size], &want[r * cfg.hidden_size..(r + 1) * cfg.hidden_size]))
            .map(|c| if c.is_nan() { f64::NEG_INFINITY } else { c })
            .fold(1f64, f64::min);
        eprintln!("bert-base {b}x{s} cuda {precision:?} vs cpu f32: max abs {worst:.3e}, worst cosine {cos:.7}");
        assert!(cos >= min_cos && worst <= max_abs, "{precision:?}: cosine {cos} (need >= {min_cos}), max abs {worst} (need <= {max_abs})");
    }
}
