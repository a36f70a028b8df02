//! What `rlx bench` produces: one row per (model, dtype, shape), the
//! markdown table with the machine and date, and the grouped-bar SVG chart.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One benchmarked configuration. Times are medians in microseconds; `None`
/// where that side did not run (no peer, a failure, a mode not available).
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub model: String,
    pub dtype: String,
    pub batch: usize,
    pub seq: usize,
    pub rlx_replay_us: Option<f64>,
    pub rlx_eager_us: Option<f64>,
    pub torch_eager_us: Option<f64>,
    pub torch_graph_us: Option<f64>,
    /// Median host time inside `submit` for a replayed call.
    pub host_submit_us: Option<f64>,
    /// CPU time of the calling thread per replayed call (submit + wait).
    pub host_cpu_us: Option<f64>,
    /// Pipelined replay (call k + 1 submitted before call k is collected):
    /// wall time per call, and the median submit time in that steady state.
    pub pipelined_us: Option<f64>,
    pub host_submit_pipelined_us: Option<f64>,
    pub kernels: Option<usize>,
    /// Max abs difference of RLX's output against PyTorch's, and the largest
    /// magnitude in PyTorch's output (the scale the difference is read on).
    pub max_abs_diff: Option<(f64, f64)>,
    pub notes: Vec<String>,
}

impl Row {
    pub fn shape(&self) -> String {
        format!("{}x{}", self.batch, self.seq)
    }

    pub fn label(&self) -> String {
        format!("{} {} {}", self.model, self.dtype, self.shape())
    }

    /// RLX over the peer's time: below 1 means RLX is faster.
    pub fn ratio(&self, peer: Option<f64>) -> Option<f64> {
        match (self.rlx_replay_us, peer) {
            (Some(r), Some(p)) if p > 0.0 => Some(r / p),
            _ => None,
        }
    }
}

/// Where and when the numbers were taken.
#[derive(Debug, Clone)]
pub struct Context {
    pub machine: String,
    pub date: String,
    pub command: String,
    pub runs: usize,
    pub warmup: usize,
    pub peer: String,
    /// Lines printed under the table (peer missing, failures...).
    pub notes: Vec<String>,
    /// A GPU run (replay and eager, PyTorch timed with CUDA events) rather
    /// than a CPU one (one RLX executable, PyTorch eager, wall clock).
    pub gpu: bool,
}

/// The GPU name and driver from nvidia-smi, or the CPU model when there is
/// no nvidia-smi (or for a CPU run).
pub fn machine(gpu: bool) -> String {
    if gpu {
        let out = Command::new("nvidia-smi").args(["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]).output();
        if let Ok(o) = out {
            if o.status.success() {
                let text = String::from_utf8_lossy(&o.stdout);
                if let Some(first) = text.lines().next() {
                    let parts: Vec<&str> = first.split(',').map(str::trim).collect();
                    if let [name, driver, mem] = parts[..] {
                        return format!("{name}, driver {driver}, {mem}");
                    }
                    return first.trim().to_string();
                }
            }
        }
        return "unknown GPU (nvidia-smi not available)".into();
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| t.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into());
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    format!("{cpu}, {threads} threads")
}

/// Now in UTC as `YYYY-MM-DD HH:MM UTC`, without a date crate.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day)
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn us(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.1}"),
        None => "—".into(),
    }
}

fn ratio(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.2}")).unwrap_or_else(|| "—".into())
}

/// A table column: its header and how a row fills it.
type Column = (&'static str, fn(&Row) -> String);

/// The GPU table: both RLX modes against both PyTorch modes, host time.
const GPU_COLUMNS: &[Column] = &[
    ("RLX replay µs", |r| us(r.rlx_replay_us)),
    ("RLX eager µs", |r| us(r.rlx_eager_us)),
    ("PyTorch eager µs", |r| us(r.torch_eager_us)),
    ("PyTorch graph µs", |r| us(r.torch_graph_us)),
    ("RLX replay / PyTorch graph", |r| ratio(r.ratio(r.torch_graph_us))),
    ("host µs/call (submit)", |r| us(r.host_submit_us)),
    ("host CPU µs/call", |r| us(r.host_cpu_us)),
    ("RLX pipelined µs/call", |r| us(r.pipelined_us)),
    ("host µs/call (submit, pipelined)", |r| us(r.host_submit_pipelined_us)),
    ("kernels/forward", |r| r.kernels.map(|k| k.to_string()).unwrap_or_else(|| "—".into())),
];

/// The CPU table: there is no replay, no CUDA graph and no kernel launch,
/// so one RLX time against PyTorch eager, and the schedule's thunk count.
const CPU_COLUMNS: &[Column] = &[
    ("RLX µs", |r| us(r.rlx_replay_us)),
    ("PyTorch µs", |r| us(r.torch_eager_us)),
    ("RLX / PyTorch", |r| ratio(r.ratio(r.torch_eager_us))),
    ("RLX pipelined µs/call", |r| us(r.pipelined_us)),
    ("thunks/forward", |r| r.kernels.map(|k| k.to_string()).unwrap_or_else(|| "—".into())),
];

/// The results as markdown: context, the table, then notes.
pub fn markdown(ctx: &Context, rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Machine: {}  ", ctx.machine);
    let _ = writeln!(s, "Date: {}  ", ctx.date);
    let _ = writeln!(s, "Command: `{}`  ", ctx.command);
    let _ = writeln!(s, "Peer: {}  ", ctx.peer);
    let _ = writeln!(s, "Medians of {} runs after {} warm-up runs.\n", ctx.runs, ctx.warmup);
    let columns = if ctx.gpu { GPU_COLUMNS } else { CPU_COLUMNS };
    s.push_str("| model | dtype | batch×seq |");
    for (head, _) in columns {
        let _ = write!(s, " {head} |");
    }
    s.push_str(" max abs diff vs PyTorch |\n|---|---|---|");
    s.push_str(&"---:|".repeat(columns.len()));
    s.push_str("---|\n");
    for r in rows {
        let _ = write!(s, "| {} | {} | {}×{} |", r.model, r.dtype, r.batch, r.seq);
        for (_, cell) in columns {
            let _ = write!(s, " {} |", cell(r));
        }
        let diff = r.max_abs_diff.map(|(d, scale)| format!("{d:.2e} (of {scale:.2})")).unwrap_or_else(|| "—".into());
        let _ = writeln!(s, " {diff} |");
    }
    if ctx.gpu {
        s.push_str(
            "\nRLX times are wall clock around `run` (submit + wait, copy-in and copy-out included); PyTorch times are \
             CUDA-event spans of the forward pass alone (inputs already on the device). Host µs/call (submit) is the \
             median time `submit` takes to return for a replayed call; host CPU µs/call is the calling thread's CPU \
             time per replayed call (submit and wait; a spinning wait counts here). Pipelined: call k + 1 is submitted \
             before call k is collected (two slots in flight, as a serving loop drives the executor); the mean wall \
             time per call over the whole pipelined run.\n",
        );
    } else {
        s.push_str(
            "\nRLX times are wall clock around `run` (submit + wait, inputs and outputs included); PyTorch times are \
             wall clock around its eager forward pass. Pipelined: call k + 1 is submitted before call k is collected; \
             the mean wall time per call over the whole pipelined run.\n",
        );
    }
    let notes: Vec<String> =
        ctx.notes.iter().cloned().chain(rows.iter().flat_map(|r| r.notes.iter().map(move |n| format!("{}: {n}", r.label())))).collect();
    if !notes.is_empty() {
        s.push_str("\nNotes:\n");
        for n in notes {
            let _ = writeln!(s, "- {n}");
        }
    }
    s
}

/// A bar series of the chart: its legend, colour and value per row.
type Series = (&'static str, RGBColor, fn(&Row) -> Option<f64>);

const GPU_SERIES: &[Series] = &[
    ("RLX replay", RGBColor(0xd6, 0x27, 0x28), |r| r.rlx_replay_us),
    ("RLX eager", RGBColor(0xff, 0x98, 0x96), |r| r.rlx_eager_us),
    ("PyTorch eager", RGBColor(0xae, 0xc7, 0xe8), |r| r.torch_eager_us),
    ("PyTorch CUDA graph", RGBColor(0x1f, 0x77, 0xb4), |r| r.torch_graph_us),
];

const CPU_SERIES: &[Series] =
    &[("RLX", RGBColor(0xd6, 0x27, 0x28), |r| r.rlx_replay_us), ("PyTorch", RGBColor(0x1f, 0x77, 0xb4), |r| r.torch_eager_us)];

/// Grouped bars, one group per configuration, on a log scale (eager and
/// replay differ by 10× or more), each bar labelled with its value.
pub fn plot_svg(path: &Path, ctx: &Context, rows: &[Row]) -> Result<(), String> {
    let series = if ctx.gpu { GPU_SERIES } else { CPU_SERIES };
    let present: Vec<f64> = rows.iter().flat_map(|r| series.iter().filter_map(|s| s.2(r))).filter(|v| *v > 0.0).collect();
    if present.is_empty() {
        return Err("--plot: no timings to draw".into());
    }
    let lo = present.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = present.iter().cloned().fold(0.0, f64::max);
    // Whole decades around the data so the log axis has readable ticks, and
    // headroom above the tallest bar for the legend.
    let y_lo = 10f64.powf(lo.log10().floor()).max(0.1);
    let y_hi = 10f64.powf((hi * 20.0).log10().ceil());
    let width = (220 * rows.len() as u32 + 160).max(640);
    let err = |e: String| format!("--plot {}: {e}", path.display());
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let title = format!("rlx bench — {} — {}", ctx.machine, ctx.date);
    let n = rows.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n, (y_lo..y_hi).log_scale())
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("median µs per forward (log scale)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    let bar = 0.8 / series.len() as f64;
    for (k, (name, color, value)) in series.iter().enumerate() {
        let bars: Vec<(f64, f64)> =
            rows.iter().enumerate().filter_map(|(i, r)| value(r).map(|v| (i as f64 + 0.1 + k as f64 * bar, v))).collect();
        let color = *color;
        chart
            .draw_series(bars.iter().map(|&(x, v)| Rectangle::new([(x, y_lo), (x + bar * 0.9, v)], color.filled())))
            .map_err(|e| err(e.to_string()))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        chart
            .draw_series(bars.iter().map(|&(x, v)| Text::new(format!("{v:.0}"), (x + bar * 0.45, v), anchored(10, VPos::Bottom))))
            .map_err(|e| err(e.to_string()))?;
    }
    for (i, r) in rows.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(i as f64 + 0.5, y_lo));
        root.draw(&Text::new(r.label(), (px, py + 8), anchored(12, VPos::Top))).map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Black sans-serif text of `size`, centred horizontally on its position.
fn anchored(size: u32, v: VPos) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK).pos(Pos::new(HPos::Center, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_match_known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_422), (2025, 11, 30));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    fn sample() -> (Context, Vec<Row>) {
        let ctx = Context {
            machine: "test GPU".into(),
            date: "2026-11-30 06:00 UTC".into(),
            command: "rlx bench".into(),
            runs: 5,
            warmup: 1,
            peer: "none".into(),
            notes: vec!["peer missing".into()],
            gpu: true,
        };
        let a = Row {
            model: "minilm".into(),
            dtype: "f16".into(),
            batch: 1,
            seq: 128,
            rlx_replay_us: Some(70.0),
            rlx_eager_us: Some(900.0),
            torch_eager_us: Some(2912.0),
            torch_graph_us: Some(325.0),
            host_submit_us: Some(4.2),
            host_cpu_us: Some(71.0),
            pipelined_us: Some(150.0),
            host_submit_pipelined_us: Some(3.9),
            kernels: Some(40),
            max_abs_diff: Some((0.004, 4.1)),
            notes: vec!["replay and eager outputs bit-identical".into()],
        };
        let b = Row {
            model: "bert-base".into(),
            batch: 32,
            rlx_replay_us: Some(1400.0),
            torch_graph_us: None,
            torch_eager_us: None,
            ..a.clone()
        };
        (ctx, vec![a, b])
    }

    #[test]
    fn table_has_a_row_per_config_with_ratio() {
        let (ctx, rows) = sample();
        let md = markdown(&ctx, &rows);
        assert!(
            md.contains("| minilm | f16 | 1×128 | 70.0 | 900 | 2912 | 325 | 0.22 | 4.2 | 71.0 | 150 | 3.9 | 40 | 4.00e-3 (of 4.10) |"),
            "{md}"
        );
        assert!(md.contains("| bert-base | f16 | 32×128 | 1400 | 900 | — | — | — |"), "{md}");
        assert!(md.contains("| RLX replay µs | RLX eager µs |") && md.contains("PyTorch graph µs"), "{md}");
        assert!(md.contains("- peer missing"));
        assert!(md.contains("- minilm f16 1x128: replay and eager outputs bit-identical"));
        // Verdicts against internal targets are not the user's business.
        assert!(!md.contains("PASS") && !md.contains("FAIL") && !md.contains("Targets"), "{md}");
    }

    #[test]
    fn a_cpu_table_has_cpu_columns() {
        let (ctx, mut rows) = sample();
        rows.iter_mut().for_each(|r| r.notes.clear());
        let ctx = Context { gpu: false, ..ctx };
        let md = markdown(&ctx, &rows);
        let header = md.lines().find(|l| l.starts_with("| model")).unwrap_or_default();
        for gpu_only in ["replay", "eager", "graph", "kernels", "submit", "CUDA"] {
            assert!(!header.contains(gpu_only), "a CPU table's columns mention {gpu_only:?}: {header}");
        }
        assert!(
            md.contains("| model | dtype | batch×seq | RLX µs | PyTorch µs | RLX / PyTorch | RLX pipelined µs/call | thunks/forward |"),
            "{md}"
        );
        // The ratio is against PyTorch eager, the only PyTorch mode on a CPU.
        assert!(md.contains("| minilm | f16 | 1×128 | 70.0 | 2912 | 0.02 | 150 | 40 | 4.00e-3 (of 4.10) |"), "{md}");

        let path = std::env::temp_dir().join(format!("rlx-bench-plot-cpu-{}.svg", std::process::id()));
        plot_svg(&path, &ctx, &rows).unwrap_or_else(|e| panic!("{e}"));
        let svg = std::fs::read_to_string(&path).unwrap_or_default();
        let _ = std::fs::remove_file(&path);
        assert!(svg.contains("PyTorch") && !svg.contains("CUDA graph") && !svg.contains("replay"), "CPU chart legend");
    }

    #[test]
    fn plot_writes_an_svg_with_every_label() {
        let (ctx, rows) = sample();
        let path = std::env::temp_dir().join(format!("rlx-bench-plot-{}.svg", std::process::id()));
        plot_svg(&path, &ctx, &rows).map_err(|e| e.to_string()).unwrap_or_else(|e| panic!("{e}"));
        // Text content sits on its own line in plotters' SVG: compare without whitespace.
        let svg: String = std::fs::read_to_string(&path).unwrap_or_default().split_whitespace().collect::<Vec<_>>().join(" ");
        if std::env::var_os("KEEP_SVG").is_none() {
            let _ = std::fs::remove_file(&path);
        }
        for want in ["<svg", "RLX replay", "PyTorch CUDA graph", "minilm f16 1x128", "bert-base f16 32x128", "> 325 <", "> 1400 <"] {
            assert!(svg.contains(want), "SVG lacks {want}");
        }
        // Bars: 4 for the first row, 2 for the second, plus legend swatches.
        assert!(svg.matches("<rect").count() >= 6);
    }

    #[test]
    fn plot_without_timings_is_an_error() {
        let (ctx, mut rows) = sample();
        for r in &mut rows {
            r.rlx_replay_us = None;
            r.rlx_eager_us = None;
            r.torch_eager_us = None;
            r.torch_graph_us = None;
        }
        let path = std::env::temp_dir().join("rlx-bench-never-written.svg");
        assert!(plot_svg(&path, &ctx, &rows).is_err());
    }
}
