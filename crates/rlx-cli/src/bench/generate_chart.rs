//! The chart of `rlx bench --model smollm2 --plot FILE.svg`: horizontal
//! grouped bars, one group per measurement row of the table, one bar per
//! runner that has a figure. The rows differ by 400× (decode at batch 1
//! against prefill of 32 prompts), so each bar's length is its share of the
//! row's fastest, and its tok/s is written beside it.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One group of bars: the row's label and a figure (tok/s) per series.
pub struct ChartRow {
    pub label: String,
    pub values: Vec<Option<f64>>,
}

pub struct Chart {
    pub title: String,
    /// The runners, in the order of every row's values.
    pub series: Vec<&'static str>,
    pub rows: Vec<ChartRow>,
}

/// RLX red, llama.cpp green, PyTorch blue (the embedding chart's RLX and
/// PyTorch colours); further series reuse them.
const COLORS: [RGBColor; 3] = [RGBColor(0xd6, 0x27, 0x28), RGBColor(0x2c, 0xa0, 0x2c), RGBColor(0x1f, 0x77, 0xb4)];

const BAR_PX: u32 = 18;
const GAP_PX: u32 = 16;
/// Bars end at 1 (the row's fastest); the rest is room for their labels.
const X_MAX: f64 = 1.3;

/// Writes the chart. Series without a figure in any row are left out; a
/// row's missing figure shows as "– (no figure)" where its bar would be.
pub fn plot_svg(path: &Path, chart: &Chart) -> Result<(), String> {
    let err = |e: String| format!("--plot {}: {e}", path.display());
    let shown: Vec<usize> =
        (0..chart.series.len()).filter(|&k| chart.rows.iter().any(|r| r.values.get(k).copied().flatten().is_some())).collect();
    if shown.is_empty() {
        return Err(err("no figures to draw".into()));
    }
    let n = chart.rows.len();
    let group_px = BAR_PX * shown.len() as u32 + GAP_PX;
    // Labels in 12 px sans-serif: about 7 px a character.
    let label_px = chart.rows.iter().map(|r| r.label.chars().count()).max().unwrap_or(0) as u32 * 7 + 16;
    let (width, height) = (label_px + 760, group_px * n as u32 + 150);
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (head, body) = root.split_vertically(64);
    head.draw(&Text::new(chart.title.clone(), (12, 8), ("sans-serif", 16).into_font().color(&BLACK))).map_err(|e| err(e.to_string()))?;
    // The legend, one swatch per series shown, under the title.
    let mut x = 12;
    for &k in &shown {
        let color = COLORS[k % COLORS.len()];
        head.draw(&Rectangle::new([(x, 38), (x + 12, 50)], color.filled())).map_err(|e| err(e.to_string()))?;
        head.draw(&Text::new(chart.series[k], (x + 18, 44), anchored(12, HPos::Left))).map_err(|e| err(e.to_string()))?;
        x += 18 + 8 * chart.series[k].chars().count() as i32 + 24;
    }
    head.draw(&Text::new("bars scaled to each row's fastest, labelled in tok/s", (x, 44), anchored(12, HPos::Left)))
        .map_err(|e| err(e.to_string()))?;
    let mut plot = ChartBuilder::on(&body)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(label_px)
        .build_cartesian_2d(0f64..X_MAX, 0f64..n as f64)
        .map_err(|e| err(e.to_string()))?;
    plot.configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(14)
        .light_line_style(WHITE)
        .x_label_formatter(&|v| if *v <= 1.0 + 1e-9 { format!("{:.0}%", v * 100.0) } else { String::new() })
        .x_desc("bar length: share of the row's fastest; labels: tok/s")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    // Row i spans y in [n - i - 1, n - i], top to bottom; its bars share
    // the upper part, the rest is the gap to the next row.
    let bar = f64::from(BAR_PX) / f64::from(group_px);
    for (i, row) in chart.rows.iter().enumerate() {
        let top = (n - i) as f64 - f64::from(GAP_PX) / f64::from(group_px) / 2.0;
        let fastest = row.values.iter().flatten().copied().fold(0.0, f64::max);
        for (slot, &k) in shown.iter().enumerate() {
            let (y1, y0) = (top - slot as f64 * bar, top - (slot as f64 + 0.85) * bar);
            let mid = (y0 + y1) / 2.0;
            match row.values.get(k).copied().flatten().filter(|v| *v > 0.0 && fastest > 0.0) {
                Some(v) => {
                    let share = v / fastest;
                    let color = COLORS[k % COLORS.len()];
                    plot.draw_series(std::iter::once(Rectangle::new([(0.0, y0), (share, y1)], color.filled())))
                        .map_err(|e| err(e.to_string()))?;
                    plot.draw_series(std::iter::once(Text::new(format!("{v:.0} tok/s"), (share + 0.01, mid), anchored(11, HPos::Left))))
                        .map_err(|e| err(e.to_string()))?;
                }
                None => {
                    plot.draw_series(std::iter::once(Text::new("– (no figure)", (0.01, mid), anchored(11, HPos::Left))))
                        .map_err(|e| err(e.to_string()))?;
                }
            }
        }
        // Backend coordinates are the whole image's: draw on the root.
        let (px, py) = plot.backend_coord(&(0.0, top - shown.len() as f64 * bar / 2.0));
        root.draw(&Text::new(row.label.clone(), (px - 8, py), anchored(12, HPos::Right))).map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// Black sans-serif text of `size`, centred vertically on its position.
fn anchored(size: u32, h: HPos) -> TextStyle<'static> {
    ("sans-serif", size).into_font().color(&BLACK).pos(Pos::new(h, VPos::Center))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Chart {
        Chart {
            title: "rlx bench --model smollm2 — test GPU — 2026-12-06 22:18 UTC".into(),
            series: vec!["RLX", "llama.cpp", "PyTorch"],
            rows: vec![
                ChartRow { label: "prefill, 128-token prompt".into(), values: vec![Some(52342.0), Some(16484.0), Some(20100.4)] },
                ChartRow { label: "decode, batch 1".into(), values: vec![Some(1642.0), Some(952.0), None] },
                ChartRow { label: "decode, batch 32".into(), values: vec![Some(21598.0), Some(8502.0), Some(30000.0)] },
            ],
        }
    }

    fn svg_of(chart: &Chart, name: &str) -> String {
        let path = std::env::temp_dir().join(format!("rlx-bench-gen-{name}-{}.svg", std::process::id()));
        plot_svg(&path, chart).unwrap_or_else(|e| panic!("{e}"));
        // Text sits on its own line in plotters' SVG: compare without whitespace runs.
        let svg = std::fs::read_to_string(&path).unwrap_or_default().split_whitespace().collect::<Vec<_>>().join(" ");
        if std::env::var_os("KEEP_SVG").is_none() {
            let _ = std::fs::remove_file(&path);
        }
        svg
    }

    #[test]
    fn every_row_series_and_figure_is_in_the_chart() {
        let chart = sample();
        let svg = svg_of(&chart, "all");
        for want in [
            "<svg",
            "> RLX <",
            "> llama.cpp <",
            "> PyTorch <",
            "> prefill, 128-token prompt <",
            "> decode, batch 1 <",
            "> decode, batch 32 <",
            "> 52342 tok/s <",
            "> 16484 tok/s <",
            "> 20100 tok/s <",
            "> 1642 tok/s <",
            "> 952 tok/s <",
            "> 21598 tok/s <",
            "> 8502 tok/s <",
            "> 30000 tok/s <",
            "share of the row&apos;s fastest",
            "test GPU",
        ] {
            assert!(svg.contains(want), "SVG lacks {want:?}");
        }
        // PyTorch has no decode figure at batch 1: a dash where its bar would be.
        assert_eq!(svg.matches("> – (no figure) <").count(), 1);
        assert!(svg.contains("bars scaled to each row&apos;s fastest, labelled in tok/s"));
        // Eight bars and three legend swatches, besides the background and the plot frame.
        let fills = COLORS.iter().map(|c| svg.matches(&format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2)).count()).sum::<usize>();
        assert_eq!(fills, 8 + 3, "{svg}");
    }

    #[test]
    fn the_fastest_bar_of_a_row_is_the_longest_and_others_scale_to_it() {
        let chart = Chart {
            title: "t".into(),
            series: vec!["RLX", "llama.cpp"],
            rows: vec![ChartRow { label: "decode, batch 1".into(), values: vec![Some(1000.0), Some(250.0)] }],
        };
        let svg = svg_of(&chart, "scale");
        let widths: Vec<f64> = ["D62728", "2CA02C"]
            .iter()
            .map(|c| {
                // The last rectangle of the colour: the legend's swatches come first.
                let at = svg.rfind(&format!("fill=\"#{c}\"")).unwrap_or_else(|| panic!("no bar of #{c}"));
                let rect = &svg[svg[..at].rfind("<rect").unwrap_or(0)..at];
                let w = rect.split("width=\"").nth(1).and_then(|s| s.split('"').next()).and_then(|s| s.parse().ok());
                w.unwrap_or_else(|| panic!("no width in {rect}"))
            })
            .collect();
        let ratio = widths[1] / widths[0];
        assert!((ratio - 0.25).abs() < 0.02, "{widths:?}");
    }

    #[test]
    fn series_that_never_ran_are_left_out_and_no_figures_is_an_error() {
        let mut chart = sample();
        chart.rows.iter_mut().for_each(|r| r.values[1] = None);
        let svg = svg_of(&chart, "twoseries");
        assert!(!svg.contains("llama.cpp") && svg.contains("> PyTorch <"), "a series without figures has no legend entry");
        chart.rows.iter_mut().for_each(|r| r.values = vec![None, None, None]);
        let path = std::env::temp_dir().join("rlx-bench-gen-never-written.svg");
        assert!(plot_svg(&path, &chart).is_err());
    }
}
