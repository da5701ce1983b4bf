//! The layout planner (`troupe_actors::plan`) as the training engine and `troupe plan` rely on it: every
//! rank placed once, coordinates and ranks in one-to-one correspondence, tensor groups inside a host
//! whenever the hosts' slots allow it, groups of the right size, the same plan for the same inputs, a
//! rank's parameters ≈ 1/T of the split ones plus the replicated ones; each refused input with its
//! numbers and the nearest valid choice; and the `troupe plan` binary.

use std::collections::BTreeSet;
use std::process::Command;

use proptest::prelude::*;
use troupe_actors::plan::{coords_of, plan_layout, rank_of, Degrees, Host, LayoutPlan, LayoutRequest};
use troupe_model::model::presets::preset;
use troupe_model::ModelConfig;

fn request(tp: usize, pp: usize, dp: usize, hosts: Vec<Host>, model: ModelConfig) -> LayoutRequest {
    LayoutRequest::new(Degrees { tp, pp, dp }, hosts, model)
}

fn gpt_tiny() -> ModelConfig {
    ModelConfig::gpt_tiny()
}

fn hosts_of(plan: &LayoutPlan, group: &[usize]) -> BTreeSet<String> {
    group.iter().map(|&r| plan.ranks[r].host.clone()).collect()
}

/// `sizes` (each ≥ 1) cut into hosts whose slots add up to `world`.
fn cut(world: usize, sizes: &[usize]) -> Vec<Host> {
    let (mut hosts, mut left) = (Vec::new(), world);
    for (i, &size) in sizes.iter().cycle().enumerate() {
        if left == 0 {
            break;
        }
        let slots = size.min(left);
        hosts.push(Host { name: format!("h{i}"), slots });
        left -= slots;
    }
    hosts
}

fn layouts() -> impl Strategy<Value = (LayoutRequest, bool)> {
    (
        prop::sample::select(vec![1usize, 2, 4]),
        1usize..=4,
        1usize..=3,
        4usize..=6,
        prop::collection::vec(1usize..=4, 1..6),
        any::<bool>(),
        any::<bool>(),
        0u8..=3,
        any::<bool>(),
    )
        .prop_map(|(tp, pp, dp, layers, sizes, whole_groups, llama, zero, within)| {
            let base = if llama { preset("llama-tiny").unwrap() } else { gpt_tiny() };
            let model = ModelConfig { n_layers: layers, n_kv_heads: if llama { 4 } else { 0 }, ..base };
            // Hosts of whole tensor groups, or of any slot counts.
            let hosts = if whole_groups {
                cut(pp * dp, &sizes).into_iter().map(|h| Host { slots: h.slots * tp, ..h }).collect()
            } else {
                cut(tp * pp * dp, &sizes)
            };
            let mut r = request(tp, pp, dp, hosts, model);
            r.zero = zero;
            r.global_batch = 12 * dp;
            r.tp_within_host = within;
            (r, whole_groups)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_rank_is_placed_once_in_groups_of_the_right_size((req, whole_groups) in layouts()) {
        let plan = match plan_layout(&req) {
            Ok(plan) => plan,
            Err(e) => {
                // Only spanning hosts are refused here, and only when they must not be spanned.
                prop_assert!(!whole_groups && req.tp_within_host, "refused: {e}");
                return Ok(());
            }
        };
        let d = req.degrees;
        prop_assert_eq!(plan.ranks.len(), d.world());
        let seats: BTreeSet<(String, usize)> = plan.ranks.iter().map(|r| (r.host.clone(), r.slot)).collect();
        prop_assert_eq!(seats.len(), d.world(), "two ranks share a slot");
        for host in &req.hosts {
            let used = plan.ranks.iter().filter(|r| r.host == host.name).count();
            prop_assert_eq!(used, host.slots, "host {} fills its slots", host.name);
            prop_assert!(plan.ranks.iter().filter(|r| r.host == host.name).all(|r| r.slot < host.slots));
        }
        let coords: BTreeSet<_> = plan.ranks.iter().map(|r| (r.dp, r.pp, r.tp)).collect();
        prop_assert_eq!(coords.len(), d.world(), "coordinates are distinct");
        for r in &plan.ranks {
            let c = coords_of(d, r.rank);
            prop_assert_eq!((c.dp, c.pp, c.tp), (r.dp, r.pp, r.tp));
            prop_assert_eq!(rank_of(d, c), r.rank);
        }
        let g = &plan.groups;
        for (groups, size, count) in [(&g.tensor, d.tp, d.pp * d.dp), (&g.pipeline, d.pp, d.tp * d.dp), (&g.data, d.dp, d.tp * d.pp)] {
            prop_assert_eq!(groups.len(), count);
            prop_assert!(groups.iter().all(|group| group.len() == size));
            let all: BTreeSet<usize> = groups.iter().flatten().copied().collect();
            prop_assert_eq!(all.len(), d.world(), "each rank in exactly one group of each kind");
        }
        for group in &g.tensor {
            prop_assert!(group.windows(2).all(|w| plan.ranks[w[0]].pp == plan.ranks[w[1]].pp && plan.ranks[w[0]].dp == plan.ranks[w[1]].dp));
            if whole_groups || req.tp_within_host {
                prop_assert_eq!(hosts_of(&plan, group).len(), 1, "tensor group {:?} spans hosts", group);
            }
        }
    }

    #[test]
    fn the_plan_is_a_pure_function_of_its_inputs((req, _) in layouts()) {
        let again = req.clone();
        prop_assert_eq!(plan_layout(&req), plan_layout(&again));
    }

    #[test]
    fn a_rank_holds_a_tth_of_the_split_parameters_and_all_replicated_ones((req, _) in layouts()) {
        let mut req = req;
        req.tp_within_host = false;
        req.zero = 0;
        let Ok(plan) = plan_layout(&req) else { return Ok(()) };
        let single = plan_layout(&LayoutRequest { degrees: Degrees { tp: 1, ..req.degrees }, hosts: vec![Host { name: "one".into(), slots: req.degrees.pp * req.degrees.dp }], ..req.clone() }).unwrap();
        let tp = req.degrees.tp as u64;
        for r in &plan.ranks {
            let whole = &single.ranks[rank_of(single_degrees(&req), troupe_actors::plan::Coords { tp: 0, ..coords_of(req.degrees, r.rank) })].memory;
            let m = &r.memory;
            prop_assert_eq!(m.replicated_elements, whole.replicated_elements);
            prop_assert_eq!(tp * m.sharded_elements, whole.sharded_elements, "split parameters divide by T");
            prop_assert_eq!(m.param_bytes, 4 * (m.sharded_elements + m.replicated_elements + m.tied_copy_elements));
            prop_assert_eq!(m.optimizer_bytes, 8 * (m.sharded_elements + m.replicated_elements));
            // The replicated part (norms, biases of row-parallel layers, position embeddings) is small: a
            // rank holds 1/T of its stage plus at most 5% of it.
            let stage = (whole.sharded_elements + whole.replicated_elements) as f64;
            prop_assert!((m.sharded_elements + m.replicated_elements) as f64 <= stage / tp as f64 + 0.05 * stage);
        }
    }
}

fn single_degrees(req: &LayoutRequest) -> Degrees {
    Degrees { tp: 1, ..req.degrees }
}

#[test]
fn the_issues_layout_keeps_tensor_groups_on_a_host_and_stages_apart() {
    let plan = plan_layout(&request(2, 2, 2, Host::uniform(4, 2), gpt_tiny())).unwrap();
    for group in &plan.groups.tensor {
        assert_eq!(hosts_of(&plan, group).len(), 1, "tensor group {group:?}");
    }
    for group in &plan.groups.pipeline {
        assert_eq!(hosts_of(&plan, group).len(), 2, "pipeline {group:?}: each stage on its own host");
    }
    let at = |r: usize| (plan.ranks[r].host.as_str(), plan.ranks[r].slot, plan.ranks[r].pp, plan.ranks[r].dp);
    assert_eq!(at(0), ("host-0", 0, 0, 0));
    assert_eq!(at(1), ("host-0", 1, 0, 0));
    assert_eq!(at(2), ("host-1", 0, 0, 1));
    assert_eq!(at(7), ("host-3", 1, 1, 1));
    assert_eq!((plan.stages[0].layers.clone(), plan.stages[1].layers.clone()), (0..2, 2..4));
    assert!(plan.sp, "sequence parallelism is on by default with tp > 1");
    assert!(plan.traffic_bytes_by_collective["all_gather"] > 0 && plan.traffic_bytes_by_collective["send"] > 0);
    assert!(!plan.why.is_empty());
}

/// The planner's error for `req`, as the user reads it.
fn refusal(req: LayoutRequest) -> String {
    plan_layout(&req).expect_err("refused").to_string()
}

fn check(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
}

#[test]
fn each_bad_input_names_its_numbers_and_the_nearest_valid_choice() {
    let hosts = |n| Host::uniform(1, n);
    check(&refusal(request(3, 1, 1, hosts(3), gpt_tiny())), &["--tp 3", "model.n_heads = 4", "nearest valid: --tp 2"]);
    let llama = preset("llama-tiny").unwrap();
    let kv_heads = ModelConfig { n_heads: 12, n_kv_heads: 4, ffn_hidden: 96, ..llama.clone() };
    let mut kv_refused = request(6, 1, 1, hosts(6), kv_heads);
    kv_refused.sp = false;
    check(&refusal(kv_refused), &["--tp 6", "model.n_kv_heads = 4", "model.n_heads = 12", "nearest valid: --tp 4"]);
    let replicated = plan_layout(&request(4, 1, 1, hosts(4), llama.clone())).expect("tp 4 over 2 key/value heads");
    assert!(replicated.why.iter().any(|w| w.contains("replicated on the 2 tensor ranks")), "{:?}", replicated.why);
    let odd_ffn = ModelConfig { n_heads: 8, ffn_hidden: 1020, ..gpt_tiny() };
    check(
        &refusal(request(8, 1, 1, hosts(8), odd_ffn)),
        &["--tp 8", "model.ffn_hidden = 1020", "nearest valid: --tp 4"],
    );
    let gpt2 = preset("gpt2").unwrap();
    let padded = plan_layout(&request(2, 1, 1, hosts(2), gpt2)).expect("gpt2's 50257 tokens at tp 2, padded");
    assert!(padded.why.iter().any(|w| w.contains("50257 is padded to 50258")), "{:?}", padded.why);
    let odd_context = ModelConfig { context: 126, ..gpt_tiny() };
    check(
        &refusal(request(4, 1, 1, hosts(4), odd_context.clone())),
        &["--sp", "model.context = 126", "nearest valid: --tp 2", "--no-sp"],
    );
    let mut no_sp = request(4, 1, 1, hosts(4), odd_context);
    no_sp.sp = false;
    assert!(plan_layout(&no_sp).is_ok(), "without SP the sequence is not split");
    check(
        &refusal(request(2, 2, 2, Host::uniform(3, 2), gpt_tiny())),
        &["8 ranks", "6 slots", "--hosts 4 with 2 slots each"],
    );
    check(&refusal(request(2, 2, 2, Host::uniform(4, 3), gpt_tiny())), &["8 ranks", "12 slots", "--dp 3"]);
    check(&refusal(request(1, 5, 1, hosts(5), gpt_tiny())), &["--pp 5", "model.n_layers = 4", "nearest valid: --pp 4"]);
    check(
        &refusal(request(4, 2, 1, Host::uniform(4, 2), gpt_tiny())),
        &["--tp 4", "2 slots", "nearest valid: --tp 2", "--tp-across-hosts"],
    );
    let split = vec![Host { name: "a".into(), slots: 3 }, Host { name: "b".into(), slots: 1 }];
    check(
        &refusal(request(2, 2, 1, split.clone(), gpt_tiny())),
        &["--tp 2", "a: 3, b: 1", "hold 1 whole tensor groups", "needs 2"],
    );
    let mut allowed = request(2, 2, 1, split, gpt_tiny());
    allowed.tp_within_host = false;
    let plan = plan_layout(&allowed).unwrap();
    assert_eq!(hosts_of(&plan, &plan.groups.tensor[1]).len(), 2);
    assert!(plan.why.iter().any(|w| w.contains("span two hosts")), "{:?}", plan.why);
    check(&refusal(request(0, 1, 1, hosts(1), gpt_tiny())), &["--tp 0"]);
    let mut zero = request(1, 1, 1, hosts(1), gpt_tiny());
    zero.zero = 4;
    check(&refusal(zero), &["--zero 4", "--zero 3"]);
}

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).output().expect("troupe runs")
}

#[test]
fn troupe_plan_prints_json_and_refuses_a_bad_tp_on_stderr() {
    let out = troupe(&["plan", "--tp", "2", "--pp", "2", "--dp", "2", "--hosts", "4", "--slots", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!((plan["tp"].as_u64(), plan["world"].as_u64(), plan["sp"].as_bool()), (Some(2), Some(8), Some(true)));
    let ranks = plan["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 8);
    assert_eq!((ranks[1]["host"].as_str(), ranks[1]["tp"].as_u64()), (Some("host-0"), Some(1)));
    assert!(ranks[0]["memory"]["total_bytes"].as_u64().unwrap() > 0);
    assert_eq!(plan["stages"][1]["layers"]["start"].as_u64(), Some(2));
    assert_eq!(plan["groups"]["tensor"][0], serde_json::json!([0, 1]));

    let args = ["plan", "--tp", "2", "--nodes", "2", "--model", "llama-tiny", "--no-sp", "--tp-across-hosts"];
    let text = troupe(&args);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    check(&stdout, &["RANK", "HOST", "LAYERS", "all_reduce", "span two hosts"]);

    let bad = troupe(&["plan", "--tp", "3", "--hosts", "1", "--slots", "3"]);
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    check(&stderr, &["--tp 3", "model.n_heads = 4", "nearest valid: --tp 2"]);
    assert!(bad.stdout.is_empty(), "no plan printed: {}", String::from_utf8_lossy(&bad.stdout));
}
