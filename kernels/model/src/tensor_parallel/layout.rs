//! How each parameter of the model seam splits over a tensor-parallel group of `T` ranks, as a small table
//! per family ([`rules`]), and the functions that cut a full parameter list into rank `r`'s shards and
//! put shards back together (checkpoints stay layout-free: they hold the gathered list).

use tch::{Kind, Tensor};

use super::TpError;
use crate::model::{base_specs, param_specs, Arch, ModelConfig, ParamSpec};
use crate::optim::adafactor_shard::Runs;

/// How one parameter splits over the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it (norms, biases added after a row-parallel product, position
    /// embeddings). Its gradient ends identical on every rank.
    Replicated,
    /// Column-parallel (`[out, in]`'s dim 0, and a bias of it): dim 0 is `parts` blocks one after the other
    /// (GPT-2's fused `c_attn` holds Q, K and V: 3), and rank r holds its `1/T` of each block (its heads of
    /// Q, of K and of V).
    Column { parts: usize },
    /// Column-parallel by key/value heads (grouped-query attention's k and v, weight and bias): with
    /// `T <= n_kv_heads` as `Column { parts: 1 }`; with `T > n_kv_heads` (a multiple of it) each key/value
    /// head is replicated over the `T / n_kv_heads` consecutive ranks whose query heads use it (Megatron's
    /// and torchtitan's replication): rank r holds head `r / (T / n_kv_heads)`, and its gradient is summed
    /// over the ranks that share the head.
    KvHeads,
    /// Row-parallel: `[out, in]`'s dim 1 cut into `T` contiguous pieces.
    Row,
    /// Vocab-parallel: the rows of a token embedding or of an untied head, `T` contiguous vocabulary ranges
    /// of the vocabulary padded to a multiple of `T` (Megatron's make-vocab-size-divisible-by): the padded
    /// rows are zeros, never looked up, their logits masked out of the cross-entropy, never gathered.
    Vocab,
}

use Split::{Column, KvHeads, Replicated, Row, Vocab};

/// GPT-2's rules, by name (a block's names by their suffix after `h.{i}.`).
const GPT2: &[(&str, Split)] = &[
    ("wte.weight", Vocab),
    ("wpe.weight", Replicated),
    ("ln_1.weight", Replicated),
    ("ln_1.bias", Replicated),
    ("attn.c_attn.weight", Column { parts: 3 }),
    ("attn.c_attn.bias", Column { parts: 3 }),
    ("attn.c_proj.weight", Row),
    ("attn.c_proj.bias", Replicated),
    ("ln_2.weight", Replicated),
    ("ln_2.bias", Replicated),
    ("mlp.c_fc.weight", Column { parts: 1 }),
    ("mlp.c_fc.bias", Column { parts: 1 }),
    ("mlp.c_proj.weight", Row),
    ("mlp.c_proj.bias", Replicated),
    ("ln_f.weight", Replicated),
    ("ln_f.bias", Replicated),
    ("lm_head.weight", Vocab),
];

/// Llama's rules (q by heads, k and v by key/value heads: grouped-query attention splits both, or
/// replicates each key/value head when the degree exceeds them).
const LLAMA: &[(&str, Split)] = &[
    ("model.embed_tokens.weight", Vocab),
    ("input_layernorm.weight", Replicated),
    ("self_attn.q_proj.weight", Column { parts: 1 }),
    ("self_attn.q_proj.bias", Column { parts: 1 }),
    ("self_attn.k_proj.weight", KvHeads),
    ("self_attn.k_proj.bias", KvHeads),
    ("self_attn.v_proj.weight", KvHeads),
    ("self_attn.v_proj.bias", KvHeads),
    ("self_attn.o_proj.weight", Row),
    ("post_attention_layernorm.weight", Replicated),
    ("mlp.gate_proj.weight", Column { parts: 1 }),
    ("mlp.up_proj.weight", Column { parts: 1 }),
    ("mlp.down_proj.weight", Row),
    ("model.norm.weight", Replicated),
    ("lm_head.weight", Vocab),
];

/// The family's table: a name (or a block parameter's suffix) and its split.
pub fn rules(arch: Arch) -> &'static [(&'static str, Split)] {
    match arch {
        Arch::Gpt2 => GPT2,
        Arch::Llama => LLAMA,
    }
}

/// The split of the parameter named `name`, and whether its gradient is a partial sum on each rank. A
/// LoRA adapter splits with its weight: under a column-parallel weight `B` (`[out, r]`) splits its rows
/// as the weight's (by blocks, for GPT-2's fused Q/K/V) and `A` (`[r, in]`) is whole on every rank;
/// under a row-parallel one `A` splits its columns as the weight's and `B` is whole. The whole factor's
/// gradient is then a partial sum on each rank: `∂A = s·(∂y_r·B_r)ᵀ·x` sums over the weight's output
/// rows, of which rank r holds its share; `∂B = s·∂yᵀ·(x_r·A_rᵀ)` sums over the input columns, of which
/// rank r holds its share.
fn split_of(arch: Arch, name: &str) -> Result<(Split, bool), TpError> {
    let adapter = [(".lora_A.weight", true), (".lora_B.weight", false)]
        .into_iter()
        .find_map(|(suffix, is_a)| name.strip_suffix(suffix).map(|module| (module, is_a)));
    let Some((module, is_a)) = adapter else { return rule_of(arch, name).map(|split| (split, false)) };
    match (rule_of(arch, &format!("{module}.weight"))?, is_a) {
        (Column { .. } | KvHeads, true) | (Row, false) => Ok((Replicated, true)),
        (split @ (Column { .. } | KvHeads), false) | (split @ Row, true) => Ok((split, false)),
        (split, _) => Err(TpError::Unsupported(format!(
            "LoRA adapters on {module} ({split:?} under tensor parallelism): peft.targets may name the blocks' \
             column- and row-parallel linears only"
        ))),
    }
}

/// The family table's split of the parameter named `name`.
fn rule_of(arch: Arch, name: &str) -> Result<Split, TpError> {
    let block_suffix = name.strip_prefix("h.").or_else(|| name.strip_prefix("model.layers.")).and_then(|rest| {
        let (index, suffix) = rest.split_once('.')?;
        index.parse::<usize>().ok().map(|_| suffix)
    });
    let wanted = block_suffix.unwrap_or(name);
    rules(arch)
        .iter()
        .find(|(rule, _)| *rule == wanted)
        .map(|&(_, split)| split)
        .ok_or_else(|| TpError::NoRule { name: name.to_owned(), arch: arch.as_str() })
}

/// Whether `degree` splits `kv_heads` key/value heads: it divides them, or is a multiple of them (each
/// head then replicated over `degree / kv_heads` ranks).
pub fn splits_kv_heads(degree: usize, kv_heads: usize) -> bool {
    degree > 0 && (kv_heads.is_multiple_of(degree) || degree.is_multiple_of(kv_heads))
}

/// The degree nearest `degree` (the smaller on a tie) that divides every one of `values` and splits
/// `kv_heads` ([`splits_kv_heads`]).
pub(super) fn nearest_degree(degree: usize, values: &[usize], kv_heads: usize) -> usize {
    let valid = |d: usize| values.iter().all(|v| v.is_multiple_of(d)) && splits_kv_heads(d, kv_heads);
    (1..=2 * degree).filter(|&d| valid(d)).min_by_key(|&d| (d.abs_diff(degree), d)).unwrap_or(1)
}

/// A model's parameters laid out over a tensor-parallel group: each parameter's [`Split`], the degree, and
/// the config a rank's attention and MLP run with (its own heads and MLP width).
#[derive(Clone, Debug)]
pub struct TpLayout {
    pub config: ModelConfig,
    pub degree: usize,
    /// Sequence parallelism: the norms and the residual stream sharded along the sequence.
    pub sp: bool,
    pub specs: Vec<ParamSpec>,
    pub splits: Vec<Split>,
    /// Per parameter, whether its gradient is a partial sum on each rank (the whole LoRA factor beside
    /// a split one, see [`split_of`]): [`super::TpRank::loss_and_backward`] sums it over the group.
    pub partial_grads: Vec<bool>,
    /// With `[peft]`, the split of every family parameter ([`base_specs`] order): how a rank cuts its
    /// shards of the frozen base.
    pub base_splits: Vec<Split>,
}

impl TpLayout {
    /// The layout of `config`'s parameters over `degree` ranks; refuses a degree that does not divide
    /// the heads, the MLP width or, with `sp`, the context, or that neither divides the key/value heads
    /// nor is a multiple of them, naming the numbers and the nearest valid degree. A vocabulary the
    /// degree does not divide is padded ([`Self::padded_vocab`]).
    pub fn new(config: &ModelConfig, degree: usize, sp: bool) -> Result<Self, TpError> {
        if degree == 0 {
            return Err(TpError::Degree { key: "tp", value: 0, degree, nearest: 1 });
        }
        let mut sizes = vec![("model.n_heads", config.n_heads), ("model.ffn_hidden", config.ffn_hidden())];
        if sp {
            sizes.push(("model.context", config.context));
        }
        let kv_heads = config.kv_heads();
        let values: Vec<usize> = sizes.iter().map(|&(_, v)| v).collect();
        let nearest = nearest_degree(degree, &values, kv_heads);
        if let Some(&(key, value)) = sizes.iter().find(|(_, value)| !value.is_multiple_of(degree)) {
            return Err(TpError::Degree { key, value, degree, nearest });
        }
        if !splits_kv_heads(degree, kv_heads) {
            return Err(TpError::KvHeads { degree, kv_heads, n_heads: config.n_heads, nearest });
        }
        let specs = param_specs(config);
        let (splits, partial_grads) =
            specs.iter().map(|s| split_of(config.arch, &s.name)).collect::<Result<Vec<_>, _>>()?.into_iter().unzip();
        let base_splits = match config.peft {
            Some(_) => base_specs(config).iter().map(|s| rule_of(config.arch, &s.name)).collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        Ok(Self { config: config.clone(), degree, sp, specs, splits, partial_grads, base_splits })
    }

    /// The config a rank's attention and MLP run with: its `n_heads / T` query heads, `n_kv_heads / T`
    /// key/value heads (one, replicated, when `T > n_kv_heads`) and `ffn_hidden / T` MLP width (head
    /// width unchanged).
    pub fn local_config(&self) -> ModelConfig {
        let t = self.degree;
        let c = &self.config;
        ModelConfig {
            n_heads: c.n_heads / t,
            n_kv_heads: c.kv_heads() / self.kv_pieces(),
            head_dim: c.head_dim(),
            ffn_hidden: c.ffn_hidden() / t,
            ..c.clone()
        }
    }

    /// The vocabulary padded to a multiple of the degree (Megatron's make-vocab-size-divisible-by): the
    /// rows of the vocab-parallel embedding and head a rank holds are `padded_vocab / T`; the padded ones
    /// are zeros, never looked up, masked out of the cross-entropy and never gathered.
    pub fn padded_vocab(&self) -> usize {
        self.config.vocab_size.next_multiple_of(self.degree)
    }

    /// Rank `rank`'s range of the padded vocabulary (ids at or past `model.vocab_size` are padding).
    pub fn vocab_range(&self, rank: usize) -> std::ops::Range<i64> {
        let n = (self.padded_vocab() / self.degree) as i64;
        rank as i64 * n..(rank as i64 + 1) * n
    }

    /// The distinct pieces the key/value heads are cut into: `min(T, n_kv_heads)`.
    pub fn kv_pieces(&self) -> usize {
        self.degree.min(self.config.kv_heads())
    }

    /// How many ranks hold each key/value head: `T / n_kv_heads` when `T > n_kv_heads`, else 1.
    pub fn kv_replicas(&self) -> usize {
        self.degree / self.kv_pieces()
    }

    /// How many ranks hold each element of a parameter split as `split` (every rank for a replicated one).
    pub fn holders(&self, split: Split) -> usize {
        match split {
            Replicated => self.degree,
            KvHeads => self.kv_replicas(),
            Column { .. } | Row | Vocab => 1,
        }
    }

    /// (pieces, rank's piece) of a split along its dim: the key/value heads' `kv_pieces`, the rest's `T`.
    fn piece_of(&self, split: Split, rank: usize) -> (i64, i64) {
        match split {
            KvHeads => (self.kv_pieces() as i64, (rank / self.kv_replicas()) as i64),
            _ => (self.degree as i64, rank as i64),
        }
    }

    /// The shape of every parameter's shard (the same on every rank).
    pub fn shard_shapes(&self) -> Vec<Vec<i64>> {
        self.specs
            .iter()
            .zip(&self.splits)
            .map(|(spec, &split)| {
                let mut shape = spec.shape.clone();
                let (pieces, _) = self.piece_of(split, 0);
                match split {
                    Replicated => {}
                    Column { .. } | KvHeads => shape[0] /= pieces,
                    Vocab => shape[0] = self.padded_vocab() as i64 / pieces,
                    Row => shape[1] /= pieces,
                }
                shape
            })
            .collect()
    }

    /// Elements a rank holds: (of sharded parameters, of replicated ones).
    pub fn rank_numel(&self) -> (usize, usize) {
        let numel = |shape: &Vec<i64>| shape.iter().product::<i64>() as usize;
        self.shard_shapes().iter().zip(&self.splits).fold((0, 0), |(sharded, replicated), (shape, split)| match split {
            Replicated => (sharded, replicated + numel(shape)),
            _ => (sharded + numel(shape), replicated),
        })
    }

    /// Rank `rank`'s shards of the full list `full` (parameters, gradients or optimizer moments in
    /// [`param_specs`] order): new contiguous tensors, detached.
    pub fn shard(&self, full: &[Tensor], rank: usize) -> Vec<Tensor> {
        assert_eq!(full.len(), self.specs.len(), "the full parameter list's length");
        assert!(rank < self.degree, "rank {rank} of a tensor-parallel group of {}", self.degree);
        full.iter().zip(&self.splits).map(|(x, &split)| self.shard_one(x, split, rank)).collect()
    }

    /// Rank `rank`'s shards of the parameters of `full` marked in `held` (a pipeline stage's,
    /// [`super::held_params`]), an empty tensor for each of the others.
    pub fn shard_held(&self, full: &[Tensor], rank: usize, held: &[bool]) -> Vec<Tensor> {
        assert_eq!((full.len(), held.len()), (self.specs.len(), self.specs.len()), "the full list's length");
        let empty = |x: &Tensor| Tensor::zeros([0], (x.kind(), x.device()));
        let shard = |(x, (&split, &held)): (&Tensor, (&Split, &bool))| match held {
            true => self.shard_one(x, split, rank),
            false => empty(x),
        };
        full.iter().zip(self.splits.iter().zip(held)).map(shard).collect()
    }

    /// Where rank `rank`'s shard elements of each parameter marked in `held` lie in the whole parameter
    /// (row-major positions in its local order; `None` for vocabulary padding), empty for the others:
    /// the shards of each parameter's positions, cut as [`Self::shard_held`] cuts its values.
    pub fn held_runs(&self, rank: usize, held: &[bool]) -> Vec<Runs> {
        assert_eq!(held.len(), self.specs.len(), "one flag per parameter");
        self.specs
            .iter()
            .zip(self.splits.iter().zip(held))
            .map(|(spec, (&split, &held))| {
                if !held {
                    return Runs::default();
                }
                // Position + 1, so that the zeros of padding stand apart.
                let numel = spec.numel() as i64;
                let positions =
                    Tensor::arange_start(1, numel + 1, (Kind::Int64, tch::Device::Cpu)).view(spec.shape.as_slice());
                let shard = Vec::<i64>::try_from(self.shard_one(&positions, split, rank).flatten(0, -1))
                    .expect("an int64 tensor");
                Runs::from_positions(shard.into_iter().map(|p| (p > 0).then(|| p as usize - 1)))
            })
            .collect()
    }

    /// Whether rank `rank` is the first of the ranks holding parameter `index`'s shard (every rank holds a
    /// replicated one; `kv_replicas` ranks a replicated key/value head): the one that counts it once in a
    /// sum over the group.
    pub fn first_holder(&self, index: usize, rank: usize) -> bool {
        rank.is_multiple_of(self.holders(self.splits[index]))
    }

    /// Rank `rank`'s shard of the frozen base's parameter `index` ([`base_specs`] order), `full` as read.
    pub fn shard_base(&self, full: &Tensor, index: usize, rank: usize) -> Tensor {
        self.shard_one(full, self.base_splits[index], rank)
    }

    /// Rank `rank`'s shard of `x` split as `split`: a new contiguous tensor, detached.
    fn shard_one(&self, x: &Tensor, split: Split, rank: usize) -> Tensor {
        let (pieces, index) = self.piece_of(split, rank);
        let piece = |x: &Tensor, dim: i64| {
            let n = x.size()[dim as usize] / pieces;
            x.narrow(dim, index * n, n)
        };
        let x = x.detach();
        let shard = match split {
            Replicated => x,
            Row => piece(&x, 1),
            Vocab => piece(&self.pad_vocab(&x), 0),
            KvHeads => piece(&x, 0),
            Column { parts } => {
                let blocks = x.chunk(parts as i64, 0);
                Tensor::cat(&blocks.iter().map(|b| piece(b, 0)).collect::<Vec<_>>(), 0)
            }
        };
        shard.contiguous().copy()
    }

    /// `x` (vocabulary rows first) with zero rows appended up to [`Self::padded_vocab`].
    fn pad_vocab(&self, x: &Tensor) -> Tensor {
        let mut size = x.size();
        let missing = self.padded_vocab() as i64 - size[0];
        if missing == 0 {
            return x.shallow_clone();
        }
        size[0] = missing;
        Tensor::cat(&[x.shallow_clone(), Tensor::zeros(size.as_slice(), (x.kind(), x.device()))], 0)
    }

    /// The full list from every rank's shards (`shards[r]` is rank r's, in [`param_specs`] order);
    /// replicated tensors are rank 0's, a replicated key/value head its first holder's, the padded
    /// vocabulary rows dropped; a parameter the ranks do not hold (empty shards: another pipeline stage's)
    /// stays empty.
    pub fn gather(&self, shards: &[Vec<Tensor>]) -> Vec<Tensor> {
        assert_eq!(shards.len(), self.degree, "one shard list per rank");
        (0..self.specs.len())
            .map(|i| {
                let of_ranks: Vec<Tensor> = shards.iter().map(|s| s[i].detach()).collect();
                if of_ranks[0].numel() == 0 && self.specs[i].numel() > 0 {
                    return of_ranks[0].copy();
                }
                match self.splits[i] {
                    Replicated => of_ranks[0].copy(),
                    Row => Tensor::cat(&of_ranks, 1),
                    Vocab => Tensor::cat(&of_ranks, 0).narrow(0, 0, self.config.vocab_size as i64).copy(),
                    KvHeads => Tensor::cat(&of_ranks.iter().step_by(self.kv_replicas()).collect::<Vec<_>>(), 0),
                    Column { parts } => {
                        let blocks: Vec<Vec<Tensor>> = of_ranks.iter().map(|s| s.chunk(parts as i64, 0)).collect();
                        let ordered: Vec<&Tensor> =
                            (0..parts).flat_map(|p| blocks.iter().map(move |b| &b[p])).collect();
                        Tensor::cat(&ordered, 0)
                    }
                }
            })
            .collect()
    }
}
