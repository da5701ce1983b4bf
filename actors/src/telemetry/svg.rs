//! A small SVG writer for troupe's pictures (timelines, plots): rectangles, lines, polylines and text,
//! escaped, with round axis ticks. Hand-written SVG keeps the pictures dependency-free and their
//! structure predictable (tests read them back as XML).

use std::fmt::Write as _;

#[derive(Debug)]
pub struct Svg {
    out: String,
}

/// Escapes text for XML content and attribute values.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

impl Svg {
    pub fn new(width: f64, height: f64, title: &str) -> Self {
        let mut out = String::new();
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">"#
        );
        let _ = write!(out, "\n<title>{}</title>\n", escape(title));
        let _ = writeln!(out, r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#);
        Svg { out }
    }

    /// Opens a group carrying `class` (and `data-*` attributes) so readers can find parts by role.
    pub fn group(&mut self, class: &str, data: &[(&str, &str)]) {
        let _ = write!(self.out, r#"<g class="{}""#, escape(class));
        for (k, v) in data {
            let _ = write!(self.out, r#" data-{k}="{}""#, escape(v));
        }
        self.out.push_str(">\n");
    }

    pub fn end_group(&mut self) {
        self.out.push_str("</g>\n");
    }

    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: &str, tooltip: Option<&str>) {
        self.data_rect((x, y, w, h), fill, &[], tooltip);
    }

    /// A rectangle carrying `data-*` attributes (what it stands for, for readers of the file).
    pub fn data_rect(
        &mut self,
        (x, y, w, h): (f64, f64, f64, f64),
        fill: &str,
        data: &[(&str, &str)],
        tooltip: Option<&str>,
    ) {
        let _ = write!(self.out, r#"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{fill}""#);
        for (k, v) in data {
            let _ = write!(self.out, r#" data-{k}="{}""#, escape(v));
        }
        match tooltip {
            Some(t) => {
                let _ = writeln!(self.out, "><title>{}</title></rect>", escape(t));
            }
            None => self.out.push_str("/>\n"),
        }
    }

    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), stroke: &str, width: f64, dash: Option<&str>) {
        let _ = write!(
            self.out,
            r#"<line x1="{x1:.2}" y1="{y1:.2}" x2="{x2:.2}" y2="{y2:.2}" stroke="{stroke}" stroke-width="{width}""#
        );
        if let Some(d) = dash {
            let _ = write!(self.out, r#" stroke-dasharray="{d}""#);
        }
        self.out.push_str("/>\n");
    }

    pub fn polyline(&mut self, points: &[(f64, f64)], stroke: &str, width: f64, class: &str) {
        let mut pts = String::new();
        for (x, y) in points {
            let _ = write!(pts, "{x:.2},{y:.2} ");
        }
        let _ = writeln!(
            self.out,
            r#"<polyline class="{class}" points="{}" fill="none" stroke="{stroke}" stroke-width="{width}" stroke-linejoin="round"/>"#,
            pts.trim_end()
        );
    }

    /// A dot at (cx, cy), with a tooltip.
    pub fn circle(&mut self, (cx, cy): (f64, f64), r: f64, fill: &str, tooltip: Option<&str>) {
        let _ = write!(self.out, r#"<circle cx="{cx:.2}" cy="{cy:.2}" r="{r}" fill="{fill}""#);
        match tooltip {
            Some(t) => {
                let _ = writeln!(self.out, "><title>{}</title></circle>", escape(t));
            }
            None => self.out.push_str("/>\n"),
        }
    }

    /// Text at (x, y); `anchor` is start, middle or end.
    pub fn text(&mut self, (x, y): (f64, f64), text: &str, size: f64, anchor: &str, fill: &str) {
        let _ = writeln!(
            self.out,
            r#"<text x="{x:.2}" y="{y:.2}" font-size="{size}" text-anchor="{anchor}" fill="{fill}">{}</text>"#,
            escape(text)
        );
    }

    /// Text rotated a quarter turn anticlockwise about (x, y) (a y-axis label).
    pub fn vertical_text(&mut self, (x, y): (f64, f64), text: &str, size: f64) {
        let _ = writeln!(
            self.out,
            r#"<text x="{x:.2}" y="{y:.2}" font-size="{size}" text-anchor="middle" transform="rotate(-90 {x:.2} {y:.2})">{}</text>"#,
            escape(text)
        );
    }

    pub fn finish(mut self) -> String {
        self.out.push_str("</svg>\n");
        self.out
    }
}

/// About `n` round tick values covering [lo, hi] (steps of 1, 2 or 5 × 10^k).
pub fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo || n == 0 {
        return vec![lo];
    }
    let raw = (hi - lo) / n as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude);
    let first = (lo / step).ceil() * step;
    let mut out = Vec::new();
    let mut v = first;
    while v <= hi + step * 1e-9 {
        out.push(if v.abs() < step * 1e-9 { 0.0 } else { v });
        v += step;
    }
    out
}

/// A tick label: no trailing zeros, thousands as k and millions as M.
pub fn tick_label(v: f64) -> String {
    let (scaled, suffix) = match v.abs() {
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let mut s = format!("{scaled:.3}");
    while s.contains('.') && (s.ends_with('0') || s.ends_with('.')) {
        s.pop();
    }
    format!("{s}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(3.2, 5.7, 5), vec![3.5, 4.0, 4.5, 5.0, 5.5]);
        assert_eq!(tick_label(2.5), "2.5");
        assert_eq!(tick_label(20_000.0), "20k");
        assert_eq!(tick_label(2_500.0), "2.5k");
        assert_eq!(tick_label(3.0), "3");
        assert_eq!(escape("<a & \"b\">"), "&lt;a &amp; &quot;b&quot;&gt;");
    }
}
