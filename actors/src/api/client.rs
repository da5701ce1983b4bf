//! Talking to a cluster as a client: requests and their replies, and a job's event stream.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use troupe_cluster::control::{ControlEndpoint, ControlEvent, PeerRole};
use troupe_cluster::{ClusterError, NodeIdentity, TransportConfig};

use super::Job;
use crate::error::{Error, Result};
use crate::protocol::{ClusterStatus, JobEvent, JobId, JobInfo, JobState, Reply, Request, Wire};

/// How long a request waits for its reply.
const REPLY_TIMEOUT_MS: u64 = 30_000;
/// Redirects followed before giving up (a node names the controller; the controller answers).
const REDIRECTS_MAX: usize = 3;
/// How long a job's watcher keeps trying to reach the controller again after losing its connection.
const RECONNECT_FOR: Duration = Duration::from_secs(60);
/// Pause between reconnection tries.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// A connection to one daemon of a cluster, authenticated with a certificate from the cluster CA.
pub struct Client {
    endpoint: ControlEndpoint,
    events: UnboundedReceiver<ControlEvent>,
    identity: NodeIdentity,
    peer: String,
    addr: SocketAddr,
    /// Job events that arrived while waiting for a reply.
    /// Events received and not yet yielded: (job, number, event).
    pending: VecDeque<(JobId, u64, JobEvent)>,
}

impl Client {
    /// Connects to the daemon at `addr` with `identity` (any certificate issued by the cluster CA, e.g.
    /// `troupe cluster add-node admin`). Nothing listening there, or a certificate the daemon refuses, is
    /// [`Error::Unreachable`].
    pub async fn connect(addr: SocketAddr, identity: &NodeIdentity) -> Result<Client> {
        let local: SocketAddr = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("valid");
        let config =
            TransportConfig { idle_timeout_ms: 10_000, keep_alive_interval_ms: 1_000, ..TransportConfig::default() };
        let (endpoint, events) = ControlEndpoint::bind(identity, local, PeerRole::Client, &config)
            .map_err(|e| unreachable(addr, format!("opening a client endpoint to reach {addr}"), Some(e)))?;
        let peer = endpoint.connect(addr).await.map_err(|e| {
            let what = format!("connecting to the troupe daemon at {addr} (is it running? is the address right?)");
            unreachable(addr, what, Some(e))
        })?;
        Ok(Client { endpoint, events, identity: identity.clone(), peer, addr, pending: VecDeque::new() })
    }

    /// The daemon this client talks to.
    pub fn peer(&self) -> (&str, SocketAddr) {
        (&self.peer, self.addr)
    }

    /// Sends `msg` and waits for the reply; the controller's refusals become the variant they mean
    /// ([`Error::from_controller`]).
    async fn request(&mut self, msg: Request) -> Result<Reply> {
        let addr = self.addr;
        let sent = self.endpoint.send(&self.peer, 0, Wire::Request(msg).encode()).await;
        sent.map_err(|e| unreachable(addr, format!("sending to {addr}"), Some(e)))?;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(REPLY_TIMEOUT_MS);
        loop {
            let event = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .map_err(|_| unreachable(addr, format!("no reply from {addr} within {REPLY_TIMEOUT_MS} ms"), None))?;
            match event {
                Some(ControlEvent::Message { body, .. }) => {
                    let undecodable = |e| Error::Protocol { addr, message: format!("an undecodable reply: {e}") };
                    match Wire::decode(&body).map_err(undecodable)? {
                        Wire::Reply(Reply::Event { job, seq, event }) => self.pending.push_back((job, seq, event)),
                        Wire::Reply(Reply::Error { message }) => return Err(Error::from_controller(addr, message)),
                        Wire::Reply(reply) => return Ok(reply),
                        other => return Err(self.unexpected(&other)),
                    }
                }
                Some(event) => {
                    if let Some(lost) = connection_lost(addr, event) {
                        return Err(lost);
                    }
                }
                None => return Err(unreachable(addr, "the client endpoint closed".into(), None)),
            }
        }
    }

    /// A reply this client did not ask for.
    fn unexpected(&self, reply: &dyn std::fmt::Debug) -> Error {
        let message = format!("unexpected reply {reply:?}; is it the same troupe version as this client?");
        Error::Protocol { addr: self.addr, message }
    }

    /// Sends `msg`; if the daemon is not the controller, reconnects to the controller and asks again.
    async fn request_controller(&mut self, msg: Request) -> Result<Reply> {
        for _ in 0..REDIRECTS_MAX {
            match self.request(msg.clone()).await? {
                Reply::Redirect { controller } => {
                    let next = Client::connect(controller, &self.identity).await?;
                    self.endpoint.close().await;
                    *self = next;
                }
                reply => return Ok(reply),
            }
        }
        let message = format!("too many redirects (more than {REDIRECTS_MAX}): the daemons disagree on the controller");
        Err(Error::Protocol { addr: self.addr, message })
    }

    /// The cluster as the daemon this client talks to sees it.
    pub async fn status(&mut self) -> Result<ClusterStatus> {
        match self.request(Request::StatusRequest).await? {
            Reply::Status(s) => Ok(*s),
            other => Err(self.unexpected(&other)),
        }
    }

    /// The controllers' Raft group as a controller-eligible daemon sees it (`troupe cluster
    /// controllers`); a daemon that is not eligible redirects to the controller.
    pub async fn controllers(&mut self) -> Result<crate::protocol::ControllersStatus> {
        match self.request_controller(Request::ControllersRequest).await? {
            Reply::Controllers(s) => Ok(*s),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Submits `job`; the handle streams its events from now on. A job config the controller cannot run
    /// is [`Error::Refused`], naming the config key.
    pub async fn submit(mut self, job: Job) -> Result<JobHandle> {
        let spec = Box::new(job.into_spec());
        match self.request_controller(Request::Submit { spec }).await? {
            Reply::Submitted { job } => Ok(JobHandle { id: job, client: self, done: false, next: 0 }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// The job's state as the controller has it; [`Error::NoSuchJob`] when it has no such job.
    pub async fn job_status(&mut self, job: JobId) -> Result<JobInfo> {
        match self.request_controller(Request::JobStatusRequest { job }).await? {
            Reply::JobStatus(info) => Ok(*info),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Asks the controller to cancel `job`; its state when the controller got the request (a `Cancelled`
    /// event follows). [`Error::NoSuchJob`] when it has no such job.
    pub async fn cancel(&mut self, job: JobId) -> Result<JobInfo> {
        match self.request_controller(Request::Cancel { job }).await? {
            Reply::JobStatus(info) => Ok(*info),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Follows a job submitted elsewhere (events from now on).
    pub async fn watch(mut self, job: JobId) -> Result<JobHandle> {
        let info = self.watch_since(job, None).await?;
        Ok(JobHandle { id: job, client: self, done: info.state.is_terminal(), next: info.events })
    }

    /// Follows a job submitted elsewhere from its event number `since` on (those already streamed
    /// first): a watcher that lost its controller for good picks up where it was at another daemon,
    /// which redirects it to the new one.
    pub async fn watch_from(mut self, job: JobId, since: u64) -> Result<JobHandle> {
        let info = self.watch_since(job, Some(since)).await?;
        let done = info.state.is_terminal() && since >= info.events;
        Ok(JobHandle { id: job, client: self, done, next: since })
    }

    /// Asks for the events of `job` numbered `since` and later (None: from now on); those already
    /// streamed arrive before the reply.
    async fn watch_since(&mut self, job: JobId, since: Option<u64>) -> Result<JobInfo> {
        match self.request_controller(Request::Watch { job, since }).await? {
            Reply::JobStatus(info) => Ok(*info),
            other => Err(self.unexpected(&other)),
        }
    }

    pub async fn close(self) {
        self.endpoint.close().await;
    }
}

/// The daemon at `addr` could not be reached: `what` the client was doing, naming the address.
fn unreachable(addr: SocketAddr, what: String, source: Option<ClusterError>) -> Error {
    Error::Unreachable { addr, reason: what, source }
}

/// The error a lost or closed connection to `addr` is; None for events that are not a loss.
fn connection_lost(addr: SocketAddr, event: ControlEvent) -> Option<Error> {
    match event {
        ControlEvent::Lost { reason, .. } => {
            Some(unreachable(addr, format!("lost the connection to {addr}: {reason}"), None))
        }
        ControlEvent::Departed { .. } => Some(unreachable(addr, format!("{addr} closed the connection"), None)),
        _ => None,
    }
}

/// The events the new connection brought before the controller answered a reconnection's `Watch`, in
/// the order to yield them: `job`'s from `next` on, each once, by number — a live event the controller
/// sent to the new connection before it handled the `Watch` arrives ahead of the replay that repeats it
/// — with other jobs' events after them as they came.
fn replayed_in_order(
    received: VecDeque<(JobId, u64, JobEvent)>,
    job: JobId,
    next: u64,
) -> impl Iterator<Item = (JobId, u64, JobEvent)> {
    let (mut mine, others): (Vec<_>, Vec<_>) = received.into_iter().partition(|(j, _, _)| *j == job);
    mine.retain(|(_, seq, _)| *seq >= next);
    mine.sort_by_key(|(_, seq, _)| *seq); // stable
    mine.dedup_by_key(|(_, seq, _)| *seq);
    mine.into_iter().chain(others)
}

/// A submitted job: its events, and cancellation. A lost connection to the controller is re-made
/// (for up to a minute) and the events missed meanwhile are replayed, so the stream has no gap.
pub struct JobHandle {
    id: JobId,
    client: Client,
    done: bool,
    /// The number of the next event of the job this handle yields (events are numbered from 0).
    next: u64,
}

impl JobHandle {
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The next event; `Ok(None)` after the terminal one (finished, failed, cancelled). A failed or
    /// cancelled job's end comes as an event here (`JobEvent::Failed`, `JobEvent::Cancelled`), not as an
    /// error: errors are about the stream — [`Error::Unreachable`] when the controller stayed out of
    /// reach for longer than the reconnection tries.
    pub async fn next_event(&mut self) -> Result<Option<JobEvent>> {
        if self.done {
            return Ok(None);
        }
        let id = self.id;
        let (seq, event) = loop {
            if let Some(pos) = self.client.pending.iter().position(|(job, _, _)| *job == id) {
                let (_, seq, event) = self.client.pending.remove(pos).expect("found");
                if seq < self.next {
                    continue; // yielded already (a replay after a reconnection repeats it)
                }
                break (seq, event);
            }
            match self.client.events.recv().await {
                Some(ControlEvent::Message { body, .. }) => {
                    if let Ok(Wire::Reply(Reply::Event { job, seq, event })) = Wire::decode(&body) {
                        self.client.pending.push_back((job, seq, event));
                    }
                }
                Some(ControlEvent::Lost { reason, .. }) => self.reconnect(&reason).await?,
                Some(ControlEvent::Departed { .. }) => self.reconnect("the controller closed the connection").await?,
                Some(ControlEvent::Connected { .. }) => {}
                None => return Err(unreachable(self.client.addr, "the client endpoint closed".into(), None)),
            }
        };
        self.done = event.is_terminal();
        self.next = seq + 1;
        Ok(Some(event))
    }

    /// Connects to the controller again and asks for the events from `self.next` on: the events of this
    /// job not yet yielded are dropped here and come again, in order, from the controller's log.
    async fn reconnect(&mut self, reason: &str) -> Result<()> {
        let (id, addr) = (self.id, self.client.addr);
        tracing::warn!(job = id, controller = %addr, %reason, "lost the connection to the controller; reconnecting");
        let started = tokio::time::Instant::now();
        let deadline = started + RECONNECT_FOR;
        loop {
            let tried = async {
                let mut client = Client::connect(addr, &self.client.identity).await?;
                client.watch_since(id, Some(self.next)).await?;
                Ok::<_, Error>(client)
            };
            let last = match tried.await {
                Ok(mut client) => {
                    let others = self.client.pending.iter().filter(|(job, _, _)| *job != id).cloned();
                    let mut pending: VecDeque<_> = others.collect();
                    pending.extend(replayed_in_order(std::mem::take(&mut client.pending), id, self.next));
                    client.pending = pending;
                    let old = std::mem::replace(&mut self.client, client);
                    old.endpoint.close().await;
                    let ms = started.elapsed().as_millis();
                    tracing::warn!(job = id, controller = %addr, "reconnected to the controller after {ms} ms; the events missed meanwhile follow");
                    return Ok(());
                }
                Err(e) => e,
            };
            if tokio::time::Instant::now() + RECONNECT_PAUSE > deadline {
                let why = format!(
                    "lost the connection to the controller {addr}: {reason}; reconnecting for {} s failed: {}",
                    RECONNECT_FOR.as_secs(),
                    with_causes(&last)
                );
                return Err(unreachable(addr, why, None));
            }
            tokio::time::sleep(RECONNECT_PAUSE).await;
        }
    }

    /// Asks the controller to cancel the job; a `Cancelled` event follows.
    pub async fn cancel(&mut self) -> Result<()> {
        self.client.cancel(self.id).await.map(|_| ())
    }

    /// The job's state as the controller has it.
    pub async fn status(&mut self) -> Result<JobInfo> {
        self.client.job_status(self.id).await
    }

    /// Consumes the job's events until it ends. A job that finished gives its `JobEvent::Finished` and
    /// the events before it, in order (steps, checkpoints, membership changes, …). A job that did not
    /// finish is an error a program can match, and `?` passes on: [`Error::JobFailed`] with the
    /// controller's reason, or [`Error::Cancelled`] — its events are dropped; read them with
    /// [`JobHandle::next_event`], which yields `Failed` and `Cancelled` as events. A job already over
    /// when watched ends the same way, from its status.
    pub async fn wait(mut self) -> Result<(JobEvent, Vec<JobEvent>)> {
        let mut seen = Vec::new();
        let end = loop {
            match self.next_event().await {
                Ok(Some(event)) if event.is_terminal() => break Ok(event),
                Ok(Some(event)) => seen.push(event),
                Ok(None) => break self.client.job_status(self.id).await.map(|info| ended(&info)),
                Err(e) => break Err(e),
            }
        };
        self.client.close().await;
        match end? {
            JobEvent::Failed { reason } => Err(Error::JobFailed { job: self.id, reason }),
            JobEvent::Cancelled => Err(Error::Cancelled { job: self.id }),
            finished => Ok((finished, seen)),
        }
    }

    pub async fn close(self) {
        self.client.close().await;
    }
}

/// The terminal event of a job that ended, from its status.
fn ended(info: &JobInfo) -> JobEvent {
    match info.state {
        JobState::Failed => {
            JobEvent::Failed { reason: info.reason.clone().unwrap_or_else(|| "(no reason kept)".into()) }
        }
        JobState::Cancelled => JobEvent::Cancelled,
        // A handle is over only once its job's state is terminal.
        JobState::Finished | JobState::Waiting | JobState::Running => {
            JobEvent::Finished { steps: info.step, final_loss: info.last_loss }
        }
    }
}

/// `error` and its causes on one line, as anyhow's `{:#}` prints them.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(step: u64) -> JobEvent {
        JobEvent::Checkpoint { step, path: format!("step-{step}").into(), seconds: 0.0, bytes: 0 }
    }

    #[test]
    fn a_live_event_ahead_of_the_replay_is_yielded_once_in_order() {
        // The controller, back from a pause, sent event 32 on the new connection before it handled the
        // `Watch { since: 12 }` that replays 12..=32; event 5 of another job came too.
        let mut received: VecDeque<_> = VecDeque::from([(1, 32, event(32)), (2, 5, event(5))]);
        received.extend((12..=32).map(|s| (1, s, event(s))));
        let order: Vec<(JobId, u64)> = replayed_in_order(received, 1, 12).map(|(j, s, _)| (j, s)).collect();
        let mut want: Vec<(JobId, u64)> = (12..=32).map(|s| (1, s)).collect();
        want.push((2, 5));
        assert_eq!(order, want);
        // What the handle yielded already is not yielded again.
        let received = VecDeque::from([(1, 10, event(10)), (1, 11, event(11)), (1, 12, event(12))]);
        let seqs: Vec<u64> = replayed_in_order(received, 1, 12).map(|(_, s, _)| s).collect();
        assert_eq!(seqs, vec![12]);
    }
}
