//! PNG plots: [`Plot`] describes a line chart ([`PlotKind::Line`]: numeric x, named
//! series, optional log axes, markers) or a grouped bar chart ([`PlotKind::Bars`]), plus
//! horizontal reference lines; [`Plot::render`] draws it with plotters' bitmap backend.
//!
//! Text is rendered with the DejaVu Sans font bundled in `assets/` through plotters'
//! `ab_glyph` feature, so rendering needs no system fonts, fontconfig or freetype.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::combinators::LogCoord;
use plotters::coord::ranged1d::{
    AsRangedCoord, DefaultFormatting, KeyPointHint, Ranged, ValueFormatter,
};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::error::{ReportError, Result};
use crate::table::{format_axis, format_number};

/// DejaVu Sans (Bitstream Vera license with public-domain DejaVu changes); see
/// `assets/README.md`.
static FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Default image size in pixels.
pub const DEFAULT_SIZE: (u32, u32) = (1024, 640);

/// Registers the bundled font under the family names plotters asks for (once).
fn ensure_font() -> std::result::Result<(), String> {
    static REGISTERED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            for family in ["sans-serif", "serif", "monospace"] {
                plotters::style::register_font(family, FontStyle::Normal, FONT_BYTES)
                    .map_err(|_| "the bundled DejaVuSans.ttf could not be parsed".to_owned())?;
            }
            Ok(())
        })
        .clone()
}

/// Tableau 10: distinguishable, colour-blind-friendlier than the primaries.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Colours for reference lines.
const HLINE_COLORS: [RGBColor; 3] = [
    RGBColor(40, 40, 40),
    RGBColor(200, 30, 30),
    RGBColor(30, 30, 200),
];

fn series_color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// What kind of chart a [`Plot`] draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlotKind {
    /// Numeric x axis; each series is a polyline with a marker on every point.
    Line,
    /// Categories on the x axis; one bar per series in each category's group.
    Bars,
}

/// Where the legend goes (or whether it is drawn at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Legend {
    /// Upper left corner of the plotting area (room is reserved above the data).
    UpperLeft,
    /// Upper right corner of the plotting area (room is reserved above the data).
    #[default]
    UpperRight,
    /// Lower left corner of the plotting area.
    LowerLeft,
    /// Lower right corner of the plotting area.
    LowerRight,
    /// No legend.
    Hidden,
}

/// One named data series.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// `(x, y)` points, drawn in the given order. For bar charts x is the category
    /// index. Non-finite points (and non-positive ones on a log axis) are skipped.
    pub points: Vec<(f64, f64)>,
}

/// A horizontal reference line, e.g. `y = 1.0` labelled "ideal".
#[derive(Debug, Clone, PartialEq)]
pub struct HLine {
    /// Height in data units.
    pub y: f64,
    /// Legend label.
    pub label: String,
}

/// A chart description, rendered to PNG by [`Plot::render`] (or by a
/// [`Report`](crate::Report)).
///
/// ```no_run
/// use granule_report::{Plot, PlotKind};
/// let plot = Plot::new(PlotKind::Line, "Call efficiency")
///     .x_label("work per call (µs)")
///     .y_label("efficiency")
///     .log_x(true)
///     .series("local", vec![(0.1, 0.4), (1.0, 0.8), (10.0, 0.97)])
///     .series("remote", vec![(0.1, 0.05), (1.0, 0.2), (10.0, 0.7)])
///     .hline(1.0, "ideal");
/// plot.render(std::path::Path::new("plot.png")).unwrap();
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Plot {
    kind: PlotKind,
    title: String,
    x_label: String,
    y_label: String,
    categories: Vec<String>,
    series: Vec<Series>,
    hlines: Vec<HLine>,
    log_x: bool,
    log_y: bool,
    x_range: Option<(f64, f64)>,
    y_range: Option<(f64, f64)>,
    legend: Legend,
    width: u32,
    height: u32,
}

impl Plot {
    /// An empty plot of this kind, 1024×640.
    pub fn new(kind: PlotKind, title: impl Into<String>) -> Plot {
        Plot {
            kind,
            title: title.into(),
            x_label: String::new(),
            y_label: String::new(),
            categories: Vec::new(),
            series: Vec::new(),
            hlines: Vec::new(),
            log_x: false,
            log_y: false,
            x_range: None,
            y_range: None,
            legend: Legend::default(),
            width: DEFAULT_SIZE.0,
            height: DEFAULT_SIZE.1,
        }
    }

    /// Shorthand for `Plot::new(PlotKind::Line, title)`.
    pub fn line(title: impl Into<String>) -> Plot {
        Plot::new(PlotKind::Line, title)
    }

    /// Shorthand for `Plot::new(PlotKind::Bars, title)`.
    pub fn bars(title: impl Into<String>) -> Plot {
        Plot::new(PlotKind::Bars, title)
    }

    /// Sets the x axis label.
    pub fn x_label(mut self, label: impl Into<String>) -> Plot {
        self.x_label = label.into();
        self
    }

    /// Sets the y axis label.
    pub fn y_label(mut self, label: impl Into<String>) -> Plot {
        self.y_label = label.into();
        self
    }

    /// Logarithmic x axis (line charts only; ignored for bars).
    pub fn log_x(mut self, on: bool) -> Plot {
        self.log_x = on;
        self
    }

    /// Logarithmic y axis.
    pub fn log_y(mut self, on: bool) -> Plot {
        self.log_y = on;
        self
    }

    /// Image size in pixels (default 1024×640).
    pub fn size(mut self, width: u32, height: u32) -> Plot {
        self.width = width.max(64);
        self.height = height.max(64);
        self
    }

    /// Fixes the x axis range instead of fitting it to the data (line charts).
    pub fn x_range(mut self, lo: f64, hi: f64) -> Plot {
        self.x_range = Some((lo, hi));
        self
    }

    /// Fixes the y axis range instead of fitting it to the data.
    pub fn y_range(mut self, lo: f64, hi: f64) -> Plot {
        self.y_range = Some((lo, hi));
        self
    }

    /// Legend placement (default upper right).
    pub fn legend(mut self, legend: Legend) -> Plot {
        self.legend = legend;
        self
    }

    /// Adds a line series of `(x, y)` points.
    pub fn series(
        mut self,
        name: impl Into<String>,
        points: impl IntoIterator<Item = (f64, f64)>,
    ) -> Plot {
        self.push_series(name, points);
        self
    }

    /// Adds a line series in place (for loops).
    pub fn push_series(
        &mut self,
        name: impl Into<String>,
        points: impl IntoIterator<Item = (f64, f64)>,
    ) -> &mut Plot {
        self.series.push(Series {
            name: name.into(),
            points: points.into_iter().collect(),
        });
        self
    }

    /// Sets the bar chart's categories (x axis groups), in order.
    pub fn categories<S: Into<String>>(mut self, categories: impl IntoIterator<Item = S>) -> Plot {
        self.categories = categories.into_iter().map(Into::into).collect();
        self
    }

    /// Adds a bar series: one value per category, in category order (NaN = no bar).
    pub fn bar_series(
        mut self,
        name: impl Into<String>,
        values: impl IntoIterator<Item = f64>,
    ) -> Plot {
        self.push_bar_series(name, values);
        self
    }

    /// Adds a bar series in place (for loops).
    pub fn push_bar_series(
        &mut self,
        name: impl Into<String>,
        values: impl IntoIterator<Item = f64>,
    ) -> &mut Plot {
        let points = values
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i as f64, v))
            .collect::<Vec<_>>();
        self.push_series(name, points)
    }

    /// Adds a horizontal reference line at `y`, shown dashed and labelled in the legend.
    pub fn hline(mut self, y: f64, label: impl Into<String>) -> Plot {
        self.hlines.push(HLine {
            y,
            label: label.into(),
        });
        self
    }

    /// The chart kind.
    pub fn kind(&self) -> PlotKind {
        self.kind
    }

    /// The title.
    pub fn title(&self) -> &str {
        &self.title
    }

    /// The series added so far.
    pub fn series_list(&self) -> &[Series] {
        &self.series
    }

    /// The reference lines added so far.
    pub fn hlines(&self) -> &[HLine] {
        &self.hlines
    }

    /// Image size in pixels.
    pub fn dimensions(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    /// Renders the chart to a PNG file at `path` (its directory must exist).
    pub fn render(&self, path: &Path) -> Result<()> {
        let perr = |message: String| ReportError::Plot {
            path: path.to_owned(),
            message,
        };
        ensure_font().map_err(perr)?;
        let root = BitMapBackend::new(path, (self.width, self.height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| perr(e.to_string()))?;
        match self.kind {
            PlotKind::Line => self.draw_line_dispatch(&root),
            PlotKind::Bars => self.draw_bars_dispatch(&root),
        }
        .map_err(perr)?;
        root.present().map_err(|e| perr(e.to_string()))?;
        Ok(())
    }

    // ----- layout helpers -------------------------------------------------------

    fn scale(&self) -> f64 {
        (f64::from(self.width.min(self.height * 16 / 10)) / 1024.0).clamp(0.5, 4.0)
    }

    fn font_px(&self, base: f64) -> f64 {
        (base * self.scale()).round()
    }

    fn px(&self, base: f64) -> u32 {
        (base * self.scale()).round() as u32
    }

    fn legend_entries(&self) -> usize {
        if self.legend == Legend::Hidden {
            0
        } else {
            self.series.len() + self.hlines.len()
        }
    }

    /// Fraction of the plotting area's height kept free at the top for the legend.
    fn legend_headroom(&self) -> f64 {
        let entries = self.legend_entries();
        if entries == 0 || !matches!(self.legend, Legend::UpperLeft | Legend::UpperRight) {
            return 0.0;
        }
        let plot_h = f64::from(self.height) - f64::from(self.px(140.0));
        let legend_h = (entries as f64 * self.font_px(15.0) * 1.6) + f64::from(self.px(24.0));
        (legend_h / plot_h.max(1.0)).min(0.6)
    }

    fn position(&self) -> SeriesLabelPosition {
        match self.legend {
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::UpperRight | Legend::Hidden => SeriesLabelPosition::UpperRight,
            Legend::LowerLeft => SeriesLabelPosition::LowerLeft,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
        }
    }

    fn builder<'a, 'b>(
        &self,
        root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
    ) -> ChartBuilder<'a, 'b, BitMapBackend<'b>> {
        let mut b = ChartBuilder::on(root);
        b.caption(&self.title, ("sans-serif", self.font_px(26.0)))
            .margin(self.px(18.0))
            .x_label_area_size(self.px(if self.x_label.is_empty() { 36.0 } else { 60.0 }))
            .y_label_area_size(self.px(if self.y_label.is_empty() { 64.0 } else { 88.0 }));
        b
    }

    fn finite_points(&self, log_x: bool, log_y: bool) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.series
            .iter()
            .flat_map(|s| s.points.iter().copied())
            .filter(move |&p| visible(p, log_x, log_y))
    }

    fn y_values(&self, log_y: bool) -> Vec<f64> {
        let log_x = self.log_x && self.kind == PlotKind::Line;
        let mut ys: Vec<f64> = self.finite_points(log_x, log_y).map(|p| p.1).collect();
        ys.extend(
            self.hlines
                .iter()
                .map(|h| h.y)
                .filter(|&y| visible((1.0, y), false, log_y)),
        );
        ys
    }

    fn y_axis(&self, bars: bool) -> (f64, f64) {
        if let Some(r) = self.y_range.and_then(|r| valid_range(r, self.log_y)) {
            return r;
        }
        let ys = self.y_values(self.log_y);
        let (mut lo, hi) = fit_range(&ys, self.log_y, !self.log_y || bars);
        if bars && self.log_y {
            // Bars grow from the bottom of the axis: start a decade boundary below the
            // smallest value so that every bar has a visible height.
            let decade = 10f64.powf(lo.log10().floor());
            lo = if decade >= lo * 0.999 {
                decade / 10.0
            } else {
                decade
            };
        } else if self.log_y {
            // Keep markers and reference lines off the bottom edge.
            lo = pad_both(lo, hi, true, 0.03).0;
        }
        let top = 0.05 + if bars { 0.04 } else { 0.0 };
        pad_top(lo, hi, self.log_y, top + self.legend_headroom())
    }

    // ----- line charts ----------------------------------------------------------

    fn draw_line_dispatch(
        &self,
        root: &DrawingArea<BitMapBackend<'_>, Shift>,
    ) -> std::result::Result<(), String> {
        let xs: Vec<f64> = self
            .finite_points(self.log_x, self.log_y)
            .map(|p| p.0)
            .collect();
        let (x0, x1) = match self.x_range.and_then(|r| valid_range(r, self.log_x)) {
            Some(r) => r,
            None => {
                let (lo, hi) = fit_range(&xs, self.log_x, false);
                pad_both(lo, hi, self.log_x, 0.03)
            }
        };
        let (y0, y1) = self.y_axis(false);
        match (self.log_x, self.log_y) {
            (false, false) => self.draw_line(root, x0..x1, y0..y1, (x0, x1)),
            (true, false) => self.draw_line(root, LogAxis::new(x0, x1), y0..y1, (x0, x1)),
            (false, true) => self.draw_line(root, x0..x1, LogAxis::new(y0, y1), (x0, x1)),
            (true, true) => {
                self.draw_line(root, LogAxis::new(x0, x1), LogAxis::new(y0, y1), (x0, x1))
            }
        }
    }

    fn draw_line<X, Y>(
        &self,
        root: &DrawingArea<BitMapBackend<'_>, Shift>,
        x: X,
        y: Y,
        (x0, x1): (f64, f64),
    ) -> std::result::Result<(), String>
    where
        X: AsRangedCoord<Value = f64>,
        Y: AsRangedCoord<Value = f64>,
        X::CoordDescType: ValueFormatter<f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let mut chart = self
            .builder(root)
            .build_cartesian_2d(x, y)
            .map_err(|e| e.to_string())?;
        let fmt = |v: &f64| format_axis(*v);
        chart
            .configure_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            .x_label_formatter(&fmt)
            .y_label_formatter(&fmt)
            .label_style(("sans-serif", self.font_px(15.0)))
            .axis_desc_style(("sans-serif", self.font_px(17.0)))
            .light_line_style(BLACK.mix(0.04))
            .bold_line_style(BLACK.mix(0.15))
            .draw()
            .map_err(|e| e.to_string())?;

        let marker_px = self.px(4.0).max(2);
        for (i, series) in self.series.iter().enumerate() {
            let color = series_color(i);
            let marker = Marker::cycle(i);
            let pts: Vec<(f64, f64)> = series
                .points
                .iter()
                .copied()
                .filter(|&p| visible(p, self.log_x, self.log_y))
                .collect();
            let stroke = self.px(2.0).max(1);
            let s = marker_px as i32;
            let anno = chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(stroke)))
                .map_err(|e| e.to_string())?
                .label(series.name.as_str());
            let legend_line = move |lx: i32, ly: i32| {
                EmptyElement::at((lx, ly))
                    + PathElement::new(vec![(0, 0), (22, 0)], color.stroke_width(2))
            };
            match marker {
                Marker::Circle => anno.legend(move |(lx, ly)| {
                    legend_line(lx, ly) + Circle::new((11, 0), s, color.filled())
                }),
                Marker::Triangle => anno.legend(move |(lx, ly)| {
                    legend_line(lx, ly) + TriangleMarker::new((11, 0), s + 1, color.filled())
                }),
                Marker::Square => anno.legend(move |(lx, ly)| {
                    legend_line(lx, ly)
                        + Rectangle::new([(11 - s, -s), (11 + s, s)], color.filled())
                }),
                Marker::Cross => anno.legend(move |(lx, ly)| {
                    legend_line(lx, ly) + Cross::new((11, 0), s + 1, color.stroke_width(2))
                }),
            };
            let size = marker_px as i32;
            match marker {
                Marker::Circle => chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, size, color.filled())))
                    .map(|_| ()),
                Marker::Triangle => chart
                    .draw_series(
                        pts.iter()
                            .map(|&p| TriangleMarker::new(p, size + 1, color.filled())),
                    )
                    .map(|_| ()),
                Marker::Square => chart
                    .draw_series(pts.iter().map(|&p| {
                        EmptyElement::at(p)
                            + Rectangle::new([(-size, -size), (size, size)], color.filled())
                    }))
                    .map(|_| ()),
                Marker::Cross => chart
                    .draw_series(
                        pts.iter()
                            .map(|&p| Cross::new(p, size + 1, color.stroke_width(2))),
                    )
                    .map(|_| ()),
            }
            .map_err(|e| e.to_string())?;
        }
        self.draw_hlines(&mut chart, x0, x1)?;
        self.draw_legend(&mut chart)
    }

    fn draw_hlines<'a, 'b: 'a, X, Y>(
        &self,
        chart: &mut ChartContext<'a, BitMapBackend<'b>, Cartesian2d<X, Y>>,
        x0: f64,
        x1: f64,
    ) -> std::result::Result<(), String>
    where
        X: Ranged<ValueType = f64>,
        Y: Ranged<ValueType = f64>,
    {
        for (i, h) in self.hlines.iter().enumerate() {
            if !visible((1.0, h.y), false, self.log_y) {
                continue;
            }
            let style = HLINE_COLORS[i % HLINE_COLORS.len()].stroke_width(self.px(2.0).max(1));
            let dash = self.px(10.0).max(2);
            let gap = self.px(6.0).max(2);
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x0, h.y), (x1, h.y)],
                    dash,
                    gap,
                    style,
                ))
                .map_err(|e| e.to_string())?
                .label(h.label.as_str())
                .legend(move |(lx, ly)| {
                    EmptyElement::at((lx, ly))
                        + PathElement::new(vec![(0, 0), (8, 0)], style)
                        + PathElement::new(vec![(13, 0), (22, 0)], style)
                });
        }
        Ok(())
    }

    fn draw_legend<'a, 'b: 'a, X, Y>(
        &self,
        chart: &mut ChartContext<'a, BitMapBackend<'b>, Cartesian2d<X, Y>>,
    ) -> std::result::Result<(), String>
    where
        X: Ranged<ValueType = f64>,
        Y: Ranged<ValueType = f64>,
    {
        if self.legend_entries() == 0 {
            return Ok(());
        }
        chart
            .configure_series_labels()
            .position(self.position())
            .margin(self.px(10.0))
            .label_font(("sans-serif", self.font_px(15.0)))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(|e| e.to_string())
    }

    // ----- bar charts -----------------------------------------------------------

    fn n_categories(&self) -> usize {
        let from_series = self
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|p| p.0.is_finite() && p.0 >= 0.0)
            .map(|p| p.0.round() as usize + 1)
            .max()
            .unwrap_or(0);
        self.categories.len().max(from_series).max(1)
    }

    fn draw_bars_dispatch(
        &self,
        root: &DrawingArea<BitMapBackend<'_>, Shift>,
    ) -> std::result::Result<(), String> {
        let (y0, y1) = self.y_axis(true);
        let x = CategoryAxis {
            n: self.n_categories(),
        };
        if self.log_y {
            self.draw_bars(root, x, LogAxis::new(y0, y1), y0)
        } else {
            self.draw_bars(root, x, y0..y1, 0.0f64.clamp(y0, y1))
        }
    }

    fn draw_bars<Y>(
        &self,
        root: &DrawingArea<BitMapBackend<'_>, Shift>,
        x: CategoryAxis,
        y: Y,
        base: f64,
    ) -> std::result::Result<(), String>
    where
        Y: AsRangedCoord<Value = f64>,
        Y::CoordDescType: ValueFormatter<f64>,
    {
        let n = x.n;
        let mut chart = self
            .builder(root)
            .build_cartesian_2d(x, y)
            .map_err(|e| e.to_string())?;
        let names = &self.categories;
        let xfmt = |v: &f64| {
            let i = v.round();
            if (v - i).abs() > 1e-6 || i < 0.0 {
                return String::new();
            }
            names
                .get(i as usize)
                .cloned()
                .unwrap_or_else(|| format_number(i))
        };
        let yfmt = |v: &f64| format_axis(*v);
        let x_font = if n > 12 { 11.0 } else { 15.0 };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            .x_label_formatter(&xfmt)
            .y_label_formatter(&yfmt)
            .x_labels(n)
            .label_style(("sans-serif", self.font_px(15.0)))
            .x_label_style(("sans-serif", self.font_px(x_font)))
            .axis_desc_style(("sans-serif", self.font_px(17.0)))
            .light_line_style(BLACK.mix(0.04))
            .bold_line_style(BLACK.mix(0.15))
            .draw()
            .map_err(|e| e.to_string())?;

        let n_series = self.series.len().max(1);
        let group = 0.8;
        let width = group / n_series as f64;
        let total_bars: usize = self.series.iter().map(|s| s.points.len()).sum();
        let show_values = total_bars <= 48;
        let value_font = (
            "sans-serif",
            self.font_px(if total_bars > 24 { 10.0 } else { 12.0 }),
        )
            .into_font();
        let label_color = BLACK.mix(0.8);
        for (j, series) in self.series.iter().enumerate() {
            let color = series_color(j);
            let bars: Vec<(f64, f64)> = series
                .points
                .iter()
                .copied()
                .filter(|&p| visible(p, false, self.log_y) && p.0 >= -0.5)
                .collect();
            let rects = bars.iter().map(|&(cx, v)| {
                let left = cx.round() - group / 2.0 + j as f64 * width;
                Rectangle::new(
                    [(left + width * 0.06, base), (left + width * 0.94, v)],
                    color.filled(),
                )
            });
            chart
                .draw_series(rects)
                .map_err(|e| e.to_string())?
                .label(series.name.as_str())
                .legend(move |(lx, ly)| {
                    Rectangle::new([(lx, ly - 6), (lx + 16, ly + 6)], color.filled())
                });
            if show_values {
                let labels = bars.iter().map(|&(cx, v)| {
                    let center = cx.round() - group / 2.0 + (j as f64 + 0.5) * width;
                    let vpos = if v >= base { VPos::Bottom } else { VPos::Top };
                    let style = TextStyle::from(value_font.clone())
                        .color(&label_color)
                        .pos(Pos::new(HPos::Center, vpos));
                    Text::new(format_axis(v), (center, v), style)
                });
                chart.draw_series(labels).map_err(|e| e.to_string())?;
            }
        }
        self.draw_hlines(&mut chart, -0.5, n as f64 - 0.5)?;
        self.draw_legend(&mut chart)
    }
}

/// Marker shapes, cycled through by series index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Circle,
    Triangle,
    Square,
    Cross,
}

impl Marker {
    fn cycle(i: usize) -> Marker {
        [
            Marker::Circle,
            Marker::Triangle,
            Marker::Square,
            Marker::Cross,
        ][i % 4]
    }
}

/// plotters' log axis with duplicate tick values removed (its light ticks repeat the
/// next power of ten, which then gets drawn twice).
struct LogAxis(LogCoord<f64>);

impl LogAxis {
    fn new(lo: f64, hi: f64) -> LogAxis {
        LogAxis((lo..hi).log_scale().into())
    }
}

impl Ranged for LogAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.0.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let mut points = self.0.key_points(hint);
        points.dedup_by(|a, b| (*a - *b).abs() <= 1e-9 * b.abs());
        points
    }

    fn range(&self) -> Range<f64> {
        self.0.range()
    }
}

/// A category axis for bar charts: category `i` is centred on `i as f64`.
struct CategoryAxis {
    n: usize,
}

impl Ranged for CategoryAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let lo = -0.5;
        let hi = self.n as f64 - 0.5;
        let linear: RangedCoordf64 = (lo..hi).into();
        linear.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        (0..self.n).map(|i| i as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        -0.5..(self.n as f64 - 0.5)
    }
}

/// Whether a point can be drawn on these axes.
fn visible((x, y): (f64, f64), log_x: bool, log_y: bool) -> bool {
    x.is_finite() && y.is_finite() && (!log_x || x > 0.0) && (!log_y || y > 0.0)
}

/// A user-given range if usable on this axis.
fn valid_range((lo, hi): (f64, f64), log: bool) -> Option<(f64, f64)> {
    let ok = lo.is_finite() && hi.is_finite() && lo < hi && (!log || lo > 0.0);
    ok.then_some((lo, hi))
}

/// Fits an axis to the values: min..max, widened when degenerate, starting at zero on a
/// linear axis when `include_zero` and all values are positive.
fn fit_range(values: &[f64], log: bool, include_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        if hi / lo < 10.0 {
            // Make sure at least one power of ten is inside, or ticks may vanish.
            let dlo = 10f64.powf(lo.log10().floor());
            let dhi = 10f64.powf(hi.log10().ceil());
            if dlo >= lo && dhi <= hi {
                // lo and hi are both exact powers of ten and equal.
                return (lo / 10.0, hi * 10.0);
            }
            let has_decade = 10f64.powf(lo.log10().ceil()) <= hi;
            if !has_decade {
                return (dlo, dhi);
            }
        }
        return (lo, hi);
    }
    if include_zero {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    if lo == hi {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        lo -= d;
        hi += d;
    }
    (lo, hi)
}

/// Adds `frac` of the span on both sides (in log space for a log axis).
fn pad_both(lo: f64, hi: f64, log: bool, frac: f64) -> (f64, f64) {
    if log {
        let f = (hi / lo).powf(frac);
        (lo / f, hi * f)
    } else {
        let d = (hi - lo) * frac;
        (lo - d, hi + d)
    }
}

/// Extends the top so that the original range fills `1 - frac` of the axis (in log
/// space for a log axis); a linear axis starting at zero keeps its zero.
fn pad_top(lo: f64, hi: f64, log: bool, frac: f64) -> (f64, f64) {
    let keep = (1.0 - frac).max(0.2);
    if log {
        (lo, lo * (hi / lo).powf(1.0 / keep))
    } else {
        let lo2 = if lo < 0.0 { lo - (hi - lo) * 0.03 } else { lo };
        (lo2, lo2 + (hi - lo2) / keep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_png(path: &Path) {
        let bytes = std::fs::read(path).unwrap();
        assert!(
            bytes.starts_with(&[0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a]),
            "not a PNG"
        );
        assert!(bytes.len() > 5 * 1024, "PNG is only {} bytes", bytes.len());
    }

    fn line_plot(log_x: bool, log_y: bool) -> Plot {
        let works = [0.1, 1.0, 10.0, 50.0];
        let mut p = Plot::line("proclet call efficiency")
            .x_label("work per call (µs)")
            .y_label("calls/s")
            .log_x(log_x)
            .log_y(log_y);
        for (k, name) in ["function call", "local", "remote", "ray"]
            .iter()
            .enumerate()
        {
            let pts = works
                .iter()
                .map(|&w| (w, 1e6 / (w + 0.05 * 10f64.powi(k as i32))))
                .collect::<Vec<_>>();
            p.push_series(*name, pts);
        }
        p.hline(1e4, "ideal")
    }

    #[test]
    fn line_plots_render_with_all_axis_kinds() {
        let dir = tempfile::tempdir().unwrap();
        for (log_x, log_y) in [(false, false), (true, false), (false, true), (true, true)] {
            let path = dir.path().join(format!("line_{log_x}_{log_y}.png"));
            line_plot(log_x, log_y).render(&path).unwrap();
            assert_png(&path);
        }
    }

    #[test]
    fn bar_plots_render() {
        let dir = tempfile::tempdir().unwrap();
        for log_y in [false, true] {
            let path = dir.path().join(format!("bars_{log_y}.png"));
            Plot::bars("kv throughput")
                .x_label("workload")
                .y_label("ops/s")
                .log_y(log_y)
                .categories(["GET 100 B", "SET 100 B", "GET 4 KiB", "SET 4 KiB"])
                .bar_series("redis", [95e3, 92e3, 80e3, 70e3])
                .bar_series("granule", [60e3, 58e3, f64::NAN, 40e3])
                .bar_series("granule -P16", [600e3, 580e3, 300e3, 250e3])
                .hline(1e5, "target")
                .render(&path)
                .unwrap();
            assert_png(&path);
        }
    }

    #[test]
    fn degenerate_plots_still_render() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.png");
        Plot::line("nothing yet").render(&path).unwrap();
        assert_png(&path);
        let path = dir.path().join("one.png");
        Plot::line("one point")
            .log_x(true)
            .log_y(true)
            .series("s", [(1.0, 1.0), (f64::NAN, 2.0), (-1.0, 3.0)])
            .legend(Legend::Hidden)
            .render(&path)
            .unwrap();
        assert_png(&path);
        let path = dir.path().join("negative_bars.png");
        Plot::bars("deltas")
            .bar_series("change", [-3.0, 2.0])
            .y_range(-5.0, 5.0)
            .size(400, 300)
            .render(&path)
            .unwrap();
        assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
    }

    #[test]
    fn render_error_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing-dir").join("plot.png");
        let err = Plot::line("x").render(&path).unwrap_err();
        match err {
            ReportError::Plot { path: p, .. } => assert_eq!(p, path),
            other => panic!("unexpected error {other:?}"),
        }
    }

    #[test]
    fn ranges() {
        assert_eq!(fit_range(&[], false, true), (0.0, 1.0));
        assert_eq!(fit_range(&[], true, true), (1.0, 10.0));
        assert_eq!(fit_range(&[2.0, 5.0], false, true), (0.0, 5.0));
        assert_eq!(fit_range(&[2.0, 5.0], false, false), (2.0, 5.0));
        assert_eq!(fit_range(&[3.0], false, false), (2.7, 3.3));
        assert_eq!(fit_range(&[2.0, 5.0], true, false), (1.0, 10.0));
        assert_eq!(fit_range(&[5.0, 20.0], true, false), (5.0, 20.0));
        assert_eq!(fit_range(&[10.0], true, false), (1.0, 100.0));
        assert_eq!(fit_range(&[0.1, 50.0], true, false), (0.1, 50.0));
        let (lo, hi) = pad_top(0.0, 1.0, false, 0.5);
        assert_eq!((lo, hi), (0.0, 2.0));
        let (lo, hi) = pad_top(1.0, 100.0, true, 0.5);
        assert!((lo - 1.0).abs() < 1e-9 && (hi - 1e4).abs() < 1e-6);
    }
}
