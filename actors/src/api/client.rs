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
/// Redirects followed in a row before the client waits and looks again (the daemons disagree on the
/// controller while an election settles).
const REDIRECTS_MAX: usize = 3;
/// How long a request for the controller keeps looking for it: an election under way, a redirect to a
/// controller that just died, a daemon that is gone.
const FIND_CONTROLLER_FOR: Duration = Duration::from_secs(30);
/// How long dialing one of several addresses may take before the next is tried (a dead daemon's
/// address answers nothing; a live one's handshake takes milliseconds on a LAN).
const CANDIDATE_CONNECT_MS: u64 = 2_000;
/// How long a job's watcher keeps trying to reach the controller again after losing its connection.
const RECONNECT_FOR: Duration = Duration::from_secs(60);
/// Pause between reconnection tries.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);

/// A connection to one daemon of a cluster, authenticated with a certificate from the cluster CA. It
/// keeps every daemon address it learns of (those it was given, the controllers it was redirected to,
/// the members a status named): a request for the controller that finds it gone looks for the new one
/// among them, and a job's watcher reconnects through them.
pub struct Client {
    endpoint: ControlEndpoint,
    events: UnboundedReceiver<ControlEvent>,
    identity: NodeIdentity,
    peer: String,
    addr: SocketAddr,
    /// Job events that arrived while waiting for a reply.
    /// Events received and not yet yielded: (job, number, event).
    pending: VecDeque<(JobId, u64, JobEvent)>,
    /// Every daemon address this client knows of, in the order it learned them.
    known: Vec<SocketAddr>,
}

impl Client {
    /// Connects to the daemon at `addr` with `identity` (any certificate issued by the cluster CA, e.g.
    /// `troupe cluster add-node admin`). Nothing listening there, or a certificate the daemon refuses, is
    /// [`Error::Unreachable`].
    pub async fn connect(addr: SocketAddr, identity: &NodeIdentity) -> Result<Client> {
        Self::dial(addr, identity, TransportConfig::default().connect_timeout_ms).await
    }

    /// Connects to the first of `addrs` that answers (any daemons of the cluster: the controllers, or
    /// any member), each tried for at most 2 s. Requests for the controller follow its redirects, and
    /// when the controller is gone (a take-over) look for the new one among `addrs` and the members the
    /// cluster names. None answering is [`Error::Unreachable`] naming them all.
    pub async fn connect_any(addrs: &[SocketAddr], identity: &NodeIdentity) -> Result<Client> {
        let Some(&first) = addrs.first() else {
            let reason = "no daemon address to connect to: give at least one (--cluster ADDR[,ADDR…])".into();
            return Err(unreachable(SocketAddr::from(([0, 0, 0, 0], 0)), reason, None));
        };
        let timeout_ms =
            if addrs.len() == 1 { TransportConfig::default().connect_timeout_ms } else { CANDIDATE_CONNECT_MS };
        let mut failed = Vec::new();
        for &addr in addrs {
            match Self::dial(addr, identity, timeout_ms).await {
                Ok(mut client) => {
                    client.learn(addrs.iter().copied());
                    return Ok(client);
                }
                Err(e) => failed.push(with_causes(&e)),
            }
        }
        if let [only] = &failed[..] {
            return Err(unreachable(first, only.clone(), None));
        }
        let list: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
        let why = format!("none of the troupe daemons at {} answered: {}", list.join(", "), failed.join("; "));
        Err(unreachable(first, why, None))
    }

    async fn dial(addr: SocketAddr, identity: &NodeIdentity, connect_timeout_ms: u64) -> Result<Client> {
        let local: SocketAddr = if addr.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("valid");
        // The daemons' own idle timeout and keep-alive (2 s, 400 ms), not a longer one: a watcher sees
        // a SIGKILLed controller gone within 2 s (a client connection has no companion TCP connection
        // to see the process die) and re-finds the leader, elected meanwhile.
        let config = TransportConfig { connect_timeout_ms, ..TransportConfig::default() };
        let (endpoint, events) = ControlEndpoint::bind(identity, local, PeerRole::Client, &config)
            .map_err(|e| unreachable(addr, format!("opening a client endpoint to reach {addr}"), Some(e)))?;
        let peer = endpoint.connect(addr).await.map_err(|e| {
            let what = format!("connecting to the troupe daemon at {addr} (is it running? is the address right?)");
            unreachable(addr, what, Some(e))
        })?;
        let known = vec![addr];
        Ok(Client { endpoint, events, identity: identity.clone(), peer, addr, pending: VecDeque::new(), known })
    }

    /// The daemon this client talks to.
    pub fn peer(&self) -> (&str, SocketAddr) {
        (&self.peer, self.addr)
    }

    /// Every daemon address this client knows of: where it looks for the controller when it is gone.
    pub fn known(&self) -> &[SocketAddr] {
        &self.known
    }

    fn learn(&mut self, addrs: impl IntoIterator<Item = SocketAddr>) {
        for addr in addrs {
            if !self.known.contains(&addr) {
                self.known.push(addr);
            }
        }
    }

    /// Learns the cluster's members from the daemon it talks to (best effort: a client that cannot ask
    /// keeps the addresses it has).
    async fn learn_members(&mut self) {
        if let Ok(status) = self.status().await {
            self.learn(status.members.iter().map(|m| m.addr).chain(status.controller_addr));
        }
    }

    /// Talks to the daemon at `addr` from now on (for at most 2 s of dialing); the events received and
    /// the addresses known are kept.
    async fn switch_to(&mut self, addr: SocketAddr) -> Result<()> {
        let mut next = Self::dial(addr, &self.identity, CANDIDATE_CONNECT_MS).await?;
        next.pending = std::mem::take(&mut self.pending);
        next.known = std::mem::take(&mut self.known);
        next.learn([addr]);
        let old = std::mem::replace(self, next);
        old.endpoint.close().await;
        Ok(())
    }

    /// Talks to the first known daemon after the current one that answers; false when none did.
    async fn switch_to_another(&mut self) -> bool {
        let here = self.known.iter().position(|a| *a == self.addr).unwrap_or(0);
        let n = self.known.len();
        for k in 1..=n {
            let addr = self.known[(here + k) % n];
            if self.switch_to(addr).await.is_ok() {
                return true;
            }
        }
        false
    }

    /// Sends `msg` and waits for the reply; the controller's refusals become the variant they mean
    /// ([`Error::from_controller`]).
    async fn request(&mut self, msg: Request) -> Result<Reply> {
        match self.exchange(msg).await? {
            Reply::Error { message } => Err(Error::from_controller(self.addr, message)),
            reply => Ok(reply),
        }
    }

    /// Sends `msg` and waits for the reply, an error reply included; events that arrive meanwhile are
    /// kept for the job handles.
    async fn exchange(&mut self, msg: Request) -> Result<Reply> {
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

    /// Sends `msg` to the controller: a daemon that is not the controller redirects to it; while none
    /// answers as the controller (it died and an election is under way, a redirect names the dead one)
    /// the other known daemons are asked, for up to [`FIND_CONTROLLER_FOR`]. A request whose connection
    /// broke after it was sent is sent again only if sending it twice does no harm (not `Submit`).
    async fn request_controller(&mut self, msg: Request) -> Result<Reply> {
        let deadline = tokio::time::Instant::now() + FIND_CONTROLLER_FOR;
        let resend = !matches!(msg, Request::Submit { .. } | Request::ChangeControllers { .. });
        let mut redirects = 0;
        loop {
            let why = match self.exchange(msg.clone()).await {
                Ok(Reply::Redirect { controller }) if redirects < REDIRECTS_MAX => {
                    redirects += 1;
                    match self.switch_to(controller).await {
                        Ok(()) => continue,
                        Err(e) => e,
                    }
                }
                Ok(Reply::Redirect { controller }) => {
                    let message = format!("redirected {redirects} times in a row, last to {controller}: the daemons disagree on the controller");
                    Error::Protocol { addr: self.addr, message }
                }
                Ok(Reply::Error { message }) if no_controller_known(&message) => unreachable(self.addr, message, None),
                Ok(Reply::Error { message }) => return Err(Error::from_controller(self.addr, message)),
                Ok(reply) => return Ok(reply),
                Err(e @ Error::Unreachable { .. }) if resend => e,
                Err(e) => return Err(e),
            };
            redirects = 0;
            if tokio::time::Instant::now() + RECONNECT_PAUSE > deadline {
                let secs = FIND_CONTROLLER_FOR.as_secs();
                let known: Vec<String> = self.known.iter().map(SocketAddr::to_string).collect();
                let reason = format!(
                    "no controller answered within {secs} s (asked {}): {}",
                    known.join(", "),
                    with_causes(&why)
                );
                return Err(unreachable(self.addr, reason, None));
            }
            tracing::debug!(daemon = %self.addr, "looking for the controller: {}", with_causes(&why));
            tokio::time::sleep(RECONNECT_PAUSE).await;
            self.switch_to_another().await;
        }
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

    /// Changes the controllers' Raft group (`troupe cluster controllers add|remove`), at the controller;
    /// answers the group as the leader has it once the change is committed. A refusal (not a member,
    /// already a controller, the last one, a Raft address that does not answer) names the fix, and
    /// nothing changed. Not sent again on a lost connection (it may have been made; look first).
    pub async fn change_controllers(
        &mut self,
        change: crate::protocol::ControllersChange,
    ) -> Result<crate::protocol::ControllersStatus> {
        match self.request_controller(Request::ChangeControllers { change }).await? {
            Reply::Controllers(s) => Ok(*s),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Submits `job`; the handle streams its events from now on. A job config the controller cannot run
    /// is [`Error::Refused`], naming the config key.
    pub async fn submit(mut self, job: Job) -> Result<JobHandle> {
        let spec = Box::new(job.into_spec());
        self.learn_members().await;
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
        self.learn_members().await;
        let info = self.watch_since(job, None).await?;
        Ok(JobHandle { id: job, client: self, done: info.state.is_terminal(), next: info.events })
    }

    /// Follows a job submitted elsewhere from its event number `since` on (those already streamed
    /// first): a watcher that lost its controller for good picks up where it was at another daemon,
    /// which redirects it to the new one.
    pub async fn watch_from(mut self, job: JobId, since: u64) -> Result<JobHandle> {
        self.learn_members().await;
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

/// Whether a daemon's error reply says it is not the controller and knows of none (an election is under
/// way: `NodeCore::redirect`), so the client should look again.
fn no_controller_known(message: &str) -> bool {
    message.contains("is not the controller and knows of none yet")
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
        Ok(self.next_numbered().await?.map(|(_, event)| event))
    }

    /// The next event with its number in the job's event log (numbered from 0, as the controller
    /// recorded them): across reconnections and take-overs a handle yields each number once, in order.
    pub async fn next_numbered(&mut self) -> Result<Option<(u64, JobEvent)>> {
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
        Ok(Some((seq, event)))
    }

    /// Connects to the controller again — the same one restarted, or after a take-over the new one,
    /// found through every daemon the client knows of — and asks for the events from `self.next` on:
    /// the events of this job not yet yielded are dropped here and come again, in order, from the
    /// controller's log (the replicated one after a take-over, numbered the same).
    async fn reconnect(&mut self, reason: &str) -> Result<()> {
        let (id, addr) = (self.id, self.client.addr);
        tracing::warn!(job = id, controller = %addr, %reason, "lost the connection to the controller; reconnecting");
        let started = tokio::time::Instant::now();
        let deadline = started + RECONNECT_FOR;
        // The lost controller last: with one controller it is the one that comes back.
        let mut candidates: Vec<SocketAddr> = self.client.known.iter().copied().filter(|a| *a != addr).collect();
        candidates.push(addr);
        loop {
            let tried = async {
                let mut client = Client::connect_any(&candidates, &self.client.identity).await?;
                client.watch_since(id, Some(self.next)).await?;
                Ok::<_, Error>(client)
            };
            let last = match tried.await {
                Ok(mut client) => {
                    let others = self.client.pending.iter().filter(|(job, _, _)| *job != id).cloned();
                    let mut pending: VecDeque<_> = others.collect();
                    pending.extend(replayed_in_order(std::mem::take(&mut client.pending), id, self.next));
                    client.pending = pending;
                    let now_at = client.addr;
                    let old = std::mem::replace(&mut self.client, client);
                    old.endpoint.close().await;
                    let ms = started.elapsed().as_millis();
                    tracing::warn!(job = id, controller = %now_at, "reconnected to the controller after {ms} ms; the events missed meanwhile follow");
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
