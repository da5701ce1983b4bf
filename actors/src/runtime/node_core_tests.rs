//! [`NodeCore`]'s role switch with replicated controllers (issue 32): an elected node restores the
//! replicated jobs as a restarted controller does, a deposed one announces nothing it decided, and
//! members find the controller through redirects and the list of controllers. And a member's dashboard:
//! its URL in the controller's status, its page's fragment asked of the controller.

use std::net::SocketAddr;
use std::time::Duration;

use troupe_cluster::control::PeerRole;
use troupe_cluster::membership::{MembershipConfig, NodeId};

use super::job::RESUME_GRACE;
use super::messages::WorkerMsg;
use super::node_core::{NodeAction, NodeCore, NodeNote, NodeSettings};
use crate::catalog::{StoredJob, StoredView};
use crate::node_config::restart::RestartPolicy;
use crate::protocol::{ControllersChange, Reply, Request, SlotDevice, ToController, Wire};

const T: Duration = Duration::from_secs(1);

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn node(name: &str, port: u16, join: Option<SocketAddr>) -> NodeCore {
    NodeCore::new(settings(name, port, join), Duration::ZERO, 1, None, Vec::new())
}

fn settings(name: &str, port: u16, join: Option<SocketAddr>) -> NodeSettings {
    NodeSettings {
        id: NodeId(name.into()),
        addr: addr(port),
        join,
        slots: 1,
        allow_plaintext_tcp: false,
        membership: MembershipConfig::default(),
        restart: RestartPolicy::default(),
        controllers: vec!["a".into(), "b".into(), "c".into()],
        dashboard: Some(format!("http://{name}:9400/")),
        raft_listen: None,
        devices: vec![SlotDevice::Cpu],
    }
}

fn running_job(id: u64, step: u64) -> StoredJob {
    let spec = super::job::tests::spec(10);
    let mut info = super::job::JobDriver::new(id, spec.clone()).info();
    info.state = crate::protocol::JobState::Running;
    info.step = step;
    StoredJob { spec, info, first_event: 0, events: Vec::new() }
}

fn actions(core: &mut NodeCore) -> Vec<NodeAction> {
    std::iter::from_fn(|| core.poll_action()).collect()
}

fn dials(actions: &[NodeAction]) -> Vec<SocketAddr> {
    actions.iter().filter_map(|a| if let NodeAction::Dial { addr } = a { Some(*addr) } else { None }).collect()
}

/// The catalog as the old leader "a" left it: epoch 5 with a, b and c; one job at step 7.
fn elected_b() -> NodeCore {
    let mut b = node("b", 2, None);
    assert!(!b.is_controller() && b.eligible(), "a listed node waits for its Raft group");
    assert!(actions(&mut b).is_empty(), "records nothing before it is elected");
    let view = StoredView {
        epoch: 5,
        members: vec!["a".into(), "b".into(), "c".into()],
        recorded_by: Some(("a".into(), addr(1))),
        expecting: Vec::new(),
    };
    b.become_controller(T, Some(view), vec![running_job(3, 7)]);
    b
}

#[test]
fn an_elected_node_restores_the_jobs_past_the_last_epoch_without_waiting_for_the_old_leader() {
    let mut b = elected_b();
    assert!(b.is_controller());
    assert_eq!(b.epoch(), 6, "one past the last recorded view");
    let actions = actions(&mut b);
    let kept = actions
        .iter()
        .position(|a| matches!(a, NodeAction::Worker { msg: WorkerMsg::AbortAll { keep }, .. } if *keep == vec![3]));
    let recorded = actions.iter().position(|a| {
        matches!(a, NodeAction::RecordView(v) if v.epoch == 6 && v.members == ["b"]
            && v.recorded_by == Some(("b".into(), addr(2))) && v.expecting == ["c"])
    });
    let started = actions.iter().position(|a| {
        matches!(a, NodeAction::StartJob { id: 3, restored: Some((info, _, expect)), .. }
            if info.step == 7 && *expect == vec![NodeId("b".into()), NodeId("c".into())])
    });
    let (kept, recorded, started) = (kept.expect("aborts"), recorded.expect("records"), started.expect("restores"));
    assert!(kept < recorded && recorded < started, "its own attempts end, the view is recorded, then the job resumes");
}

#[test]
fn a_deposed_controller_announces_nothing_it_decided_and_follows_the_new_leader() {
    let mut b = elected_b();
    b.step_down(T, "Raft term 4: c leads");
    assert!(!b.is_controller());
    let after = actions(&mut b);
    let leaked = after.iter().any(|a| {
        matches!(
            a,
            NodeAction::RecordView(_) | NodeAction::Send { .. } | NodeAction::StartJob { .. } | NodeAction::Job { .. }
        )
    });
    assert!(!leaked, "nothing decided as the controller goes out once it lost the leadership");
    assert!(after.iter().any(|a| matches!(a, NodeAction::StopJobs)));
    assert!(after
        .iter()
        .any(|a| matches!(a, NodeAction::Worker { msg: WorkerMsg::AbortAll { keep }, .. } if *keep == vec![3])));
    b.tick(T);
    assert!(dials(&actions(&mut b)).is_empty(), "no controller known: nothing to dial");
    b.follow("c", addr(3));
    b.tick(T);
    assert_eq!(dials(&actions(&mut b)), vec![addr(3)]);
}

#[test]
fn a_member_follows_a_redirect_and_tries_the_next_controller_when_one_knows_none() {
    let mut w = node("w", 9, Some(addr(1)));
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(1)]);
    w.dialed(T, addr(1), Ok("a".into()), true);
    let redirect = Wire::Reply(Reply::Redirect { controller: addr(3) });
    w.message(T, "a", PeerRole::Node, 0, redirect);
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(3)], "followed the redirect");
    w.dialed(T, addr(3), Ok("c".into()), true);
    let none = Wire::Reply(Reply::Error { message: "knows of none".into() });
    w.message(T, "c", PeerRole::Node, 0, none);
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(1)], "back to `join`, the only controller it knows the address of");
}

/// A listed controller that does not answer (gone for good) is given up after a second for the next
/// one the member knows, not after the connect timeout (found by the simulation of issue 32).
#[test]
fn a_member_whose_dial_goes_unanswered_tries_the_next_controller_after_a_second() {
    let mut w = node("w", 9, Some(addr(1)));
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(1)]);
    w.dialed(T, addr(1), Ok("a".into()), true);
    w.message(T, "a", PeerRole::Node, 0, Wire::Reply(Reply::Redirect { controller: addr(3) }));
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(3)], "followed the redirect");
    w.tick(T + Duration::from_millis(900));
    assert!(dials(&actions(&mut w)).is_empty(), "the handshake has a second");
    w.tick(T + Duration::from_millis(1_000));
    assert_eq!(dials(&actions(&mut w)), vec![addr(1)], "c does not answer: the next controller it knows");
    w.dialed(T + Duration::from_secs(10), addr(3), Err("timed out".into()), false);
    assert!(actions(&mut w).is_empty() && !w.has_controller_peer(), "the abandoned dial's end changes nothing");
}

fn cancels(actions: &[NodeAction]) -> Vec<SocketAddr> {
    actions.iter().filter_map(|a| if let NodeAction::CancelDial { addr } = a { Some(*addr) } else { None }).collect()
}

/// A dial the node turned away from is given up before the next one starts: left running, a dial to a
/// daemon that is down lands when it comes back, and its connection replaces the live one between the
/// two (rolling-restart-three-controllers: a member's connection to the node elected meanwhile, which
/// then saw that member lost). Elected while dialing, the node gives its dial up too.
#[test]
fn a_dial_the_node_turned_from_is_given_up() {
    let mut a = node("a", 1, None);
    a.follow("b", addr(2));
    a.tick(T);
    let first = actions(&mut a);
    assert_eq!((dials(&first), cancels(&first)), (vec![addr(2)], vec![]));
    a.tick(T + T);
    assert!(actions(&mut a).is_empty(), "the dial in flight is left to run");
    a.follow("c", addr(3));
    a.tick(T + T);
    let turned = actions(&mut a);
    assert!(
        matches!(turned[..], [NodeAction::CancelDial { addr: b }, NodeAction::Dial { addr: c }] if b == addr(2) && c == addr(3))
    );
    a.dialed(T + T, addr(2), Ok("b".into()), true);
    assert!(actions(&mut a).is_empty() && !a.has_controller_peer(), "a given-up dial's end changes nothing");

    a.become_controller(T + T, None, Vec::new());
    assert_eq!(cancels(&actions(&mut a)), vec![addr(3)], "elected while dialing c");
    a.dialed(T + T, addr(3), Ok("c".into()), true);
    assert!(!a.has_controller_peer());
}

/// `troupe cluster controllers add NODE` with no address takes the Raft address NODE's `Join`
/// announced (its node.toml `raft_listen`); an address given wins; a joiner's own setting is announced.
#[test]
fn adding_a_controller_by_name_takes_the_raft_address_its_join_announced() {
    let mut d = NodeCore::new(
        NodeSettings { raft_listen: Some(addr(7401)), ..settings("d", 4, Some(addr(2))) },
        Duration::ZERO,
        1,
        None,
        Vec::new(),
    );
    d.tick(T);
    d.dialed(T, addr(2), Ok("b".into()), true);
    d.tick(T + Duration::from_millis(250)); // the heartbeat interval: its `Join`
    let sent = actions(&mut d).into_iter().find_map(|a| match a {
        NodeAction::Send { msg: Wire::ToController(join @ ToController::Join { .. }), .. } => Some(join),
        _ => None,
    });
    let Some(join) = sent else { panic!("d sent no join") };
    assert!(matches!(join, ToController::Join { raft_listen: Some(a), .. } if a == addr(7401)), "{join:?}");

    let mut b = node("b", 2, None);
    b.become_controller(T, None, Vec::new());
    b.message(T, "d", PeerRole::Node, 0, Wire::ToController(join));
    b.step_boundary(T);
    actions(&mut b);
    let asked = |b: &mut NodeCore, node: &str, raft_addr| {
        let change = ControllersChange::Add { node: node.into(), raft_addr };
        b.message(T, "admin#1", PeerRole::Client, b.epoch(), Wire::Request(Request::ChangeControllers { change }));
        actions(b).into_iter().find_map(|a| match a {
            NodeAction::AnswerControllers { change: Some(ControllersChange::Add { raft_addr, .. }), .. } => {
                Some(raft_addr)
            }
            _ => None,
        })
    };
    assert_eq!(asked(&mut b, "d", None), Some(Some(addr(7401))), "the announced address");
    assert_eq!(asked(&mut b, "d", Some(addr(7500))), Some(Some(addr(7500))), "the given address wins");
    assert_eq!(asked(&mut b, "x", None), Some(None), "not a member: the group refuses it, naming the fix");
}

#[test]
fn a_members_dashboard_url_reaches_the_controllers_status_and_its_page_is_fetched_from_the_controller() {
    let mut b = node("b", 2, None);
    b.become_controller(T, None, Vec::new());
    let url = |n: &str| Some(format!("http://{n}:9400/"));
    let (dashboard, controllers, raft_listen) = (url("w"), None, None);
    let join = ToController::Join {
        slots: 1,
        addr: addr(9),
        incarnation: Some(1),
        dashboard,
        controllers,
        raft_listen,
        devices: Vec::new(),
    };
    b.message(T, "w", PeerRole::Node, 0, Wire::ToController(join));
    b.step_boundary(T);
    let members: Vec<_> = b.status().members.into_iter().map(|m| (m.name, m.dashboard)).collect();
    assert_eq!(members, [("b".to_owned(), url("b")), ("w".to_owned(), url("w"))]);
    actions(&mut b);
    b.message(T, "w", PeerRole::Node, b.epoch(), Wire::Request(Request::DashboardRequest));
    let answers = actions(&mut b);
    assert!(answers.iter().any(|a| matches!(a, NodeAction::AnswerDashboard { client } if client == "w")));

    let mut w = node("w", 9, Some(addr(2)));
    assert!(!w.ask_controller_dashboard(), "not connected to a controller yet");
    w.tick(T);
    w.dialed(T, addr(2), Ok("b".into()), true);
    actions(&mut w);
    assert!(w.ask_controller_dashboard());
    let asked = actions(&mut w).into_iter().any(
        |a| matches!(a, NodeAction::Send { peer, msg: Wire::Request(Request::DashboardRequest), .. } if peer == "b"),
    );
    assert!(asked, "the request goes to the controller over the node's own connection");
    let page = |fragment: &str| Wire::Reply(Reply::Dashboard { fragment: fragment.into() });
    w.message(T, "c", PeerRole::Node, 0, page("not from the controller"));
    w.message(T, "b", PeerRole::Node, 0, page("<section>cluster</section>"));
    let got: Vec<String> = actions(&mut w)
        .into_iter()
        .filter_map(|a| if let NodeAction::ControllerDashboard { fragment } = a { Some(fragment) } else { None })
        .collect();
    assert_eq!(got, ["<section>cluster</section>"]);
    assert!(w.ask_controller_dashboard(), "the answer is no refusal: still connected to b");
}

/// A member whose `join` names a controller that is gone for good before any view admitted it still
/// finds the cluster: with its `Join` it asked that controller's status, and tries the daemons named
/// there — any of them redirects it to the leader. Before, it knew no address but its `join`'s and
/// dialed it forever (found by the simulation: loaded replicated seed 242).
#[test]
fn a_member_never_admitted_tries_the_daemons_its_join_named_once_that_one_is_gone() {
    let mut a = node("a", 1, None);
    a.become_controller(T, None, Vec::new());
    join(&mut a, "b", 2);
    join(&mut a, "c", 3);
    a.step_boundary(T);
    assert_eq!(a.status().members.len(), 3);
    actions(&mut a);

    let mut w = node("w", 9, Some(addr(1)));
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(1)]);
    w.dialed(T, addr(1), Ok("a".into()), true);
    let to_a = |actions: Vec<NodeAction>| -> Vec<Wire> {
        actions
            .into_iter()
            .filter_map(|x| match x {
                NodeAction::Send { peer, msg, .. } if peer == "a" => Some(msg),
                _ => None,
            })
            .collect()
    };
    actions(&mut w);
    w.tick(T + Duration::from_millis(250)); // the heartbeat interval: the first `Join`
    let sent = to_a(actions(&mut w));
    assert!(matches!(sent[..], [Wire::ToController(ToController::Join { .. }), Wire::Request(Request::StatusRequest)]));
    // The next `Join`s (each heartbeat interval) do not ask again until 5 s passed.
    let join_only = |sent: &[Wire]| matches!(sent, [Wire::ToController(ToController::Join { .. })]);
    for ms in [500, 750, 5_000] {
        w.tick(T + Duration::from_millis(ms));
        let sent = to_a(actions(&mut w));
        assert!(join_only(&sent), "{ms} ms: {sent:?}");
    }
    w.tick(T + Duration::from_millis(5_250));
    let sent = to_a(actions(&mut w));
    assert!(matches!(sent[..], [Wire::ToController(ToController::Join { .. }), Wire::Request(Request::StatusRequest)]));
    a.message(T, "w", PeerRole::Node, 0, Wire::Request(Request::StatusRequest));
    let answer = actions(&mut a).into_iter().find_map(|x| match x {
        NodeAction::Send { peer, msg: msg @ Wire::Reply(Reply::Status(_)), .. } if peer == "w" => Some(msg),
        _ => None,
    });
    w.message(T, "a", PeerRole::Node, 0, answer.expect("a answers with its status"));
    let heard = actions(&mut w).into_iter().find_map(|x| match x {
        NodeAction::Note(NodeNote::HeardOfDaemons { daemons }) => Some(daemons),
        _ => None,
    });
    let names: Vec<String> = heard.expect("noted for the data dir").into_iter().map(|m| m.name).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert!(w.has_controller_peer(), "a status is no refusal");

    // a is gone before it admitted w: w tries b, then c, instead of dialing a forever.
    w.lost(T, "a");
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(2)]);
    w.dialed(T, addr(2), Err("unreachable".into()), false);
    w.tick(T);
    assert_eq!(dials(&actions(&mut w)), vec![addr(3)]);
}

fn recorded_views(actions: &[NodeAction]) -> Vec<StoredView> {
    actions.iter().filter_map(|a| if let NodeAction::RecordView(v) = a { Some(v.clone()) } else { None }).collect()
}

fn restored_expect(actions: &[NodeAction]) -> Vec<String> {
    let expect = actions.iter().find_map(|a| match a {
        NodeAction::StartJob { restored: Some((_, _, expect)), .. } => Some(expect.clone()),
        _ => None,
    });
    expect.expect("a job restored").into_iter().map(|n| n.0).collect()
}

fn join(core: &mut NodeCore, name: &str, port: u16) {
    let (dashboard, controllers, raft_listen) = (None, None, None);
    let msg = ToController::Join {
        slots: 1,
        addr: addr(port),
        incarnation: Some(1),
        dashboard,
        controllers,
        raft_listen,
        devices: Vec::new(),
    };
    core.message(T, name, PeerRole::Node, 0, Wire::ToController(msg));
}

/// A controller that took over (or restarted) and lost the leadership before the nodes of the last
/// view rejoined recorded a view of itself alone: the next one still waits for those nodes — they may
/// hold the job's state in memory (its buddy copies, DDP replicas) — instead of resuming without them
/// and falling back to a checkpoint or failing (found by `rolling-restart-three-controllers`, seed 44).
#[test]
fn a_controller_deposed_before_the_members_rejoined_hands_them_over_to_the_next() {
    // "a" led with a, b, c and the worker w; it restarted and took the leadership back: it records
    // itself alone, expecting b, c and w.
    let mut a = node("a", 1, None);
    let last = StoredView {
        epoch: 5,
        members: ["a", "b", "c", "w"].map(String::from).to_vec(),
        recorded_by: Some(("a".into(), addr(1))),
        expecting: Vec::new(),
    };
    a.become_controller(T, Some(last), vec![running_job(3, 7)]);
    let first = actions(&mut a);
    assert_eq!(restored_expect(&first), ["a", "b", "c", "w"], "a restarted controller waits for all");
    let recorded = recorded_views(&first);
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        (recorded[0].members.clone(), recorded[0].expecting.clone()),
        (vec!["a".into()], ["b", "c", "w"].map(String::from).to_vec())
    );
    // c rejoins before "a" is deposed: the view it records names c, and still expects b and w.
    join(&mut a, "c", 3);
    a.step_boundary(T);
    let second = recorded_views(&actions(&mut a));
    let second = second.last().expect("c's admission recorded");
    assert_eq!(second.members, ["a", "c"]);
    assert_eq!(second.expecting, ["b", "w"]);
    // "a" is deposed; b is elected from that view: it does not wait for a (it lost its majority), it
    // waits for c and for the nodes a still expected.
    let mut b = node("b", 2, None);
    b.become_controller(T, Some(second.clone()), vec![running_job(3, 7)]);
    let taken = actions(&mut b);
    assert_eq!(restored_expect(&taken), ["c", "b", "w"]);
    assert_eq!(recorded_views(&taken)[0].expecting, ["c", "w"], "and hands them over in turn");
    // Once the grace is over the job resumed without whoever did not come back: nobody waits for them.
    b.tick(T + RESUME_GRACE);
    actions(&mut b);
    join(&mut b, "x", 7);
    b.step_boundary(T + RESUME_GRACE);
    let after = recorded_views(&actions(&mut b));
    assert_eq!(
        after.last().map(|v| (v.members.clone(), v.expecting.clone())),
        Some((vec!["b".into(), "x".into()], vec![]))
    );
}

fn takeovers(actions: &[NodeAction]) -> Vec<u64> {
    actions.iter().filter_map(|a| if let NodeAction::TakeOver { term } = a { Some(*term) } else { None }).collect()
}

/// The Raft group's leadership, decided in the core for node.rs and the simulation alike: named, the
/// node takes over once; named in an older term than one already seen, a leader is not followed; a
/// leader whose address is not known yet is looked up each tick, the newest term's first.
#[test]
fn the_leader_of_the_newest_term_is_followed_and_an_election_won_is_taken_once() {
    let mut a = node("a", 1, None);
    a.on_leadership(T, 3, Some("a"), || None);
    a.leadership_tick(3, Some("a"), || None);
    assert_eq!(takeovers(&actions(&mut a)), vec![3], "one read of the replicated catalog, however many ticks");
    a.become_controller(T, None, Vec::new());
    actions(&mut a);
    // Deposed: term 5 names b, whose address nobody recorded yet.
    a.on_leadership(T, 5, Some("b"), || None);
    assert!(!a.is_controller());
    a.tick(T);
    assert!(dials(&actions(&mut a)).is_empty(), "b's address is not known yet");
    // A report of term 4 that waited in the mailbox: stale, not followed.
    let c_recorded = StoredView { epoch: 9, recorded_by: Some(("c".into(), addr(3))), ..Default::default() };
    a.on_leadership(T, 4, Some("c"), || Some(c_recorded.clone()));
    a.tick(T);
    assert!(dials(&actions(&mut a)).is_empty(), "term 4's leader is not followed after term 5's");
    // The watch moved on to term 6, led by c, which recorded the last view: c is followed, not b.
    a.leadership_tick(6, Some("c"), || Some(c_recorded.clone()));
    a.tick(T);
    assert_eq!(dials(&actions(&mut a)), vec![addr(3)]);
}
