//! The key/value cache of incremental decoding: each block's keys and values of the positions seen so
//! far, so that a new token costs one forward of itself (its query against every cached key) instead of
//! the whole prefix again. [`super::Model::forward_cached`] runs a model on it; both families' blocks take
//! an optional [`LayerCache`] and compute exactly their uncached function when given none.

use tch::{Kind, Tensor};

/// One block's cached keys and values, `[batch, kv_heads, positions, head_dim]` each.
#[derive(Debug, Default)]
pub struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    /// Positions cached.
    pub fn len(&self) -> i64 {
        self.kv.as_ref().map_or(0, |(k, _)| k.size()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the new positions' keys and values; returns all of them (cached first).
    pub fn append(&mut self, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let (k, v) = match self.kv.take() {
            None => (k, v),
            Some((old_k, old_v)) => (Tensor::cat(&[&old_k, &k], 2), Tensor::cat(&[&old_v, &v], 2)),
        };
        self.kv = Some((k.shallow_clone(), v.shallow_clone()));
        (k, v)
    }
}

/// The whole model's cache: one [`LayerCache`] per block.
#[derive(Debug)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    pub fn new(n_layers: usize) -> Self {
        Self { layers: (0..n_layers).map(|_| LayerCache::default()).collect() }
    }

    /// Positions cached.
    pub fn len(&self) -> i64 {
        self.layers.first().map_or(0, LayerCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Causal scaled-dot-product attention of queries at positions `start..start + q_len` against keys and
/// values at positions `0..k_len` (`[batch, heads, len, head_dim]` each): query i sees keys 0..=start + i.
/// Without a cache (`start` 0, as many keys as queries) this is libtorch's fused causal attention, exactly
/// what training computes.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, start: i64) -> Tensor {
    let (q_len, k_len) = (q.size()[2], k.size()[2]);
    if start == 0 && q_len == k_len {
        return Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, false);
    }
    assert_eq!(start + q_len, k_len, "the queries continue the cached positions");
    if q_len == 1 {
        // The newest position sees every key.
        return Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, false, None, false);
    }
    let rows = Tensor::arange_start(start, start + q_len, (Kind::Int64, q.device())).unsqueeze(1);
    let cols = Tensor::arange(k_len, (Kind::Int64, q.device())).unsqueeze(0);
    let allowed = cols.le_tensor(&rows);
    Tensor::scaled_dot_product_attention(q, k, v, Some(allowed), 0.0, false, None, false)
}
