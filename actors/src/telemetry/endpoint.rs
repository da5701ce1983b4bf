//! The daemon's HTTP endpoint (`telemetry.metrics_listen`), an axum router served by [`super::http`]:
//! `GET /metrics` renders [`NodeMetrics`] with the node's current status in the Prometheus text format;
//! `GET /status` answers exactly what `troupe status --json` prints for this daemon; `GET /` is the
//! dashboard ([`super::dashboard`]) and `GET /events` its live updates as server-sent events: a new
//! fragment of the page whenever a job event or a view change passed (at most one a second), or every
//! few seconds otherwise. Anything else is a `404` naming what is served.
//!
//! A member's page shows the cluster through the controller: the controller's own fragment (members,
//! jobs, charts, timelines, event logs), which the member's node asks of the controller over its
//! authenticated control connection ([`NodeSources::controller_page`]), under a line saying whose view
//! it is; refreshed every second while a page is open. When the controller does not answer, the page
//! says so and shows what the member itself knows.

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

/// How the endpoint asks its node something: the daemon passes a call to its node actor. Telemetry
/// sees the runtime through these and [`NodeMetrics`] only, never through its messages.
pub type Source<T> = Arc<dyn Fn() -> SourceFuture<T> + Send + Sync>;
/// One answer of a [`Source`].
pub type SourceFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, String>> + Send>>;
/// The node's current status.
pub type StatusSource = Source<ClusterStatus>;

/// A [`Source`] from an async function.
pub fn source<T, F, Fut>(ask: F) -> Source<T>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<T, String>> + Send + 'static,
{
    Arc::new(move || -> SourceFuture<T> { Box::pin(ask()) })
}

/// What the endpoint asks its node.
#[derive(Clone)]
pub struct NodeSources {
    pub status: StatusSource,
    /// On a member: the controller's page fragment, fetched by the node from the controller.
    pub controller_page: Source<String>,
}

#[derive(Clone)]
struct App {
    node: NodeSources,
    metrics: Arc<NodeMetrics>,
    streams: Arc<Semaphore>,
}

/// The endpoint's routes.
pub fn router(node: NodeSources, metrics: Arc<NodeMetrics>) -> Router {
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
    node: NodeSources,
    metrics: Arc<NodeMetrics>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(serve(listener, router(node, metrics), tls))
}

async fn ask<T>(source: &Source<T>, who: &str) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_millis(STATUS_TIMEOUT_MS), source()).await {
        Ok(answer) => answer.map_err(|e| format!("{who} did not answer: {e}\n")),
        Err(_) => Err(format!("{who} did not answer within {STATUS_TIMEOUT_MS} ms\n")),
    }
}

async fn status(node: &NodeSources) -> Result<ClusterStatus, String> {
    ask(&node.status, "the node").await
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

/// The live part of the page as this daemon sees the cluster: with `status` and the histories of
/// `metrics` (the controller's; a member keeps none). The controller answers a member's
/// `DashboardRequest` with it.
pub fn fragment(status: &ClusterStatus, metrics: &NodeMetrics) -> String {
    page::fragment(status, &metrics.dashboard(&page::drawn(status)))
}

/// The live part of this daemon's page: its own on the controller; on a member the controller's,
/// fetched through the node, or what the member knows when the controller does not answer.
async fn page_fragment(app: &App, status: &ClusterStatus) -> String {
    if status.controller {
        return fragment(status, &app.metrics);
    }
    match ask(&app.node.controller_page, "the controller").await {
        Ok(controllers) => page::through_controller(status, &controllers),
        Err(why) => page::without_controller(status, &why, &fragment(status, &app.metrics)),
    }
}

/// The page's live part and whether it came through the controller (see [`page_fragment`]).
async fn live_fragment(app: &App) -> (String, bool) {
    match status(&app.node).await {
        Ok(status) => (page_fragment(app, &status).await, !status.controller),
        Err(why) => (page::unavailable(&why), false),
    }
}

async fn dashboard(State(app): State<App>) -> Response {
    match status(&app.node).await {
        Ok(status) => Html(page::document(&status.node, &page_fragment(&app, &status).await)).into_response(),
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
    let start = Updates { app, changes, _permit: permit, last: String::new(), first: true, member: false };
    let stream = futures::stream::unfold(start, |mut u| async move {
        loop {
            if !u.first {
                tokio::time::sleep(Duration::from_millis(UPDATE_INTERVAL_MS)).await;
                // A member hears of no job event: it asks the controller again every update interval.
                if !u.member {
                    let refresh = Duration::from_millis(REFRESH_INTERVAL_MS - UPDATE_INTERVAL_MS);
                    let _ = tokio::time::timeout(refresh, u.changes.changed()).await;
                }
            }
            u.first = false;
            let (fragment, member) = live_fragment(&u.app).await;
            u.member = member;
            let fragment = fragment.replace('\r', "");
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
    /// The last fragment came through the controller (this daemon is a member).
    member: bool,
}

async fn not_found(uri: Uri) -> Response {
    tracing::info!("HTTP endpoint: no such route: {uri}");
    (StatusCode::NOT_FOUND, format!("no such endpoint: {}\n{INDEX}", uri.path())).into_response()
}
