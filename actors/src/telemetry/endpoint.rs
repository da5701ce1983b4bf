//! The daemon's HTTP endpoint (`telemetry.metrics_listen`): `GET /metrics` renders [`NodeMetrics`] with
//! the node's current status in the Prometheus text format; `GET /status` answers exactly what
//! `troupe status --json` prints for this daemon.

use std::sync::Arc;

use ractor::ActorRef;
use tokio::net::TcpListener;

use super::http::{serve, Response};
use super::metrics::NodeMetrics;
use super::prometheus::CONTENT_TYPE;
use crate::runtime::node::NodeMsg;
use crate::runtime::protocol::ClusterStatus;

/// How long a scrape waits for the node actor's status.
const STATUS_TIMEOUT_MS: u64 = 2_000;

const INDEX: &str = "troupe daemon\n  /metrics  Prometheus text format\n  /status   JSON, as `troupe status --json`\n";

/// Serves the endpoint on `listener` until the returned task is aborted.
pub fn spawn(listener: TcpListener, node: ActorRef<NodeMsg>, metrics: Arc<NodeMetrics>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(serve(listener, move |path: String| {
        let (node, metrics) = (node.clone(), metrics.clone());
        async move {
            match path.as_str() {
                "/metrics" => match status(&node).await {
                    Ok(status) => Response::ok(CONTENT_TYPE, metrics.render(&status)),
                    Err(why) => Response::text(503, why),
                },
                "/status" => match status(&node).await {
                    Ok(status) => match serde_json::to_string(&status) {
                        Ok(json) => Response::ok("application/json", json),
                        Err(e) => Response::text(503, format!("{e}\n")),
                    },
                    Err(why) => Response::text(503, why),
                },
                "/" => Response::text(200, INDEX),
                _ => Response::text(404, format!("no such endpoint: {path}\n{INDEX}")),
            }
        }
    }))
}

async fn status(node: &ActorRef<NodeMsg>) -> Result<ClusterStatus, String> {
    ractor::call_t!(node, NodeMsg::Status, STATUS_TIMEOUT_MS).map_err(|e| format!("the node did not answer: {e}\n"))
}
