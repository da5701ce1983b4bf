//! The deterministic simulation of issue 8: random fault schedules against the step protocol, with the
//! invariant checker after every run (troupe_chaos::sim). Everything here runs in virtual time: a few
//! seconds in release for all of it.
//!
//! A failing seed prints its report (violations, scenario, the end of its trace) and how to replay it:
//! `make sim-replay SIM_SEED=<seed>` (add `SIM_PLANTED=1` for the planted bug, `SIM_NETWORK=datagrams`
//! for a network without QUIC's guarantees, `SIM_LOADED=1` for a loaded machine).

use troupe_chaos::sim::{self, Fault, JobEnd, Network, NodeSpec, Outcome, PlantedBug, Scenario, SimConfig};
use troupe_cluster::membership::NodeId;

/// Seeds every property below runs.
const SEEDS: u64 = 300;

/// Runs `seeds` and returns the first failing outcome, re-run with its trace kept for the report.
fn first_failure(config: &SimConfig, seeds: std::ops::Range<u64>) -> Option<Outcome> {
    seeds.map(|seed| sim::run_seed(seed, config, 0)).find(|o| !o.ok()).map(|o| sim::run_seed(o.seed, config, 200))
}

fn assert_no_failure(config: &SimConfig, seeds: std::ops::Range<u64>) {
    if let Some(outcome) = first_failure(config, seeds) {
        panic!("{}", outcome.report());
    }
}

/// The main property: over random clusters, jobs and fault schedules, no invariant breaks. The nodes and
/// the job driver are the runtime's own code (`NodeCore`, `JobDriver`).
#[test]
fn random_fault_schedules_break_no_invariant() {
    assert_no_failure(&SimConfig::default(), 0..SEEDS);
}

#[test]
fn fault_free_jobs_finish_with_every_rank_holding_every_step() {
    for nodes in 1..=5 {
        let scenario = Scenario::calm(nodes, 20);
        for seed in 0..10 {
            let outcome = sim::run(seed, &scenario, &SimConfig::default(), 100);
            assert!(outcome.ok(), "{}", outcome.report());
            assert!(matches!(outcome.end, JobEnd::Finished { .. }), "{}", outcome.report());
            assert_eq!(outcome.stats.view_changes, 0);
            assert_eq!(outcome.stats.applied, 20 * nodes as u64, "every rank applies every step once");
        }
    }
}

/// A run is a pure function of its seed: the same seed gives the same trace, line for line.
#[test]
fn a_seed_replays_exactly() {
    let config = SimConfig::default();
    let seed = (0..SEEDS).find(|&s| Scenario::random(s).faults.len() >= 3).expect("some seed has several faults");
    let first = sim::run_seed(seed, &config, 0);
    let again = sim::run_seed(seed, &config, 50);
    assert_eq!((first.trace_hash, first.trace_lines), (again.trace_hash, again.trace_lines));
    assert_eq!(first.stats, again.stats);
    assert_eq!(first.end, again.end);
    assert!(first.trace_lines > 100, "the run did something ({} lines)", first.trace_lines);
    let other = sim::run_seed(seed + 1, &config, 0);
    assert_ne!(first.trace_hash, other.trace_hash);
}

/// The fault schedules do reach the recovery paths; otherwise the property above proves little.
#[test]
fn faults_exercise_every_recovery_path() {
    const RUNS: u64 = 1000; // rollbacks need every copy of the state lost: rare
    let config = SimConfig::default();
    let outcomes: Vec<Outcome> = (0..RUNS).map(|seed| sim::run_seed(seed, &config, 0)).collect();
    let seeds_where = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let changed_view = seeds_where(&|o| o.stats.view_changes > 0);
    let fenced = seeds_where(&|o| o.stats.fences > 0);
    let retried = seeds_where(&|o| o.stats.attempts > 1);
    let copied = seeds_where(&|o| o.stats.state_copies > 0);
    let failed_attempt = seeds_where(&|o| o.stats.failed_attempts_seen > 0);
    let lost = seeds_where(&|o| o.stats.lost_messages > 0);
    let rolled_back = seeds_where(&|o| o.stats.rollbacks > 0);
    let state_lost = seeds_where(&|o| matches!(&o.end, JobEnd::Failed { reason, .. } if reason.contains("lost")));
    let finished = seeds_where(&|o| matches!(o.end, JobEnd::Finished { .. }));
    let restarted = seeds_where(&|o| o.stats.controller_restarts > 0);
    let restarted_finished =
        seeds_where(&|o| o.stats.controller_restarts > 0 && matches!(o.end, JobEnd::Finished { .. }));
    let cut_off = |o: &Outcome| {
        o.scenario.faults.iter().any(|f| matches!(f, Fault::Isolate { node: 0, for_ms, .. } if *for_ms > 2_500))
    };
    // Cut off past the failure timeout, the controller trains on alone; its members are fenced on healing.
    let controller_cut_off = seeds_where(&|o| cut_off(o));
    let cut_off_fenced = seeds_where(&|o| cut_off(o) && o.stats.fences > 0);
    println!(
        "of {RUNS} seeds: view changed {changed_view}, fenced {fenced}, retried {retried}, copied state {copied}, \
         an attempt failed {failed_attempt}, messages lost {lost}, rolled back {rolled_back}, \
         failed with state lost {state_lost}, finished {finished}, controller killed and restarted \
         {restarted} (finished {restarted_finished}), controller cut off past the timeout \
         {controller_cut_off} (members fenced {cut_off_fenced})"
    );
    assert!(outcomes.iter().all(Outcome::ok), "see random_fault_schedules_break_no_invariant");
    // QUIC: one connection delivers in order and once; only a replaced connection's messages come late.
    let out_of_order = |o: &&Outcome| o.stats.overtaken > o.stats.late_after_replacement || o.stats.duplicates > 0;
    assert_eq!(outcomes.iter().find(out_of_order).map(|o| o.seed), None);
    assert!(changed_view > RUNS as usize / 2);
    assert!(fenced > 150 && retried > 150 && copied > 100 && failed_attempt > 150 && lost > 150);
    assert!(rolled_back > 0 && state_lost > 0);
    assert!(finished > RUNS as usize * 9 / 10);
    assert!(restarted > 40 && restarted_finished > restarted * 8 / 10);
    assert!(controller_cut_off > 5 && cut_off_fenced > controller_cut_off / 2);
}

/// The planted bug: the modelled controller commits a step on its first vote (a wrapper around the
/// driver's actions). The checker must catch it in some seed of the first 200.
#[test]
fn the_checker_catches_a_controller_that_commits_before_every_vote() {
    let config = SimConfig { planted: PlantedBug::CommitOnFirstVote, ..SimConfig::default() };
    let caught = first_failure(&config, 0..200).expect("the planted bug goes unnoticed in 200 seeds");
    println!("the planted bug is caught by seed {}:\n{}", caught.seed, caught.report());
    assert!(
        caught.violations.iter().any(|v| v.contains("which the controller had not committed")),
        "{}",
        caught.report()
    );
    let caught_seeds = (0..200).filter(|&s| !sim::run_seed(s, &config, 0).ok()).count();
    println!("{caught_seeds} of 200 seeds catch it");
    assert!(caught_seeds > 100);
}

// ---- the replicated controller (issue 32): three controllers, a Raft group whose leader leads ----

/// Runs `seeds` of the replicated controllers' random schedules and returns the first failing outcome,
/// re-run with its trace kept.
fn first_replicated_failure(config: &SimConfig, seeds: std::ops::Range<u64>) -> Option<Outcome> {
    let run = |seed: u64, keep| sim::run(seed, &Scenario::random_replicated(seed), config, keep);
    seeds.map(|seed| run(seed, 0)).find(|o| !o.ok()).map(|o| run(o.seed, 300))
}

/// Over random schedules that kill (for good, or with a restart), pause and cut off the controllers —
/// the leader among them — with the other nodes' faults beside: no invariant breaks, across take-overs.
/// Half the seeds on a loaded machine, whose reader stalls reorder what no connection orders.
///
/// The three seeds that broke it (of 1000, 2026-11-27): 130 and 340 — the job's last record (its end)
/// was committed, but its leader heard `NotLeader` (deposed by a controller back from a partition
/// while the record was on a majority's logs; the next leader's first entry committed it, Raft's
/// rule), so the end was never announced: the simulation's watcher now re-watches at the new leader,
/// as `JobHandle` does (the model lacked it); 585 — a node that is not a controller, restarted 274 ms
/// before node-a (its only `join`) died for good and not yet admitted again, knew no controller to
/// dial: the runtime now tries the daemons of the last view it knew, kept in its data dir across the
/// restart, which the simulation keeps too (`NodeCore::remember`).
/// `SIM_RSEED=n` replays a seed with its trace; `survey_replicated` searches further.
#[test]
fn replicated_controllers_break_no_invariant_across_takeovers() {
    if let Some(outcome) = first_replicated_failure(&SimConfig::default(), 0..SEEDS) {
        panic!("{}", outcome.report());
    }
    if let Some(outcome) = first_replicated_failure(&SimConfig::loaded(), SEEDS..SEEDS + SEEDS / 2) {
        panic!("loaded machine: {}", outcome.report());
    }
}

/// The seeds that broke the property above stay clean (see its docs for why each broke).
#[test]
fn replicated_seeds_130_340_585_break_no_invariant() {
    for seed in [130, 340, 585] {
        let scenario = Scenario::random_replicated(seed);
        let outcome = sim::run(seed, &scenario, &SimConfig::default(), 0);
        assert!(outcome.ok(), "{}", sim::run(seed, &scenario, &SimConfig::default(), 300).report());
        assert!(matches!(outcome.end, JobEnd::Finished { .. }), "seed {seed}: {:?}", outcome.end);
    }
}

/// `Submitted` only once the job's first record was committed by a majority (controller.rs
/// `pre_start`, `not_started`). In these loaded seeds the leader was paused 6 ms after a submission and
/// the record never committed; the client was told `Submitted` all the same, and no controller ever ran
/// the job. Now the client is told that the controller lost its leadership, and submits again to the
/// next one (the checker fails any `Submitted` answered before a majority held the job).
#[test]
fn a_submission_not_committed_is_refused_and_submitted_again() {
    let config = SimConfig::loaded();
    for seed in [155, 242] {
        let scenario = Scenario::random_replicated(seed);
        let outcome = sim::run(seed, &scenario, &config, 0);
        assert!(outcome.ok(), "{}", sim::run(seed, &scenario, &config, 300).report());
    }
}

/// The replicated schedules do reach take-overs: leaders killed for good and replaced, deposed leaders
/// stepping down, jobs finishing after them.
#[test]
fn replicated_faults_exercise_takeovers_and_step_downs() {
    const RUNS: u64 = 500;
    let config = SimConfig::default();
    let outcomes: Vec<Outcome> =
        (0..RUNS).map(|seed| sim::run(seed, &Scenario::random_replicated(seed), &config, 0)).collect();
    let seeds_where = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let finished = |o: &Outcome| matches!(o.end, JobEnd::Finished { .. });
    let leader_killed = |o: &Outcome| {
        o.scenario.faults.iter().any(|f| matches!(f, Fault::Crash { node: 0, restart_after_ms: None, .. }))
    };
    let took_over = seeds_where(&|o| o.stats.takeovers > 1);
    let stepped_down = seeds_where(&|o| o.stats.step_downs > 0);
    let killed = seeds_where(&|o| leader_killed(o));
    let killed_finished = seeds_where(&|o| leader_killed(o) && finished(o));
    let late = seeds_where(&|o| o.stats.late_commits > 0);
    let all_finished = seeds_where(&|o| finished(o));
    println!(
        "of {RUNS} replicated seeds: a take-over in {took_over}, a controller stepped down in {stepped_down}, the first \
         leader (node-a) killed for good in {killed} (finished in {killed_finished}), a deposed leader's late \
         commit in {late}, finished {all_finished}"
    );
    let broken: Vec<u64> = outcomes.iter().filter(|o| !o.ok()).map(|o| o.seed).collect();
    println!("seeds that break an invariant (open, see the ignored property above): {broken:?}");
    assert!(took_over > RUNS as usize / 3 && stepped_down > 30);
    assert!(killed > 30 && killed_finished * 10 >= killed * 9, "jobs whose first leader died for good finish");
    assert!(all_finished > RUNS as usize * 9 / 10);
}

/// Three controllers and a worker node; the job's first leader (node-a) is killed for good mid-job, or
/// cut off for 3 s, or paused past the election timeout but within the idle timeout (its members'
/// connections survive: it resumes believing it leads).
fn leader_fault(fault: Fault) -> Scenario {
    let mut scenario = Scenario::calm(4, 30);
    scenario.controllers = 3;
    scenario.faults = vec![fault];
    scenario
}

const LEADER_FAULTS: [Fault; 3] = [
    Fault::Crash { node: 0, at_ms: 1_200, restart_after_ms: None },
    Fault::Isolate { node: 0, at_ms: 1_200, for_ms: 3_000 },
    Fault::Pause { node: 0, at_ms: 1_200, for_ms: 1_900 },
];

/// Each leader fault: another controller is elected and the job finishes with every step committed
/// once; a leader that comes back (cut off, paused) steps down and rejoins as a member.
#[test]
fn a_leader_killed_cut_off_or_paused_is_replaced_and_the_job_finishes() {
    for fault in LEADER_FAULTS {
        for seed in 0..40 {
            let outcome = sim::run(seed, &leader_fault(fault), &SimConfig::default(), 0);
            assert!(outcome.ok(), "{}", sim::run(seed, &leader_fault(fault), &SimConfig::default(), 300).report());
            assert!(matches!(outcome.end, JobEnd::Finished { .. }), "{fault:?}: {:?}", outcome.end);
            assert!(outcome.stats.takeovers >= 2, "{fault:?}, seed {seed}: another controller took over");
            if !fault.never_back() {
                assert!(outcome.stats.step_downs >= 1, "{fault:?}, seed {seed}: the old leader stepped down");
            }
        }
    }
}

/// The planted bug: a job controller whose record was not committed by a majority (its node deposed,
/// cut off or paused past an election) announces its batch anyway. The checker catches it: a `Commit`
/// whose record no majority of the controllers' stores holds.
#[test]
fn the_checker_catches_a_deposed_leader_that_announces_an_uncommitted_step() {
    let config = SimConfig { planted: PlantedBug::DeposedLeaderAnnounces, ..SimConfig::default() };
    let caught =
        |o: &Outcome| o.violations.iter().any(|v| v.contains("which no majority of the controllers' stores holds"));
    let directed = (0..40).map(|seed| sim::run(seed, &leader_fault(LEADER_FAULTS[2]), &config, 0));
    let directed_caught = directed.filter(|o| caught(o)).count();
    let random = first_replicated_failure(&config, 0..SEEDS).expect("the planted bug goes unnoticed");
    println!("caught in {directed_caught} of 40 paused-leader seeds; first random seed: {}", random.report());
    assert!(directed_caught > 0, "a paused leader's votes come in on resume: it commits on its own");
    let random_caught =
        (0..SEEDS).filter(|&s| caught(&sim::run(s, &Scenario::random_replicated(s), &config, 0))).count();
    println!("{random_caught} of {SEEDS} random replicated seeds catch it");
    assert!(random_caught > 0);
    let clean = (0..40).map(|seed| sim::run(seed, &leader_fault(LEADER_FAULTS[2]), &SimConfig::default(), 0));
    assert!(clean.filter(caught).count() == 0, "without the bug, no such violation");
}

// ---- what the network may reorder and repeat ----

/// Connection resets of nodes 1 and 2 in turn, every `gap_ms` for 1.2 s while a job trains: each node
/// dials again at once, often while the controller still holds its older connection (half the resets
/// reach the node's end only).
fn reset_storm(gap_ms: u64) -> Scenario {
    let mut scenario = Scenario::calm(3, 30);
    scenario.faults = (0..1_200 / gap_ms)
        .map(|i| Fault::DropConnection { node: 1 + (i % 2) as usize, at_ms: 100 + gap_ms * i })
        .collect();
    scenario
}

/// Under QUIC, what is not ordered by one live connection is reordered: a replaced connection's last
/// messages reach the controller after the newer connection's `Connected` (which removed the node) and
/// sometimes after its first messages, and a joiner's resent `Join` arrives once on each connection.
/// The runtime tolerates both. A loaded machine's reader stalls make the first common in a reset storm;
/// over random seeds they stay rare, and break nothing either.
#[test]
fn late_messages_of_replaced_connections_and_resent_joins_break_nothing() {
    let config = SimConfig::loaded();
    let count = |outcomes: &[Outcome], f: &dyn Fn(&sim::Stats) -> bool| outcomes.iter().filter(|o| f(&o.stats)).count();
    let storm: Vec<Outcome> = (0..100).map(|seed| sim::run(seed, &reset_storm(60), &config, 0)).collect();
    if let Some(bad) = storm.iter().find(|o| !o.ok()) {
        panic!("{}", sim::run(bad.seed, &reset_storm(60), &config, 200).report());
    }
    let late = count(&storm, &|s| s.late_after_replacement > 0);
    let joins = count(&storm, &|s| s.join_repeats_across_connections > 0);
    let random: Vec<Outcome> = (0..1000).map(|seed| sim::run_seed(seed, &config, 0)).collect();
    if let Some(bad) = random.iter().find(|o| !o.ok()) {
        panic!("{}", sim::run_seed(bad.seed, &config, 200).report());
    }
    let (random_late, random_overtaken) =
        (count(&random, &|s| s.late_after_replacement > 0), count(&random, &|s| s.overtaken > 0));
    println!(
        "reset storm, 100 seeds: a replaced connection's message came late in {late}, a resent Join came on \
         another connection in {joins}; 1000 random seeds: late in {random_late}, a message overtook one sent \
         earlier in {random_overtaken}"
    );
    assert!(late > 20 && joins > 20);
    assert!(random_late > 0 && random_overtaken > 0);
    for o in storm.iter().chain(&random) {
        let s = &o.stats;
        assert_eq!(s.duplicates, 0, "seed {}: QUIC delivers once", o.seed);
        assert!(s.overtaken <= s.late_after_replacement, "seed {}: only a replaced connection's are overtaken", o.seed);
    }
}

/// Ranks finish a collective each on its own. After the last commit, a view change can start an attempt
/// with no step left (here node-b's `Completed` is slow to arrive and node-a crashes): every rank connects
/// and completes at once, and one may complete before another has connected. A completed rank shuts its
/// transport down gracefully (worker.rs `train_over`: a goodbye, then it waits for its peers), so no peer
/// fails; modelled as an abrupt leave, 41 of these 200 seeds failed the job.
#[test]
fn an_attempt_with_no_step_left_completes_on_every_rank() {
    let names = ["node-c", "node-d", "node-e", "node-a", "node-b"];
    let scenario = Scenario {
        nodes: names
            .iter()
            .map(|n| NodeSpec { name: NodeId((*n).into()), slots: if n.ends_with(['b', 'e']) { 2 } else { 1 } })
            .collect(),
        steps: 9,
        max_ranks: 0,
        step_ms_min: 26,
        step_ms_max: 91,
        checkpoint_every: None,
        faults: vec![
            Fault::SlowLink { node: 4, at_ms: 897, for_ms: 1_148, extra_ms: 231 },
            Fault::Crash { node: 3, at_ms: 1_044, restart_after_ms: Some(295) },
        ],
        controllers: 1,
    };
    for seed in 0..200 {
        let outcome = sim::run(seed, &scenario, &SimConfig::default(), 0);
        assert!(outcome.ok(), "{}", sim::run(seed, &scenario, &SimConfig::default(), 100).report());
    }
}

/// The default network is QUIC's. Without its guarantees — each control message delayed on its own, a
/// tenth delivered twice — many seeds break invariants, which shows what rests on them: a `View` that
/// overtakes a `Commit` makes the node refuse the commit as stale while the attempt waits for it, and a
/// `Prepare` that overtakes the `View` admitting its node gets a `Ready` stamped before the admission,
/// which the controller refuses (both hang the job); a fenced node adopts a view older than the one it
/// left. Not bugs: one connection delivers the controller's messages to a node in order.
#[test]
fn without_quics_guarantees_some_seeds_break_invariants() {
    let config = SimConfig { network: Network::DATAGRAMS, ..SimConfig::default() };
    let outcomes: Vec<Outcome> = (0..SEEDS).map(|seed| sim::run_seed(seed, &config, 0)).collect();
    let seeds_where = |f: &dyn Fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    let duplicated = seeds_where(&|o| o.stats.duplicates > 0);
    let overtaken = seeds_where(&|o| o.stats.overtaken > 0);
    let broken: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok()).collect();
    println!(
        "without QUIC's guarantees, of {SEEDS} seeds: a copy delivered in {duplicated}, a message overtaken in \
         {overtaken}, an invariant broken in {}",
        broken.len()
    );
    assert!(duplicated > SEEDS as usize * 9 / 10 && overtaken > SEEDS as usize * 8 / 10);
    let first = broken.first().expect("some seed breaks an invariant");
    let again = sim::run_seed(first.seed, &config, 100);
    assert_eq!((again.trace_hash, &again.violations), (first.trace_hash, &first.violations), "it replays");
    println!("{}", again.report());
}

// ---- bugs the simulation found in the node ----
//
// The simulation found these in node.rs when it still modelled the node by hand (fixed in 856e3b4 and
// ae88e14). Since it runs `NodeCore` itself, each fix was reverted in `NodeCore` in a scratch branch
// (2026-11-27) and the simulation broke the seeds below with the violation each test names, in the
// share of seeds it gives; with the fix they are clean. They stay as regression tests: a change that
// brings a bug back breaks its seeds (and, with any luck, the random property above).

/// Runs `seeds` of `scenario` and fails with the first broken one's report.
fn assert_clean(what: &str, scenario: &dyn Fn(u64) -> Scenario, config: &SimConfig, seeds: &[u64]) {
    for &seed in seeds {
        let outcome = sim::run(seed, &scenario(seed), config, 0);
        if !outcome.ok() {
            panic!("{what}, seed {seed}:\n{}", sim::run(seed, &scenario(seed), config, 200).report());
        }
    }
}

/// The controller's node paused six times just past the idle timeout while a job trains: each time the
/// members' connections time out with their last messages read but not yet handed over, and they dial
/// again at once.
fn controller_paused_past_the_idle_timeout() -> Scenario {
    let mut scenario = Scenario::calm(3, 60);
    scenario.faults = (0..6).map(|i| Fault::Pause { node: 0, at_ms: 300 + 2_600 * i, for_ms: 2_020 }).collect();
    scenario
}

/// `NodeCore::dialed` takes a connection for the controller's only if it is still up. A node hears that
/// its dial succeeded from the dialing task and that the connection was lost from the endpoint: two paths
/// into its actor, in either order. Taking a connection whose loss it had handled already, it held a dead
/// one for good — it dials only while it has none — and never came back. Reverted: 21 of 200 seeds of a
/// storm of resets leave a node "not back in the controller's view".
#[test]
fn a_node_takes_a_dialed_connection_only_while_it_is_up() {
    let what = "the dialed connection's loss came first";
    assert_clean(what, &|_| reset_storm(4), &SimConfig::default(), &[0, 15, 17, 26, 30]);
}

/// `NodeCore` refuses a job message stamped before the view that admitted its sender
/// (`Membership::admitted_at`). On an overloaded machine the reader of a member's replaced connection may
/// hand over a message it read long before: the first one makes the controller fence the node, which
/// rejoins — and the next, sent by the membership that was fenced, was taken for the new one's.
/// Reverted: 39 of 300 seeds of the paused controller on a loaded machine accept "an incarnation it never
/// admitted" (and seed 192 of the random schedules).
#[test]
fn a_job_message_of_an_earlier_membership_is_refused() {
    let what = "a message of an earlier membership";
    let loaded = SimConfig::loaded();
    assert_clean(what, &|_| controller_paused_past_the_idle_timeout(), &loaded, &[5, 24, 34, 36, 38]);
    assert_clean(what, &Scenario::random, &loaded, &[192]);
}

/// `NodeCore::connected`: a member that connects again lost its previous connection and whatever was in
/// flight on it, so it leaves the view and rejoins. A replacement is silent at the endpoint: without
/// this, messages vanished with no membership change (an attempt waited for a vote that never came) and
/// a restarted node adopted a view naming it before its `Join` got through, inheriting its old
/// incarnation's membership. Reverted: 35 of 3000 random seeds break ("did not end", "an incarnation it
/// never admitted").
#[test]
fn a_member_that_connects_again_leaves_the_view_and_rejoins() {
    let what = "a member's connection replaced";
    assert_clean(what, &Scenario::random, &SimConfig::default(), &[81, 145, 198, 223, 242]);
    assert_clean(what, &|_| reset_storm(60), &SimConfig::default(), &[1, 3, 12, 22, 23]);
}

/// `NodeCore` accepts job messages of current members whatever epoch they carry (the driver matches
/// them to attempts). Ignoring a member whose view lags threw away votes of an attempt that a view change
/// did not abort (its ranks did not change: a spare left), which then waited forever. Reverted: 10 of
/// 3000 random seeds "did not end".
#[test]
fn a_job_message_of_a_member_whose_view_lags_is_accepted() {
    let what = "a lagging member's vote";
    assert_clean(what, &Scenario::random, &SimConfig::default(), &[364, 457, 759, 832, 1227]);
}

/// A deeper search than the default property: `SIM_SEEDS=100000 cargo test --release -p troupe-chaos
/// --test simulation survey -- --ignored --nocapture` (`SIM_NETWORK=datagrams` for a network without
/// QUIC's guarantees, `SIM_LOADED=1` for a loaded machine's reader stalls, `SIM_FIRST=n` to start at
/// seed n).
#[test]
#[ignore]
fn survey() {
    let var = |name: &str, default: u64| std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let (first, seeds) = (var("SIM_FIRST", 0), var("SIM_SEEDS", 10_000));
    let config = config_from_env();
    let mut failing = Vec::new();
    let (mut late, mut overtaken, mut joins_across, mut duplicated) = (0, 0, 0, 0);
    for seed in first..first + seeds {
        let outcome = sim::run_seed(seed, &config, 0);
        if !outcome.ok() {
            failing.push(seed);
        }
        let s = &outcome.stats;
        late += u64::from(s.late_after_replacement > 0);
        overtaken += u64::from(s.overtaken > 0);
        joins_across += u64::from(s.join_repeats_across_connections > 0);
        duplicated += u64::from(s.duplicates > 0);
    }
    println!(
        "seeds {first}..{}: a replaced connection's message came late in {late}, a message overtook an earlier \
         one in {overtaken}, a resent Join came on another connection in {joins_across}, a copy was delivered \
         in {duplicated}",
        first + seeds
    );
    println!(
        "{} of {seeds} seeds break an invariant; the first: {:?}",
        failing.len(),
        &failing[..failing.len().min(20)]
    );
    if let Some(&seed) = failing.first() {
        panic!("{}", sim::run_seed(seed, &config, 200).report());
    }
}

fn config_from_env() -> SimConfig {
    let mut config = SimConfig::default();
    if std::env::var("SIM_PLANTED").is_ok() {
        config.planted = PlantedBug::CommitOnFirstVote;
    }
    if std::env::var("SIM_NETWORK").as_deref() == Ok("datagrams") {
        config.network = Network::DATAGRAMS;
    }
    if std::env::var("SIM_LOADED").is_ok() {
        config = SimConfig { network: config.network, planted: config.planted, ..SimConfig::loaded() };
    }
    config
}

/// `SIM_RSEED=n` replays one seed of the replicated controllers' random schedules with its whole trace.
#[test]
fn replay_one_replicated_seed() {
    let Some(seed) = std::env::var("SIM_RSEED").ok().and_then(|s| s.parse().ok()) else { return };
    let outcome = sim::run(seed, &Scenario::random_replicated(seed), &config_from_env(), 100_000);
    println!("{}", outcome.report());
}

/// Survey of the replicated controllers' random schedules (`SIM_SEEDS`, `SIM_FIRST` as in `survey`).
#[test]
#[ignore]
fn survey_replicated() {
    let var = |name: &str, default: u64| std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let (first, seeds) = (var("SIM_FIRST", 0), var("SIM_SEEDS", 1_000));
    let config = config_from_env();
    let failing: Vec<u64> =
        (first..first + seeds).filter(|&s| !sim::run(s, &Scenario::random_replicated(s), &config, 0).ok()).collect();
    println!(
        "{} of {seeds} seeds break an invariant; the first: {:?}",
        failing.len(),
        &failing[..failing.len().min(20)]
    );
    if let Some(&seed) = failing.first() {
        panic!("{}", sim::run(seed, &Scenario::random_replicated(seed), &config, 300).report());
    }
}

/// `SIM_SEED=n` replays one seed with its whole trace (`SIM_PLANTED`, `SIM_NETWORK`, `SIM_LOADED` as
/// above).
#[test]
fn replay_one_seed() {
    let Some(seed) = std::env::var("SIM_SEED").ok().and_then(|s| s.parse().ok()) else { return };
    let outcome = sim::run_seed(seed, &config_from_env(), 100_000);
    println!("{}", outcome.report());
}
