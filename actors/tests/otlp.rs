//! OpenTelemetry export: two `troupe daemon` processes configured with `telemetry.otlp_endpoint` send
//! their spans over OTLP/HTTP to a receiver this test runs. A job runs on both, one daemon is SIGKILLed
//! mid-run, and the receiver must see each committed step as a `step` span with its phases as children
//! (compute, collective, commit wait, optimizer), carrying job, rank, epoch and node; the controller's
//! `failure_detection`, `recovery` and `job` spans; and the resource naming the service and node.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::common::v1::KeyValue;
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

/// A minimal OTLP/HTTP receiver: answers every POST with 200 and decodes its protobuf body.
fn receiver() -> (SocketAddr, mpsc::Receiver<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let (mut line, mut length, mut path) = (String::new(), 0, String::new());
            while reader.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                if path.is_empty() {
                    path = line.split(' ').nth(1).unwrap_or_default().to_owned();
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
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
    (addr, rx)
}

struct DaemonProcess(Child);

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn daemon(dir: &Path, name: &str, join: Option<SocketAddr>, otlp: SocketAddr) -> (DaemonProcess, SocketAddr) {
    let config = dir.join(format!("{name}.toml"));
    let join = join.map(|a| format!("join = \"{a}\"\n")).unwrap_or_default();
    let text = format!(
        "name = \"{name}\"\nlisten = \"127.0.0.1:0\"\n{join}data_dir = \"{}\"\ncerts = \"{}\"\ntorch_threads = 1\n[telemetry]\notlp_endpoint = \"http://{otlp}\"\n",
        dir.join(name).display(),
        dir.join("certs").display()
    );
    std::fs::write(&config, text).unwrap();
    let mut child = Command::new(common::binary())
        .args(["daemon", "--exit-with-parent", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_of_a_two_node_job_with_a_failure_reach_an_otlp_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    init_cluster(&certs).unwrap();
    for name in ["node-a", "node-b", "client"] {
        add_node(name, &certs).unwrap();
    }
    let (otlp, spans) = receiver();
    let (_a, addr) = daemon(dir.path(), "node-a", None, otlp);
    let (b, _) = daemon(dir.path(), "node-b", Some(addr), otlp);
    let identity = NodeIdentity::load(&certs, "client").unwrap();
    common::wait_for(Duration::from_secs(20), "node-b to join", || async {
        let mut c = Client::connect(addr, &identity).await.ok()?;
        let s = c.status().await.ok()?;
        c.close().await;
        (s.members.len() == 2).then_some(())
    })
    .await;
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
    let mut seen: Vec<Received> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
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
        ["job", "recovery", "failure_detection"].iter().all(|n| seen.iter().any(|s| &s.name == n))
            && steps_on_a >= 8
            && job_steps >= 8
    };
    while !complete(&seen) {
        let left = deadline.saturating_duration_since(Instant::now());
        match spans.recv_timeout(left) {
            Ok(span) => seen.push(span),
            Err(_) => {
                let names: Vec<(&str, &str)> = seen.iter().map(|s| (s.name.as_str(), s.instance.as_str())).collect();
                panic!("timed out waiting for the spans; received {names:?}");
            }
        }
    }

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
    let job_span = seen.iter().find(|s| s.name == "job").unwrap();
    assert_eq!(
        (job_span.attrs["troupe.outcome"].as_str(), job_span.attrs["troupe.job.name"].as_str()),
        ("finished", "otlp")
    );
    assert!(
        seen.iter().any(|s| s.name == "recovery" && s.instance == "node-a" && s.attrs.contains_key("troupe.rank")),
        "node-a's rank recovered"
    );
}
