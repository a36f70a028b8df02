//! Next-token sampling (`Thunk::Sample`), one sequence per batch row.
//!
//! Order, as llama.cpp's default chain: repetition penalty over the last
//! `repeat_last_n` tokens of the history, then (unless greedy) top-k, top-p
//! and min-p on the temperature-1 distribution, then the temperature, then
//! one draw. The draw is a pure function of (seed, position): same seed,
//! same text, however the steps are pipelined.

use rlx_schedule::BufRef;

use crate::memory::Mem;
use crate::{exec_err, Result};

pub struct SampleArgs<'a> {
    pub batch: usize,
    pub vocab: usize,
    pub history_len: usize,
    pub logits: &'a BufRef,
    pub fparams: &'a BufRef,
    pub iparams: &'a BufRef,
    pub history: &'a BufRef,
    pub position: &'a BufRef,
    pub out: &'a BufRef,
}

/// Per-sequence sampling settings as the thunk reads them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub top_k: i32,
    pub repeat_last_n: i32,
    pub seed: u64,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) from (seed, position): counter-based, so any
/// backend computes the same value without carrying generator state.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let z = splitmix64(seed ^ splitmix64(position));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Whether `p` changes the logits before choosing (a repeat penalty).
fn penalises(p: &SampleParams) -> bool {
    p.repeat_penalty != 1.0 && p.repeat_penalty > 0.0
}

/// The repeat penalty on the logits of the `recent` tokens, once each.
fn penalise(logits: &mut [f32], recent: &[i32], p: &SampleParams) {
    let v = logits.len();
    let mut seen = std::collections::HashSet::new();
    for &t in recent {
        if t >= 0 && (t as usize) < v && seen.insert(t) {
            let l = &mut logits[t as usize];
            *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
        }
    }
}

crate::simd::multiversion! {
    /// The first index of the largest logit; NaN never wins, and an
    /// all-NaN row gives 0. Two passes that vectorise (the maximum in
    /// lanes, then its first position) rather than one that compares
    /// each logit with the best so far.
    fn argmax(logits: &[f32]) -> usize {
        let mut lanes = [f32::NEG_INFINITY; 16];
        let (chunks, rest) = logits.as_chunks::<16>();
        for c in chunks {
            for l in 0..16 {
                // f32::max ignores a NaN operand.
                lanes[l] = lanes[l].max(c[l]);
            }
        }
        let m = rest.iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        // The first chunk holding it, tested whole (no early exit inside).
        let hit = chunks.iter().position(|c| c.iter().fold(false, |a, &x| a | (x == m)));
        let from = hit.map_or(chunks.len() * 16, |c| c * 16);
        logits[from..].iter().position(|&x| x == m).map_or(0, |i| from + i)
    }
}

/// f32's total order (`f32::total_cmp`) as an integer key.
#[inline(always)]
fn total_key(x: f32) -> i32 {
    let b = x.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

/// The k best ids by logit (ties to the lower id; NaN never taken), in
/// that order: at most k of them, fewer where fewer logits are numbers.
/// One pass that keeps the k best so far and compares each logit with
/// the worst of them (in a vocabulary of 49,152 nearly every logit is
/// dropped there), rather than a selection over an index list of every
/// logit.
fn top_k(logits: &[f32], k: usize) -> Vec<usize> {
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    let mut i = 0;
    while best.len() < k && i < logits.len() {
        if !logits[i].is_nan() {
            best.push(i);
        }
        i += 1;
    }
    best.sort_unstable_by(by_logit);
    if best.len() < k {
        return best;
    }
    // Ids rise through the scan, so a later id beats the worst kept only
    // with a strictly greater logit.
    let mut worst = total_key(logits[best[k - 1]]);
    for (j, &x) in logits.iter().enumerate().skip(i) {
        if x.is_nan() || total_key(x) <= worst {
            continue;
        }
        let at = best.partition_point(|b| by_logit(b, &j) == std::cmp::Ordering::Less);
        best.insert(at, j);
        best.truncate(k);
        worst = total_key(logits[best[k - 1]]);
    }
    best
}

/// The sampled id for one row of logits. `recent` are the tokens the
/// repetition penalty applies to. Ties go to the lower id.
pub fn sample_row(logits: &mut [f32], recent: &[i32], p: &SampleParams, position: u64) -> usize {
    if penalises(p) {
        penalise(logits, recent, p);
    }
    choose(logits, p, position)
}

/// A token from logits the penalty has been applied to.
fn choose(logits: &[f32], p: &SampleParams, position: u64) -> usize {
    let v = logits.len();
    // Greedy at temperature <= 0, and for NaN.
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return argmax(logits);
    }
    let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut cand: Vec<usize> = if p.top_k > 0 && (p.top_k as usize) < v {
        top_k(logits, p.top_k as usize)
    } else {
        (0..v).filter(|&i| !logits[i].is_nan()).collect()
    };
    if cand.is_empty() {
        return 0;
    }
    let filter = p.top_p < 1.0 || p.min_p > 0.0;
    if filter || p.top_k > 0 {
        cand.sort_unstable_by(by_logit);
    }
    let max = cand.iter().map(|&i| logits[i]).fold(f32::NEG_INFINITY, f32::max);
    if filter {
        let w: Vec<f64> = cand.iter().map(|&i| ((logits[i] - max) as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut keep = cand.len();
        if p.min_p > 0.0 {
            // The first candidate has weight 1 (the maximum).
            keep = w.iter().take_while(|&&x| x >= p.min_p as f64).count().max(1);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (j, x) in w.iter().enumerate().take(keep) {
                acc += x / total;
                if acc >= p.top_p as f64 {
                    keep = j + 1;
                    break;
                }
            }
        }
        cand.truncate(keep.max(1));
    }
    let t = p.temperature as f64;
    let w: Vec<f64> = cand.iter().map(|&i| ((logits[i] - max) as f64 / t).exp()).collect();
    let total: f64 = w.iter().sum();
    let mut u = uniform(p.seed, position) * total;
    for (j, x) in w.iter().enumerate() {
        if u < *x {
            return cand[j];
        }
        u -= x;
    }
    cand[cand.len() - 1]
}

pub fn run(a: &SampleArgs<'_>, mem: &Mem) -> Result<()> {
    let logits = mem.src::<f32>(a.logits).map_err(exec_err)?;
    let fp = mem.src::<f32>(a.fparams).map_err(exec_err)?;
    let ip = mem.src::<i32>(a.iparams).map_err(exec_err)?;
    let hist = mem.src::<i32>(a.history).map_err(exec_err)?;
    let pos = mem.src::<i32>(a.position).map_err(exec_err)?;
    let out = mem.dst::<i32>(a.out).map_err(exec_err)?;
    let mut row = Vec::new();
    for b in 0..a.batch {
        let p = SampleParams {
            temperature: fp.get(b * 4),
            top_p: fp.get(b * 4 + 1),
            min_p: fp.get(b * 4 + 2),
            repeat_penalty: fp.get(b * 4 + 3),
            top_k: ip.get(b * 4),
            repeat_last_n: ip.get(b * 4 + 1),
            seed: (ip.get(b * 4 + 2) as u32 as u64) | ((ip.get(b * 4 + 3) as u32 as u64) << 32),
        };
        let at = pos.get(b);
        if at < 0 || at as usize >= a.history_len.max(1) {
            return Err(exec_err(format!("sample: position {at} (batch row {b}) is outside the history of {} tokens", a.history_len)));
        }
        let first = (at as i64 - p.repeat_last_n.max(0) as i64 + 1).max(0) as usize;
        let recent: Vec<i32> = (first..=at as usize).map(|j| hist.get(b * a.history_len + j)).collect();
        let src = logits.row(b * a.vocab, a.vocab);
        // A copy only where the penalty changes logits: the row is the
        // vocabulary's size (196 KB for 49,152 tokens).
        let id = if penalises(&p) {
            row.clear();
            row.extend_from_slice(src);
            sample_row(&mut row, &recent, &p, at as u64)
        } else {
            choose(src, &p, at as u64)
        };
        out.set(b, id as i32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small seeded generator for the tests' random rows.
    fn xorshift(mut x: u32) -> impl FnMut() -> u32 {
        move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        }
    }

    /// argmax against the one-pass form it replaced: NaN anywhere (first
    /// too), ties (the first wins), signed zeros, infinities, all-NaN and
    /// lengths that are not whole chunks.
    #[test]
    fn argmax_matches_the_one_pass_form() {
        let plain = |logits: &[f32]| {
            let mut best = 0;
            for (i, &l) in logits.iter().enumerate() {
                if l > logits[best] || (logits[best].is_nan() && !l.is_nan()) {
                    best = i;
                }
            }
            best
        };
        let mut next = xorshift(0x2545_F491);
        for case in 0..400 {
            let n = 1 + (next() % 300) as usize;
            let mut row: Vec<f32> = (0..n).map(|_| (next() % 41) as f32 - 20.0).collect();
            match case % 6 {
                1 => row[0] = f32::NAN,
                2 => row.iter_mut().for_each(|v| *v = f32::NAN),
                3 => row.iter_mut().for_each(|v| *v = if next().is_multiple_of(2) { 0.0 } else { -0.0 }),
                4 => {
                    row.iter_mut().for_each(|v| *v = if next().is_multiple_of(3) { f32::NAN } else { f32::NEG_INFINITY });
                }
                5 => {
                    let at = (next() as usize) % n;
                    row[at] = f32::INFINITY;
                    row[(at + 7) % n] = f32::NAN;
                }
                _ => {}
            }
            assert_eq!(argmax(&row), plain(&row), "case {case}: {row:?}");
        }
        assert_eq!(argmax(&[]), 0);
    }

    /// The one-pass top-k against a selection over every logit (the form
    /// it replaced): the same ids in the same order, with ties, signed
    /// zeros, infinities, NaN anywhere, k above the count of numbers.
    #[test]
    fn top_k_matches_a_selection_over_every_logit() {
        let select = |logits: &[f32], k: usize| {
            let by_logit = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
            let mut cand: Vec<usize> = (0..logits.len()).filter(|&i| !logits[i].is_nan()).collect();
            if k < cand.len() {
                cand.select_nth_unstable_by(k - 1, by_logit);
                cand.truncate(k);
            }
            cand.sort_unstable_by(by_logit);
            cand
        };
        let mut next = xorshift(0x9E37_79B9);
        for case in 0..600 {
            let n = 1 + (next() % 400) as usize;
            let spread = [3, 40, 100_000][case % 3];
            let mut row: Vec<f32> = (0..n).map(|_| (next() % spread) as f32 / 7.0 - 2.0).collect();
            match case % 5 {
                1 => row.iter_mut().for_each(|v| *v = if next().is_multiple_of(2) { 0.0 } else { -0.0 }),
                2 => {
                    for _ in 0..n / 3 {
                        row[(next() as usize) % n] = f32::NAN;
                    }
                }
                3 => {
                    row[(next() as usize) % n] = f32::INFINITY;
                    row[(next() as usize) % n] = f32::NEG_INFINITY;
                }
                4 => row.iter_mut().for_each(|v| *v = f32::NAN),
                _ => {}
            }
            let k = 1 + (next() % 60) as usize;
            assert_eq!(top_k(&row, k), select(&row, k), "case {case} k {k}: {row:?}");
        }
    }
}
