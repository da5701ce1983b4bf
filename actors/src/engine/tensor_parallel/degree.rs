//! The tensor degree of an attempt: `parallel.tp`, or — after a loss left fewer slots than one model
//! replica — a smaller degree the model splits into. Pure: the job driver asks it on every re-plan.

use troupe_model::config::JobConfig;
use troupe_model::tensor_parallel::TpLayout;

/// The tensor degrees an attempt of `config` may run at, largest first: `parallel.tp`, then each
/// smaller degree the model splits into (its heads, key/value heads, MLP width and, with
/// `parallel.sp`, context; 1 always). Only `parallel.tp` under a pipeline (`parallel.pp` > 1).
pub fn degrees_to_try(config: &JobConfig) -> Vec<usize> {
    let parallel = &config.parallel;
    let tp = parallel.tp.max(1);
    if parallel.pp > 1 {
        return vec![tp];
    }
    (1..=tp).rev().filter(|&t| t == tp || TpLayout::new(&config.model, t, parallel.sp && t > 1).is_ok()).collect()
}

/// The membership change that says an attempt's tensor degree changed from `from` to `to`, and where
/// its state comes from.
pub fn degree_change(config: &JobConfig, from: usize, to: usize) -> String {
    let tp = config.parallel.tp.max(1);
    if to < from {
        let whence = if from == 2 {
            "a survivor of a tensor group of 2 holds the whole state of the last committed step (its own shard and \
             its buddy copy of the other's), so the job goes on from that step"
        } else {
            "its survivors put the whole state of the last committed step together from their own shards and buddy \
             copies (each rank holds the previous one's), so the job goes on from that step — from the newest \
             checkpoint if two neighbouring ranks were lost"
        };
        format!("tensor degree {from} → {to} (parallel.tp = {tp}): no whole tensor group of {from} is left; {whence} over {to} rank(s)")
    } else {
        format!("tensor degree {from} → {to} (parallel.tp = {tp}): enough slots for a tensor group of {to} again")
    }
}

#[cfg(test)]
mod tests {
    use troupe_model::model::ModelConfig;

    use super::*;

    fn config(tp: usize, n_heads: usize, pp: usize) -> JobConfig {
        let mut config = JobConfig::small_llama(4);
        config.model = ModelConfig { n_heads, n_kv_heads: 2, head_dim: 8, ..config.model };
        config.parallel.tp = tp;
        config.parallel.pp = pp;
        config
    }

    #[test]
    fn smaller_degrees_are_those_the_model_splits_into_largest_first() {
        assert_eq!(degrees_to_try(&config(4, 4, 1)), vec![4, 2, 1], "3 does not divide 4 heads");
        assert_eq!(degrees_to_try(&config(2, 4, 1)), vec![2, 1]);
        assert_eq!(degrees_to_try(&config(1, 4, 1)), vec![1]);
        assert_eq!(degrees_to_try(&config(6, 12, 1)), vec![6, 4, 2, 1], "5 divides no head count, 3 no kv heads");
        assert_eq!(degrees_to_try(&config(2, 4, 2)), vec![2], "a pipeline keeps its degree");
    }
}
