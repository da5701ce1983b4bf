//! `troupe plan`: where the ranks of a `--tp T --pp P --dp D` job would run, what each holds and what
//! it sends per step — the layout planner ([`crate::plan`]) printed as tables or JSON, without running
//! anything.

use std::path::Path;

use anyhow::{bail, Context};
use troupe_model::config::JobConfig;
use troupe_model::model::presets;
use troupe_model::ModelConfig;

use super::table::Table;
use crate::plan::{plan_layout, Degrees, Host, LayoutPlan, LayoutRequest};

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Tensor-parallel degree: the ranks that split each layer's matrices (parallel.tp).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Pipeline stages (parallel.pp).
    #[arg(long)]
    pub pp: Option<usize>,
    /// Data-parallel replicas (parallel.dp).
    #[arg(long)]
    pub dp: Option<usize>,
    /// The hosts: a count (with --slots), or `name:slots,name:slots,…`.
    #[arg(long, value_name = "N|NAME:SLOTS,…", conflicts_with = "nodes")]
    pub hosts: Option<String>,
    /// Slots (ranks) per host, with --hosts N.
    #[arg(long, conflicts_with = "nodes")]
    pub slots: Option<usize>,
    /// Daemons of one slot each, as `troupe train --nodes` (the same as --hosts N --slots 1).
    #[arg(long)]
    pub nodes: Option<usize>,
    /// The model: a preset (gpt-tiny, the default; llama-tiny, gpt2, …), a job config (.toml: its
    /// [model], [train] batch and [parallel] degrees), or a Hugging Face directory (its config.json).
    #[arg(long, default_value = "gpt-tiny")]
    pub model: String,
    /// Sequence parallelism (the default with --tp > 1).
    #[arg(long, overrides_with = "no_sp")]
    pub sp: bool,
    /// No sequence parallelism: all-reduces instead of all-gather / reduce-scatter pairs.
    #[arg(long, overrides_with = "sp")]
    pub no_sp: bool,
    /// ZeRO stage inside the data-parallel groups, 0..=3 (parallel.shard zero1..zero3).
    #[arg(long, value_name = "N")]
    pub zero: Option<u8>,
    /// Let a tensor group span hosts when the hosts' slots cannot hold every group whole.
    #[arg(long)]
    pub tp_across_hosts: bool,
    /// The plan as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let request = request(&args)?;
    let plan = plan_layout(&request)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", render(&plan));
    }
    Ok(())
}

/// The job config `--model` names: a preset's, a job config file, or a Hugging Face directory's.
fn job_config(model: &str) -> anyhow::Result<JobConfig> {
    let path = Path::new(model);
    let mut config = JobConfig::default();
    if path.extension().is_some_and(|e| e == "toml") {
        return JobConfig::from_file(path).with_context(|| format!("--model {model}"));
    }
    config.model = if path.join("config.json").is_file() {
        troupe_model::hf::read_config(path).with_context(|| format!("--model {model}"))?
    } else if let Some(preset) = presets::preset(model) {
        ModelConfig { preset: Some(model.to_owned()), ..preset }
    } else {
        bail!(
            "--model {model:?}: not a preset ({}), a job config (.toml) or a Hugging Face directory",
            presets::names()
        );
    };
    config.model.validate().with_context(|| format!("--model {model}"))?;
    Ok(config)
}

/// The hosts and how they were given (for errors).
fn hosts(args: &PlanArgs) -> anyhow::Result<(Vec<Host>, String)> {
    if let Some(nodes) = args.nodes {
        return Ok((Host::uniform(nodes, 1), format!("--nodes {nodes} (one slot each)")));
    }
    let Some(spec) = &args.hosts else {
        bail!("name the hosts: --hosts N --slots S, --hosts NAME:SLOTS,NAME:SLOTS,… or --nodes N");
    };
    if let Ok(count) = spec.parse::<usize>() {
        let Some(slots) = args.slots else { bail!("--hosts {count}: give the slots per host too (--slots S)") };
        return Ok((Host::uniform(count, slots), format!("--hosts {count} × --slots {slots}")));
    }
    if args.slots.is_some() {
        bail!("--slots goes with --hosts N; --hosts {spec} names each host's slots already");
    }
    let hosts = spec
        .split(',')
        .map(|entry| {
            let (name, slots) = entry.split_once(':').context("each host as NAME:SLOTS")?;
            let slots = slots.parse().with_context(|| format!("slots of host {name:?}: {slots:?} is not a count"))?;
            Ok(Host { name: name.to_owned(), slots })
        })
        .collect::<anyhow::Result<Vec<Host>>>()
        .with_context(|| format!("--hosts {spec}"))?;
    let total: usize = hosts.iter().map(|h| h.slots).sum();
    Ok((hosts, format!("--hosts {spec} ({total} slots)")))
}

fn request(args: &PlanArgs) -> anyhow::Result<LayoutRequest> {
    let config = job_config(&args.model)?;
    let (hosts, world_source) = hosts(args)?;
    let parallel = &config.parallel;
    let tp = args.tp.unwrap_or(1);
    let degrees = Degrees { tp, pp: args.pp.unwrap_or(parallel.pp), dp: args.dp.unwrap_or(parallel.dp.max(1)) };
    let zero = match args.zero {
        Some(zero) => zero,
        None => parallel.shard.strip_prefix("zero").and_then(|n| n.parse().ok()).unwrap_or(0),
    };
    let sp = if args.no_sp { false } else { args.sp || tp > 1 };
    Ok(LayoutRequest {
        degrees,
        sp,
        zero,
        hosts,
        world_source,
        model: config.model,
        global_batch: config.train.global_batch,
        micro_batch: config.train.micro_batch,
        tp_within_host: !args.tp_across_hosts,
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// The plan for people: the ranks, the traffic per stage, the totals and the reasons.
fn render(plan: &LayoutPlan) -> String {
    let mut out = format!(
        "{} ranks = tp {} × pp {} × dp {} on {} hosts; sequence parallelism {}; ZeRO-{}\n\n",
        plan.world,
        plan.tp,
        plan.pp,
        plan.dp,
        plan.hosts.len(),
        if plan.sp { "on" } else { "off" },
        plan.zero
    );
    let mut ranks =
        Table::new(&["RANK", "HOST", "SLOT", "DP", "PP", "TP", "LAYERS", "PARAMS", "GRADS", "OPTIMIZER", "TOTAL"]);
    for r in &plan.ranks {
        let layers = &plan.stages[r.pp].layers;
        let m = &r.memory;
        ranks.row(vec![
            r.rank.to_string(),
            r.host.clone(),
            r.slot.to_string(),
            r.dp.to_string(),
            r.pp.to_string(),
            r.tp.to_string(),
            format!("{}..{}", layers.start, layers.end),
            mib(m.param_bytes),
            mib(m.grad_bytes),
            mib(m.optimizer_bytes),
            mib(m.total_bytes),
        ]);
    }
    out.push_str(&ranks.render());
    out.push_str("\nper step, each rank of a stage sends (fp32, ring formulas):\n");
    let mut traffic = Table::new(&["STAGE", "GROUP", "COLLECTIVE", "CALLS", "ELEMENTS", "SENT/RANK", "WHAT"]);
    for stage in &plan.stages {
        for t in &stage.traffic {
            traffic.row(vec![
                stage.stage.to_string(),
                format!("{:?}", t.group).to_lowercase(),
                t.collective.as_str().into(),
                t.calls.to_string(),
                t.elements.to_string(),
                mib(t.bytes_per_rank),
                t.what.clone(),
            ]);
        }
    }
    out.push_str(&traffic.render());
    let totals: Vec<String> =
        plan.traffic_bytes_by_collective.iter().map(|(k, v)| format!("{k} {}", mib(*v))).collect();
    out.push_str(&format!(
        "all ranks per step: {}\n\nwhy:\n",
        if totals.is_empty() { "nothing".into() } else { totals.join(", ") }
    ));
    for line in &plan.why {
        out.push_str(&format!("- {line}\n"));
    }
    out
}
