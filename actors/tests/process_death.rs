//! A daemon process's death is an event, not a silence: real `troupe daemon` processes, one SIGKILLed,
//! leave the controller's view within milliseconds (the control connection's companion TCP socket is
//! closed by the dead process's kernel: `ConnectionLost`), far below a failure timeout raised to 10 s;
//! a SIGSTOPped daemon keeps its sockets, so a pause below the detector's floor causes no false alarm.

mod common;

use std::time::{Duration, Instant};

use common::{binary, converged, names, signal, status, wait_for};
use troupe_actors::api::{LocalCluster, LocalClusterOptions};

const ALL: &[&str] = &["node-0", "node-1", "node-2"];
/// Silence alone would take this long to remove a member.
const FAILURE_TIMEOUT_MS: u64 = 10_000;
/// What the test asserts (generous on a loaded 2-core machine; the measured figure is printed).
const LOST_WITHIN: Duration = Duration::from_millis(1_000);

async fn cluster(failure_timeout_ms: u64) -> LocalCluster {
    let mut options = LocalClusterOptions::new(3);
    options.torch_threads = 1;
    options.membership.failure_timeout_ms = failure_timeout_ms;
    LocalCluster::processes(binary(), options).await.expect("local cluster starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_daemon_leaves_the_controllers_view_in_milliseconds() {
    let cluster = cluster(FAILURE_TIMEOUT_MS).await;
    let mut epoch = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(15)).await;
    // Both members in turn: each kill is one view change, seen at once, caused by the lost connection.
    for (victim, survivors) in [(2, &ALL[..2]), (1, &ALL[..1])] {
        signal(cluster.pid(victim).unwrap(), "KILL");
        let killed = Instant::now();
        let (next, _) = wait_for(Duration::from_secs(5), "the controller to drop the killed daemon", || async {
            let s = status(&cluster, 0).await;
            (names(&s) == survivors).then_some(s.epoch)
        })
        .await;
        let seen = killed.elapsed();
        eprintln!("the controller dropped node-{victim} {} ms after SIGKILL", seen.as_millis());
        assert!(seen < LOST_WITHIN, "node-{victim} dropped {seen:?} after SIGKILL (failure timeout 10 s)");
        assert_eq!(next, epoch + 1, "one view change per kill");
        epoch = next;
        let s = status(&cluster, 0).await;
        let name = format!("node-{victim}");
        let about: Vec<_> = s.changes.iter().filter(|c| c.contains(&name)).collect();
        assert!(about.iter().any(|c| c.contains("ConnectionLost")), "removed for its lost connection: {about:?}");
        assert!(!about.iter().any(|c| c.contains("Failed")), "not by silence: {about:?}");
    }
    cluster.shutdown().await;
}

/// A paused process keeps its sockets: its kernel closes nothing, so a pause below the failure detector's
/// floor (the default phi-accrual detector never declares a node dead sooner than `failure_timeout_min_ms`,
/// 1000 ms) and the transport's idle timeout leaves it in the view, at the same epoch. The pause is half the
/// floor: the status read after it must land before the floor on a loaded machine too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_daemon_keeps_its_place_in_the_view() {
    let defaults = troupe_cluster::membership::MembershipConfig::default();
    let cluster = cluster(defaults.failure_timeout_ms).await;
    let before = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(15)).await;
    let pid = cluster.pid(2).unwrap();
    signal(pid, "STOP");
    tokio::time::sleep(Duration::from_millis(defaults.failure_timeout_min_ms / 2)).await;
    let during = status(&cluster, 0).await;
    signal(pid, "CONT");
    assert_eq!(names(&during), ALL, "still a member while paused");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let after = converged(&cluster, &[0, 1, 2], ALL, Duration::from_secs(5)).await;
    assert_eq!(after, before, "no view change: {:?}", status(&cluster, 0).await.changes);
    let s = status(&cluster, 0).await;
    let lost: Vec<_> = s.changes.iter().filter(|c| c.contains("node-2") && !c.contains("Joined")).collect();
    assert!(lost.is_empty(), "no failure reported for the paused node: {lost:?}");
    cluster.shutdown().await;
}
