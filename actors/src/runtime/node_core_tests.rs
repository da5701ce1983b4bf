//! [`NodeCore`]'s role switch with replicated controllers (issue 32): an elected node restores the
//! replicated jobs as a restarted controller does, a deposed one announces nothing it decided, and
//! members find the controller through redirects and the list of controllers. And a member's dashboard:
//! its URL in the controller's status, its page's fragment asked of the controller.

use std::net::SocketAddr;
use std::time::Duration;

use troupe_cluster::control::PeerRole;
use troupe_cluster::membership::{MembershipConfig, NodeId};

use super::messages::WorkerMsg;
use super::node_core::{NodeAction, NodeCore, NodeSettings};
use crate::catalog::{StoredJob, StoredView};
use crate::node_config::restart::RestartPolicy;
use crate::protocol::{Reply, Request, ToController, Wire};

const T: Duration = Duration::from_secs(1);

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn node(name: &str, port: u16, join: Option<SocketAddr>) -> NodeCore {
    let settings = NodeSettings {
        id: NodeId(name.into()),
        addr: addr(port),
        join,
        slots: 1,
        allow_plaintext_tcp: false,
        membership: MembershipConfig::default(),
        restart: RestartPolicy::default(),
        controllers: vec!["a".into(), "b".into(), "c".into()],
        dashboard: Some(format!("http://{name}:9400/")),
    };
    NodeCore::new(settings, Duration::ZERO, 1, None, Vec::new())
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
            && v.recorded_by == Some(("b".into(), addr(2))))
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

#[test]
fn a_members_dashboard_url_reaches_the_controllers_status_and_its_page_is_fetched_from_the_controller() {
    let mut b = node("b", 2, None);
    b.become_controller(T, None, Vec::new());
    let url = |n: &str| Some(format!("http://{n}:9400/"));
    let join =
        ToController::Join { slots: 1, addr: addr(9), incarnation: Some(1), dashboard: url("w"), controllers: None };
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
