//! The Prometheus text exposition format (version 0.0.4): a writer for `/metrics`, and a strict reader
//! that checks what the writer produced (and what a scraper will see) line by line.

use std::fmt::Write as _;

/// The `Content-Type` of a scrape answer.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

impl MetricKind {
    fn name(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// Builds one exposition: families (`# HELP`, `# TYPE`) each followed by their samples.
#[derive(Debug, Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    pub fn family(&mut self, name: &str, kind: MetricKind, help: &str) -> &mut Self {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {}", kind.name());
        self
    }

    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let escaped = value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
                let _ = write!(self.text, "{key}=\"{escaped}\"");
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {}", format_value(value));
        self
    }

    /// One family with one sample.
    pub fn single(
        &mut self,
        name: &str,
        kind: MetricKind,
        help: &str,
        labels: &[(&str, &str)],
        value: f64,
    ) -> &mut Self {
        self.family(name, kind, help).sample(name, labels, value)
    }

    /// The `_bucket`, `_sum` and `_count` samples of a histogram (its family line written before).
    pub fn histogram(&mut self, name: &str, labels: &[(&str, &str)], histogram: &Histogram) -> &mut Self {
        let mut cumulative = 0;
        for (bound, count) in histogram.bounds.iter().zip(&histogram.counts) {
            cumulative += count;
            let le = format_value(*bound);
            let mut with_le = labels.to_vec();
            with_le.push(("le", &le));
            self.sample(&format!("{name}_bucket"), &with_le, cumulative as f64);
        }
        let mut with_inf = labels.to_vec();
        with_inf.push(("le", "+Inf"));
        self.sample(&format!("{name}_bucket"), &with_inf, histogram.count as f64);
        self.sample(&format!("{name}_sum"), labels, histogram.sum);
        self.sample(&format!("{name}_count"), labels, histogram.count as f64)
    }

    pub fn finish(self) -> String {
        self.text
    }
}

fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

/// Observations in fixed buckets (upper bounds, ascending), with their sum and count.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last bucket, +Inf, is `count` minus their sum.
    counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
    pub last: Option<f64>,
}

/// Bucket bounds in seconds for things from milliseconds (a step of a small model) to minutes.
pub const SECONDS_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0, last: None }
    }

    pub fn seconds() -> Self {
        Self::new(SECONDS_BUCKETS)
    }

    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|b| value <= *b) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
        self.last = Some(value);
    }
}

/// One parsed sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Reads an exposition strictly: every line a comment (`# HELP`/`# TYPE` well formed, each family typed
/// once and before its samples), a blank line, or `name{labels} value`. An error names the line.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut samples = Vec::new();
    let mut typed: Vec<(String, String)> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let mut words = comment.trim_start().splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("TYPE"), Some(name), Some(kind)) => {
                    valid_name(name).map_err(|e| at(&e))?;
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        return Err(at("unknown metric type"));
                    }
                    if typed.iter().any(|(t, _)| t == name) {
                        return Err(at("family typed twice"));
                    }
                    typed.push((name.to_owned(), kind.to_owned()));
                }
                (Some("HELP"), Some(name), _) => valid_name(name).map_err(|e| at(&e))?,
                _ => {}
            }
            continue;
        }
        let sample = parse_sample(line).map_err(|e| at(&e))?;
        let family = typed.iter().find(|(name, kind)| {
            &sample.name == name
                || (kind == "histogram"
                    && ["_bucket", "_sum", "_count"].iter().any(|s| sample.name == format!("{name}{s}")))
        });
        if family.is_none() {
            return Err(at("sample before (or without) its # TYPE line"));
        }
        samples.push(sample);
    }
    Ok(samples)
}

fn valid_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name
            .chars()
            .enumerate()
            .all(|(i, c)| c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(format!("bad metric name {name:?}"))
    }
}

/// One sample line: `name value` or `name{key="value",…} value`.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    valid_name(name)?;
    let rest = &line[name_end..];
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let (labels, close) = parse_labels(inner)?;
            (labels, &inner[close + 1..])
        }
        None => (Vec::new(), rest),
    };
    let value = parse_value(rest.trim().split(' ').next().ok_or("no value")?)?;
    Ok(Sample { name: name.to_owned(), labels, value })
}

/// The labels of a label set, `inner` being what follows its `{`; and where its closing `}` is in `inner`.
fn parse_labels(inner: &str) -> Result<(Vec<(String, String)>, usize), String> {
    let mut labels = Vec::new();
    let mut chars = inner.char_indices();
    let mut key = String::new();
    loop {
        let (i, c) = chars.next().ok_or("unclosed label set")?;
        match c {
            '}' if key.is_empty() => return Ok((labels, i)),
            ',' if key.is_empty() => {}
            '=' => {
                let value = parse_label_value(&mut chars)?;
                valid_name(&key)?;
                labels.push((std::mem::take(&mut key), value));
            }
            c => key.push(c),
        }
    }
}

/// A quoted label value, `chars` being just after its `=`: unescaped, and `chars` past its closing quote.
fn parse_label_value(chars: &mut std::str::CharIndices<'_>) -> Result<String, String> {
    let (_, quote) = chars.next().ok_or("label without a value")?;
    if quote != '"' {
        return Err("label value not quoted".into());
    }
    let mut value = String::new();
    loop {
        match chars.next().ok_or("unterminated label value")?.1 {
            '"' => return Ok(value),
            '\\' => match chars.next().ok_or("dangling escape")?.1 {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            other => value.push(other),
        }
    }
}

/// A sample's value: a float, `+Inf`, `-Inf` or `NaN`.
fn parse_value(value: &str) -> Result<f64, String> {
    Ok(match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().map_err(|_| format!("bad value {v:?}"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_writer_writes_the_reader_reads_back() {
        let mut e = Exposition::default();
        e.single("troupe_up", MetricKind::Gauge, "Up.\nReally.", &[("node", "a \"b\"\\c")], 1.0);
        let mut h = Histogram::seconds();
        for v in [0.003, 0.2, 0.2, 100.0] {
            h.observe(v);
        }
        e.family("troupe_step_seconds", MetricKind::Histogram, "Step time.").histogram(
            "troupe_step_seconds",
            &[("job", "1")],
            &h,
        );
        let samples = parse(&e.finish()).unwrap();
        assert_eq!(samples[0].label("node"), Some("a \"b\"\\c"));
        let bucket = |le: &str| {
            samples.iter().find(|s| s.name == "troupe_step_seconds_bucket" && s.label("le") == Some(le)).unwrap().value
        };
        assert_eq!(
            (bucket("0.005"), bucket("0.1"), bucket("0.25"), bucket("60"), bucket("+Inf")),
            (1.0, 1.0, 3.0, 3.0, 4.0)
        );
        let count = samples.iter().find(|s| s.name == "troupe_step_seconds_count").unwrap();
        assert_eq!((count.value, count.label("job")), (4.0, Some("1")));
    }

    #[test]
    fn the_reader_refuses_what_a_scraper_would() {
        for bad in [
            "x 1",
            "# TYPE x gauge\nx{a=1} 1",
            "# TYPE x gauge\nx one",
            "# TYPE x gauge\n# TYPE x gauge",
            "# TYPE 1x gauge",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
