//! The soak's chart (`report.svg`): one panel per family of series over the run's time (RSS,
//! descriptors, threads per process; PostgreSQL's connections; lag; p99), each fault a dashed
//! vertical line with its number and the warm-up shaded. Drawn with plotters, in the style of
//! the bench report's charts (`report/charts.rs`).

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::processes::ROLES;
use super::sample::{ProcSample, Sample};

type ChartResult<T> = Result<T, Box<dyn std::error::Error>>;
/// A named line's points; a line may break (a restart): each inner Vec is drawn apart.
type Line = (String, RGBColor, Vec<Vec<(f64, f64)>>);

const W: u32 = 1000;
const H: u32 = 300;
const FONT: &str = "sans-serif";
const CAPTION: u32 = 20;
const LABEL: u32 = 14;
const LEGEND_W: u32 = 130;
const ORANGE: RGBColor = RGBColor(230, 140, 0);
const PURPLE: RGBColor = RGBColor(140, 60, 170);
const COLORS: [RGBColor; 4] = [BLUE, ORANGE, GREEN, PURPLE];

/// A fault on the time axis: seconds since the start and its label.
pub(super) struct FaultLine {
    pub t_s: f64,
    pub label: String,
}

/// The SVG of the whole soak.
pub(super) fn chart(
    samples: &[Sample],
    faults: &[FaultLine],
    warm_up_s: f64,
) -> ChartResult<String> {
    let per_role = |f: fn(&ProcSample) -> f64| -> Vec<Line> {
        ROLES
            .iter()
            .zip(COLORS)
            .map(|(role, color)| (role.to_string(), color, by_incarnation(samples, role, f)))
            .collect()
    };
    let one = |name: &str, f: &dyn Fn(&Sample) -> Option<f64>| -> Vec<Line> {
        let pts = samples
            .iter()
            .filter_map(|s| Some((s.t_s, f(s)?)))
            .collect();
        vec![(name.to_string(), BLUE, vec![pts])]
    };
    let panels: [(&str, &str, Vec<Line>); 6] = [
        (
            "Resident memory per process",
            "RSS (MB)",
            per_role(|p| p.rss_mb),
        ),
        (
            "Open file descriptors per process",
            "descriptors",
            per_role(|p| p.fds as f64),
        ),
        (
            "Threads per process",
            "threads",
            per_role(|p| p.threads as f64),
        ),
        (
            "PostgreSQL connections of the engine",
            "connections",
            one("connections", &|s| s.pg_connections.map(|c| c as f64)),
        ),
        (
            "Consumer lag",
            "records",
            one("lag", &|s| s.lag.map(|l| l as f64)),
        ),
        (
            "End-to-end latency, p99 of each interval",
            "p99 (ms)",
            one("p99", &|s| s.p99_ms),
        ),
    ];
    let t_end = samples.last().map_or(1.0, |s| s.t_s.max(1.0));
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (W, H * panels.len() as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((panels.len(), 1));
        for ((title, y_desc, lines), area) in panels.iter().zip(areas.iter()) {
            panel(area, title, y_desc, lines, faults, warm_up_s, t_end)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// A role's series split where the process was restarted.
fn by_incarnation(
    samples: &[Sample],
    role: &str,
    f: fn(&ProcSample) -> f64,
) -> Vec<Vec<(f64, f64)>> {
    let mut runs: Vec<(u32, Vec<(f64, f64)>)> = Vec::new();
    for s in samples {
        for p in s.processes.iter().filter(|p| p.role == role) {
            match runs.last_mut() {
                Some((inc, pts)) if *inc == p.incarnation => pts.push((s.t_s, f(p))),
                _ => runs.push((p.incarnation, vec![(s.t_s, f(p))])),
            }
        }
    }
    runs.into_iter().map(|(_, pts)| pts).collect()
}

fn panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    lines: &[Line],
    faults: &[FaultLine],
    warm_up_s: f64,
    t_end: f64,
) -> ChartResult<()> {
    let ys = lines.iter().flat_map(|l| l.2.iter().flatten().map(|p| p.1));
    let hi = ys.filter(|y| y.is_finite()).fold(0.0f64, f64::max);
    let top = if hi > 0.0 { hi * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, CAPTION))
        .margin(10)
        .margin_right(LEGEND_W)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_end, 0.0..top)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .bold_line_style(BLACK.mix(0.12))
        .label_style((FONT, LABEL))
        .axis_desc_style((FONT, LABEL))
        .x_labels(12)
        .y_labels(6)
        .x_label_formatter(&|v| format!("{}", v.round()))
        .y_label_formatter(&|v| format!("{}", (v * 100.0).round() / 100.0))
        .x_desc("time since start (s)")
        .y_desc(y_desc)
        .draw()?;
    if warm_up_s > 0.0 {
        let shade = Rectangle::new(
            [(0.0, 0.0), (warm_up_s.min(t_end), top)],
            BLACK.mix(0.05).filled(),
        );
        chart.draw_series(std::iter::once(shade))?;
    }
    for (i, f) in faults.iter().enumerate() {
        let dash = DashedLineSeries::new(
            [(f.t_s, 0.0), (f.t_s, top)],
            6,
            4,
            RED.mix(0.7).stroke_width(1),
        );
        chart.draw_series(dash)?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{} {}", i + 1, f.label),
            (f.t_s, top * 0.97),
            TextStyle::from((FONT, 11))
                .color(&RED)
                .pos(Pos::new(HPos::Left, VPos::Top)),
        )))?;
    }
    for (i, (name, color, runs)) in lines.iter().enumerate() {
        let style = color.stroke_width(2);
        for pts in runs {
            let pts: Vec<(f64, f64)> = pts
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            if pts.len() == 1 {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            chart.draw_series(LineSeries::new(pts, style))?;
        }
        let (x, y) = (W as i32 - LEGEND_W as i32 + 10, 40 + 22 * i as i32);
        area.draw(&PathElement::new([(x, y), (x + 22, y)], style))?;
        area.draw(&Text::new(
            name.clone(),
            (x + 28, y),
            TextStyle::from((FONT, LABEL)).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}
