//! The user guide documents every config key: each key the job config and node.toml accept (as their
//! defaults serialise them) appears, in backticks, in the guide's reference section for that file. A key
//! added to a config without a line in docs/guide.md fails here.

use troupe_actors::daemon::NodeConfig;
use troupe_model::config::JobConfig;

/// The guide's text from `start` up to the next `## ` heading.
fn section(start: &str) -> String {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/guide.md")).unwrap();
    let from = guide.find(start).unwrap_or_else(|| panic!("docs/guide.md has no section {start:?}"));
    let rest = &guide[from + start.len()..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_string()
}

/// Every key of `value`'s tables, dotted (`train.lr`), leaves only.
fn keys(value: &toml::Value, prefix: &str, out: &mut Vec<String>) {
    if let toml::Value::Table(table) = value {
        for (key, v) in table {
            let dotted = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
            match v {
                toml::Value::Table(_) => keys(v, &dotted, out),
                _ => out.push(dotted),
            }
        }
    }
}

fn undocumented(config: &impl serde::Serialize, text: &str) -> Vec<String> {
    let mut all = Vec::new();
    keys(&toml::Value::try_from(config).unwrap(), "", &mut all);
    assert!(all.len() > 10, "the walk found the keys: {all:?}");
    all.into_iter().filter(|k| !text.contains(&format!("`{}`", k.rsplit('.').next().unwrap()))).collect()
}

#[test]
fn every_job_config_key_is_in_the_guide() {
    let mut config = JobConfig::default();
    // Keys serialised only when set.
    config.data.path = Some("corpus.bin".into());
    config.data.tokenizer = Some("tokenizer.json".into());
    config.data.val_path = Some("val.bin".into());
    config.checkpoint.dir = Some("ckpt".into());
    config.model.peft =
        Some(troupe_model::model::PeftConfig { from_adapters: Some("adapters".into()), ..Default::default() });
    let elsewhere = undocumented(&config, &section("## 3. node.toml reference"));
    assert!(elsewhere.contains(&"train.global_batch".to_string()), "the check tells sections apart: {elsewhere:?}");
    let missing = undocumented(&config, &section("## 2. Job config reference"));
    assert!(missing.is_empty(), "job config keys missing from docs/guide.md section 2: {missing:?}");
}

#[test]
fn every_node_toml_key_is_in_the_guide() {
    let minimal = "name = \"node-a\"\nlisten = \"127.0.0.1:7400\"\ndata_dir = \"/d\"\ncerts = \"/c\"\n";
    let mut config: NodeConfig = toml::from_str(minimal).unwrap();
    // Keys serialised only when set.
    config.join = Some("127.0.0.1:7401".parse().unwrap());
    config.telemetry.metrics_listen = Some("127.0.0.1:9400".parse().unwrap());
    config.telemetry.peak_tflops_per_slot = Some(1.0);
    config.telemetry.otlp_endpoint = Some("http://127.0.0.1:4317".into());
    let missing = undocumented(&config, &section("## 3. node.toml reference"));
    assert!(missing.is_empty(), "node.toml keys missing from docs/guide.md section 3: {missing:?}");
}
