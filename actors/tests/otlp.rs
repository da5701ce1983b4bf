//! OpenTelemetry export: two `troupe daemon` processes configured with `telemetry.otlp_endpoint` send
//! their spans and metrics over OTLP/HTTP to a receiver this test runs. A job runs on both, one daemon
//! is SIGKILLed mid-run, and the receiver must see each committed step as a `step` span with its phases
//! as children (compute, collective, commit wait, optimizer), carrying job, rank, epoch and node; the
//! controller's `failure_detection`, `recovery` and `job` spans; the resource naming the service and
//! node; and the job metrics. A pipeline job (restored from a checkpoint) gives each stage's F, B, send
//! and recv spans with micro-batch and chunk, `checkpoint_restore` spans, and its bubble as a metric.
//! Over https (a collector with a private CA's certificate), the spans and metrics arrive with the
//! headers of `OTEL_EXPORTER_OTLP_HEADERS`.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value as Number;
use prost::Message;
use troupe_actors::api::{Client, Job, JobEvent};
use troupe_cluster::{add_node, init_cluster, NodeIdentity};
use troupe_model::config::JobConfig;

const WAIT: Duration = Duration::from_secs(60);

/// One received span: name, ids, attributes, and the service instance that sent it.
#[derive(Clone, Debug)]
struct Received {
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    attrs: BTreeMap<String, String>,
    instance: String,
}

fn text(kv: &[KeyValue]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Any::StringValue(s)) => s.clone(),
                Some(Any::IntValue(i)) => i.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

/// One received metric data point: the metric's name, the point's attributes, its value (a histogram's
/// count), and the service instance that sent it.
#[derive(Clone, Debug)]
struct Point {
    name: String,
    attrs: BTreeMap<String, String>,
    value: f64,
    instance: String,
}

/// The data points of an OTLP metrics export.
fn points(request: ExportMetricsServiceRequest) -> Vec<Point> {
    let mut out = Vec::new();
    for resource_metrics in request.resource_metrics {
        let resource = text(&resource_metrics.resource.map(|r| r.attributes).unwrap_or_default());
        let instance = resource.get("service.instance.id").cloned().unwrap_or_default();
        for metric in resource_metrics.scope_metrics.into_iter().flat_map(|s| s.metrics) {
            let number = |v: Option<Number>| match v {
                Some(Number::AsDouble(d)) => d,
                Some(Number::AsInt(i)) => i as f64,
                None => f64::NAN,
            };
            let values: Vec<(BTreeMap<String, String>, f64)> = match metric.data {
                Some(Data::Gauge(g)) => {
                    g.data_points.into_iter().map(|p| (text(&p.attributes), number(p.value))).collect()
                }
                Some(Data::Sum(s)) => {
                    s.data_points.into_iter().map(|p| (text(&p.attributes), number(p.value))).collect()
                }
                Some(Data::Histogram(h)) => {
                    h.data_points.into_iter().map(|p| (text(&p.attributes), p.count as f64)).collect()
                }
                other => panic!("{}: unexpected metric data {other:?}", metric.name),
            };
            for (attrs, value) in values {
                out.push(Point { name: metric.name.clone(), attrs, value, instance: instance.clone() });
            }
        }
    }
    out
}

/// A minimal OTLP/HTTP receiver: answers every POST with 200 and decodes its protobuf body, spans from
/// `/v1/traces` and metric points from `/v1/metrics`.
fn receiver() -> (SocketAddr, mpsc::Receiver<Received>, mpsc::Receiver<Point>) {
    let (addr, spans, points, _) = receiver_over(None);
    (addr, spans, points)
}

/// What the receiver got with each export: the request's header lines, lowercased names.
type Headers = Vec<String>;

/// An OTLP/HTTP receiver on loopback, over TLS with `tls`: the spans and metric points it decoded, and
/// the headers of each request.
#[allow(clippy::type_complexity)]
fn receiver_over(
    tls: Option<Arc<rustls::ServerConfig>>,
) -> (SocketAddr, mpsc::Receiver<Received>, mpsc::Receiver<Point>, mpsc::Receiver<Headers>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    let (metrics_tx, metrics_rx) = mpsc::channel();
    let (headers_tx, headers_rx) = mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let stream: Box<dyn ReadWrite> = match &tls {
                Some(config) => {
                    let Ok(connection) = rustls::ServerConnection::new(config.clone()) else { continue };
                    Box::new(rustls::StreamOwned::new(connection, stream))
                }
                None => Box::new(stream),
            };
            let mut reader = BufReader::new(stream);
            let (mut line, mut length, mut path, mut headers) = (String::new(), 0, String::new(), Vec::new());
            while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if path.is_empty() {
                    path = line.split(' ').nth(1).unwrap_or_default().to_owned();
                } else {
                    let (name, value) = line.split_once(':').unwrap_or((&line, ""));
                    headers.push(format!("{}:{}", name.to_ascii_lowercase(), value.trim()));
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0; length];
            if path.is_empty() || reader.read_exact(&mut body).is_err() {
                continue;
            }
            let _ = reader.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            let _ = reader.get_mut().flush();
            let _ = headers_tx.send(headers);
            if path == "/v1/metrics" {
                let request = ExportMetricsServiceRequest::decode(&body[..]).expect("an OTLP protobuf metrics export");
                for point in points(request) {
                    let _ = metrics_tx.send(point);
                }
                continue;
            }
            assert_eq!(path, "/v1/traces", "spans are posted to the OTLP traces path");
            let request = ExportTraceServiceRequest::decode(&body[..]).expect("an OTLP protobuf trace export");
            for resource_spans in request.resource_spans {
                let resource = text(&resource_spans.resource.map(|r| r.attributes).unwrap_or_default());
                assert_eq!(resource.get("service.name").map(String::as_str), Some("troupe"));
                let instance = resource.get("service.instance.id").cloned().unwrap_or_default();
                for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                    let received = Received {
                        name: span.name,
                        trace_id: span.trace_id,
                        span_id: span.span_id,
                        parent: span.parent_span_id,
                        attrs: text(&span.attributes),
                        instance: instance.clone(),
                    };
                    if tx.send(received).is_err() {
                        return;
                    }
                }
            }
        }
    });
    (addr, rx, metrics_rx, headers_rx)
}

trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

struct DaemonProcess(Child);

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn daemon(dir: &Path, name: &str, join: Option<SocketAddr>, otlp: SocketAddr) -> (DaemonProcess, SocketAddr) {
    daemon_exporting_to(dir, name, join, &format!("http://{otlp}"), &[])
}

/// A daemon exporting to `endpoint`, with `env` set.
fn daemon_exporting_to(
    dir: &Path,
    name: &str,
    join: Option<SocketAddr>,
    endpoint: &str,
    env: &[(&str, String)],
) -> (DaemonProcess, SocketAddr) {
    let config = dir.join(format!("{name}.toml"));
    let join = join.map(|a| format!("join = \"{a}\"\n")).unwrap_or_default();
    let text = format!(
        "name = \"{name}\"\nlisten = \"127.0.0.1:0\"\n{join}data_dir = \"{}\"\ncerts = \"{}\"\ntorch_threads = 1\n[telemetry]\notlp_endpoint = \"{endpoint}\"\n",
        dir.join(name).display(),
        dir.join("certs").display()
    );
    std::fs::write(&config, text).unwrap();
    let mut child = Command::new(common::binary())
        .args(["daemon", "--exit-with-parent", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "300")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("daemon starts");
    let stdout = child.stdout.take().unwrap();
    let process = DaemonProcess(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).expect("the daemon prints its address within 30 s");
    (process, line.rsplit(' ').next().unwrap().parse().unwrap())
}

/// node-a (the controller) and node-b exporting to a receiver of their own, node-b a member.
struct TwoNodes {
    _a: DaemonProcess,
    b: DaemonProcess,
    addr: SocketAddr,
    identity: NodeIdentity,
    spans: mpsc::Receiver<Received>,
    metrics: mpsc::Receiver<Point>,
}

async fn two_nodes(dir: &Path) -> TwoNodes {
    let certs = dir.join("certs");
    init_cluster(&certs).unwrap();
    for name in ["node-a", "node-b", "client"] {
        add_node(name, &certs).unwrap();
    }
    let (otlp, spans, metrics) = receiver();
    let (a, addr) = daemon(dir, "node-a", None, otlp);
    let (b, _) = daemon(dir, "node-b", Some(addr), otlp);
    let identity = NodeIdentity::load(&certs, "client").unwrap();
    common::wait_for(Duration::from_secs(20), "node-b to join", || async {
        let mut c = Client::connect(addr, &identity).await.ok()?;
        let s = c.status().await.ok()?;
        c.close().await;
        (s.members.len() == 2).then_some(())
    })
    .await;
    TwoNodes { _a: a, b, addr, identity, spans, metrics }
}

/// Receives until `done` says what is wanted arrived (at most 20 s; then fails, listing `names` of what
/// came).
fn collect<T>(rx: &mpsc::Receiver<T>, done: impl Fn(&[T]) -> bool, names: impl Fn(&T) -> String) -> Vec<T> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done(&got) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(item) => got.push(item),
            Err(_) => {
                let names: std::collections::BTreeSet<String> = got.iter().map(&names).collect();
                panic!("timed out waiting; received {names:?}");
            }
        }
    }
    got
}

fn span_name(s: &Received) -> String {
    format!("{} from {}", s.name, s.instance)
}

fn point_name(p: &Point) -> String {
    p.name.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_a_two_node_job_with_a_failure_reach_an_otlp_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let TwoNodes { _a, b, addr, identity, spans, metrics } = two_nodes(dir.path()).await;
    // One connection per certificate name at a time: the submitting client connects after the polls.
    let client = Client::connect(addr, &identity).await.unwrap();
    let mut job = client.submit(Job::new(JobConfig::small(8)).name("otlp")).await.unwrap();
    let mut b = Some(b);
    let outcome = tokio::time::timeout(WAIT, async {
        while let Some(event) = job.next_event().await.unwrap() {
            if let JobEvent::Step { step: 3, .. } = event {
                common::signal(b.as_ref().unwrap().0.id(), "KILL");
                drop(b.take());
            }
            if event.is_terminal() {
                return event;
            }
        }
        panic!("the job's events ended early");
    })
    .await
    .expect("the job ends within a minute");
    assert!(matches!(outcome, JobEvent::Finished { steps: 8, .. }), "{outcome:?}");
    job.close().await;

    // Batches go out every second; collect until every expected span has arrived (bounded).
    let complete = |seen: &[Received]| {
        let steps_on_a = seen
            .iter()
            .filter(|s| {
                s.name == "step"
                    && s.instance == "node-a"
                    && s.attrs.get("troupe.step_outcome").is_some_and(|o| o == "committed")
            })
            .count();
        let job_steps = seen.iter().filter(|s| s.name == "job_step").count();
        ["job", "recovery", "failure_detection", "mesh_rebuild", "state_restore"]
            .iter()
            .all(|n| seen.iter().any(|s| &s.name == n))
            && steps_on_a >= 8
            && job_steps >= 8
    };
    let seen = collect(&spans, complete, span_name);

    let all_steps: Vec<&Received> = seen.iter().filter(|s| s.name == "step").collect();
    let interrupted =
        all_steps.iter().filter(|s| s.instance == "node-a" && s.attrs["troupe.step_outcome"] != "committed").count();
    assert!(interrupted >= 1, "node-a's step in flight when node-b died was aborted or failed");
    let steps: Vec<&&Received> = all_steps.iter().filter(|s| s.attrs["troupe.step_outcome"] == "committed").collect();
    for step in &steps {
        for key in ["troupe.job", "troupe.rank", "troupe.epoch", "troupe.node", "troupe.step", "troupe.attempt"] {
            assert!(step.attrs.contains_key(key), "step span without {key}: {:?}", step.attrs);
        }
        assert_eq!(step.attrs["troupe.node"], step.instance);
        let children: Vec<&str> = seen.iter().filter(|c| c.parent == step.span_id).map(|c| c.name.as_str()).collect();
        for phase in ["compute", "collective", "commit_wait", "optimizer"] {
            assert!(children.contains(&phase), "step {:?} lacks a {phase} child: {children:?}", step.attrs);
        }
    }
    let ranks_on_b: Vec<&str> =
        steps.iter().filter(|s| s.instance == "node-b").map(|s| s.attrs["troupe.rank"].as_str()).collect();
    assert!(ranks_on_b.iter().all(|r| *r == "1"), "node-b held rank 1: {ranks_on_b:?}");
    let a_steps: Vec<(u64, u64)> = steps
        .iter()
        .filter(|s| s.instance == "node-a")
        .map(|s| (s.attrs["troupe.step"].parse().unwrap(), s.attrs["troupe.epoch"].parse().unwrap()))
        .collect();
    let first_epoch = a_steps.iter().map(|s| s.1).min().unwrap();
    assert!(
        a_steps.iter().any(|s| s.1 > first_epoch),
        "node-a's steps after the failure carry the new epoch: {a_steps:?}"
    );
    // One trace per step across the cluster: the controller's `job_step` span of step k is the parent of
    // every rank's `step` span of k, on either node and in any attempt.
    let job_steps: Vec<&Received> = seen.iter().filter(|s| s.name == "job_step").collect();
    assert!(job_steps.iter().all(|s| s.instance == "node-a"), "the controller exports them");
    for step in &all_steps {
        let k = &step.attrs["troupe.step"];
        let Some(root) = job_steps.iter().find(|j| &j.attrs["troupe.step"] == k) else {
            assert_ne!(step.attrs["troupe.step_outcome"], "committed", "committed step {k} has no job_step");
            continue;
        };
        assert_eq!(step.parent, root.span_id, "{}'s step {k} is a child of the job's step {k}", step.instance);
        assert_eq!(step.trace_id, root.trace_id, "{}'s step {k} is in the step's trace", step.instance);
    }
    let traces: std::collections::BTreeSet<&Vec<u8>> = job_steps.iter().map(|j| &j.trace_id).collect();
    assert_eq!(traces.len(), job_steps.len(), "a trace per step");
    for b_step in steps.iter().filter(|s| s.instance == "node-b") {
        let a_step =
            steps.iter().find(|s| s.instance == "node-a" && s.attrs["troupe.step"] == b_step.attrs["troupe.step"]);
        assert_eq!(a_step.map(|s| &s.trace_id), Some(&b_step.trace_id), "both nodes' ranks in one trace");
    }
    let collective = seen.iter().find(|s| s.name == "collective").unwrap();
    assert_eq!(collective.attrs["troupe.collective"], "all_reduce");
    let detection = seen.iter().find(|s| s.name == "failure_detection").unwrap();
    assert_eq!(detection.attrs["troupe.failed_node"], "node-b");
    assert!(["timeout", "connection_lost"].contains(&detection.attrs["troupe.cause"].as_str()), "{detection:?}");
    let recovery =
        seen.iter().find(|s| s.name == "recovery" && s.instance == "node-a" && !s.attrs.contains_key("troupe.rank"));
    let recovery = recovery.expect("the controller's recovery span");
    assert_eq!(recovery.attrs["troupe.epoch"], detection.attrs["troupe.epoch"], "both at the view that dropped node-b");
    assert!(recovery.attrs["troupe.epoch"].parse::<u64>().unwrap() > first_epoch);
    let job_span = seen.iter().find(|s| s.name == "job").unwrap();
    assert_eq!(
        (job_span.attrs["troupe.outcome"].as_str(), job_span.attrs["troupe.job.name"].as_str()),
        ("finished", "otlp")
    );
    // node-a's rank resumed: its mesh rebuild, then its state restore, each a span of its own name.
    let resumed = |name: &str| {
        seen.iter()
            .find(|s| s.name == name && s.instance == "node-a" && s.attrs.contains_key("troupe.rank"))
            .unwrap_or_else(|| panic!("node-a's rank's {name} span"))
    };
    let (rebuild, restore) = (resumed("mesh_rebuild"), resumed("state_restore"));
    assert_eq!(rebuild.attrs["troupe.attempt"], restore.attrs["troupe.attempt"]);
    assert!(rebuild.attrs["troupe.attempt"].parse::<u64>().unwrap() > 1, "a resumed attempt's");
    assert!(
        !seen.iter().any(|s| s.name == "recovery" && s.attrs.contains_key("troupe.rank")),
        "a rank's resume is no longer exported as `recovery`"
    );

    // The job metrics, as /metrics has them, from the controller (metrics go out every 300 ms here).
    let job_attrs = |p: &Point| p.attrs.get("troupe.job.name").map(String::as_str) == Some("otlp");
    let got = collect(
        &metrics,
        |got: &[Point]| {
            let committed = got.iter().rev().find(|p| p.name == "troupe_job_steps_committed" && job_attrs(p));
            // The link bytes too: the job can end before the first export (a kill is detected at once), and
            // then they come in the same batch as the rest, in any order.
            committed.is_some_and(|p| p.value == 8.0)
                && got.iter().any(|p| p.name == "troupe_job_recovery_seconds" && job_attrs(p))
                && got.iter().any(|p| p.name == "troupe_failure_detection_seconds")
                && got.iter().any(|p| p.name == "troupe_link_bytes" && p.attrs["peer"] == "node-b" && p.value > 0.0)
        },
        point_name,
    );
    let last = |name: &str| got.iter().rev().find(|p| p.name == name && job_attrs(p)).map(|p| p.value);
    assert_eq!(last("troupe_job_step_seconds"), Some(8.0), "a step time per commit");
    assert!(last("troupe_job_tokens_per_second").unwrap() > 0.0);
    assert!(last("troupe_job_model_flops_per_second").unwrap() > 0.0);
    assert_eq!(last("troupe_job_recovery_seconds"), Some(1.0));
    assert!(
        got.iter().all(|p| p.instance == "node-a" || p.name == "troupe_link_bytes"),
        "the controller's job metrics"
    );
    let detection = got.iter().rev().find(|p| p.name == "troupe_failure_detection_seconds").unwrap();
    assert_eq!(detection.value, 1.0, "one member lost");
    assert!(got.iter().any(|p| p.name == "troupe_link_bytes" && p.attrs["peer"] == "node-b" && p.value > 0.0));
}

/// A pipeline of 2 stages over the two daemons, restored from a checkpoint of a first run: every
/// stage's `step` span carries `troupe.stage`; its F and B of each micro-batch are `forward` and
/// `backward` spans with `troupe.microbatch` and `troupe.chunk`, its activations and gradients `send`
/// and `recv` spans, its flush an all-reduce `collective`; each rank's state came from the checkpoint in
/// a `checkpoint_restore` span; and the controller exports the bubble and the checkpoint throughput.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_jobs_ops_restore_and_bubble_reach_an_otlp_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let TwoNodes { _a, b: _b, addr, identity, spans, metrics } = two_nodes(dir.path()).await;
    let checkpoints = dir.path().join("checkpoints");
    for (steps, name) in [(3, "first"), (5, "pipe")] {
        let mut config = JobConfig::small(steps);
        config.model.n_layers = 2;
        let job = Job::new(config).name(name).pipeline(2, "1f1b", 2).checkpoints(&checkpoints, 3, 2);
        let client = Client::connect(addr, &identity).await.unwrap();
        let (end, _) = tokio::time::timeout(WAIT, client.submit(job).await.unwrap().wait())
            .await
            .expect("the job ends within a minute")
            .unwrap();
        assert!(matches!(end, JobEvent::Finished { steps: s, .. } if s == steps), "{end:?}");
    }

    let pipe = |s: &Received| s.attrs.get("troupe.job").map(String::as_str) == Some("2");
    let complete = |seen: &[Received]| {
        let committed =
            seen.iter().filter(|s| s.name == "step" && pipe(s) && s.attrs["troupe.step_outcome"] == "committed");
        committed.count() >= 4 && seen.iter().filter(|s| s.name == "checkpoint_restore" && pipe(s)).count() >= 2
    };
    let seen = collect(&spans, complete, span_name);
    let steps: Vec<&Received> =
        seen.iter().filter(|s| s.name == "step" && pipe(s) && s.attrs["troupe.step_outcome"] == "committed").collect();
    for step in &steps {
        let (rank, stage) = (&step.attrs["troupe.rank"], &step.attrs["troupe.stage"]);
        assert_eq!(rank, stage, "one pipeline: rank r runs stage r");
        let children: Vec<&Received> = seen.iter().filter(|c| c.parent == step.span_id).collect();
        let named = |name: &str| children.iter().filter(|c| c.name == name).copied().collect::<Vec<_>>();
        for kind in ["forward", "backward"] {
            let mut microbatches: Vec<&str> =
                named(kind).iter().map(|c| c.attrs["troupe.microbatch"].as_str()).collect();
            microbatches.sort();
            assert_eq!(microbatches, ["0", "1"], "stage {stage}: a {kind} per micro-batch");
            assert!(named(kind).iter().all(|c| &c.attrs["troupe.chunk"] == stage && &c.attrs["troupe.stage"] == stage));
        }
        let (sends, recvs) = (named("send"), named("recv"));
        assert_eq!((sends.len(), recvs.len()), (2, 2), "stage {stage}: one send and one recv per micro-batch");
        let expected =
            if stage == "0" { ("send activation", "recv gradient") } else { ("send gradient", "recv activation") };
        assert!(sends.iter().all(|s| s.attrs["troupe.phase"].starts_with(expected.0)), "{sends:?}");
        assert!(recvs.iter().all(|s| s.attrs["troupe.phase"].starts_with(expected.1)), "{recvs:?}");
        let collectives = named("collective");
        assert_eq!(collectives.len(), 1, "the flush only: {collectives:?}");
        assert_eq!(collectives[0].attrs["troupe.collective"], "all_reduce");
    }
    let stages: std::collections::BTreeSet<(&str, &str)> =
        steps.iter().map(|s| (s.instance.as_str(), s.attrs["troupe.stage"].as_str())).collect();
    assert_eq!(stages.len(), 2, "both stages, one per node: {stages:?}");
    let restores: Vec<&Received> = seen.iter().filter(|s| s.name == "checkpoint_restore" && pipe(s)).collect();
    let restored: std::collections::BTreeSet<&str> = restores.iter().map(|s| s.instance.as_str()).collect();
    assert_eq!(restored.len(), 2, "both ranks restored the first run's checkpoint: {restores:?}");
    assert!(restores.iter().all(|s| s.attrs.contains_key("troupe.stage")));

    let job_attrs = |p: &Point| p.attrs.get("troupe.job.name").map(String::as_str) == Some("pipe");
    let got = collect(
        &metrics,
        |got: &[Point]| {
            let committed = got.iter().rev().find(|p| p.name == "troupe_job_steps_committed" && job_attrs(p));
            committed.is_some_and(|p| p.value == 2.0)
                && got.iter().any(|p| p.name == "troupe_job_checkpoint_bytes_per_second" && job_attrs(p))
        },
        point_name,
    );
    let last = |name: &str| got.iter().rev().find(|p| p.name == name && job_attrs(p)).map(|p| p.value);
    let bubble = last("troupe_job_bubble_fraction").expect("a bubble for a pipeline job");
    assert!(bubble > 0.0 && bubble < 1.0, "bubble {bubble}");
    assert!(last("troupe_job_checkpoint_bytes").unwrap() > 0.0);
    assert!(last("troupe_job_checkpoint_bytes_per_second").unwrap() > 0.0);
    assert_eq!(
        last("troupe_job_checkpoint_seconds"),
        Some(1.0),
        "one checkpoint of the second job (step 3 was the first's)"
    );
}

/// A collector over https (its certificate from a private CA, given to the daemon with
/// `OTEL_EXPORTER_OTLP_CERTIFICATE`; a client certificate required, given with
/// `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`/`_KEY`) with headers from `OTEL_EXPORTER_OTLP_HEADERS`: the
/// daemon's spans and metrics arrive there, decoded by the OTLP protobuf definitions, each request with
/// the headers; a daemon whose CA file does not exist, or with a client certificate but no key, refuses
/// to start, naming the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_and_metrics_reach_a_collector_over_https_with_the_configured_headers() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    init_cluster(&certs).unwrap();
    for name in ["node-a", "client", "localhost"] {
        add_node(name, &certs).unwrap();
    }
    let collector = NodeIdentity::load(&certs, "localhost").unwrap();
    // The collector also wants a client certificate of the same CA (mutual TLS).
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(collector.ca.clone()).unwrap();
    let clients =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build().unwrap();
    let tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(clients)
        .with_single_cert(vec![collector.cert.clone()], collector.key.clone_key())
        .unwrap();
    let (otlp, spans, metrics, headers) = receiver_over(Some(Arc::new(tls)));
    let ca = certs.join("ca.pem").display().to_string();
    let node_file = |file: &str| certs.join("nodes").join(file).display().to_string();
    let env = [
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca.clone()),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", node_file("node-a.pem")),
        ("OTEL_EXPORTER_OTLP_CLIENT_KEY", node_file("node-a.key.pem")),
        ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20s3cret,x-tenant=troupe-tests".to_owned()),
    ];
    let endpoint = format!("https://localhost:{}", otlp.port());
    let (_daemon, addr) = daemon_exporting_to(dir.path(), "node-a", None, &endpoint, &env);
    let identity = NodeIdentity::load(&certs, "client").unwrap();
    let client = Client::connect(addr, &identity).await.unwrap();
    let (end, _) =
        tokio::time::timeout(WAIT, client.submit(Job::new(JobConfig::small(3)).name("secure")).await.unwrap().wait())
            .await
            .expect("the job ends within a minute")
            .unwrap();
    assert!(matches!(end, JobEvent::Finished { steps: 3, .. }), "{end:?}");

    let got = collect(&spans, |s| s.iter().filter(|s| s.name == "job_step").count() >= 3, span_name);
    assert!(got.iter().all(|s| s.instance == "node-a"), "every span from node-a");
    collect(&metrics, |p| p.iter().any(|p| p.name == "troupe_job_steps_committed"), point_name);
    let requests: Vec<Headers> = headers.try_iter().collect();
    assert!(!requests.is_empty());
    for request in &requests {
        assert!(request.contains(&"authorization:Bearer s3cret".to_owned()), "{request:?}");
        assert!(request.contains(&"x-tenant:troupe-tests".to_owned()), "{request:?}");
        assert!(request.iter().any(|h| h == "content-type:application/x-protobuf"), "{request:?}");
    }

    // A CA file that is not there, or a client certificate without its key: the daemon stops at start
    // and says which variable.
    let config = dir.path().join("node-a.toml");
    for (var, path, named) in [
        (
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            dir.path().join("missing.pem").display().to_string(),
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ),
        ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", node_file("node-a.pem"), "OTEL_EXPORTER_OTLP_CLIENT_KEY"),
    ] {
        let out =
            Command::new(common::binary()).args(["daemon", "--config"]).arg(&config).env(var, path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(named), "{var}: {stderr}");
    }
}
