//! Measured spans as a Chrome / Perfetto trace-event JSON (`{"traceEvents": [...]}`): one complete event
//! (`"ph": "X"`) per op, one thread per stage (device), categories `forward`, `backward`, `weight` and
//! `comm`, times in microseconds. `troupe trace` renders such files; chrome://tracing and
//! ui.perfetto.dev open them as they are.

use serde_json::{json, Value};

use super::{OpKind, PipelineStep};

/// The trace category of an op kind.
pub fn category(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Forward => "forward",
        OpKind::Backward | OpKind::BackwardInput => "backward",
        OpKind::BackwardWeight => "weight",
        OpKind::SendActivation | OpKind::RecvActivation | OpKind::SendGradient | OpKind::RecvGradient => "comm",
    }
}

/// The short name of an op kind (F, B, W, send/recv activation/gradient).
pub fn op_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Forward => "F",
        OpKind::Backward => "B",
        OpKind::BackwardInput => "B",
        OpKind::BackwardWeight => "W",
        OpKind::SendActivation => "send activation",
        OpKind::RecvActivation => "recv activation",
        OpKind::SendGradient => "send gradient",
        OpKind::RecvGradient => "recv gradient",
    }
}

/// The trace of `steps` (process `pid`, membership epoch `epoch`), stages named `stage N`.
pub fn chrome_trace(steps: &[PipelineStep], stages: usize, pid: u32, epoch: u64) -> Value {
    let mut events: Vec<Value> = (0..stages)
        .map(|stage| json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": stage, "args": {"name": format!("stage {stage}")}}))
        .collect();
    for step in steps {
        for (stage, spans) in step.spans.iter().enumerate() {
            for span in spans {
                let op = span.op;
                events.push(json!({
                    "name": op_name(op.kind),
                    "cat": category(op.kind),
                    "ph": "X",
                    "ts": span.start_s * 1e6,
                    "dur": (span.end_s - span.start_s) * 1e6,
                    "pid": pid,
                    "tid": stage,
                    "args": {"stage": stage, "microbatch": op.microbatch, "chunk": op.chunk, "epoch": epoch, "step": step.step},
                }));
            }
        }
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
