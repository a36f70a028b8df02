//! Out of memory at prepare: a graph whose activations cannot fit (an
//! absurd batch) is refused with an error naming the bytes it asked for,
//! nothing stays allocated, and a normal graph then compiles and runs in
//! the same process and session. On the CPU always; on CUDA when a GPU is
//! usable (skips without one unless RLX_REQUIRE_GPU=1).

use rlx::{DType, Device, Graph, RuntimeError, Session, Tensor};

const WIDTH: usize = 1024;

/// relu(x · wᵀ + b) followed by a GELU: activations of batch × WIDTH floats.
fn graph(batch: usize) -> Graph {
    let mut g = Graph::new();
    let mut build = || -> rlx::Result<()> {
        let x = g.input("x", [batch, WIDTH], DType::F32)?;
        let w = g.param("w", [WIDTH, WIDTH], DType::F32)?;
        let b = g.param("b", [WIDTH], DType::F32)?;
        let y = g.linear(x, w, Some(b), true)?;
        let y = g.gelu(y)?;
        g.output(y)?;
        Ok(())
    };
    build().unwrap_or_else(|e| panic!("graph: {e}"));
    g
}

fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// The error of compiling an absurd batch: it must say out of memory and
/// name a byte count of at least `at_least`.
fn assert_named_oom(session: &Session, batch: usize, at_least: u64) {
    let err = match session.compile(&graph(batch)) {
        Ok(_) => panic!("a batch of {batch} x {WIDTH} floats was prepared"),
        Err(e) => e,
    };
    let text = err.to_string();
    eprintln!("{:?}: batch {batch}: {text}", session.device());
    assert!(text.contains("out of memory"), "not an out-of-memory error: {text}");
    let numbers: Vec<u64> = text.split(|c: char| !c.is_ascii_digit()).filter_map(|s| s.parse().ok()).collect();
    assert!(numbers.iter().any(|&n| n >= at_least), "no byte count of at least {at_least} in: {text}");
    if let rlx::Error::Runtime(RuntimeError::OutOfMemory { requested, .. }) = &err {
        assert!(*requested >= at_least);
    }
}

/// After the refusal a normal batch compiles and gives relu-free GELU of a
/// known linear map: with w = I and b = 0 the output is gelu(x).
fn assert_normal_run(session: &Session) {
    let mut exe = session.compile(&graph(2)).unwrap_or_else(|e| panic!("a normal prepare after the refusal: {e}"));
    let x: Vec<f32> = (0..2 * WIDTH).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
    let out = exe.run(&[("x", &Tensor::from_f32([2, WIDTH], &x).unwrap_or_else(|e| panic!("{e}")))]).unwrap_or_else(|e| panic!("{e}"));
    let got = out[0].to_f32();
    for (g, &v) in got.iter().zip(&x) {
        let v = v as f64;
        let want = 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2));
        assert!((*g as f64 - want).abs() < 2e-3, "gelu({v}) = {g}, expected {want}");
    }
}

/// erf to 1e-7 (Abramowitz-Stegun 7.1.26 is 1.5e-7).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * (-x * x).exp();
    if x >= 0.0 {
        y
    } else {
        -y
    }
}

fn session(device: Device) -> Option<Session> {
    let s = match Session::new(device) {
        Ok(s) => s,
        Err(e) if std::env::var("RLX_REQUIRE_GPU").is_ok_and(|v| v == "1") => panic!("RLX_REQUIRE_GPU=1 but {device:?} is unusable: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {device:?} out-of-memory test: no CUDA device ({e})");
            return None;
        }
    };
    let eye: Vec<f32> = (0..WIDTH * WIDTH).map(|i| if i / WIDTH == i % WIDTH { 1.0 } else { 0.0 }).collect();
    let set = |n: &str, t: rlx::Result<Tensor>| s.set_weight(n, t.unwrap_or_else(|e| panic!("{e}"))).unwrap_or_else(|e| panic!("{e}"));
    set("w", Tensor::from_f32([WIDTH, WIDTH], &eye).map_err(Into::into));
    set("b", Tensor::from_f32([WIDTH], &[0.0; WIDTH]).map_err(Into::into));
    Some(s)
}

#[test]
fn an_absurd_batch_on_the_cpu_is_a_named_error_and_leaks_nothing() {
    let Some(s) = session(Device::Cpu) else { return };
    assert_normal_run(&s);
    let before = rss_kb();
    // 2^34 rows x 4 KiB: 64 TiB of activations, past any machine's memory
    // (and past what overcommit lets one allocation reserve).
    assert_named_oom(&s, 1 << 34, 1 << 46);
    // Each slot's arena (two activations of rows x 4 KiB) at 3/4 of the
    // machine's memory: one such allocation passes the kernel's overcommit
    // heuristic, two slots of it cannot fit, and the backend's own check
    // must refuse them before anything is allocated.
    let total_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .unwrap_or(u64::MAX / 1024);
    let rows = (total_kb * 1024 / 4 * 3 / (2 * WIDTH as u64 * 4)) as usize;
    assert_named_oom(&s, rows, total_kb * 1024);
    let after = rss_kb();
    assert!(after < before + 64 * 1024, "resident memory grew from {before} KB to {after} KB over the refused prepares");
    assert_normal_run(&s);
}

#[test]
fn an_arena_larger_than_the_gpu_is_a_named_error_and_the_device_stays_usable() {
    if !cfg!(feature = "cuda") {
        eprintln!("SKIPPED CUDA out-of-memory test: no CUDA device (built without the cuda feature)");
        return;
    }
    let Some(s) = session(Device::Cuda(0)) else { return };
    assert_normal_run(&s);
    // 2^28 rows x 4 KiB = 1 TiB per activation: more than any GPU holds.
    assert_named_oom(&s, 1 << 28, 1 << 40);
    assert_normal_run(&s);
    // And a fresh session in the same process works too.
    let Some(fresh) = session(Device::Cuda(0)) else { return };
    assert_normal_run(&fresh);
}
