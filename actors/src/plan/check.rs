//! The refusals: every input the planner cannot place, checked before anything is placed, each with the
//! nearest valid choice.

use troupe_model::tensor_parallel::splits_kv_heads;

use super::error::LayoutError;
use super::request::LayoutRequest;

/// The largest tensor degree searched for a suggestion.
const TP_SEARCH_MAX: usize = 1024;

/// The model dimensions a tensor degree must divide, as (config key, value, what is split); the
/// key/value heads are checked apart (a degree that is a multiple of them replicates each), and the
/// vocabulary is padded to a multiple of the degree (the model's `TpLayout::padded_vocab`).
fn tp_divisors(request: &LayoutRequest) -> Vec<(&'static str, usize, &'static str)> {
    let model = &request.model;
    let mut dims = vec![
        ("model.n_heads", model.n_heads, "the attention heads (q, k, v are column-parallel by heads)"),
        ("model.ffn_hidden", model.ffn_hidden(), "the MLP's inner width (fc1 column-, fc2 row-parallel)"),
    ];
    if request.sp {
        dims.push(("model.context", model.context, "the sequence"));
    }
    dims
}

/// The tensor degree nearest `tp` (the smaller on a tie) that divides every dimension, splits the
/// key/value heads and is at most `limit`; 1 always qualifies.
pub(super) fn nearest_tp(request: &LayoutRequest, tp: usize, limit: usize) -> usize {
    let dims = tp_divisors(request);
    let valid = |t: usize| {
        dims.iter().all(|(_, value, _)| value.is_multiple_of(t))
            && splits_kv_heads(t, request.model.kv_heads())
            && t <= limit
    };
    (1..=TP_SEARCH_MAX.min(limit.max(1))).filter(|&t| valid(t)).min_by_key(|&t| (t.abs_diff(tp), t)).unwrap_or(1)
}

/// Every check that does not need the placement: degrees, ZeRO stage, stages against blocks, the tensor
/// degree against the model's dimensions, the world against the hosts, and the batch.
pub(super) fn check(request: &LayoutRequest) -> Result<(), LayoutError> {
    let d = request.degrees;
    for (flag, value) in [("--tp", d.tp), ("--pp", d.pp), ("--dp", d.dp)] {
        if value == 0 {
            return Err(LayoutError::ZeroDegree { flag });
        }
    }
    if request.zero > 3 {
        return Err(LayoutError::ZeroStage { stage: request.zero });
    }
    check_hosts(request)?;
    let layers = request.model.n_layers;
    if d.pp > layers {
        return Err(LayoutError::TooManyStages { pp: d.pp, layers });
    }
    check_tp(request)?;
    check_world(request)?;
    check_host_fit(request)?;
    if !request.global_batch.is_multiple_of(d.dp) {
        let nearest = (request.global_batch.div_ceil(d.dp) * d.dp).max(d.dp);
        return Err(LayoutError::BatchNotDivisible { global_batch: request.global_batch, dp: d.dp, nearest });
    }
    Ok(())
}

fn check_hosts(request: &LayoutRequest) -> Result<(), LayoutError> {
    if request.hosts.is_empty() {
        return Err(LayoutError::Hosts { reason: "no hosts given; name at least one".into() });
    }
    if let Some(host) = request.hosts.iter().find(|h| h.slots == 0) {
        return Err(LayoutError::Hosts { reason: format!("host {} has 0 slots; give it at least 1", host.name) });
    }
    let mut names: Vec<&str> = request.hosts.iter().map(|h| h.name.as_str()).collect();
    names.sort_unstable();
    if let Some(pair) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(LayoutError::Hosts { reason: format!("host {} is named twice; name each host once", pair[0]) });
    }
    Ok(())
}

fn check_tp(request: &LayoutRequest) -> Result<(), LayoutError> {
    let tp = request.degrees.tp;
    for (key, value, what) in tp_divisors(request) {
        if !value.is_multiple_of(tp) {
            let nearest = nearest_tp(request, tp, usize::MAX);
            if key == "model.context" {
                return Err(LayoutError::SequenceNotDivisible { tp, context: value, nearest });
            }
            return Err(LayoutError::TpDoesNotDivide { tp, key, value, what, nearest });
        }
    }
    let kv_heads = request.model.kv_heads();
    if !splits_kv_heads(tp, kv_heads) {
        let nearest = nearest_tp(request, tp, usize::MAX);
        return Err(LayoutError::KvHeads { tp, kv_heads, n_heads: request.model.n_heads, nearest });
    }
    Ok(())
}

fn check_world(request: &LayoutRequest) -> Result<(), LayoutError> {
    let d = request.degrees;
    let world: usize = request.hosts.iter().map(|h| h.slots).sum();
    if world == d.world() {
        return Ok(());
    }
    let suggestion = if world.is_multiple_of(d.tp * d.pp) {
        format!(
            "--dp {} (the slots hold {} replicas of tp × pp = {})",
            world / (d.tp * d.pp),
            world / (d.tp * d.pp),
            d.tp * d.pp
        )
    } else {
        let slots = request.hosts[0].slots;
        match d.world() % slots {
            0 => format!("--hosts {} with {slots} slots each ({} slots)", d.world() / slots, d.world()),
            _ => format!("hosts with {} slots in all", d.world()),
        }
    };
    Err(LayoutError::WorldMismatch {
        tp: d.tp,
        pp: d.pp,
        dp: d.dp,
        needed: d.world(),
        world,
        world_source: request.world_source.clone(),
        suggestion,
    })
}

fn check_host_fit(request: &LayoutRequest) -> Result<(), LayoutError> {
    let tp = request.degrees.tp;
    let largest = request.hosts.iter().max_by_key(|h| h.slots).expect("hosts checked non-empty");
    if request.tp_within_host && tp > largest.slots {
        let nearest = nearest_tp(request, tp, largest.slots);
        return Err(LayoutError::TensorGroupTooLarge { tp, host: largest.name.clone(), slots: largest.slots, nearest });
    }
    Ok(())
}
