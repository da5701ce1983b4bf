//! The daemon's HTTP endpoint (`telemetry.metrics_listen`), an axum router served by [`super::http`]:
//! `GET /metrics` renders [`NodeMetrics`] with the node's current status in the Prometheus text format;
//! `GET /status` answers exactly what `troupe status --json` prints for this daemon; `GET /` is the
//! dashboard ([`super::dashboard`]) and `GET /events` its live updates as server-sent events: a new
//! fragment of the page whenever a job event or a view change passed (at most one a second), or every
//! few seconds otherwise. Anything else is a `404` naming what is served.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::dashboard::page;
use super::http::serve;
use super::metrics::NodeMetrics;
use super::prometheus::CONTENT_TYPE;
use crate::protocol::ClusterStatus;

/// How long a request waits for the node actor's status.
const STATUS_TIMEOUT_MS: u64 = 2_000;
/// Dashboard pages following live updates at once; more are refused (`503`) so that scrapes always
/// find a connection.
pub const EVENT_STREAMS_MAX: usize = 16;
/// The shortest time between two updates of a page.
const UPDATE_INTERVAL_MS: u64 = 1_000;
/// The longest time between two looks at the status when nothing was reported (members, ranks).
const REFRESH_INTERVAL_MS: u64 = 3_000;

const INDEX: &str = "troupe daemon\n  /         the dashboard (HTML, live)\n  /events   the dashboard's live updates (server-sent events)\n  /metrics  Prometheus text format\n  /status   JSON, as `troupe status --json`\n";

/// How the endpoint asks for the node's current status: the daemon passes a call to its node actor.
/// Telemetry sees the runtime through this and [`NodeMetrics`] only, never through its messages.
pub type StatusSource = Arc<dyn Fn() -> StatusFuture + Send + Sync>;
/// One answer of a [`StatusSource`].
pub type StatusFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<ClusterStatus, String>> + Send>>;

/// A [`StatusSource`] from an async function.
pub fn status_source<F, Fut>(ask: F) -> StatusSource
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<ClusterStatus, String>> + Send + 'static,
{
    Arc::new(move || -> StatusFuture { Box::pin(ask()) })
}

#[derive(Clone)]
struct App {
    node: StatusSource,
    metrics: Arc<NodeMetrics>,
    streams: Arc<Semaphore>,
}

/// The endpoint's routes.
pub fn router(node: StatusSource, metrics: Arc<NodeMetrics>) -> Router {
    let app = App { node, metrics, streams: Arc::new(Semaphore::new(EVENT_STREAMS_MAX)) };
    Router::new()
        .route("/", get(dashboard))
        .route("/events", get(events))
        .route("/metrics", get(metrics_text))
        .route("/status", get(status_json))
        .fallback(not_found)
        .with_state(app)
}

/// Serves the endpoint on `listener` (over TLS with `tls`) until the returned task is aborted.
pub fn spawn(
    listener: TcpListener,
    node: StatusSource,
    metrics: Arc<NodeMetrics>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(serve(listener, router(node, metrics), tls))
}

async fn status(node: &StatusSource) -> Result<ClusterStatus, String> {
    match tokio::time::timeout(Duration::from_millis(STATUS_TIMEOUT_MS), node()).await {
        Ok(answer) => answer.map_err(|e| format!("the node did not answer: {e}\n")),
        Err(_) => Err(format!("the node did not answer within {STATUS_TIMEOUT_MS} ms\n")),
    }
}

fn unavailable(why: String) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
}

async fn metrics_text(State(app): State<App>) -> Response {
    match status(&app.node).await {
        Ok(status) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], app.metrics.render(&status)).into_response(),
        Err(why) => unavailable(why),
    }
}

async fn status_json(State(app): State<App>) -> Response {
    match status(&app.node).await {
        Ok(status) => match serde_json::to_string(&status) {
            Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
            Err(e) => unavailable(format!("{e}\n")),
        },
        Err(why) => unavailable(why),
    }
}

fn fragment_of(app: &App, status: &ClusterStatus) -> String {
    page::fragment(status, &app.metrics.dashboard(&page::drawn(status)))
}

async fn fragment(app: &App) -> String {
    match status(&app.node).await {
        Ok(status) => fragment_of(app, &status),
        Err(why) => page::unavailable(&why),
    }
}

async fn dashboard(State(app): State<App>) -> Response {
    match status(&app.node).await {
        Ok(status) => Html(page::document(&status.node, &fragment_of(&app, &status))).into_response(),
        Err(why) => unavailable(why),
    }
}

/// A page's live updates: `update` events whose data is the page's new fragment.
async fn events(State(app): State<App>) -> Response {
    let Ok(permit) = app.streams.clone().try_acquire_owned() else {
        tracing::warn!("dashboard: {EVENT_STREAMS_MAX} pages already follow this daemon; one more refused");
        return unavailable(format!("{EVENT_STREAMS_MAX} dashboards are already open on this daemon; close one\n"));
    };
    let changes = app.metrics.subscribe();
    let start = Updates { app, changes, _permit: permit, last: String::new(), first: true };
    let stream = futures::stream::unfold(start, |mut u| async move {
        loop {
            if !u.first {
                tokio::time::sleep(Duration::from_millis(UPDATE_INTERVAL_MS)).await;
                let refresh = Duration::from_millis(REFRESH_INTERVAL_MS - UPDATE_INTERVAL_MS);
                let _ = tokio::time::timeout(refresh, u.changes.changed()).await;
            }
            u.first = false;
            let fragment = fragment(&u.app).await.replace('\r', "");
            if fragment != u.last {
                let event = Event::default().event("update").data(&fragment);
                u.last = fragment;
                return Some((Ok::<_, Infallible>(event), u));
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// One page's stream: what it was last sent, and its place among [`EVENT_STREAMS_MAX`].
struct Updates {
    app: App,
    changes: tokio::sync::watch::Receiver<u64>,
    _permit: OwnedSemaphorePermit,
    last: String,
    first: bool,
}

async fn not_found(uri: Uri) -> Response {
    tracing::info!("HTTP endpoint: no such route: {uri}");
    (StatusCode::NOT_FOUND, format!("no such endpoint: {}\n{INDEX}", uri.path())).into_response()
}
