//! The compute half of an overlapped DDP step: a rank's forward and backward on a thread of its own,
//! handing each gradient bucket, flat, to the async side the moment the backward has finished every
//! parameter in it — so the bucket's all-reduce runs while the next blocks' backward computes.
//!
//! Why a thread for the compute rather than for the communication: an attempt runs on a current-thread
//! tokio runtime, and the transports' receive tasks (QUIC streams, same-host sockets) were spawned on it
//! when they connected. Were the backward to block that thread, no message would be read until it
//! finished, whichever runtime sent. With the backward elsewhere, the attempt's runtime stays free to
//! run the collectives and the transports' tasks.
//!
//! `no_sync`: with A micro-batches on the rank, the first A − 1 only accumulate; the buckets are taken
//! from the last one's block-wise backward ([`troupe_model::blockwise`]), in plan order (reverse
//! parameter order), so every rank all-reduces them in the same order (the collectives' sequence numbers
//! must agree).
//!
//! Dropping a [`BackwardJob`] (the step was aborted) stops the thread after its current micro-batch and
//! waits for it, so no backward ever races the next attempt on the same gradients.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use tch::Tensor;
use tokio::sync::mpsc;
use troupe_model::blockwise::{micro_batch_backward, Activations};
use troupe_model::precision::Precision;
use troupe_model::ModelConfig;

use super::flat::append_flat;

/// One micro-batch of the rank's slice, sampled, with its share of the global batch (`weight`, for the
/// loss) and the factor its backward multiplies the loss by (the share times fp16's loss scale).
pub(crate) struct MicroBatch {
    pub tokens: Tensor,
    pub targets: Tensor,
    pub weight: f64,
    pub backward_weight: f64,
    /// Which samples of the step it holds (LoRA's dropout is a function of them).
    pub samples: troupe_model::model::Samples,
}

/// What the backward thread reports, in this order: every bucket once, in plan order, then `Done`.
pub(crate) enum Progress {
    /// Bucket `index`'s gradients, flat, final for this step on this rank.
    Bucket { index: usize, flat: Vec<f32> },
    /// The slice's weighted loss; when the compute ended.
    Done { loss: f64, finished: Instant },
}

/// Everything the thread needs: the model's shape, its parameters (shallow handles sharing storage and
/// gradients with the trainer's), the batch, the bucket plan, and a buffer per bucket to fill.
pub(crate) struct BackwardWork {
    pub model: ModelConfig,
    pub precision: Precision,
    pub params: Vec<Tensor>,
    pub micro_batches: Vec<MicroBatch>,
    pub activations: Activations,
    pub buckets: Vec<Range<usize>>,
    /// Spare flat buffers by bucket (their contents are overwritten).
    pub buffers: Vec<Vec<f32>>,
}

/// The running backward of one step.
pub(crate) struct BackwardJob {
    progress: mpsc::UnboundedReceiver<Progress>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl BackwardJob {
    /// Starts `work` on a new thread (its gradients must have been zeroed).
    pub fn spawn(work: BackwardWork) -> std::io::Result<Self> {
        let (tx, progress) = mpsc::unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("troupe-backward".into()).spawn(move || run(work, &tx, &flag))?;
        Ok(Self { progress, stop, thread: Some(thread) })
    }

    /// The next report. If the thread died (a panic in libtorch), its panic continues here.
    pub async fn next(&mut self) -> Progress {
        match self.progress.recv().await {
            Some(progress) => progress,
            None => {
                let thread = self.thread.take().expect("the backward thread is joined once");
                match thread.join() {
                    Err(panic) => std::panic::resume_unwind(panic),
                    Ok(()) => panic!("the backward thread ended without reporting Done"),
                }
            }
        }
    }
}

impl Drop for BackwardJob {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // Bounded by one micro-batch's forward and backward.
            let _ = thread.join();
        }
    }
}

fn run(work: BackwardWork, tx: &mpsc::UnboundedSender<Progress>, stop: &AtomicBool) {
    let BackwardWork { model, precision, params, micro_batches, activations, buckets, mut buffers } = work;
    let mut next = 0;
    let mut send_ready = |lowest_final: usize, buffers: &mut Vec<Vec<f32>>| {
        while next < buckets.len() && buckets[next].start >= lowest_final {
            // Buffers lost to an aborted step are replaced.
            let mut flat = buffers.get_mut(next).map(std::mem::take).unwrap_or_default();
            flat.clear();
            let grads: Vec<Tensor> = params[buckets[next].clone()].iter().map(Tensor::grad).collect();
            append_flat(&grads, &mut flat);
            let _ = tx.send(Progress::Bucket { index: next, flat });
            next += 1;
        }
    };
    let last = micro_batches.len().saturating_sub(1);
    let mut loss = 0.0;
    for (i, micro) in micro_batches.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let mut on_final = |range: Range<usize>| {
            if i == last {
                send_ready(range.start, &mut buffers);
            }
        };
        let micro_loss = micro_batch_backward(
            &model,
            precision,
            &params,
            &micro.tokens,
            &micro.targets,
            micro.backward_weight,
            Some(micro.samples),
            activations,
            &mut on_final,
        );
        loss += micro_loss.double_value(&[]) * micro.weight;
    }
    // A rank whose slice is empty contributes its zero gradients.
    send_ready(0, &mut buffers);
    let _ = tx.send(Progress::Done { loss, finished: Instant::now() });
}
