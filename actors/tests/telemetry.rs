//! Observability as a user meets it: a real `troupe daemon` serving `/metrics` (parsed as Prometheus
//! text, carrying the committed-step counter of a job it ran; accepted by `promtool check metrics`, and
//! scraped by a real Prometheus server whose query API then returns troupe's series — both Debian's
//! `prometheus` package, skipped with a message when absent) and `/status` (the same JSON as `troupe
//! status --json`), refusing oversized, malformed, slow-loris and unknown-route requests with the right
//! status while its job trains on; with `dashboard_auth`, https served only to clients holding a
//! certificate of the cluster; `troupe train --run-dir` on two daemons, then `troupe trace` and `troupe plot` (the
//! SVG and the Perfetto JSON read back, every rank and phase present); a pipeline-style trace file drawn
//! per stage; and the daemon's errors for a bad `[telemetry]`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_actors::api::{Client, Job, JobEvent};
use troupe_actors::daemon::NodeConfig;
use troupe_actors::telemetry::endpoint::EVENT_STREAMS_MAX;
use troupe_actors::telemetry::http::get;
use troupe_actors::telemetry::prometheus::{parse, Sample};
use troupe_cluster::NodeIdentity;
use troupe_model::config::JobConfig;

const SMALL_JOB: &str = "[model]\nn_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n";
const WAIT: Duration = Duration::from_secs(60);

/// Runs `troupe ARGS` to completion within `timeout` (killed and failed otherwise), its output drained
/// as it comes so a full pipe never blocks it.
fn troupe(args: &[&str], timeout: Duration) -> Output {
    let mut child = Command::new(common::binary())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("troupe starts");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped")));
    let status = common::wait_child(&mut child, timeout, &format!("`troupe {}`", args.join(" ")));
    Output { status, stdout: stdout.join().expect("stdout"), stderr: stderr.join().expect("stderr") }
}

fn ok(output: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{what} failed: {stderr}");
    String::from_utf8(output.stdout.clone()).expect("utf-8")
}

/// A daemon child process, killed (and reaped) when dropped.
struct DaemonProcess(Child);

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `troupe daemon --config node.toml` (with `--json` if `json`); its control and metrics
/// addresses, from what it prints: two lines, or one JSON object.
fn start_daemon(config: &Path, json: bool) -> (DaemonProcess, SocketAddr, SocketAddr) {
    let mut child = Command::new(common::binary())
        .args(["daemon", "--exit-with-parent", "--config"])
        .arg(config)
        .args(json.then_some("--json"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("daemon starts");
    let stdout = child.stdout.take().expect("piped");
    let daemon = DaemonProcess(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = || rx.recv_timeout(Duration::from_secs(30)).expect("the daemon prints its addresses within 30 s");
    if json {
        let started: Value = serde_json::from_str(&line()).expect("one JSON object");
        assert_eq!(started["event"], "daemon", "{started}");
        assert!(started["node"].is_string(), "{started}");
        let metrics_url = started["metrics"].as_str().unwrap();
        assert_eq!(started["dashboard"].as_str(), metrics_url.strip_suffix("metrics"), "{started}");
        let metrics = started["metrics"].as_str().unwrap().trim_start_matches("http://").trim_end_matches("/metrics");
        return (daemon, started["listen"].as_str().unwrap().parse().unwrap(), metrics.parse().unwrap());
    }
    let listen = line();
    let metrics = line();
    let dashboard = line();
    assert!(dashboard.contains("dashboard on http://") && dashboard.ends_with('/'), "{dashboard}");
    let addr = |l: &str| {
        l.rsplit(' ').next().unwrap().trim_start_matches("http://").trim_end_matches("/metrics").parse().unwrap()
    };
    assert!(listen.contains("listening on"), "{listen}");
    assert!(metrics.contains("metrics on http://"), "{metrics}");
    (daemon, addr(&listen), addr(&metrics))
}

/// An installed program, if on PATH.
fn program(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| Path::new(dir).join(name)).find(|p| p.is_file())
}

/// `promtool check metrics` on a `/metrics` body: its lint findings, or None without promtool.
fn promtool_findings(text: &str) -> Option<String> {
    let Some(promtool) = program("promtool") else {
        eprintln!("SKIPPED promtool check: no promtool on PATH (Debian's prometheus package; scripts/provision-host.sh --test-runner installs it as root)");
        return None;
    };
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Some(if out.status.success() { String::new() } else { format!("exit {}: {said}", out.status) })
}

/// A Prometheus server scraping `target` every second, killed when dropped.
struct PrometheusServer {
    child: Child,
    api: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn prometheus_scraping(target: SocketAddr) -> Option<PrometheusServer> {
    let Some(prometheus) = program("prometheus") else {
        eprintln!("SKIPPED Prometheus scrape: no prometheus on PATH (Debian's prometheus package; scripts/provision-host.sh --test-runner installs it as root)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: troupe\n    static_configs:\n      - targets: [\"{target}\"]\n"),
    )
    .unwrap();
    let api = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let child = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={api}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus starts");
    Some(PrometheusServer { child, api, _dir: dir })
}

/// Sends `request` on a raw connection and reads the answer until the server closes it.
fn raw_answer(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let _ = stream.write_all(request);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

fn sample<'a>(samples: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> &'a Sample {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .unwrap_or_else(|| panic!("no sample {name}{labels:?} in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_serves_prometheus_metrics_and_the_status_json_of_troupe_status() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let certs_arg = certs.to_str().unwrap();
    for args in [
        vec!["cluster", "init", "--dir", certs_arg],
        vec!["cluster", "add-node", "node-a", "--dir", certs_arg],
        vec!["cluster", "add-node", "node-b", "--dir", certs_arg],
        vec!["cluster", "add-node", "client", "--dir", certs_arg],
        vec!["cluster", "add-node", "viewer", "--dir", certs_arg],
    ] {
        ok(&troupe(&args, WAIT), &args.join(" "));
    }
    let node_toml = |name: &str, join: Option<SocketAddr>| {
        let config = dir.path().join(format!("{name}.toml"));
        let join = join.map(|a| format!("join = \"{a}\"\n")).unwrap_or_default();
        let text = format!(
            "name = \"{name}\"\nlisten = \"127.0.0.1:0\"\n{join}data_dir = \"{}\"\ncerts = \"{certs_arg}\"\ntorch_threads = 1\n[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\npeak_tflops_per_slot = 0.5\n",
            dir.path().join(name).display()
        );
        std::fs::write(&config, text).unwrap();
        config
    };
    let (_a, addr, metrics) = start_daemon(&node_toml("node-a", None), false);
    let (_b, _, _) = start_daemon(&node_toml("node-b", Some(addr)), true);

    let identity = NodeIdentity::load(&certs, "client").unwrap();
    common::wait_for(Duration::from_secs(20), "node-b to join", || async {
        let mut c = Client::connect(addr, &identity).await.ok()?;
        let members = c.status().await.ok()?.members.len();
        c.close().await;
        (members == 2).then_some(())
    })
    .await;
    // One connection per certificate name at a time: the submitting client connects after the polls.
    let client = Client::connect(addr, &identity).await.unwrap();
    let mut job = client.submit(Job::new(JobConfig::small(3)).name("scraped")).await.unwrap();
    let finished = tokio::time::timeout(WAIT, async {
        while let Some(event) = job.next_event().await.unwrap() {
            if event.is_terminal() {
                return event;
            }
        }
        panic!("the job's events ended early");
    })
    .await
    .expect("the job ends within a minute");
    assert!(matches!(finished, JobEvent::Finished { steps: 3, .. }), "{finished:?}");
    job.close().await;

    let (status, text) = get(metrics, "/metrics", Duration::from_secs(10)).await.unwrap();
    assert_eq!(status, 200, "{text}");
    let samples = parse(&text).unwrap_or_else(|e| panic!("/metrics is not Prometheus text: {e}\n{text}"));
    let job = [("job", "1"), ("name", "scraped")];
    assert_eq!(sample(&samples, "troupe_job_steps_committed_total", &job).value, 3.0);
    assert_eq!(sample(&samples, "troupe_job_step", &job).value, 3.0);
    assert_eq!(sample(&samples, "troupe_job_step_seconds_count", &job).value, 3.0);
    assert_eq!(sample(&samples, "troupe_job_state", &[("job", "1"), ("state", "finished")]).value, 1.0);
    assert_eq!(sample(&samples, "troupe_membership_members", &[]).value, 2.0);
    for direction in ["sent", "received"] {
        let bytes = sample(&samples, "troupe_link_bytes_total", &[("peer", "node-b"), ("direction", direction)]).value;
        assert!(bytes > 0.0, "node-a's rank {direction} gradients to/from node-b: {bytes}");
    }
    assert!(sample(&samples, "troupe_membership_epoch", &[]).value >= 1.0);
    let tokens = sample(&samples, "troupe_job_tokens_per_second", &job).value;
    let mfu = sample(&samples, "troupe_job_mfu", &job).value;
    let flops = sample(&samples, "troupe_job_model_flops_per_second", &job).value;
    assert!(tokens > 0.0 && flops > tokens, "tokens/s {tokens}, FLOP/s {flops}");
    assert!((mfu - flops / 1e12).abs() <= 1e-9 * flops, "MFU {mfu} = FLOP/s / (2 slots × 0.5 TFLOP/s)");
    assert_eq!(sample(&samples, "troupe_job_planned_steps", &job).value, 3.0);
    if let Some(findings) = promtool_findings(&text) {
        assert!(findings.is_empty(), "promtool check metrics refuses /metrics: {findings}\n{text}");
    }
    if let Some(prometheus) = prometheus_scraping(metrics) {
        // The daemon's `job` label is kept as `exported_job`: Prometheus's own `job` names the scrape.
        let query = "/api/v1/query?query=troupe_job_steps_committed_total%7Bname%3D%22scraped%22%7D";
        let (answer, _) = common::wait_for(WAIT, "Prometheus to scrape the daemon", || async {
            let (status, body) = get(prometheus.api, query, Duration::from_secs(5)).await.ok()?;
            let answer: Value = serde_json::from_str(&body).ok()?;
            (status == 200 && answer["data"]["result"].as_array().is_some_and(|r| !r.is_empty())).then_some(answer)
        })
        .await;
        let series = &answer["data"]["result"][0];
        assert_eq!(series["metric"]["exported_job"], "1", "{answer}");
        assert_eq!(series["metric"]["job"], "troupe", "{answer}");
        assert_eq!(series["value"][1], "3", "three committed steps, as Prometheus stored them: {answer}");
    }

    let (status, body) = get(metrics, "/status", Duration::from_secs(10)).await.unwrap();
    assert_eq!(status, 200, "{body}");
    let served: Value = serde_json::from_str(&body).unwrap();
    let addr_arg = addr.to_string();
    let cli = ok(
        &troupe(&["status", "--json", "--cluster", &addr_arg, "--certs", certs_arg, "--as", "client"], WAIT),
        "status",
    );
    let mut printed: Value = serde_json::from_str(cli.trim()).unwrap();
    // What each member's machine is using changes from one heartbeat to the next: compared without it.
    let mut served = served;
    for status in [&mut served, &mut printed] {
        for member in status["members"].as_array_mut().unwrap() {
            let load = member.as_object_mut().unwrap().remove("load").expect("each member's load");
            assert!(load["rss_bytes"].as_u64().unwrap() > 10 << 20, "a daemon's resident memory: {load}");
        }
    }
    assert_eq!(served, printed, "/status and `troupe status --json` differ");
    assert_eq!(served["jobs"][0]["step"], json!(3));
    assert_eq!(get(metrics, "/nothing", Duration::from_secs(10)).await.unwrap().0, 404);

    let table =
        ok(&troupe(&["status", "--cluster", &addr_arg, "--certs", certs_arg, "--as", "client"], WAIT), "status");
    assert!(table.lines().any(|l| l.starts_with("NODE") && l.contains("ADDRESS")), "{table}");
    assert!(table.lines().any(|l| l.contains("scraped") && l.contains("finished") && l.contains("3/3")), "{table}");
    assert!(!table.contains("ranks:"), "a finished job has no ranks: {table}");

    // A running job: /status and the table give each rank's node, replica, state and committed step.
    let client = Client::connect(addr, &identity).await.unwrap();
    let mut job = client.submit(Job::new(JobConfig::small(100_000)).name("long")).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while let Some(event) = job.next_event().await.unwrap() {
            if let JobEvent::Step { step: 2, .. } = event {
                return;
            }
        }
    })
    .await
    .expect("two steps within a minute");
    let (_, body) = get(metrics, "/status", Duration::from_secs(10)).await.unwrap();
    let served: Value = serde_json::from_str(&body).unwrap();
    let ranks = served["jobs"][1]["ranks"].as_array().unwrap_or_else(|| panic!("no ranks: {body}"));
    let rows: Vec<(&str, u64, u64, &str)> = ranks
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap_or_else(|| panic!("{k} in {r}"));
            (r["node"].as_str().unwrap(), n("rank"), n("replica"), r["state"].as_str().unwrap())
        })
        .collect();
    assert_eq!(rows, [("node-a", 0, 0, "training"), ("node-b", 1, 1, "training")], "{body}");
    assert!(ranks.iter().all(|r| r["step"].as_u64().unwrap() >= 2 && r["stage"].is_null()), "{body}");

    // Bad requests while it trains: each refused with its status, and the job goes on.
    let oversized = [b"GET /metrics HTTP/1.1\r\nX-Filler: ".as_slice(), &[b'a'; 16 * 1024]].concat();
    assert!(raw_answer(metrics, &oversized).starts_with("HTTP/1.1 431"), "an oversized head");
    let malformed = raw_answer(metrics, b"BR\x00KEN /metrics HTTP/1.1\r\n\r\n");
    assert!(malformed.starts_with("HTTP/1.1 400"), "a malformed request line: {malformed}");
    let post =
        raw_answer(metrics, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    let (status, body) = get(metrics, "/nothing/here", Duration::from_secs(10)).await.unwrap();
    assert!(status == 404 && body.contains("/metrics"), "an unknown route names the served ones: {status} {body}");
    // The dashboard's live updates: each open page gets `update` events carrying the page's content;
    // past EVENT_STREAMS_MAX open pages, one more is refused with 503 (and scrapes still answered).
    let streams: Vec<TcpStream> = (0..EVENT_STREAMS_MAX)
        .map(|_| {
            let mut s = TcpStream::connect(metrics).unwrap();
            s.write_all(b"GET /events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n").unwrap();
            s
        })
        .collect();
    for mut stream in streams.iter() {
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains(r#"data: <section id="cluster""#) {
            let n = stream.read(&mut buf).expect("an update before the wait ends");
            assert!(n > 0, "the event stream ended: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        let seen = String::from_utf8_lossy(&seen);
        assert!(seen.starts_with("HTTP/1.1 200") && seen.contains("text/event-stream"), "{seen}");
        assert!(seen.contains("event: update\n"), "{seen}");
    }
    let (status, _) = get(metrics, "/events", Duration::from_secs(10)).await.unwrap();
    assert_eq!(status, 503, "one page more than EVENT_STREAMS_MAX");
    assert_eq!(get(metrics, "/metrics", Duration::from_secs(10)).await.unwrap().0, 200);
    drop(streams);
    // Slow-loris: heads that never end are cut off (the server closes them), and meanwhile a scrape is
    // answered.
    let slow: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut s = TcpStream::connect(metrics).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").unwrap();
            s
        })
        .collect();
    assert_eq!(get(metrics, "/metrics", Duration::from_secs(10)).await.unwrap().0, 200);
    for mut s in slow {
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut rest = Vec::new();
        let closed = s.read_to_end(&mut rest);
        assert!(closed.is_ok(), "a slow-loris connection is closed by the server: {closed:?}");
        let rest = String::from_utf8_lossy(&rest);
        assert!(rest.is_empty() || rest.starts_with("HTTP/1.1 408"), "{rest}");
    }
    let before = served["jobs"][1]["step"].as_u64().unwrap();
    common::wait_for(WAIT, "the job to go on training", || async {
        let (_, body) = get(metrics, "/status", Duration::from_secs(10)).await.ok()?;
        let now: Value = serde_json::from_str(&body).ok()?;
        (now["jobs"][1]["step"].as_u64()? > before + 1).then_some(())
    })
    .await;
    let args = ["status", "--cluster", &addr_arg, "--certs", certs_arg, "--as", "viewer"];
    let table = ok(&troupe(&args, WAIT), "status");
    let after = table.split("job 2 (long) ranks:").nth(1).unwrap_or_else(|| panic!("no rank table: {table}"));
    let header: Vec<&str> = after.lines().nth(1).unwrap().split_whitespace().collect();
    // No STAGE or TENSOR column for data parallelism; what each rank holds and sends, as DDP measured it.
    let expected = ["RANK", "NODE", "SLOT", "REPLICA", "STATE", "STEP", "MEMORY", "SENT/STEP"];
    assert_eq!(header, expected, "{table}");
    let row: Vec<&str> = after.lines().nth(3).unwrap().split_whitespace().collect();
    assert_eq!(row[..5], ["1", "node-b", "0", "1", "training"], "{table}");
    let mib = |at: usize| row[at].parse::<f64>().is_ok_and(|m| m > 0.0) && row[at + 1] == "MiB";
    assert!(mib(6) && mib(8), "memory and traffic in MiB: {table}");
    job.cancel().await.unwrap();
    job.close().await;
}

#[test]
fn bad_telemetry_settings_are_refused_with_the_key_and_the_fix() {
    let base = "name = \"a\"\nlisten = \"127.0.0.1:0\"\ndata_dir = \"/tmp/x\"\ncerts = \"/nonexistent\"\n";
    let parse = |extra: &str| NodeConfig::parse(&format!("{base}{extra}"), "node.toml").unwrap_err().to_string();
    let bad_addr = parse("[telemetry]\nmetrics_listen = \"localhost\"\n");
    assert!(bad_addr.contains("metrics_listen"), "{bad_addr}");
    let bad_peak = parse("[telemetry]\npeak_tflops_per_slot = -1.0\n");
    assert!(bad_peak.contains("telemetry.peak_tflops_per_slot") && bad_peak.contains("TFLOP/s"), "{bad_peak}");
    let bad_otlp = parse("[telemetry]\notlp_endpoint = \"grpc://x:4317\"\n");
    assert!(bad_otlp.contains("telemetry.otlp_endpoint") && bad_otlp.contains("http://"), "{bad_otlp}");
    let unknown = parse("[telemetry]\nmetrics_port = 9400\n");
    assert!(unknown.contains("metrics_port"), "{unknown}");

    // A port already taken stops the daemon at start, naming the key.
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    troupe_cluster::init_cluster(&certs).unwrap();
    troupe_cluster::add_node("a", &certs).unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = dir.path().join("node.toml");
    let text = format!(
        "name = \"a\"\nlisten = \"127.0.0.1:0\"\ndata_dir = \"{}\"\ncerts = \"{}\"\n[telemetry]\nmetrics_listen = \"{}\"\n",
        dir.path().join("data").display(),
        certs.display(),
        taken.local_addr().unwrap()
    );
    std::fs::write(&config, text).unwrap();
    let out = troupe(&["daemon", "--config", config.to_str().unwrap()], WAIT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("telemetry.metrics_listen") && stderr.contains("free port"), "{stderr}");
}

/// A `<g>` group: its `data-*` attributes and the categories of the rectangles inside.
type Group = (Vec<(String, String)>, Vec<String>);

/// The `<g>` groups of `class` in an SVG document.
fn groups(svg: &str, class: &str) -> Vec<Group> {
    let doc = roxmltree::Document::parse(svg).expect("the SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.has_tag_name("g") && n.attribute("class") == Some(class))
        .map(|g| {
            let data = g
                .attributes()
                .filter(|a| a.name().starts_with("data-"))
                .map(|a| (a.name()[5..].to_owned(), a.value().to_owned()))
                .collect();
            let cats = g.descendants().filter_map(|r| r.attribute("data-cat")).map(str::to_owned).collect();
            (data, cats)
        })
        .collect()
}

fn data<'a>(attrs: &'a [(String, String)], key: &str) -> &'a str {
    attrs.iter().find(|(k, _)| k == key).map_or("", |(_, v)| v.as_str())
}

#[test]
fn a_two_node_run_dir_gives_a_timeline_per_rank_a_perfetto_trace_and_a_loss_plot() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let run = dir.path().join("run");
    let (job_arg, run_arg) = (job.to_str().unwrap(), run.to_str().unwrap());
    let train = ok(
        &troupe(&["train", "--json", "--nodes", "2", "--steps", "6", "--config", job_arg, "--run-dir", run_arg], WAIT),
        "train",
    );
    let printed_steps = train.lines().filter(|l| l.contains("\"event\":\"step\"")).count();
    assert_eq!(printed_steps, 6, "{train}");
    assert!(!train.contains("\"phases\""), "phase reports go to the run directory only");

    // events.jsonl holds every printed event (and the ranks' phases) with a time.
    let events: Vec<Value> = std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "step").count(), 6);
    assert!(kinds.contains(&"start") && kinds.last() == Some(&"summary"), "{kinds:?}");
    assert!(events.iter().all(|e| e["time_us"].as_u64().is_some()));
    let again = troupe(&["train", "--nodes", "2", "--steps", "1", "--run-dir", run_arg], WAIT);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already holds a run"));

    let out: Value = serde_json::from_str(ok(&troupe(&["trace", run_arg, "--json"], WAIT), "trace").trim()).unwrap();
    assert_eq!(out["rows"], json!(2), "{out}");
    // The Perfetto trace: complete spans of every phase on both ranks, named by metadata.
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(run.join("trace.json")).unwrap()).unwrap();
    let spans: Vec<&Value> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").collect();
    for rank in [0, 1] {
        let cats: Vec<&str> =
            spans.iter().filter(|e| e["pid"] == json!(rank)).map(|e| e["cat"].as_str().unwrap()).collect();
        for cat in ["compute", "comm", "idle", "optimizer"] {
            assert!(cats.contains(&cat), "rank {rank} has no {cat} span: {cats:?}");
        }
        let steps = spans.iter().filter(|e| e["pid"] == json!(rank) && e["name"] == "forward+backward").count();
        assert_eq!(steps, 6, "one forward+backward per step on rank {rank}");
    }
    assert!(spans.iter().all(|e| e["dur"].as_f64().unwrap() > 0.0 && e["ts"].as_f64().unwrap() >= 0.0));
    let names = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "M").count();
    assert_eq!(names, 2, "a process_name per rank");

    // The SVG timeline: a row per rank with bars of each phase, and a legend of exactly those phases.
    let svg = std::fs::read_to_string(run.join("timeline.svg")).unwrap();
    let rows = groups(&svg, "row");
    let labels: Vec<&str> = rows.iter().map(|(d, _)| data(d, "label")).collect();
    assert_eq!(labels, ["rank 0", "rank 1"]);
    for (_, cats) in &rows {
        assert!(cats.iter().filter(|c| *c == "compute").count() == 6 && cats.contains(&"comm".to_owned()), "{cats:?}");
    }
    let legend: Vec<String> = groups(&svg, "legend-item").iter().map(|(d, _)| data(d, "cat").to_owned()).collect();
    assert_eq!(legend, ["compute", "comm", "optimizer", "idle"]);

    let out: Value = serde_json::from_str(ok(&troupe(&["plot", run_arg, "--json"], WAIT), "plot").trim()).unwrap();
    assert_eq!(out["steps"], json!(6));
    let plot = std::fs::read_to_string(run.join("plot.svg")).unwrap();
    let doc = roxmltree::Document::parse(&plot).unwrap();
    let panels: Vec<(&str, usize)> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("panel"))
        .map(|p| {
            let line = p.descendants().find(|n| n.attribute("class") == Some("series")).expect("a series line");
            (p.attribute("data-metric").unwrap(), line.attribute("points").unwrap().split(' ').count())
        })
        .collect();
    assert_eq!(panels, [("loss", 6), ("tokens_per_s", 6)]);
}

/// A pipeline across two daemons records every op of every step as a span: each rank's forwards and
/// backwards of its own chunk for every micro-batch, its sends and receives, then the flush. The
/// timeline names each row by its stage and draws its waiting as idle; `--steps` draws one step.
#[test]
fn a_pipeline_run_on_two_daemons_records_each_stages_ops() {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.toml");
    std::fs::write(&job, SMALL_JOB.replace("n_layers = 1", "n_layers = 2")).unwrap();
    let run = dir.path().join("run");
    let (job_arg, run_arg) = (job.to_str().unwrap(), run.to_str().unwrap());
    let args = ["train", "--nodes", "2", "--pp", "2", "--microbatches", "2", "--steps", "3", "--config", job_arg];
    ok(&troupe(&[&args[..], &["--run-dir", run_arg]].concat(), WAIT), "train");
    ok(&troupe(&["trace", run_arg], WAIT), "trace");
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(run.join("trace.json")).unwrap()).unwrap();
    let spans: Vec<&Value> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").collect();
    for (rank, peer_op) in [(0, "recv gradient"), (1, "recv activation")] {
        let of_rank: Vec<&&Value> = spans.iter().filter(|e| e["pid"] == json!(rank)).collect();
        let named = |name: &str| of_rank.iter().filter(|e| e["name"] == name).count();
        for mb in 0..2 {
            // 3 steps, chunk = stage on a 2-stage pipeline.
            assert_eq!(named(&format!("F c{rank} mb{mb}")), 3, "rank {rank}: {of_rank:?}");
            assert_eq!(named(&format!("B c{rank} mb{mb}")), 3, "rank {rank}");
        }
        let recvs = of_rank.iter().filter(|e| e["name"].as_str().unwrap().starts_with(peer_op)).count();
        assert_eq!(recvs, 6, "rank {rank} receives from its neighbour once per micro-batch and step");
        assert_eq!(named("flush"), 3, "rank {rank}");
        let cats: Vec<&str> = of_rank.iter().map(|e| e["cat"].as_str().unwrap()).collect();
        for cat in ["forward", "backward", "comm", "optimizer", "idle"] {
            assert!(cats.contains(&cat), "rank {rank} has no {cat} span: {cats:?}");
        }
        let recv_cats: Vec<&str> = of_rank
            .iter()
            .filter(|e| e["name"].as_str().unwrap().starts_with("recv"))
            .map(|e| e["cat"].as_str().unwrap())
            .collect();
        assert!(recv_cats.iter().all(|c| *c == "idle"), "a receive waits: drawn as idle: {recv_cats:?}");
    }
    let svg = std::fs::read_to_string(run.join("timeline.svg")).unwrap();
    let labels: Vec<String> = groups(&svg, "row").iter().map(|(d, _)| data(d, "label").to_owned()).collect();
    assert_eq!(labels, ["stage 0", "stage 1"]);

    let part = dir.path().join("step2.svg");
    ok(&troupe(&["trace", run_arg, "--steps", "2", "--svg", part.to_str().unwrap()], WAIT), "trace --steps");
    let rows = groups(&std::fs::read_to_string(&part).unwrap(), "row");
    for (d, cats) in &rows {
        let forwards = cats.iter().filter(|c| *c == "forward").count();
        assert_eq!(forwards, 2, "{}: step 2's two micro-batches only: {cats:?}", data(d, "label"));
    }
    let none = troupe(&["trace", run_arg, "--steps", "7..9"], WAIT);
    assert!(String::from_utf8_lossy(&none.stderr).contains("steps 1..3"), "{}", String::from_utf8_lossy(&none.stderr));
}

#[test]
fn a_pipeline_schedule_trace_file_is_drawn_per_stage_with_its_own_categories() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("schedule.json");
    // As `troupe bench pipeline --trace-out` writes it: one process, a thread per stage named by
    // metadata, fractional microseconds.
    let mut events: Vec<Value> = (0..2)
        .map(|s| json!({ "name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": { "name": format!("stage {s}") } }))
        .collect();
    for (stage, start) in [(0, 0.0), (1, 10.5)] {
        for (i, cat) in ["forward", "comm", "backward", "weight"].iter().enumerate() {
            let ts = start + 10.0 * i as f64;
            events.push(json!({ "name": format!("{cat} mb0"), "cat": cat, "ph": "X", "ts": ts, "dur": 9.25, "pid": 0, "tid": stage }));
        }
    }
    // And a second file: one process per stage, the second named, the first not.
    let other = dir.path().join("per-process.json");
    let mut per_process = vec![json!({ "name": "process_name", "ph": "M", "pid": 1, "args": { "name": "stage B" } })];
    for pid in [0, 1] {
        per_process
            .push(json!({ "name": "F", "cat": "forward", "ph": "X", "ts": pid, "dur": 1, "pid": pid, "tid": 0 }));
    }
    std::fs::write(&file, json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()).unwrap();
    std::fs::write(&other, json!({ "traceEvents": per_process }).to_string()).unwrap();
    let out = ok(&troupe(&["trace", file.to_str().unwrap()], WAIT), "trace");
    assert!(out.contains("8 spans in 2 rows"), "{out}");
    let svg = std::fs::read_to_string(dir.path().join("schedule.svg")).unwrap();
    let rows = groups(&svg, "row");
    let labels: Vec<&str> = rows.iter().map(|(d, _)| data(d, "label")).collect();
    assert_eq!(labels, ["stage 0", "stage 1"]);
    assert!(rows.iter().all(|(_, cats)| cats == &["forward", "comm", "backward", "weight"]));
    let legend: Vec<String> = groups(&svg, "legend-item").iter().map(|(d, _)| data(d, "cat").to_owned()).collect();
    assert_eq!(legend, ["forward", "backward", "weight", "comm"]);
    ok(
        &troupe(&["trace", other.to_str().unwrap(), "--svg", dir.path().join("p.svg").to_str().unwrap()], WAIT),
        "trace",
    );
    let rows = groups(&std::fs::read_to_string(dir.path().join("p.svg")).unwrap(), "row");
    let labels: Vec<&str> = rows.iter().map(|(d, _)| data(d, "label")).collect();
    assert_eq!(labels, ["pid 0", "stage B"]);
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"events\": []}").unwrap();
    let refused = troupe(&["trace", bad.to_str().unwrap()], WAIT);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a Chrome trace-event JSON file"));
}

/// `GET path` over TLS to `addr`, trusting `ca`, the server named `server`, presenting `client`'s
/// certificate if any: the raw answer, or the error that ended the connection.
async fn https_get(
    addr: SocketAddr,
    ca: &rustls::pki_types::CertificateDer<'static>,
    server: &str,
    client: Option<&NodeIdentity>,
    path: &str,
) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some(id) => builder.with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key()).unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from(server.to_owned()).unwrap();
    let fetch = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let mut tls = connector.connect(name, tcp).await?;
        tls.write_all(format!("GET {path} HTTP/1.1\r\nHost: {server}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
        let mut answer = Vec::new();
        tls.read_to_end(&mut answer).await?;
        Ok(String::from_utf8_lossy(&answer).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(10), fetch).await.expect("an answer or a refusal within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_dashboard_auth_only_clients_holding_a_cluster_certificate_are_served_over_https() {
    let dir = tempfile::tempdir().unwrap();
    let (certs, strangers) = (dir.path().join("certs"), dir.path().join("other-cluster"));
    troupe_cluster::init_cluster(&certs).unwrap();
    troupe_cluster::init_cluster(&strangers).unwrap();
    for name in ["node-a", "viewer"] {
        troupe_cluster::add_node(name, &certs).unwrap();
    }
    troupe_cluster::add_node("intruder", &strangers).unwrap();
    let text = format!(
        "name = \"node-a\"\nlisten = \"127.0.0.1:0\"\ndata_dir = \"{}\"\ncerts = \"{}\"\ntorch_threads = 1\n[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\ndashboard_auth = true\n",
        dir.path().join("data").display(),
        certs.display()
    );
    let daemon = troupe_actors::daemon::Daemon::start(NodeConfig::parse(&text, "node.toml").unwrap()).await.unwrap();
    let addr = daemon.metrics_addr().unwrap();
    let viewer = NodeIdentity::load(&certs, "viewer").unwrap();
    let intruder = NodeIdentity::load(&strangers, "intruder").unwrap();

    let served = https_get(addr, &viewer.ca, "node-a", Some(&viewer), "/status").await.unwrap();
    assert!(served.starts_with("HTTP/1.1 200") && served.contains("\"node\":\"node-a\""), "{served}");
    let page = https_get(addr, &viewer.ca, "node-a", Some(&viewer), "/").await.unwrap();
    assert!(page.starts_with("HTTP/1.1 200") && page.contains(r#"data-node="node-a""#), "{page}");
    for (who, client) in [("no certificate", None), ("another cluster's certificate", Some(&intruder))] {
        let refused = https_get(addr, &viewer.ca, "node-a", client, "/status").await;
        assert!(!refused.as_deref().unwrap_or("").contains("200 OK"), "a client with {who} was served: {refused:?}");
    }
    let plain = get(addr, "/status", Duration::from_secs(10)).await;
    assert!(plain.as_ref().map_or(true, |(status, _)| *status != 200), "plain http was served: {plain:?}");
    // Still serving the right clients after the refusals.
    let again = https_get(addr, &viewer.ca, "node-a", Some(&viewer), "/metrics").await.unwrap();
    assert!(again.starts_with("HTTP/1.1 200") && again.contains("troupe_node_info"), "{again}");

    let bad = NodeConfig::parse(&text.replace("metrics_listen = \"127.0.0.1:0\"\n", ""), "node.toml");
    let bad = bad.unwrap_err().to_string();
    assert!(bad.contains("telemetry.dashboard_auth") && bad.contains("metrics_listen"), "{bad}");
    daemon.drain().await.unwrap();
}
