//! The PyTorch side of `rlx bench --model smollm2 --torch`: runs
//! bench/torch_decode_peer.py (transformers' LlamaForCausalLM on random
//! weights of the model's shapes, a static KV cache, CUDA graphs on a GPU)
//! with the benchmark's settings and reads its JSON lines: one per
//! measurement, then one describing the setup.

use std::path::Path;

use serde_json::Value;

use super::peer::run_script;

/// What the peer is asked to measure (the benchmark's own settings).
pub struct TorchCommand<'a> {
    pub python: &'a str,
    pub script: &'a Path,
    /// "cpu" or "cuda:N".
    pub device: &'a str,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub batch_tokens: usize,
    pub batches: &'a [usize],
    pub runs: usize,
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    Prefill,
    Decode,
}

/// One line of the peer: a rate, or why there is none.
#[derive(Debug, Clone)]
pub struct Measurement {
    pub measure: Measure,
    pub batch: usize,
    pub tok_s: Result<f64, String>,
    /// "cuda graph" or "eager".
    pub mode: String,
    /// Prefill on a GPU: both figures, of which `tok_s` is the faster.
    pub eager_tok_s: Option<f64>,
    pub graph_tok_s: Option<f64>,
    /// A capture that failed (the figure is then eager).
    pub graph_error: Option<String>,
    /// The static cache's length in tokens (its attention reads all of it).
    pub max_cache_len: Option<u64>,
}

/// The peer's closing line: what ran, and its self-checks.
#[derive(Debug, Clone, Default)]
pub struct Setup {
    pub torch: String,
    pub transformers: String,
    pub device: String,
    pub dtype: String,
    pub graphs: bool,
    pub params: Option<u64>,
    pub layers: Option<u64>,
    pub attention: String,
    pub static_cache: String,
    pub logits: String,
    /// (check, verdict); a verdict starts with "passed" or "failed".
    pub checks: Vec<(String, String)>,
}

#[derive(Debug, Default)]
pub struct TorchRun {
    pub measurements: Vec<Measurement>,
    /// None when the peer stopped before its closing line.
    pub setup: Option<Setup>,
    /// Problems outside any one measurement (a crash, a bad line).
    pub notes: Vec<String>,
}

impl TorchRun {
    /// The rate of one measurement, or why the table has none.
    pub fn tok_s(&self, measure: Measure, batch: usize) -> Result<f64, String> {
        match self.measurements.iter().find(|m| m.measure == measure && m.batch == batch) {
            Some(m) => m.tok_s.clone(),
            None => Err(format!("no {} line for batch {batch} from the peer", measure.name())),
        }
    }

    /// Lines for the report's notes: the setup, how each figure was taken,
    /// and anything that went wrong.
    pub fn describe(&self) -> Vec<String> {
        let mut out = vec![];
        match &self.setup {
            Some(s) => {
                let params = s.params.map(|p| format!(", {:.1} M parameters", p as f64 / 1e6)).unwrap_or_default();
                let layers = s.layers.map(|l| format!("{l} layers")).unwrap_or_else(|| "? layers".into());
                let how = if s.device == "cpu" {
                    "eagerly on the CPU (no CUDA graphs there)".to_string()
                } else if s.graphs {
                    format!("on {}; each decode step captured once as a CUDA graph (the forward of the current tokens, greedy argmax written back into the static input ids, positions advanced on the device) and replayed, one synchronize per run", s.device)
                } else {
                    format!("on {}, eagerly (no CUDA graph could be captured, see below)", s.device)
                };
                out.push(format!(
                    "PyTorch: transformers {} LlamaForCausalLM (torch {}), seeded random weights of the model's shapes ({layers}{params}), {}, {} attention, static KV cache ({}), logits of the {}; {how}.",
                    s.transformers, s.torch, s.dtype, s.attention, s.static_cache, s.logits
                ));
                let passed: Vec<&str> = s.checks.iter().filter(|c| c.1.starts_with("passed")).map(|c| c.0.as_str()).collect();
                if !passed.is_empty() {
                    out.push(format!("PyTorch self-checks passed: {}.", passed.join(", ")));
                }
                for (what, verdict) in s.checks.iter().filter(|c| !c.1.starts_with("passed")) {
                    out.push(format!("PyTorch self-check '{what}' {verdict}: its figures may not be what they claim."));
                }
            }
            None => out.push("PyTorch: the peer stopped before describing its setup.".into()),
        }
        let modes: Vec<String> = self
            .measurements
            .iter()
            .filter(|m| m.measure == Measure::Prefill)
            .filter_map(|m| {
                let (e, g) = (m.eager_tok_s?, m.graph_tok_s?);
                Some(format!("batch {} {} (eager {e:.0}, CUDA graph {g:.0} tok/s)", m.batch, m.mode))
            })
            .collect();
        if !modes.is_empty() {
            out.push(format!("PyTorch prefill is the faster of eager and a CUDA graph of the same step: {}.", modes.join("; ")));
        }
        let lens: Vec<String> = self
            .measurements
            .iter()
            .filter(|m| m.measure == Measure::Decode)
            .filter_map(|m| Some(format!("{} tokens at batch {}", m.max_cache_len?, m.batch)))
            .collect();
        if !lens.is_empty() {
            out.push(format!(
                "PyTorch's static cache holds the prompt and every new token ({}); its attention reads the whole cache every step, masked.",
                lens.join(", ")
            ));
        }
        for m in &self.measurements {
            if let Some(e) = &m.graph_error {
                out.push(format!("PyTorch {} batch {}: CUDA-graph capture failed, eager figure shown: {e}", m.measure.name(), m.batch));
            }
        }
        out.extend(self.notes.iter().cloned());
        out
    }
}

impl Measure {
    fn name(self) -> &'static str {
        match self {
            Measure::Prefill => "prefill",
            Measure::Decode => "decode",
        }
    }
}

/// Runs the peer once for every measurement, or says why no peer could
/// run at all (python, torch, transformers or the GPU missing). Progress
/// goes to stderr as lines arrive; the peer's own stderr passes through.
pub fn run(cmd: &TorchCommand) -> Result<TorchRun, String> {
    let batches: Vec<String> = cmd.batches.iter().map(|b| b.to_string()).collect();
    let args: Vec<String> = [
        ("--device", cmd.device.to_string()),
        ("--prompt-tokens", cmd.prompt_tokens.to_string()),
        ("--new-tokens", cmd.new_tokens.to_string()),
        ("--batch-tokens", cmd.batch_tokens.to_string()),
        ("--batches", batches.join(",")),
        ("--runs", cmd.runs.to_string()),
        ("--seed", cmd.seed.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    let mut run = TorchRun::default();
    let mut said = vec![];
    let exit = run_script(cmd.python, cmd.script, &args, |line| match parse_line(line) {
        Line::Measurement(m) => {
            match &m.tok_s {
                Ok(v) => eprintln!("pytorch: {} batch {}: {v:.0} tok/s ({})", m.measure.name(), m.batch, m.mode),
                Err(e) => eprintln!("pytorch: {} batch {}: {e}", m.measure.name(), m.batch),
            }
            run.measurements.push(m);
        }
        Line::Setup(s) => run.setup = Some(s),
        Line::Fatal(e) => said.push(e),
        Line::Other(l) => said.push(format!("unexpected peer output: {l}")),
    });
    let exit = exit?;
    if let Some(why) = exit.unavailable(!run.measurements.is_empty(), &said) {
        return Err(why);
    }
    run.notes = said;
    if exit.code != Some(0) {
        run.notes.push(format!("the PyTorch peer exited with {}; rows without its figure were not measured", exit.status));
    }
    Ok(run)
}

enum Line {
    Measurement(Measurement),
    Setup(Setup),
    Fatal(String),
    Other(String),
}

fn parse_line(line: &str) -> Line {
    let other = || Line::Other(line.chars().take(200).collect());
    let Ok(v) = serde_json::from_str::<Value>(line) else { return other() };
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let f = |k: &str| v.get(k).and_then(Value::as_f64);
    let u = |k: &str| v.get(k).and_then(Value::as_u64);
    if let Some(what) = s("measure") {
        let measure = match what.as_str() {
            "prefill" => Measure::Prefill,
            "decode" => Measure::Decode,
            _ => return other(),
        };
        let Some(batch) = u("batch").and_then(|b| usize::try_from(b).ok()) else { return other() };
        let tok_s = match (f("tok_s"), s("error")) {
            (_, Some(e)) => Err(format!("PyTorch failed: {e}")),
            (Some(t), None) if t > 0.0 && t.is_finite() => Ok(t),
            (t, None) => Err(format!("PyTorch reported no rate ({t:?})")),
        };
        return Line::Measurement(Measurement {
            measure,
            batch,
            tok_s,
            mode: s("mode").unwrap_or_else(|| "?".into()),
            eager_tok_s: f("eager_tok_s"),
            graph_tok_s: f("graph_tok_s"),
            graph_error: s("graph_error"),
            max_cache_len: u("max_cache_len"),
        });
    }
    if v.get("info").is_some() {
        let or_q = |k: &str| s(k).unwrap_or_else(|| "?".into());
        let checks = v
            .get("checks")
            .and_then(Value::as_object)
            .map(|m| m.iter().map(|(k, c)| (k.clone(), c.as_str().unwrap_or("?").to_string())).collect())
            .unwrap_or_default();
        return Line::Setup(Setup {
            torch: or_q("torch"),
            transformers: or_q("transformers"),
            device: or_q("device"),
            dtype: or_q("dtype"),
            graphs: v.get("graphs").and_then(Value::as_bool).unwrap_or(false),
            params: u("params"),
            layers: u("layers"),
            attention: or_q("attention"),
            static_cache: or_q("static_cache"),
            logits: or_q("logits"),
            checks,
        });
    }
    match s("error") {
        Some(e) => Line::Fatal(e),
        None => other(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `run` with `sh` standing in for python and a script body.
    fn run_fake(name: &str, body: &str) -> Result<TorchRun, String> {
        let dir = std::env::temp_dir().join(format!("rlx-bench-torch-{name}-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let script = dir.join("peer.sh");
        let _ = std::fs::write(&script, body);
        let cmd = TorchCommand {
            python: "sh",
            script: &script,
            device: "cpu",
            prompt_tokens: 16,
            new_tokens: 8,
            batch_tokens: 4,
            batches: &[2, 4],
            runs: 3,
            seed: 7,
        };
        let out = run(&cmd);
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    fn ran(out: Result<TorchRun, String>) -> TorchRun {
        out.unwrap_or_else(|e| panic!("expected a run, got {e}"))
    }

    #[test]
    fn the_settings_reach_the_peer_and_its_lines_become_rates() {
        // The script checks its arguments, then prints what the real peer prints.
        let body = r#"test "$*" = "--device cpu --prompt-tokens 16 --new-tokens 8 --batch-tokens 4 --batches 2,4 --runs 3 --seed 7" || { echo "{\"error\": \"bad args: $*\"}"; exit 3; }
echo '{"measure": "prefill", "batch": 1, "tokens": 16, "tok_s": 5000.5, "seconds": 0.003, "mode": "cuda graph", "eager_tok_s": 900.0, "graph_tok_s": 5000.5, "max_cache_len": 32}'
echo '{"measure": "decode", "batch": 1, "tokens": 8, "tok_s": 400.0, "seconds": 0.02, "mode": "cuda graph", "max_cache_len": 32}'
echo '{"measure": "prefill", "batch": 2, "tokens": 16, "tok_s": null, "error": "OutOfMemoryError: CUDA out of memory"}'
echo '{"measure": "decode", "batch": 2, "tokens": 4, "tok_s": 700.0, "mode": "eager", "graph_error": "RuntimeError: operation not permitted when stream is capturing", "max_cache_len": 28}'
echo '{"info": "torch-decode-peer", "torch": "2.11.0", "transformers": "4.57.1", "device": "NVIDIA H100", "dtype": "f16", "graphs": true, "attention": "sdpa", "params": 134515008, "layers": 30, "static_cache": "StaticCache(config=, max_cache_len=)", "logits": "last position only (logits_to_keep=1)", "checks": {"decode": "passed: tokens match", "host reads": "failed: Tensor.item() at masking_utils.py:297"}}'
"#;
        let r = ran(run_fake("lines", body));
        assert_eq!(r.tok_s(Measure::Prefill, 1).ok(), Some(5000.5));
        assert_eq!(r.tok_s(Measure::Decode, 1).ok(), Some(400.0));
        assert_eq!(r.tok_s(Measure::Decode, 2).ok(), Some(700.0));
        let oom = r.tok_s(Measure::Prefill, 2).err().unwrap_or_default();
        assert!(oom.contains("out of memory"), "{oom}");
        let missing = r.tok_s(Measure::Decode, 4).err().unwrap_or_default();
        assert!(missing.contains("no decode line for batch 4"), "{missing}");
        assert!(r.notes.is_empty(), "{:?}", r.notes);

        let notes = r.describe().join("\n");
        for want in [
            "transformers 4.57.1 LlamaForCausalLM (torch 2.11.0)",
            "30 layers, 134.5 M parameters",
            "f16, sdpa attention",
            "captured once as a CUDA graph",
            "batch 1 cuda graph (eager 900, CUDA graph 5000 tok/s)",
            "32 tokens at batch 1, 28 tokens at batch 2",
            "self-checks passed: decode.",
            "decode batch 2: CUDA-graph capture failed, eager figure shown: RuntimeError: operation not permitted",
            "self-check 'host reads' failed: Tensor.item()",
        ] {
            assert!(notes.contains(want), "notes lack {want:?}:\n{notes}");
        }
        assert!(!notes.contains("self-check 'decode'"), "a passed check is not a warning:\n{notes}");
    }

    #[test]
    fn a_peer_without_torch_is_unavailable_with_its_reason() {
        let out = run_fake("notorch", "echo '{\"error\": \"python peer unavailable: cannot import torch/transformers\"}'; exit 3\n");
        let why = out.err().unwrap_or_default();
        assert!(why.contains("cannot import torch"), "{why}");
        // Exit status 3 means "cannot run here" even after some output.
        let body = "echo '{\"measure\": \"prefill\", \"batch\": 1, \"tok_s\": 5.0}'\necho '{\"error\": \"no GPU\"}'\nexit 3\n";
        assert!(run_fake("three", body).is_err_and(|m| m.contains("no GPU")));
        assert!(run_fake("silent", "exit 1\n").is_err_and(|m| m.contains("reported nothing")));
        let dir = std::env::temp_dir();
        let cmd = TorchCommand {
            python: "sh",
            script: &dir.join("rlx-no-such-peer.py"),
            device: "cpu",
            prompt_tokens: 1,
            new_tokens: 1,
            batch_tokens: 1,
            batches: &[],
            runs: 1,
            seed: 0,
        };
        assert!(run(&cmd).is_err_and(|m| m.contains("not found")));
    }

    #[test]
    fn a_crash_after_some_lines_keeps_them_and_says_so() {
        let body =
            "echo 'Traceback: something'\necho '{\"measure\": \"decode\", \"batch\": 1, \"tok_s\": 321.0, \"mode\": \"eager\"}'\nexit 1\n";
        let r = ran(run_fake("crash", body));
        assert_eq!(r.tok_s(Measure::Decode, 1).ok(), Some(321.0));
        assert!(r.setup.is_none());
        let notes = r.describe().join("\n");
        assert!(notes.contains("unexpected peer output: Traceback"), "{notes}");
        assert!(notes.contains("exited with"), "{notes}");
        assert!(notes.contains("stopped before describing its setup"), "{notes}");
    }

    #[test]
    fn a_cpu_peer_says_it_ran_eagerly() {
        let line = r#"{"info": "torch-decode-peer", "torch": "t", "transformers": "x", "device": "cpu", "dtype": "f32", "graphs": false, "checks": {}}"#;
        let Line::Setup(s) = parse_line(line) else { panic!("an info line") };
        let r = TorchRun { setup: Some(s), ..TorchRun::default() };
        assert!(r.describe().join(" ").contains("eagerly on the CPU (no CUDA graphs there)"));
        // Lines that are not the peer's are kept as text, not dropped.
        assert!(matches!(parse_line(r#"{"measure": "train", "batch": 1}"#), Line::Other(_)));
        assert!(matches!(parse_line(r#"{"measure": "decode"}"#), Line::Other(_)));
        assert!(matches!(parse_line(r#"{"measure": "decode", "batch": 1, "tok_s": 0.0}"#), Line::Measurement(m) if m.tok_s.is_err()));
    }
}
