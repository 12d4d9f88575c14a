//! The four SVG charts of `report.html`, drawn with plotters: latency over time (log scale),
//! the latency distribution, throughput, and consumer lag; "no data" in a frame for an empty
//! series.

use std::ops::Range;

use plotters::coord::ranged1d::{AsRangedCoord, SegmentValue, ValueFormatter};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{Bucket, LatencyPoint, RatePoint, Series};

type ChartResult<T> = Result<T, Box<dyn std::error::Error>>;
type Line = (&'static str, RGBColor, Vec<(f64, f64)>);
type Canvas<'b> = DrawingArea<SVGBackend<'b>, plotters::coord::Shift>;

const W: u32 = 900;
const H: u32 = 340;
const FONT: &str = "sans-serif";
const CAPTION: u32 = 22; // font sizes as given to plotters; the SVG text is about 0.8 of it
const LABEL: u32 = 16;
const LEGEND_W: u32 = 110; // room on the right of the chart for the legend
const ORANGE: RGBColor = RGBColor(230, 140, 0);

pub(super) fn charts(s: &Series) -> ChartResult<[String; 4]> {
    let lat = |f: fn(&LatencyPoint) -> f64| s.latency.iter().map(|p| (p.t_s, f(p))).collect();
    let latency: [Line; 4] = [
        ("p50", BLUE, lat(|p| p.p50)),
        ("p99", GREEN, lat(|p| p.p99)),
        ("p99.9", ORANGE, lat(|p| p.p999)),
        ("max", RED, lat(|p| p.max)),
    ];
    let rate = |v: &[RatePoint]| v.iter().map(|p| (p.t_s, p.per_s)).collect();
    let throughput: [Line; 2] = [
        ("effects/s", BLUE, rate(&s.throughput)),
        ("produced/s", ORANGE, rate(&s.produced)),
    ];
    let lag_points = s.lag.iter().map(|p| (p.t_s, p.lag as f64)).collect();
    let lag: [Line; 1] = [("lag", BLUE, lag_points)];

    let latency = match y_extent(&latency, true) {
        None => empty_chart("Latency over time")?,
        Some((lo, hi)) => {
            // Out to whole decades at least, so that the axis always has labelled ticks.
            let lo = (lo / 1.5).min(10f64.powf(lo.log10().floor()));
            let hi = (hi * 1.5).max(10f64.powf(hi.log10().ceil()));
            let title = "Latency over time (log scale)";
            lines_chart(title, "latency (ms)", (lo..hi).log_scale(), lo, &latency)?
        }
    };
    let top = |hi: f64| if hi > 0.0 { hi * 1.1 } else { 1.0 };
    let throughput = match y_extent(&throughput, false) {
        None => empty_chart("Throughput")?,
        Some((_, hi)) => lines_chart("Throughput", "per second", 0.0..top(hi), 0.0, &throughput)?,
    };
    let lag = match y_extent(&lag, false) {
        None => empty_chart("Consumer lag")?,
        Some((lo, hi)) => {
            let lo = lo.min(0.0);
            lines_chart("Consumer lag", "records", lo..top(hi), lo, &lag)?
        }
    };
    Ok([latency, histogram_chart(&s.histogram)?, throughput, lag])
}

/// Smallest and largest finite y over all lines (only the positive ones if `positive`).
fn y_extent(lines: &[Line], positive: bool) -> Option<(f64, f64)> {
    let points = lines.iter().flat_map(|(_, _, pts)| pts.iter());
    let ys = points.filter(|(x, y)| x.is_finite() && y.is_finite() && (!positive || *y > 0.0));
    ys.fold(None, |acc, &(_, y)| match acc {
        None => Some((y, y)),
        Some((lo, hi)) => Some((lo.min(y), hi.max(y))),
    })
}

/// An x range over every finite time, widened when it is a single instant.
fn x_range(lines: &[Line]) -> Range<f64> {
    let xs = lines.iter().flat_map(|(_, _, pts)| pts.iter().map(|p| p.0));
    let (lo, hi) = xs
        .filter(|x| x.is_finite())
        .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    match hi - lo {
        d if d < 0.0 => 0.0..1.0,
        d if d < 1e-9 => lo - 1.0..hi + 1.0,
        _ => lo..hi,
    }
}

fn svg_from(draw: impl FnOnce(&mut String) -> ChartResult<()>) -> ChartResult<String> {
    let mut svg = String::new();
    draw(&mut svg)?;
    // Inline SVG in HTML needs no namespace declaration; dropping it keeps the page URL-free.
    Ok(svg.replacen(" xmlns=\"http://www.w3.org/2000/svg\"", "", 1))
}

/// Axis numbers without noise: "0", "2000", "0.5", "12.25".
fn axis_num(v: &f64) -> String {
    format!("{}", (v * 100.0).round() / 100.0 + 0.0) // `+ 0.0` turns -0 into 0
}

/// A white SVG canvas with the chart area laid out: title, label areas, room for a legend.
fn canvas<'a, 'b>(
    root: &'a Canvas<'b>,
    title: &str,
) -> ChartResult<ChartBuilder<'a, 'b, SVGBackend<'b>>> {
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(title, (FONT, CAPTION))
        .margin(12)
        .margin_right(LEGEND_W);
    builder.x_label_area_size(44).y_label_area_size(76);
    Ok(builder)
}

fn text_style(size: u32, h: HPos) -> TextStyle<'static> {
    TextStyle::from((FONT, size)).pos(Pos::new(h, VPos::Center))
}

/// Lines over time with a legend in the right margin; y values below `y_floor` are clamped
/// and non-finite points dropped.
fn lines_chart<Y>(
    title: &str,
    y_desc: &str,
    y: Y,
    y_floor: f64,
    lines: &[Line],
) -> ChartResult<String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    svg_from(|buf| {
        let root = SVGBackend::with_string(buf, (W, H)).into_drawing_area();
        let mut chart = canvas(&root, title)?.build_cartesian_2d(x_range(lines), y)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(BLACK.mix(0.12))
            .label_style((FONT, LABEL))
            .axis_desc_style((FONT, LABEL))
            .x_labels(10)
            .y_labels(8)
            .x_label_formatter(&axis_num)
            .y_label_formatter(&axis_num)
            .x_desc("time since start (s)")
            .y_desc(y_desc)
            .draw()?;
        for (i, (name, color, pts)) in lines.iter().enumerate() {
            let style = color.stroke_width(2);
            let pts: Vec<(f64, f64)> = pts
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| (x, y.max(y_floor)))
                .collect();
            if pts.len() == 1 {
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
            chart.draw_series(LineSeries::new(pts, style))?;
            let (x, y) = (W as i32 - LEGEND_W as i32 + 10, 50 + 24 * i as i32);
            root.draw(&PathElement::new([(x, y), (x + 22, y)], style))?;
            root.draw(&Text::new(
                name.to_string(),
                (x + 28, y),
                text_style(LABEL, HPos::Left),
            ))?;
        }
        root.present()?;
        Ok(())
    })
}

/// A frame with "no data" in it, for a series with no usable point.
fn empty_chart(title: &str) -> ChartResult<String> {
    svg_from(|buf| {
        let root = SVGBackend::with_string(buf, (W, H)).into_drawing_area();
        root.fill(&WHITE)?;
        let area = root.titled(title, (FONT, CAPTION))?;
        let (w, h) = area.dim_in_pixel();
        let (w, h) = (w as i32, h as i32);
        area.draw(&Rectangle::new(
            [(90, 10), (w - 12, h - 44)],
            BLACK.mix(0.3),
        ))?;
        let center = ((w + 78) / 2, (h - 34) / 2);
        area.draw(&Text::new(
            "no data",
            center,
            text_style(CAPTION, HPos::Center),
        ))?;
        root.present()?;
        Ok(())
    })
}

fn histogram_chart(buckets: &[Bucket]) -> ChartResult<String> {
    if buckets.is_empty() {
        return empty_chart("Latency distribution");
    }
    let top = buckets.iter().map(|b| b.count).max().unwrap_or(0);
    svg_from(|buf| {
        let root = SVGBackend::with_string(buf, (W, H)).into_drawing_area();
        let x = (0..buckets.len() as u32).into_segmented();
        let mut chart = canvas(&root, "End-to-end latency distribution")?
            .build_cartesian_2d(x, 0..(top + top / 10).max(1))?;
        let label = |v: &SegmentValue<u32>| match v {
            SegmentValue::Exact(i) | SegmentValue::CenterOf(i) => match buckets.get(*i as usize) {
                Some(b) if b.le_ms >= 1000.0 => format!("≤{} s", b.le_ms / 1000.0),
                Some(b) => format!("≤{} ms", b.le_ms),
                None => String::new(),
            },
            SegmentValue::Last => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(BLACK.mix(0.12))
            .label_style((FONT, LABEL))
            .axis_desc_style((FONT, LABEL))
            .x_labels(buckets.len().min(16))
            .x_label_formatter(&label)
            .x_desc("latency bucket (upper bound)")
            .y_desc("count")
            .draw()?;
        // Rectangles rather than plotters' Histogram series, whose HashMap makes the SVG
        // element order (and so the file) differ from one run to the next.
        let bars = buckets.iter().zip(0u32..).filter(|(b, _)| b.count > 0);
        chart.draw_series(bars.map(|(b, i)| {
            let corners = [
                (SegmentValue::Exact(i), 0),
                (SegmentValue::Exact(i + 1), b.count),
            ];
            let mut bar = Rectangle::new(corners, BLUE.mix(0.7).filled());
            bar.set_margin(0, 0, 3, 3);
            bar
        }))?;
        root.present()?;
        Ok(())
    })
}
