//! A stand-in for the WorkerActor in tests of the actors it supervises (stage actors, shard owners): it
//! records its children's supervision events and never stops because of them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

pub struct Supervisor;

#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    Started,
    Terminated,
    Failed,
}

pub type Events = Arc<Mutex<Vec<Seen>>>;

impl Actor for Supervisor {
    type Msg = ();
    type State = Events;
    type Arguments = Events;

    async fn pre_start(&self, _: ActorRef<()>, seen: Self::Arguments) -> Result<Self::State, ActorProcessingErr> {
        Ok(seen)
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<()>,
        event: SupervisionEvent,
        seen: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let what = match event {
            SupervisionEvent::ActorStarted(_) => Seen::Started,
            SupervisionEvent::ActorTerminated(..) => Seen::Terminated,
            SupervisionEvent::ActorFailed(..) => Seen::Failed,
            _ => return Ok(()),
        };
        seen.lock().unwrap().push(what);
        Ok(())
    }
}

/// A recording supervisor, spawned (one torch thread for the test's compute).
pub async fn spawn() -> (ActorRef<()>, Events) {
    tch::set_num_threads(1);
    let seen = Events::default();
    let (supervisor, _) = Actor::spawn(None, Supervisor, seen.clone()).await.unwrap();
    (supervisor, seen)
}

/// Waits (up to 5 s) until `seen` satisfies `done`.
pub async fn eventually(seen: &Events, done: impl Fn(&[Seen]) -> bool) {
    for _ in 0..500 {
        if done(&seen.lock().unwrap()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("supervision events never got there: {:?}", seen.lock().unwrap());
}

pub fn count(seen: &[Seen], what: Seen) -> usize {
    seen.iter().filter(|s| **s == what).count()
}
