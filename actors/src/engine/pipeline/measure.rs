//! What a measured run's spans say: the bubble (idle device time over total device time, per step
//! between the step's first op and its last, so the flush and the driver's round trip are left out) and
//! the mean duration of each kind of computation, which [`super::simulate`] turns into the bubble the
//! plan would have at those costs. Pure: spans in, figures out.

use super::{Costs, OpKind, OpSpan, PipelineStep};

/// Bubble and costs over a set of steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BubbleFigures {
    /// Σ idle / Σ (devices × step span).
    pub bubble: f64,
    /// Device-seconds idle and in all.
    pub idle_s: f64,
    pub total_s: f64,
    /// Mean step span (first op to last op over all devices), seconds.
    pub step_span_s: f64,
    /// Mean seconds of one chunk's F, whole backward, B and W (NaN where the schedule has none).
    pub forward_s: f64,
    pub backward_s: f64,
    pub backward_input_s: f64,
    pub backward_weight_s: f64,
}

impl BubbleFigures {
    /// Per-device costs for [`super::simulate`] (a chunk is 1/V of a device's share).
    pub fn costs(&self, virtual_stages: usize) -> Costs {
        let v = virtual_stages as f64;
        let (input, weight) = if self.backward_input_s.is_finite() {
            (self.backward_input_s, self.backward_weight_s)
        } else {
            // Whole backwards only: split the measured time evenly (the plan never separates them).
            (self.backward_s / 2.0, self.backward_s / 2.0)
        };
        Costs { forward: self.forward_s * v, backward_input: input * v, backward_weight: weight * v, message: 0.0 }
    }
}

/// Measures `steps` (pass the steady ones: the first step pays for allocation and warm caches).
pub fn measure_bubble(steps: &[PipelineStep]) -> BubbleFigures {
    let (mut idle, mut total, mut span_sum) = (0.0, 0.0, 0.0);
    let mut sums = [(0.0f64, 0usize); 4];
    for step in steps {
        let all = || step.spans.iter().flatten();
        let start = all().map(|s| s.start_s).fold(f64::INFINITY, f64::min);
        let end = all().map(|s| s.end_s).fold(f64::NEG_INFINITY, f64::max);
        if end.partial_cmp(&start) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let window = end - start;
        span_sum += window;
        for device in &step.spans {
            let busy: f64 = device.iter().filter(|s| s.op.kind.is_compute()).map(duration).sum();
            idle += window - busy;
            total += window;
        }
        for span in all() {
            let slot = match span.op.kind {
                OpKind::Forward => 0,
                OpKind::Backward => 1,
                OpKind::BackwardInput => 2,
                OpKind::BackwardWeight => 3,
                _ => continue,
            };
            sums[slot].0 += duration(span);
            sums[slot].1 += 1;
        }
    }
    let mean = |(sum, n): (f64, usize)| if n == 0 { f64::NAN } else { sum / n as f64 };
    BubbleFigures {
        bubble: if total > 0.0 { idle / total } else { 0.0 },
        idle_s: idle,
        total_s: total,
        step_span_s: if steps.is_empty() { 0.0 } else { span_sum / steps.len() as f64 },
        forward_s: mean(sums[0]),
        backward_s: mean(sums[1]),
        backward_input_s: mean(sums[2]),
        backward_weight_s: mean(sums[3]),
    }
}

fn duration(span: &OpSpan) -> f64 {
    span.end_s - span.start_s
}
