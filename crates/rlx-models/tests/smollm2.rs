//! SmolLM2-135M-Instruct (Q4_1 GGUF) against the recorded transformers
//! outputs (tests/data/smollm2_reference.json): token ids, last-position
//! logits, 32 greedy tokens; the quantized kernels against the f32 path
//! over dequantised weights; pipelined against unpipelined decode.

mod common;

use std::path::PathBuf;

use common::smollm2::{greedy, half_cache_against_f32_cache, prompt_ids, reference, top};
use rlx::{DType, Device};
use rlx_models::{Generator, GeneratorOptions, SamplingParams};

fn model(test: &str) -> Option<PathBuf> {
    common::smollm2::gguf(test)
}

/// The tokens of `prompt` generated alone (the single-sequence API).
fn alone(g: &mut Generator, prompt: &[u32], params: &SamplingParams) -> Vec<u32> {
    g.generate_ids(prompt, params).expect("gen").map(|x| x.expect("piece").token).collect()
}

/// A CPU generator of 128 rows of context and `batch` slots.
fn cpu_batch(path: &std::path::Path, batch: usize) -> Generator {
    Generator::load_with(path, Device::Cpu, GeneratorOptions { ctx_size: 128, batch, ..Default::default() }).expect("load")
}

#[test]
fn f32_path_matches_transformers() {
    let Some(path) = model("f32_path_matches_transformers") else { return };
    let opts = GeneratorOptions { ctx_size: 256, dequantize: true, logits: true, ..Default::default() };
    let mut g = Generator::load_with(&path, Device::Cpu, opts).expect("load");
    let r = reference();
    for (n, item) in r["items"].as_array().expect("items").iter().enumerate() {
        let ids = prompt_ids(&g, item);
        assert_eq!(ids, common::u32s(&item["input_ids"]), "item {n}: prompt ids");
        let (new, logits) = greedy(&mut g, &ids, 32);
        let want_ids = common::u32s(&item["last_logits"]["top20_ids"]);
        let want_vals = common::f32s(&item["last_logits"]["top20_values"]);
        let got: Vec<u32> = top(&logits[0], 20).into_iter().map(|i| i as u32).collect();
        let mut a = got.clone();
        let mut b = want_ids.clone();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "item {n}: top-20 id set");
        for (id, v) in want_ids.iter().zip(&want_vals) {
            let d = (logits[0][*id as usize] - v).abs();
            assert!(d <= 1e-3, "item {n}: logit of {id}: {} vs {v} (|diff| {d})", logits[0][*id as usize]);
        }
        assert_eq!(new, common::u32s(&item["greedy"]["new_ids"]), "item {n}: 32 greedy tokens");
    }
}

/// An f16 KV cache (the GPU's default; keys and values rounded as they are
/// written, attention reading them with f32 queries) against the f32 cache
/// over dequantised weights: logits within 0.08 of each other (0.042 seen) and of
/// transformers' over 16 greedy steps.
#[test]
fn f16_kv_cache_close_to_f32_cache() {
    let Some(path) = model("f16_kv_cache_close_to_f32_cache") else { return };
    let mk = |kv| GeneratorOptions { ctx_size: 128, dequantize: true, logits: true, kv_dtype: Some(kv), ..Default::default() };
    let mut h = Generator::load_with(&path, Device::Cpu, mk(DType::F16)).expect("load f16 cache");
    let mut f = Generator::load_with(&path, Device::Cpu, mk(DType::F32)).expect("load f32 cache");
    assert_eq!(h.kv_dtype(), DType::F16);
    let worst = half_cache_against_f32_cache(&mut h, &mut f, 0.08, 16);
    assert!(worst > 0.0, "an f16 cache that changes no logit was not used");
}

/// The quantized kernels (Q4_1 / Q8_0 blocks read as stored, activations
/// quantized to int8 per block) against the f32 path on the same weights.
#[test]
fn quantized_path_close_to_f32_path() {
    let Some(path) = model("quantized_path_close_to_f32_path") else { return };
    let r = reference();
    let base = GeneratorOptions { ctx_size: 256, logits: true, ..Default::default() };
    let mut q = Generator::load_with(&path, Device::Cpu, base.clone()).expect("load quantized");
    let mut f = Generator::load_with(&path, Device::Cpu, GeneratorOptions { dequantize: true, ..base }).expect("load f32");
    // Stated tolerance: rounding the activations to int8 per 32-element
    // block before every matmul (as llama.cpp does), over 30 layers, moves
    // logits (range about ±25) by up to ~1 (measured 1.05 at worst on these
    // prompts); the logit vectors keep a cosine of at least 0.995 (measured 0.998).
    const TOL: f32 = 1.5;
    for (n, item) in r["items"].as_array().expect("items").iter().enumerate() {
        let ids = prompt_ids(&q, item);
        let (qi, ql) = greedy(&mut q, &ids, 16);
        let (fi, fl) = greedy(&mut f, &ids, 16);
        let d = common::max_abs_diff(&ql[0], &fl[0]);
        let dot: f64 = ql[0].iter().zip(&fl[0]).map(|(a, b)| *a as f64 * *b as f64).sum();
        let na: f64 = ql[0].iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = fl[0].iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let agree = qi.iter().zip(&fi).take_while(|(a, b)| a == b).count();
        eprintln!(
            "item {n}: quantized vs f32 at the prompt's last position: max |logit diff| {d}, cosine {:.6}; greedy agree for {agree} of 16",
            dot / (na * nb)
        );
        assert!(d <= TOL, "item {n}: quantized logits differ by {d} > {TOL}");
        assert!(dot / (na * nb) >= 0.995, "item {n}: cosine {}", dot / (na * nb));
        // Greedy-identical while the f32 path's top1-top2 margin exceeds
        // twice the tolerance.
        for (k, (a, b)) in qi.iter().zip(&fi).enumerate() {
            let t = top(&fl[k], 2);
            let margin = fl[k][t[0]] - fl[k][t[1]];
            if margin <= 2.0 * TOL {
                break;
            }
            assert_eq!(a, b, "item {n}: step {k} (margin {margin})");
        }
    }
}

/// Pipelined decode (several steps in flight, tokens fed back on the
/// device) equals one step at a time; the cache is reused across calls.
#[test]
fn pipelined_equals_unpipelined_and_cache_reuse() {
    let Some(path) = model("pipelined_equals_unpipelined_and_cache_reuse") else { return };
    let mk = |pipeline| GeneratorOptions { ctx_size: 128, pipeline, ..Default::default() };
    let mut a = Generator::load_with(&path, Device::Cpu, mk(1)).expect("load");
    let mut b = Generator::load_with(&path, Device::Cpu, mk(3)).expect("load");
    let params = SamplingParams { max_tokens: 24, seed: 7, ..Default::default() };
    let ta: Vec<u32> = a.generate("The capital of France is", &params).expect("gen").map(|p| p.expect("piece").token).collect();
    let tb: Vec<u32> = b.generate("The capital of France is", &params).expect("gen").map(|p| p.expect("piece").token).collect();
    assert_eq!(ta, tb, "sampled tokens, pipeline 1 vs 3");
    // Same prompt again on b: served from the cache but the last token,
    // same seed → same tokens.
    let mut gen = b.generate("The capital of France is", &params).expect("gen");
    let again: Vec<u32> = gen.by_ref().map(|p| p.expect("piece").token).collect();
    let st = gen.stats().clone();
    assert!(st.cached_tokens > 0, "the prompt should be served from the cache");
    // Host time counts the steps' submissions and token handling but not
    // the waits on the backend, which do the forward passes.
    assert!(st.generated == 24 && !st.host_time.is_zero(), "{st:?}");
    assert!(st.host_time * 4 < st.decode_time, "host time is most of the decode time: {st:?}");
    drop(gen);
    assert_eq!(again, tb, "a cached prompt gives the same tokens");
}

/// `generate_many`: five prompts (the reference items and two of their
/// prefixes) through two slots, each refilled as a sequence ends (they end
/// at different lengths), give every prompt's greedy tokens and text as
/// single runs do; a bad prompt fails the call before any runs.
#[test]
fn generate_many_matches_single_runs() {
    let Some(path) = model("generate_many_matches_single_runs") else { return };
    let r = reference();
    let items = r["items"].as_array().expect("items");
    let mut single = Generator::load_with(&path, Device::Cpu, GeneratorOptions { ctx_size: 128, ..Default::default() }).expect("load");
    let mut prompts: Vec<Vec<u32>> = items.iter().map(|it| prompt_ids(&single, it)).collect();
    prompts.push(prompts[0][..prompts[0].len() / 2].to_vec());
    prompts.push(prompts[1][..prompts[1].len() - 1].to_vec());
    let params: Vec<SamplingParams> =
        (0..prompts.len()).map(|i| SamplingParams { max_tokens: 4 + 3 * i, ignore_eos: true, ..SamplingParams::greedy() }).collect();
    let want: Vec<(Vec<u32>, String)> = prompts
        .iter()
        .zip(&params)
        .map(|(p, s)| {
            let mut g = single.generate_ids(p, s).expect("gen");
            let text = g.collect_text().expect("text");
            (g.ids().to_vec(), text)
        })
        .collect();
    let mut g = Generator::load_with(&path, Device::Cpu, GeneratorOptions { ctx_size: 128, batch: 2, ..Default::default() }).expect("load");
    let got = g.generate_many(&prompts, &params).expect("generate_many");
    assert_eq!(got.len(), prompts.len());
    for (i, (o, (ids, text))) in got.iter().zip(&want).enumerate() {
        assert_eq!((&o.ids, &o.text), (ids, text), "prompt {i}");
        assert_eq!(o.stop, Some(rlx_models::StopReason::MaxTokens), "prompt {i}");
    }
    let mut bad = prompts.clone();
    bad[3] = vec![u32::MAX];
    let err = g.generate_many(&bad, &params).expect_err("a bad prompt").to_string();
    assert!(err.contains("prompt 3") && err.contains("outside the vocabulary"), "{err}");
    assert_eq!(g.active_sequences(), 0);
}

/// The batch API: three prompts decoded side by side, joining at different
/// steps (one while the others are mid-generation), give the same greedy
/// tokens as three single runs, whether the steps compile on first use or
/// all ahead.
#[test]
fn batched_decode_matches_single_runs() {
    let Some(path) = model("batched_decode_matches_single_runs") else { return };
    let r = reference();
    let items = r["items"].as_array().expect("items");
    let params = SamplingParams { max_tokens: 10, ignore_eos: true, ..SamplingParams::greedy() };
    let mut single = Generator::load_with(&path, Device::Cpu, GeneratorOptions { ctx_size: 128, ..Default::default() }).expect("load");
    let prompts: Vec<Vec<u32>> = items.iter().map(|it| prompt_ids(&single, it)).collect();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&mut single, p, &params)).collect();
    // Steps compiled on first use, then all compiled ahead (`prepare_steps`,
    // what a server does on a GPU): the same tokens.
    for prepare in [false, true] {
        let mut g =
            Generator::load_with(&path, Device::Cpu, GeneratorOptions { ctx_size: 128, batch: 3, ..Default::default() }).expect("load");
        if prepare {
            // Decode widths 1 and 2 (the full width, 3, compiles at load);
            // prefill buckets 16 to 128 (256 exceeds the context) for each of
            // 3 slots; the prefill over several slots at once, at widths 2
            // and 3 and each of those chunks (a round takes the smallest
            // that holds what is left).
            assert_eq!(g.prepare_steps().expect("prepare"), 2 + 3 * 4 + 2 * 4);
            assert_eq!(g.joint_prefill_chunks(), vec![16, 32, 64, 128]);
            assert_eq!(g.prepare_steps().expect("prepare again"), 0);
        }
        let mut got: Vec<Vec<u32>> = vec![vec![]; 3];
        let mut slot_of = vec![usize::MAX; 3];
        let record = |ev: rlx_models::BatchEvent, slot_of: &[usize], got: &mut Vec<Vec<u32>>| {
            let k = slot_of.iter().position(|&s| s == ev.slot).expect("known slot");
            got[k].push(ev.piece.token);
        };
        // Sequence 0 starts alone, 1 joins after two steps, 2 after four.
        for step in 0..40 {
            for (k, join) in [(0usize, 0usize), (1, 2), (2, 4)] {
                if step == join {
                    let ev = g.add_sequence(&prompts[k], &params).expect("add");
                    slot_of[k] = ev.slot;
                    record(ev, &slot_of, &mut got);
                }
            }
            for ev in g.step_batch().expect("step") {
                let done = ev.finished.is_some();
                let slot = ev.slot;
                record(ev, &slot_of, &mut got);
                if done {
                    // The slot is free now; forget it so a reused slot is not misattributed.
                    if let Some(k) = slot_of.iter().position(|&s| s == slot) {
                        slot_of[k] = usize::MAX - 1 - k;
                    }
                }
            }
            if step > 4 && g.active_sequences() == 0 {
                break;
            }
        }
        assert_eq!(got, want, "batched greedy tokens vs single runs");
    }
}

/// Steps sized to the slots in use, with holes: four slots, sequences of
/// different lengths, so the highest slot runs on alone (a width-4 step
/// with three masked rows), then two new sequences take the lowest free
/// slots while it runs, and the single-sequence API afterwards runs at
/// width 1 on slot 0 again. Every greedy sequence equals its single run.
#[test]
fn batch_widths_follow_the_highest_slot_in_use() {
    let Some(path) = model("batch_widths_follow_the_highest_slot_in_use") else { return };
    let r = reference();
    let items = r["items"].as_array().expect("items");
    let mut single = Generator::load_with(&path, Device::Cpu, GeneratorOptions { ctx_size: 128, ..Default::default() }).expect("load");
    let base: Vec<Vec<u32>> = items.iter().map(|it| prompt_ids(&single, it)).collect();
    // Six prompts: the reference items and prefixes of them.
    let prompts: Vec<Vec<u32>> = (0..6).map(|k| base[k % base.len()][..base[k % base.len()].len() - k / base.len()].to_vec()).collect();
    let lens = [3usize, 4, 5, 14, 6, 4];
    let params: Vec<SamplingParams> =
        lens.iter().map(|&n| SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::greedy() }).collect();
    let want: Vec<Vec<u32>> = prompts.iter().zip(&params).map(|(p, s)| alone(&mut single, p, s)).collect();
    let mut g = Generator::load_with(&path, Device::Cpu, GeneratorOptions { ctx_size: 128, batch: 4, ..Default::default() }).expect("load");
    let mut got: Vec<Vec<u32>> = vec![vec![]; prompts.len()];
    let mut owner: Vec<Option<usize>> = vec![None; 4];
    let mut take = |ev: rlx_models::BatchEvent, owner: &mut Vec<Option<usize>>| {
        let k = owner[ev.slot].expect("a known slot");
        got[k].push(ev.piece.token);
        if ev.finished.is_some() {
            owner[ev.slot] = None;
        }
    };
    for k in 0..4 {
        let ev = g.add_sequence(&prompts[k], &params[k]).expect("add");
        assert_eq!(ev.slot, k, "the lowest free slot");
        owner[k] = Some(k);
        take(ev, &mut owner);
    }
    let mut next = 4;
    for _ in 0..40 {
        // Once slots 0..3 are free and slot 3 still runs, refill from the
        // bottom: the new sequences land below the running one.
        if next < prompts.len() && owner[..3].iter().all(Option::is_none) && owner[3].is_some() {
            while next < prompts.len() {
                let ev = g.add_sequence(&prompts[next], &params[next]).expect("add");
                assert!(ev.slot < 3, "slot {}", ev.slot);
                owner[ev.slot] = Some(next);
                take(ev, &mut owner);
                next += 1;
            }
        }
        for ev in g.step_batch().expect("step") {
            take(ev, &mut owner);
        }
        if next == prompts.len() && g.active_sequences() == 0 {
            break;
        }
    }
    assert_eq!(got, want, "batched greedy tokens vs single runs");
    // The single-sequence API on the same generator: slot 0 at width 1.
    let again: Vec<u32> = alone(&mut g, &prompts[0], &params[0]);
    assert_eq!(again, want[0]);
}

/// Prompts that arrive together are prefilled side by side
/// (`add_sequences_side_by_side`: one prefill step over every slot) while another
/// sequence runs in a slot of its own and a fifth slot stays free, with
/// sampling settings that differ per prompt (greedy, and seeded top-k with
/// a repetition penalty): every sequence's tokens equal its single run,
/// and the running sequence's slot keeps its cache (a later prompt reuses
/// it and gives the same first token).
#[test]
fn joint_prefill_matches_single_runs() {
    let Some(path) = model("joint_prefill_matches_single_runs") else { return };
    let r = reference();
    let items = r["items"].as_array().expect("items");
    let mut single = cpu_batch(&path, 1);
    let base: Vec<Vec<u32>> = items.iter().map(|it| prompt_ids(&single, it)).collect();
    let prompts: Vec<Vec<u32>> = (0..5).map(|k| base[k % base.len()][..base[k % base.len()].len() - k / base.len()].to_vec()).collect();
    let sampled = SamplingParams { temperature: 0.8, top_k: 20, repeat_penalty: 1.3, seed: 7, ..SamplingParams::greedy() };
    let params: Vec<SamplingParams> = [5usize, 7, 6, 4, 6]
        .iter()
        .enumerate()
        .map(|(k, &n)| SamplingParams {
            max_tokens: n,
            ignore_eos: true,
            ..if k % 2 == 1 { sampled.clone() } else { SamplingParams::greedy() }
        })
        .collect();
    let want: Vec<Vec<u32>> = prompts.iter().zip(&params).map(|(p, s)| alone(&mut single, p, s)).collect();
    let mut g = cpu_batch(&path, 5);
    let mut got: Vec<Vec<u32>> = vec![vec![]; prompts.len()];
    let mut owner: Vec<Option<usize>> = vec![None; 5];
    let mut take = |ev: rlx_models::BatchEvent, owner: &mut Vec<Option<usize>>, k: Option<usize>| {
        if let Some(k) = k {
            owner[ev.slot] = Some(k);
        }
        let k = owner[ev.slot].expect("a known slot");
        got[k].push(ev.piece.token);
        if ev.finished.is_some() {
            owner[ev.slot] = None;
        }
    };
    // Prompt 3 runs alone in slot 0 until it ends (slot 0 keeps its
    // prefix); prompt 0 then takes slot 0 and runs.
    take(g.add_sequence(&prompts[3], &params[3]).expect("add"), &mut owner, Some(3));
    while owner[0].is_some() {
        for ev in g.step_batch().expect("step") {
            take(ev, &mut owner, None);
        }
    }
    take(g.add_sequence(&prompts[0], &params[0]).expect("add"), &mut owner, Some(0));
    for ev in g.step_batch().expect("step") {
        take(ev, &mut owner, None);
    }
    // Prompts 1, 2 and 4 arrive together: slots 1, 2, 3, side by side with
    // the running slot 0 and the free slot 4.
    let joint: Vec<(Vec<u32>, SamplingParams)> = [1, 2, 4].iter().map(|&k| (prompts[k].clone(), params[k].clone())).collect();
    for (ev, k) in g.add_sequences_side_by_side(&joint).into_iter().zip([1, 2, 4]) {
        let ev = ev.expect("joint add");
        assert_eq!(ev.slot, [1, 2, 4].iter().position(|&x| x == k).expect("index") + 1);
        take(ev, &mut owner, Some(k));
    }
    // Side by side, in rounds of the smallest chunk that holds what the
    // longest prompt has left (these prompts: one round).
    let longest = [1, 2, 4].iter().map(|&k| prompts[k].len()).max().expect("prompts");
    let chunk = [16, 32, 64].into_iter().find(|&c| c >= longest).expect("a prompt under 64 tokens");
    assert_eq!(g.joint_prefill_chunks(), vec![chunk], "the prompts were prefilled side by side");
    // Over slots 0..4 (the decode width that holds slot 3): slot 4 stays
    // out of the step.
    assert_eq!(g.joint_prefill_shapes(), vec![(4, chunk)]);
    for _ in 0..20 {
        for ev in g.step_batch().expect("step") {
            take(ev, &mut owner, None);
        }
        if g.active_sequences() == 0 {
            break;
        }
    }
    assert_eq!(got, want, "joint prefill tokens vs single runs");
    // On the CPU a step costs its tokens, so side by side pays only where
    // the chunks are about full: not for an 8-token prompt beside a
    // 60-token one (side by side, both rows take 64 tokens; one at a time,
    // 16 and 64: no joint chunk), but for prompts that fill every slot's
    // chunk.
    let cycle = |k: usize, n: usize| -> Vec<u32> { (0..n).map(|j| base[k][j % base[k].len()]).collect() };
    let mut h = cpu_batch(&path, 2);
    let uneven: Vec<(Vec<u32>, SamplingParams)> = [(0, 8), (1, 60)].iter().map(|&(k, n)| (cycle(k, n), params[k].clone())).collect();
    h.add_sequences(&uneven).into_iter().for_each(|r| drop(r.expect("add")));
    assert!(h.joint_prefill_chunks().is_empty(), "uneven prompts go one at a time on the CPU");
    let mut h = cpu_batch(&path, 2);
    let full: Vec<(Vec<u32>, SamplingParams)> = (0..2).map(|k| (cycle(k, 64), params[k].clone())).collect();
    h.add_sequences(&full).into_iter().for_each(|r| drop(r.expect("add")));
    assert_eq!(h.joint_prefill_chunks(), vec![64], "full chunks go side by side");
    // Prompts of 70 and 10 tokens side by side with 128 rows of context:
    // rounds of 32 (the most a 70-token prompt leaves room for), then the
    // smallest bucket that holds the last 6 tokens; the tokens equal
    // single runs.
    let mut h = cpu_batch(&path, 2);
    let uneven: Vec<(Vec<u32>, SamplingParams)> = [(0, 70), (1, 10)].iter().map(|&(k, n)| (cycle(k, n), params[k].clone())).collect();
    let alone: Vec<Vec<u32>> = uneven.iter().map(|(p, s)| alone(&mut single, p, s)).collect();
    let mut side: Vec<Vec<u32>> = vec![vec![]; 2];
    for ev in h.add_sequences_side_by_side(&uneven) {
        let ev = ev.expect("joint add");
        side[ev.slot].push(ev.piece.token);
    }
    assert_eq!(h.joint_prefill_chunks(), vec![16, 32], "rounds of 32, 32, then 16");
    while h.active_sequences() > 0 {
        for ev in h.step_batch().expect("step") {
            side[ev.slot].push(ev.piece.token);
        }
    }
    assert_eq!(side, alone, "uneven joint prefill tokens vs single runs");
    // Slot 0's cache is intact: prompt 0 again reuses it and gives its tokens.
    let again = g.add_sequences(&[(prompts[0].clone(), params[0].clone())]);
    let ev = again.into_iter().next().expect("one").expect("add");
    assert_eq!((ev.slot, ev.piece.token), (0, want[0][0]));
    assert!(ev.cached_tokens > 0, "slot 0 kept its prefix");
}

/// A side-by-side prefill runs over the slots up to the decode width that
/// holds the highest slot it fills: with a sequence running in slot 3 of 4
/// and two prompts taking slots 0 and 1, the step covers slots 0 and 1 and
/// leaves slot 3 alone; every sequence's greedy tokens equal its single
/// run.
#[test]
fn joint_prefill_leaves_slots_past_its_width_alone() {
    let Some(path) = model("joint_prefill_leaves_slots_past_its_width_alone") else { return };
    let r = reference();
    let items = r["items"].as_array().expect("items");
    let mut single = cpu_batch(&path, 1);
    let prompts: Vec<Vec<u32>> = (0..6).map(|k| prompt_ids(&single, &items[k % items.len()])[k / items.len()..].to_vec()).collect();
    let params = SamplingParams { max_tokens: 6, ignore_eos: true, ..SamplingParams::greedy() };
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| alone(&mut single, p, &params)).collect();
    let mut g = cpu_batch(&path, 4);
    // Prompts 0..4 fill slots 0..3; 0, 1 and 2 are dropped, 3 runs on.
    let mut got: Vec<Vec<u32>> = vec![vec![]; 6];
    for k in 0..4 {
        let ev = g.add_sequence(&prompts[k], &params).expect("add");
        assert_eq!(ev.slot, k);
        got[k].push(ev.piece.token);
    }
    for slot in 0..3 {
        g.remove_sequence(slot);
    }
    for ev in g.step_batch().expect("step") {
        assert_eq!(ev.slot, 3);
        got[3].push(ev.piece.token);
    }
    let joint: Vec<(Vec<u32>, SamplingParams)> = [4, 5].iter().map(|&k| (prompts[k].clone(), params.clone())).collect();
    for (ev, k) in g.add_sequences_side_by_side(&joint).into_iter().zip([4, 5]) {
        let ev = ev.expect("joint add");
        assert_eq!(ev.slot, k - 4);
        got[k].push(ev.piece.token);
    }
    assert!(g.joint_prefill_shapes().iter().all(|&(w, _)| w == 2), "{:?}", g.joint_prefill_shapes());
    while g.active_sequences() > 0 {
        for ev in g.step_batch().expect("step") {
            let k = if ev.slot == 3 { 3 } else { ev.slot + 4 };
            got[k].push(ev.piece.token);
        }
    }
    for k in 3..6 {
        assert_eq!(got[k], want[k], "sequence {k}");
    }
}

/// The batch API reuses a slot's cache: a prompt that starts with what the
/// slot held before (its previous prompt and the tokens it fed back)
/// prefills only the rest, says how many tokens it reused, and gives the
/// greedy tokens of a cold run; a prompt that shares nothing reuses nothing.
#[test]
fn batch_slots_reuse_a_shared_prefix() {
    let Some(path) = model("batch_slots_reuse_a_shared_prefix") else { return };
    let r = reference();
    let items = r["items"].as_array().expect("items");
    let params = SamplingParams { max_tokens: 8, ignore_eos: true, ..SamplingParams::greedy() };
    let cold = |prompt: &[u32]| -> Vec<u32> { alone(&mut cpu_batch(&path, 1), prompt, &params) };
    let mut g = cpu_batch(&path, 2);
    let a = prompt_ids(&g, &items[0]);
    let run = |g: &mut Generator, prompt: &[u32]| -> (usize, usize, Vec<u32>) {
        let ev = g.add_sequence(prompt, &params).expect("add");
        let (slot, cached) = (ev.slot, ev.cached_tokens);
        let mut toks = vec![ev.piece.token];
        while g.active_sequences() > 0 {
            toks.extend(g.step_batch().expect("step").into_iter().map(|e| e.piece.token));
        }
        (slot, cached, toks)
    };
    let (slot, cached, gen_a) = run(&mut g, &a);
    assert_eq!((slot, cached), (0, 0));
    assert_eq!(gen_a, cold(&a), "first prompt");
    // The prompt, seven of its eight new tokens (the last was never fed),
    // then a token of another prompt.
    let other = prompt_ids(&g, &items[1]);
    let mut b = a.clone();
    b.extend_from_slice(&gen_a[..7]);
    b.push(*other.last().expect("a token"));
    let (slot, cached, gen_b) = run(&mut g, &b);
    assert_eq!((slot, cached), (0, a.len() + 7), "reused: the first prompt and the fed tokens");
    assert_eq!(gen_b, cold(&b), "a prompt after a reused prefix");
    // A shorter prompt that is a prefix of the cache: its last token is fed again.
    let c = a[..a.len() - 3].to_vec();
    let (_, cached, gen_c) = run(&mut g, &c);
    assert_eq!(cached, c.len() - 1);
    assert_eq!(gen_c, cold(&c), "a prompt inside the cached tokens");
    let (_, cached, gen_o) = run(&mut g, &other);
    assert_eq!(cached, other.iter().zip(&c).take_while(|(x, y)| x == y).count().min(other.len() - 1));
    assert_eq!(gen_o, cold(&other), "an unrelated prompt");
}
