//! [`Error`]: what the library surface of troupe-actors returns — the job API ([`crate::api`]: `Client`,
//! `JobHandle`, `LocalCluster`) and [`crate::daemon::Daemon`]. One enum, so that a program can tell "the
//! cluster is unreachable" from "the controller refused the job" from "the job failed" by matching,
//! while every variant still prints the sentence a person needs: the input at fault and the fix.
//!
//! It sits below `api` and `daemon` (both return it; `api` starts daemons), so neither depends on the
//! other for it. Binaries, examples and tests keep `anyhow`: `?` converts.

use std::net::SocketAddr;
use std::time::Duration;

use crate::node_config::NodeConfigError;
use crate::protocol::JobId;

/// What the job API and the daemon return when they fail. New variants may come (`#[non_exhaustive]`):
/// match the ones you handle and keep a `_` arm.
///
/// ```no_run
/// # async fn demo(client: troupe_actors::api::Client, job: troupe_actors::api::Job) {
/// use troupe_actors::api::Error;
/// match client.submit(job).await {
///     Ok(handle) => println!("submitted job {}", handle.id()),
///     Err(Error::Refused { key: Some(key), message }) => eprintln!("fix `{key}` in the job config: {message}"),
///     Err(Error::Unreachable { addr, .. }) => eprintln!("no troupe daemon answers at {addr}"),
///     Err(e) => eprintln!("{e}"),
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No connection to the daemon at `addr`, a connection lost (and not re-made in time), or no reply
    /// in time. `reason` is the whole sentence: what the client was doing, the address, and what to
    /// check; `source` the transport's error, when there is one.
    #[error("{reason}")]
    Unreachable {
        addr: SocketAddr,
        reason: String,
        #[source]
        source: Option<troupe_cluster::ClusterError>,
    },

    /// The controller refused the request: a job config it cannot run (`key` names the config key, e.g.
    /// `parallel.dp`, when its message does), or a job this cluster does not allow (`data_plane`).
    /// `message` is the controller's, unchanged.
    #[error("{message}")]
    Refused { key: Option<String>, message: String },

    /// The job ended failed; `reason` is the controller's (e.g. "the state of step 12 was lost … no
    /// checkpoint.dir to fall back on").
    #[error("job {job} failed: {reason}")]
    JobFailed { job: JobId, reason: String },

    /// The job was cancelled (`troupe job cancel`, [`crate::api::JobHandle::cancel`]) before it finished.
    #[error("job {job} was cancelled before it finished")]
    Cancelled { job: JobId },

    /// `what` did not happen within `after` (e.g. a local cluster forming).
    #[error("{what} within {} ms", after.as_millis())]
    TimedOut { what: String, after: Duration },

    /// The cluster has no job `job` (never submitted there, or the controller lost its catalog).
    #[error("no job {job} on this cluster (see `troupe status`)")]
    NoSuchJob { job: JobId },

    /// The daemon at `addr` answered something this client does not expect (a different troupe
    /// version?).
    #[error("the troupe daemon at {addr}: {message}; is it the same troupe version as this client?")]
    Protocol { addr: SocketAddr, message: String },

    /// The node config (node.toml) of a daemon being started is invalid; the error names the key.
    #[error(transparent)]
    Config(#[from] NodeConfigError),

    /// A daemon could not start, or a local cluster could not start or restart one: `what` says what
    /// (naming the file or node.toml key and the fix), `source` why, when another error says it.
    #[error("{what}")]
    Start {
        what: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },

    /// A local cluster has no node `index` (or none of the kind asked for).
    #[error("the local cluster has no {kind} {index} (it has {nodes} node(s), numbered from 0)")]
    NoSuchNode { index: usize, kind: &'static str, nodes: usize },

    /// The daemon `node` is not running (it stopped or was drained), so it could not answer.
    #[error("node {node} is not running: {reason}")]
    NotRunning { node: String, reason: String },

    /// The daemon `node` stopped on its own: a child kept failing and the restart policy escalated.
    #[error("node {node} stopped: {reason}")]
    Escalated { node: String, reason: String },
}

/// What the library surface of troupe-actors returns.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A daemon could not start: `what` (naming the input and the fix) with no further cause.
    pub(crate) fn start(what: impl Into<String>) -> Self {
        Error::Start { what: what.into(), source: None }
    }

    /// A daemon could not start: `what`, because of `source`.
    pub(crate) fn start_because(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::Start { what: what.into(), source: Some(source.into()) }
    }

    /// What the controller's `Reply::Error { message }` means: an unknown job, a request it does not take
    /// (a protocol mismatch), or else a refusal — naming the config key when the message does.
    pub(crate) fn from_controller(addr: SocketAddr, message: String) -> Self {
        if let Some(job) = unknown_job(&message) {
            return Error::NoSuchJob { job };
        }
        if message.starts_with("not a client request") {
            return Error::Protocol { addr, message };
        }
        Error::Refused { key: refused_key(&message), message }
    }
}

/// The job of "no job N on this cluster …".
fn unknown_job(message: &str) -> Option<JobId> {
    let rest = message.strip_prefix("no job ")?;
    let (id, rest) = rest.split_once(' ')?;
    rest.starts_with("on this cluster").then(|| id.parse().ok()).flatten()
}

/// The config key a refusal names: "job config: config key `train.lr` = …" (every job config check),
/// or a message that starts with the key, "data_plane = plaintext_tcp: …".
fn refused_key(message: &str) -> Option<String> {
    if let Some((_, rest)) = message.split_once("config key `") {
        return rest.split_once('`').map(|(key, _)| key.to_owned());
    }
    let (key, _) = message.split_once(" = ")?;
    let is_key = !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == '.');
    is_key.then(|| key.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(message: &str, expected: &str) {
        let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let got = match Error::from_controller(addr, message.to_owned()) {
            Error::NoSuchJob { job } => format!("no such job {job}"),
            Error::Protocol { .. } => "protocol".to_owned(),
            Error::Refused { key, message: m } => {
                assert_eq!(m, message, "the controller's message is kept");
                format!("refused {key:?}")
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(got, expected, "{message}");
    }

    #[test]
    fn controller_errors_become_the_variant_a_user_matches() {
        check("no job 99 on this cluster (see `troupe status`)", "no such job 99");
        check(
            "job config: config key `train.lr` = -1: must be a finite number > 0, e.g. 1e-3",
            "refused Some(\"train.lr\")",
        );
        check(
            "data_plane = plaintext_tcp: this cluster does not allow tensors between hosts unencrypted; …",
            "refused Some(\"data_plane\")",
        );
        check("job config: config job.toml: unknown field `bogus`", "refused None");
        check("starting the job controller: spawn failed", "refused None");
        check("not a client request: Heartbeat", "protocol");
        check("no job here = x", "refused None");
    }

    #[test]
    fn the_messages_name_the_input_and_the_fix() {
        let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(Error::NoSuchJob { job: 4 }.to_string(), "no job 4 on this cluster (see `troupe status`)");
        assert_eq!(
            Error::JobFailed { job: 4, reason: "rank 1 failed".into() }.to_string(),
            "job 4 failed: rank 1 failed"
        );
        let timed_out =
            Error::TimedOut { what: "the local cluster did not form".into(), after: Duration::from_secs(30) };
        assert_eq!(timed_out.to_string(), "the local cluster did not form within 30000 ms");
        let protocol = Error::Protocol { addr, message: "unexpected reply Submitted { job: 1 }".into() };
        assert!(protocol.to_string().contains("127.0.0.1:7000"), "{protocol}");
    }
}
