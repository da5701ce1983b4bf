//! A pipeline's validation loss (`train.eval_every`): a forward-only pass of the held-out windows through
//! the stages. No schedule plan is needed — with no backward there is nothing to interleave — so every
//! device runs its chunks in order (virtual stage by virtual stage) over the micro-batches of a round,
//! GPipe's forward: an activation goes to the next chunk's device as soon as it is computed, the last
//! chunk turns each micro-batch into its windows' summed loss. Every op (chunk c, micro-batch e) needs
//! only (c − 1, e), which every device reaches first in this order, and sends never wait, so no device
//! waits on one that waits on it.
//!
//! The windows are split among the pipeline's data-parallel replicas as a step's samples are
//! (`rank_slice`), each replica's share cut into micro-batches of its training micro-batch size, at most
//! `M` (the step's micro-batch count) to a round. Each round ends with a sum of the loss along the
//! replica's chain, which bounds the activations in flight between two devices to one round's — what a
//! step holds, and what the transport's mailbox is sized for. The replicas' totals are then summed in
//! each stage's group. Nothing is written: parameters, moments and counters stay as committed (with
//! ZeRO inside the stages' groups the parameters are gathered first, as a step does, and ZeRO-3 drops
//! them again after).

use bytes::Bytes;
use tch::Tensor;
use troupe_cluster::collective::{Collective, ReduceOp};
use troupe_cluster::transport::{LossScope, Transport};
use troupe_cluster::wire::Tag;
use troupe_model::data::{micro_batch_ranges, rank_slice, EvalWindows};
use troupe_model::generate::Evaluation;
use troupe_model::model::{block, cross_entropy, embed, head};

use super::super::PipelineError;
use super::{tensor_bytes, PipelineStage, PIPELINE_TAG_GROUP};

/// The sequence-number kind of an evaluation's activations (a step's use 1 and 2).
const EVAL_ACTIVATION: u64 = 3;

impl<T: Transport> PipelineStage<T> {
    /// The validation loss of the committed parameters over `windows`: this device's part of the forward
    /// pass of its replica's share, then the sums along the chain and among the stage's replicas. A
    /// collective of the whole pipeline (every device of every replica calls it); every device returns
    /// the same evaluation.
    pub async fn evaluate(&mut self, windows: &EvalWindows) -> Result<Evaluation, PipelineError> {
        let step = self.step;
        self.refresh_params(step).await?;
        let result = self.evaluate_share(windows, step).await;
        self.release_params();
        let sum = result?;
        Ok(Evaluation::of_sum(sum, windows))
    }

    async fn evaluate_share(&mut self, windows: &EvalWindows, step: u64) -> Result<f64, PipelineError> {
        let device = self.device;
        let failed = |what: String| PipelineError::Eval { device, step, what };
        let (replica, replicas) = match &self.data_parallel {
            Some(group) => (group.comm.rank(), group.comm.world()),
            None => (0, 1),
        };
        let size = self.microbatches.iter().map(|m| m.len()).max().unwrap_or(1).max(1);
        let micro = micro_batch_ranges(rank_slice(windows.len(), replica, replicas), size);
        let shape = self.plan.shape;
        let mut total = 0.0;
        for (round, batches) in micro.chunks(shape.microbatches.max(1)).enumerate() {
            let first = round * shape.microbatches.max(1);
            let mut local: Vec<Option<Tensor>> = batches.iter().map(|_| None).collect();
            let mut loss = 0.0;
            for v in 0..shape.virtual_stages {
                let c = shape.chunk_at(device, v);
                let layout = self.local_chunk(c).layout.clone();
                for (i, range) in batches.iter().enumerate() {
                    let e = first + i;
                    // The ends read the windows: the first chunk its tokens, the last their targets.
                    let batch = (layout.embed || layout.head).then(|| windows.batch(range.clone()));
                    let input = match (layout.embed, local[i].take()) {
                        (true, _) => None,
                        (false, Some(x)) => Some(x),
                        (false, None) => Some(self.recv_eval(c - 1, e, step, range.len()).await?),
                    };
                    let output = tch::no_grad(|| {
                        let tokens = batch.as_ref().map(|(tokens, _)| tokens);
                        self.eval_chunk(c, input.as_ref(), tokens)
                    });
                    if layout.head {
                        let targets = batch.as_ref().map(|(_, targets)| targets.shallow_clone());
                        let targets = targets.expect("the last chunk reads its windows' targets");
                        let mean = tch::no_grad(|| cross_entropy(&output, &targets)).double_value(&[]);
                        loss += mean * range.len() as f64;
                    } else if self.is_local(c + 1) {
                        local[i] = Some(output);
                    } else {
                        self.send_eval(c, e, step, tensor_bytes(&output)).await?;
                    }
                }
            }
            // The round's loss along the chain: only the last chunk's device adds anything.
            let mut sum = [loss as f32];
            self.comm.all_reduce(&mut sum[..], ReduceOp::Sum).await.map_err(|e| failed(e.to_string()))?;
            total += f64::from(sum[0]);
        }
        if let Some(group) = &mut self.data_parallel {
            let mut sum = [total as f32];
            group.comm.all_reduce(&mut sum[..], ReduceOp::Sum).await.map_err(|e| failed(e.to_string()))?;
            total = f64::from(sum[0]);
        }
        Ok(total)
    }

    /// Chunk c's forward: from the tokens (the first chunk) or the received activation, through its
    /// blocks, to the logits (the last chunk) or its output activation.
    fn eval_chunk(&self, c: usize, input: Option<&Tensor>, tokens: Option<&Tensor>) -> Tensor {
        let (layout, p) = (&self.local_chunk(c).layout, self.chunk_params(c));
        let (model, precision) = (&self.config.model, self.precision);
        let (mut x, mut used) = match input {
            None => {
                let embeds = model.embed_range();
                let tokens = tokens.expect("the first chunk reads its windows' tokens");
                (embed(model, &p[embeds.clone()], tokens), embeds.end)
            }
            Some(input) => (input.shallow_clone(), 0),
        };
        for b in layout.blocks.clone() {
            let per_block = model.block_range(b).len();
            x = block(model, precision, b, &p[used..used + per_block], &x);
            used += per_block;
        }
        if layout.head {
            head(model, precision, &p[used..], &x)
        } else {
            x
        }
    }

    fn eval_tag(&self, chunk: usize, microbatch: usize, step: u64) -> Tag {
        let seq = (EVAL_ACTIVATION << 48) | ((chunk as u64) << 24) | microbatch as u64;
        Tag { group: PIPELINE_TAG_GROUP, epoch: self.comm.epoch(), seq, step: step as u32 }
    }

    async fn send_eval(
        &mut self,
        chunk: usize,
        microbatch: usize,
        step: u64,
        bytes: Bytes,
    ) -> Result<(), PipelineError> {
        let (to, tag) = (self.plan.shape.device_of(chunk + 1), self.eval_tag(chunk, microbatch, step));
        self.transport.send(to, tag, bytes).await.map_err(|e| PipelineError::Eval {
            device: self.device,
            step,
            what: format!("sending micro-batch {microbatch}'s activation of chunk {chunk}: {e}"),
        })
    }

    /// The activation chunk `chunk` computed for evaluation micro-batch `microbatch` of `rows` windows.
    async fn recv_eval(
        &mut self,
        chunk: usize,
        microbatch: usize,
        step: u64,
        rows: usize,
    ) -> Result<Tensor, PipelineError> {
        let (from, tag) = (self.plan.shape.device_of(chunk), self.eval_tag(chunk, microbatch, step));
        let failed = |what: String| PipelineError::Eval { device: self.device, step, what };
        let what = format!("micro-batch {microbatch}'s activation of chunk {chunk}");
        let payload = self
            .transport
            .recv(from, tag, LossScope::Peer, self.recv_timeout_ms)
            .await
            .map_err(|e| failed(format!("receiving {what}: {e}")))?;
        let model = &self.config.model;
        let shape = [rows as i64, model.context as i64, model.d_model as i64];
        let bytes = payload.to_vec();
        let expected = rows * model.context * model.d_model * 4;
        if bytes.len() != expected {
            return Err(failed(format!("{what} is {} bytes, expected {expected}", bytes.len())));
        }
        let values: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok(Tensor::from_slice(&values).view(shape))
    }
}
