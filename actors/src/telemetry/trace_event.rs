//! The Chrome trace-event JSON format (what Perfetto and chrome://tracing open): `{"traceEvents":
//! [...]}` with complete spans (`ph: "X"`, `ts`/`dur` in microseconds), instants (`"i"`) and metadata
//! (`"M"`: process and thread names). troupe writes it from a run's phase reports; pipeline schedules
//! write it directly. `pid`/`tid` are kept as JSON values: numbers (rank, stage) or strings.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceFile {
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
    #[serde(rename = "displayTimeUnit", default, skip_serializing_if = "Option::is_none")]
    pub display_time_unit: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cat: String,
    pub ph: String,
    #[serde(default)]
    pub ts: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    #[serde(default)]
    pub pid: Value,
    #[serde(default)]
    pub tid: Value,
    /// Instant scope ("g" global, "p" process, "t" thread).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
}

impl TraceEvent {
    /// A complete span.
    pub fn span(name: &str, cat: &str, pid: Value, tid: Value, ts: f64, dur: f64, args: Option<Value>) -> Self {
        TraceEvent { name: name.into(), cat: cat.into(), ph: "X".into(), ts, dur: Some(dur), pid, tid, s: None, args }
    }

    /// A `process_name` or `thread_name` metadata record.
    pub fn name_of(kind: &str, pid: Value, tid: Value, name: &str) -> Self {
        let args = Some(serde_json::json!({ "name": name }));
        TraceEvent {
            name: kind.into(),
            cat: String::new(),
            ph: "M".into(),
            ts: 0.0,
            dur: None,
            pid,
            tid,
            s: None,
            args,
        }
    }

    pub fn is_span(&self) -> bool {
        self.ph == "X" && self.dur.is_some()
    }
}

impl TraceFile {
    /// Reads a trace file: the object form, or the bare array form Chrome also accepts (even without
    /// its closing bracket, as a trace cut short by a crash is).
    pub fn parse(text: &str, origin: &str) -> Result<TraceFile, String> {
        let trimmed = text.trim_start();
        if trimmed.starts_with('[') {
            let events: Vec<TraceEvent> = serde_json::from_str(trimmed)
                .or_else(|_| serde_json::from_str(&format!("{}]", trimmed.trim_end().trim_end_matches(','))))
                .map_err(|e| format!("{origin}: not a trace-event JSON array: {e}"))?;
            return Ok(TraceFile { trace_events: events, display_time_unit: None });
        }
        serde_json::from_str(text).map_err(|e| {
            format!("{origin}: not a Chrome trace-event JSON file (expected {{\"traceEvents\": [...]}}): {e}")
        })
    }

    /// The name a metadata record gives `pid` (and `tid`, for a thread).
    pub fn label(&self, kind: &str, pid: &Value, tid: Option<&Value>) -> Option<String> {
        self.trace_events
            .iter()
            .filter(|e| e.ph == "M" && e.name == kind && &e.pid == pid && tid.is_none_or(|t| &e.tid == t))
            .find_map(|e| e.args.as_ref()?.get("name")?.as_str().map(str::to_owned))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_the_object_form_and_a_truncated_array() {
        let object = r#"{"traceEvents":[{"name":"F0","cat":"forward","ph":"X","ts":1,"dur":2,"pid":0,"tid":1},
            {"name":"process_name","ph":"M","pid":0,"args":{"name":"stage 0"}}]}"#;
        let t = TraceFile::parse(object, "t.json").unwrap();
        assert!(t.trace_events[0].is_span());
        assert_eq!(t.label("process_name", &json!(0), None).as_deref(), Some("stage 0"));
        let cut = r#"[{"name":"a","ph":"X","ts":0,"dur":1,"pid":"r","tid":0},"#;
        assert_eq!(TraceFile::parse(cut, "cut").unwrap().trace_events.len(), 1);
        assert!(TraceFile::parse("{\"nope\":1}", "bad").unwrap_err().contains("bad: not a Chrome trace-event"));
    }
}
