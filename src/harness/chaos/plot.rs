//! `chaos --plot`: the run as an SVG. Top panel the I/O rate, bottom panel the latency
//! (mean and max, log scale), both over time; each fault a vertical line across both
//! panels labelled with its kind, and the time from the fault until the controller was live
//! again shaded behind it.

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;

use crate::harness::chaos::report::{FaultOutcome, Sample};

const WIDTH: u32 = 1100;
const HEIGHT: u32 = 720;
/// Fault markers, their labels and (faded) their recovery windows. Nothing else in the
/// picture has this colour: a reader (or a test) finds the faults by it.
pub const MARKER: RGBColor = RGBColor(0xB2, 0x22, 0x22);
const RATE: RGBColor = RGBColor(0x1F, 0x77, 0xB4);
const LAT_MEAN: RGBColor = RGBColor(0x2C, 0xA0, 0x2C);
const LAT_MAX: RGBColor = RGBColor(0xFF, 0x7F, 0x0E);
/// Labels closer than this (pixels) to the one before are left out: they would overprint.
const LABEL_GAP: i32 = 16;

/// The SVG text of the plot of a run that lasted `elapsed`.
pub fn svg(
    title: &str,
    faults: &[FaultOutcome],
    series: &[Sample],
    elapsed: Duration,
) -> Result<String> {
    let mut out = String::new();
    draw(&mut out, title, faults, series, elapsed).map_err(|e| anyhow!("cannot draw: {e}"))?;
    Ok(out)
}

/// Refuse a `--plot` path that the run could not write at its end, before the run.
pub fn check_plot_path(path: &std::path::Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => bail!(
            "--plot {}: not a regular file; give the path of a new or regular file",
            path.display()
        ),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            bail!("--plot {}: {e}", path.display())
        }
        _ => {}
    }
    let dir = plot_dir(path);
    if !dir.is_dir() {
        bail!(
            "--plot {}: no directory {}; create it first",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

fn plot_dir(path: &std::path::Path) -> &std::path::Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    }
}

/// Write `data` to `path` through a temporary file beside it and a rename: a reader sees
/// the old file or the whole new one, never half.
pub fn write_atomic(path: &std::path::Path, data: &[u8]) -> Result<()> {
    check_plot_path(path)?;
    let name = path
        .file_name()
        .map_or("plot".into(), |n| n.to_string_lossy());
    let tmp = plot_dir(path).join(format!(".{name}.{}.tmp", std::process::id()));
    let r = std::fs::write(&tmp, data).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        bail!("cannot write {}: {e}", path.display());
    }
    Ok(())
}

/// The step line of `f` over the samples: each value held from its interval's start to its
/// end, broken where `f` has none.
fn steps(series: &[Sample], f: impl Fn(&Sample) -> Option<f64>) -> Vec<Vec<(f64, f64)>> {
    let mut runs: Vec<Vec<(f64, f64)>> = Vec::new();
    let mut open = false;
    for s in series {
        match f(s) {
            Some(v) => {
                if !open {
                    runs.push(Vec::new());
                    open = true;
                }
                let run = runs.last_mut().expect("a run was opened");
                run.push((s.start().as_secs_f64(), v));
                run.push((s.at.as_secs_f64(), v));
            }
            None => open = false,
        }
    }
    runs
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn draw(
    out: &mut String,
    title: &str,
    faults: &[FaultOutcome],
    series: &[Sample],
    elapsed: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let end = time_end(faults, series, elapsed);
    let rate_max = series.iter().map(Sample::iops).fold(0.0, f64::max).max(1.0) * 1.15;
    let (lat_lo, lat_hi) = latency_range(series);

    let full = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    full.fill(&WHITE)?;
    let body = full.titled(title, ("sans-serif", 20))?;
    let (top, bottom) = body.split_vertically(HEIGHT as i32 * 44 / 100);

    // One time axis, under the bottom panel: the markers cross from one panel to the other
    // through nothing but a margin.
    let mut rate = ChartBuilder::on(&top)
        .caption(
            "I/Os completed per interval; shaded: from each fault until the controller was live again",
            ("sans-serif", 14),
        )
        .margin(12)
        .x_label_area_size(0)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..end, 0f64..rate_max)?;
    rate.configure_mesh()
        .y_desc("I/O per s")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    let mut lat = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..end, (lat_lo..lat_hi).log_scale())?;
    lat.configure_mesh()
        .x_desc("time since the start of the run")
        .y_desc("I/O latency, ms (log)")
        .x_label_formatter(&|x| format!("{x:.1} s"))
        .y_label_formatter(&|y| format!("{y}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;

    let shade = MARKER.mix(0.13).filled();
    for (x0, x1) in faults.iter().filter_map(|f| recovery_window(f, end)) {
        rate.draw_series([Rectangle::new([(x0, 0.0), (x1, rate_max)], shade)])?;
        lat.draw_series([Rectangle::new([(x0, lat_lo), (x1, lat_hi)], shade)])?;
    }

    for run in steps(series, |s| Some(s.iops())) {
        rate.draw_series(LineSeries::new(run, RATE.stroke_width(2)))?;
    }
    type Line = (&'static str, RGBColor, fn(&Sample) -> Option<Duration>);
    let lines: [Line; 2] = [
        ("max latency", LAT_MAX, Sample::lat_max),
        ("mean latency", LAT_MEAN, Sample::lat_mean),
    ];
    for (name, colour, f) in lines {
        for (i, run) in steps(series, |s| f(s).map(ms)).into_iter().enumerate() {
            let drawn = lat.draw_series(LineSeries::new(run, colour.stroke_width(2)))?;
            if i == 0 {
                drawn.label(name).legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(2))
                });
            }
        }
    }
    lat.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;

    // The markers span both panels: drawn on the whole picture at the panels' pixels.
    let y_top = rate.backend_coord(&(0.0, rate_max)).1;
    let y_bottom = lat.backend_coord(&(0.0, lat_lo)).1;
    let label_style = ("sans-serif", 13)
        .into_font()
        .transform(FontTransform::Rotate90)
        .color(&MARKER);
    let mut last_label = i32::MIN / 2;
    for f in faults {
        let x = rate.backend_coord(&(f.at.as_secs_f64(), 0.0)).0;
        full.draw(&PathElement::new(
            [(x, y_top), (x, y_bottom)],
            MARKER.stroke_width(2),
        ))?;
        if x - last_label < LABEL_GAP {
            continue;
        }
        last_label = x;
        // Rotated a quarter turn clockwise: the text runs down beside the line.
        let label = fault_label(f);
        full.draw(&Text::new(label, (x + 16, y_top + 4), label_style.clone()))?;
    }
    full.present()?;
    Ok(())
}

/// The time axis's end, in seconds: the run's, or the last sample's or recovery's if later.
fn time_end(faults: &[FaultOutcome], series: &[Sample], elapsed: Duration) -> f64 {
    series
        .iter()
        .map(|s| s.at)
        .chain(faults.iter().map(|f| f.at + f.to_live.unwrap_or_default()))
        .fold(elapsed, Duration::max)
        .as_secs_f64()
        .max(0.1)
}

/// The latency axis (ms, log scale) over every sample's mean and max, with room above the
/// highest for the legend.
fn latency_range(series: &[Sample]) -> (f64, f64) {
    let lats: Vec<f64> = series
        .iter()
        .flat_map(|s| [s.lat_mean(), s.lat_max()])
        .flatten()
        .map(ms)
        .filter(|&v| v > 0.0)
        .collect();
    if lats.is_empty() {
        return (0.01, 1.0);
    }
    let lo = lats.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = lats.iter().copied().fold(0.0, f64::max);
    (lo / 2.0, hi * 10.0)
}

/// From fault `f` to where its recovery ends: live again, or (not recovered) `end`, the end
/// of the run. None for a fault that was not inflicted.
fn recovery_window(f: &FaultOutcome, end: f64) -> Option<(f64, f64)> {
    let at = f.at.as_secs_f64();
    match (&f.error, f.to_live) {
        (Some(_), _) => None,
        (None, Some(d)) => Some((at, at + d.as_secs_f64())),
        (None, None) => Some((at, end)),
    }
}

/// What the marker of fault `f` says.
fn fault_label(f: &FaultOutcome) -> String {
    match (&f.error, f.to_live) {
        (Some(_), _) => format!("{}: not inflicted", f.kind.name()),
        (None, Some(d)) => format!("{} {:.0} ms", f.kind.name(), ms(d)),
        (None, None) => format!("{}: NOT RECOVERED", f.kind.name()),
    }
}
