//! How a run reports itself: JSON lines on stdout with `--json` (one object per event, DESIGN.md §3),
//! otherwise a progress bar on an interactive terminal plus periodic plain lines that also read well in
//! a CI log. With a run directory every event is also appended to its `events.jsonl`.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use crate::telemetry::RunDir;

fn mib(bytes: u64) -> f64 {
    (bytes as f64 / 1048576.0 * 10.0).round() / 10.0
}

/// A bar over `total` bytes on an interactive stderr (none with `--json` or in a log).
pub fn bytes_bar(json: bool, total: u64, what: &str) -> Option<ProgressBar> {
    (!json && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        let template = format!("{what} {{wide_bar}} {{bytes}}/{{total_bytes}} {{bytes_per_sec}} [{{eta}}]");
        bar.set_style(ProgressStyle::with_template(&template).expect("valid template"));
        bar
    })
}

/// A spinner with a message on stderr while it lives, for work that reports no progress of its own.
#[derive(Debug)]
pub struct Spinner(ProgressBar);

impl Drop for Spinner {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// A [`Spinner`] on an interactive stderr (none with `--json` or in a log).
pub fn spinner(json: bool, message: String) -> Option<Spinner> {
    (!json && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("valid template"));
        bar.set_message(message);
        bar.enable_steady_tick(Duration::from_millis(120));
        Spinner(bar)
    })
}

/// One committed step, as reported.
#[derive(Clone, Debug)]
pub struct StepEvent {
    /// Committed steps after this one (1-based).
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub epoch: u64,
    pub world: usize,
    /// Peak resident memory of each rank's process so far, in bytes, by rank (one entry when the ranks
    /// share this process).
    pub peak_rss_bytes: Vec<u64>,
    /// fp16: the gradients overflowed and the step applied no update.
    pub skipped: bool,
    /// The loss scale the step's backward ran at (1 unless fp16).
    pub loss_scale: f64,
    /// Pipelines: the step's bubble (idle over device time in its schedule).
    pub bubble: Option<f64>,
    /// Model FLOPs utilisation, when every rank's device peak is known (`JobEvent::Step::mfu`).
    pub mfu: Option<f64>,
}

#[derive(Debug)]
pub struct Reporter {
    json: bool,
    total_steps: u64,
    log_every: u64,
    bar: Option<ProgressBar>,
    run_dir: Option<Mutex<RunDir>>,
    /// Steps reported skipped (fp16 overflow), for the summary.
    skipped: AtomicU64,
}

impl Reporter {
    /// `log_every`: plain-line interval in steps (0 picks about 20 lines per run).
    pub fn new(json: bool, first_step: u64, total_steps: u64, log_every: u64) -> Self {
        let log_every = if log_every > 0 { log_every } else { (total_steps / 20).max(1) };
        let bar = (!json && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{spinner} step {pos}/{len} {wide_bar} {msg} [{elapsed_precise} < {eta}]")
                    .expect("valid template"),
            );
            bar.set_position(first_step);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Self { json, total_steps, log_every, bar, run_dir: None, skipped: AtomicU64::new(0) }
    }

    /// Also records every event in `run_dir` (`--run-dir`).
    pub fn with_run_dir(mut self, run_dir: Option<RunDir>) -> Self {
        self.run_dir = run_dir.map(Mutex::new);
        self
    }

    fn record(&self, event: &Value) {
        if let Some(dir) = &self.run_dir {
            dir.lock().unwrap_or_else(|p| p.into_inner()).record(event.clone());
        }
    }

    /// An event for the run directory only (a rank's step phases): never printed.
    pub fn record_only(&self, name: &str, fields: Value) {
        if self.run_dir.is_some() {
            self.record(&with_name(name, fields));
        }
    }

    /// A line for people (ignored in JSON mode, which gets `event` objects instead).
    pub fn say(&self, line: &str) {
        if self.json {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }

    /// A non-step event (`{"event": name, ...fields}`); people get `line`.
    pub fn event(&self, name: &str, fields: Value, line: &str) {
        let object = with_name(name, fields);
        self.record(&object);
        if self.json {
            emit(&object);
        } else {
            self.say(line);
        }
    }

    /// A durable checkpoint of `step`: `bytes` written (0: unknown) in `seconds`.
    pub fn checkpoint(&self, step: u64, path: &std::path::Path, seconds: f64, bytes: u64) {
        let rate = if bytes > 0 && seconds > 0.0 {
            format!(", {:.1} MiB at {:.0} MiB/s", mib(bytes), bytes as f64 / 1048576.0 / seconds)
        } else {
            String::new()
        };
        self.event(
            "checkpoint",
            json!({ "step": step, "path": path, "seconds": seconds, "bytes": bytes }),
            &format!("checkpoint: step {step} saved to {} in {seconds:.2} s{rate}", path.display()),
        );
    }

    /// The validation loss of the model after `step` committed steps over `windows` held-out windows
    /// (`tokens` predicted tokens).
    pub fn eval(&self, step: u64, loss: f64, perplexity: f64, windows: usize, tokens: usize) {
        self.event(
            "eval",
            json!({ "step": step, "loss": loss, "perplexity": perplexity, "windows": windows, "tokens": tokens }),
            &format!(
                "eval   {step:>6}/{}  validation loss {loss:.4}  perplexity {perplexity:.2}  ({windows} windows, {tokens} tokens)",
                self.total_steps
            ),
        );
    }

    pub fn step(&self, e: &StepEvent) {
        let mut object = json!({
            "event": "step", "step": e.step, "loss": e.loss, "tokens_per_s": e.tokens_per_s,
            "epoch": e.epoch, "world": e.world, "lr": e.lr, "grad_norm": e.grad_norm,
            "peak_rss_mib_per_rank": e.peak_rss_bytes.iter().map(|&b| mib(b)).collect::<Vec<f64>>(),
            "skipped": e.skipped, "loss_scale": e.loss_scale,
        });
        if let (Some(bubble), Some(fields)) = (e.bubble, object.as_object_mut()) {
            fields.insert("bubble".into(), json!(bubble));
        }
        if let (Some(mfu), Some(fields)) = (e.mfu, object.as_object_mut()) {
            fields.insert("mfu".into(), json!(mfu));
        }
        if e.skipped {
            self.skipped.fetch_add(1, Ordering::Relaxed);
        }
        self.record(&object);
        if self.json {
            emit(&object);
            return;
        }
        if let Some(bar) = &self.bar {
            bar.set_position(e.step);
            bar.set_message(format!("loss {:.4}  {:.0} tok/s", e.loss, e.tokens_per_s));
        }
        if e.skipped {
            self.say(&format!(
                "step {:>6}/{}  loss {:.4}  skipped: the fp16 gradients overflowed at loss scale {}; no update, the scale halves",
                e.step, self.total_steps, e.loss, e.loss_scale
            ));
        } else if e.step.is_multiple_of(self.log_every) || e.step == self.total_steps || e.step == 1 {
            let peak =
                e.peak_rss_bytes.iter().copied().max().map_or(String::new(), |b| format!("  peak {:.0} MiB", mib(b)));
            let scale = if e.loss_scale != 1.0 { format!("  loss-scale {}", e.loss_scale) } else { String::new() };
            let bubble = e.bubble.map_or(String::new(), |b| format!("  bubble {:.0}%", b * 100.0));
            let mfu = e.mfu.map_or(String::new(), |m| format!("  MFU {:.1}%", m * 100.0));
            self.say(&format!(
                "step {:>6}/{}  loss {:.4}  lr {:.2e}  grad-norm {:.3}  {:.0} tokens/s{mfu}{bubble}{peak}{scale}",
                e.step, self.total_steps, e.loss, e.lr, e.grad_norm, e.tokens_per_s
            ));
        }
    }

    /// The steps the run trains for.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// Ends the bar and prints the summary (`{"event":"summary", ...}` or `line`).
    /// With a run directory, then writes its trace and says where the run was recorded.
    /// Steps skipped for an fp16 overflow are added to both (`skipped_steps`).
    pub fn finish(self, mut summary: Value, line: &str) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        let skipped = self.skipped.load(Ordering::Relaxed);
        let mut line = line.to_owned();
        if skipped > 0 {
            if let Some(fields) = summary.as_object_mut() {
                fields.insert("skipped_steps".into(), json!(skipped));
            }
            line.push_str(&format!(" ({skipped} step(s) skipped for an fp16 overflow)"));
        }
        self.event("summary", summary, &line);
        self.close();
    }

    /// Ends the bar without a summary (a run that did not finish); with a run directory, writes its
    /// trace of what was recorded and says where.
    pub fn close(mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        let Some(dir) = self.run_dir.take().map(|d| d.into_inner().unwrap_or_else(|p| p.into_inner())) else {
            return;
        };
        let path = dir.path().display().to_string();
        match dir.finish() {
            Ok(_) => self.say(&format!(
                "run recorded in {path} (events.jsonl, trace.json): `troupe trace {path}` draws its timeline, `troupe plot {path}` its loss"
            )),
            Err(e) => eprintln!("troupe: writing the trace of {path}: {e:#}"),
        }
    }
}

fn with_name(name: &str, fields: Value) -> Value {
    let mut object = json!({ "event": name });
    if let (Some(o), Value::Object(f)) = (object.as_object_mut(), fields) {
        o.extend(f);
    }
    object
}

fn emit(value: &Value) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (e.g. `| head`) must not kill a training run: drop the line.
    let _ = writeln!(out, "{value}").and_then(|()| out.flush());
}
