//! What a rank keeps between steps, counted in elements — the persistent model state whose size ZeRO
//! divides by the world (activations, gathered units and other buffers of a step in flight are not
//! counted: they are freed when the step ends).

use troupe_model::Trainer;

/// Elements (fp32) a rank holds between steps, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PersistentState {
    /// Model parameters kept for compute (DDP and ZeRO-1/2: the whole model; ZeRO-3: none).
    pub params: usize,
    /// Gradients kept: the model's `.grad` tensors and gradient shards (own and buddy copies).
    pub grads: usize,
    /// Sharded fp32 master parameters (own shard and buddy copies); DDP's masters are its `params`.
    pub masters: usize,
    /// The optimizer's state: AdamW's two moments (sharded or whole) or Adafactor's statistics.
    pub moments: usize,
    /// Flat communication buffers kept allocated between steps.
    pub buffers: usize,
}

impl PersistentState {
    /// What a trainer's model and optimizer hold: parameters, their defined gradients, the optimizer's
    /// state tensors — a DDP rank's whole persistent state (its flat buckets aside).
    pub fn of_model(trainer: &Trainer) -> Self {
        let params = trainer.model.params();
        let grads = params.iter().map(|p| p.grad()).filter(|g| g.defined()).map(|g| g.numel()).sum();
        let moments = trainer.optimizer.state_numel();
        Self { params: params.iter().map(|p| p.numel()).sum(), grads, masters: 0, moments, buffers: 0 }
    }

    pub fn total(&self) -> usize {
        self.params + self.grads + self.masters + self.moments + self.buffers
    }
}
