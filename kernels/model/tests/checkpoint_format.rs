//! The version-2 checkpoint format: resharding round trips are bit-exact, shards are standard
//! safetensors, version-1 checkpoints still load, bad checkpoints get errors that say what is wrong, and
//! the asynchronous writer writes one at a time and lets a newer snapshot replace a queued one.

use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use tch::Tensor;
use troupe_kernels::checksum64;
use troupe_model::checkpoint::{
    load_shard, load_state, Catalog, CatalogEntry, CheckpointError, CheckpointStore, CheckpointWriter, Layout,
    MemoryCatalog, SaveRequest, TrainingState, WriteReport,
};
use troupe_model::config::JobConfig;
use troupe_model::Trainer;

/// A small model after two steps, so both AdamW moments are non-zero.
fn trained_state() -> (JobConfig, TrainingState) {
    tch::set_num_threads(1);
    let config = JobConfig::small(4);
    let mut trainer = Trainer::new(config.clone()).unwrap();
    trainer.train_step();
    trainer.train_step();
    (config, TrainingState::snapshot(&trainer))
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn assert_same(a: &TrainingState, b: &TrainingState, what: &str) {
    assert_eq!((a.step, a.optimizer_step, &a.sampler, &a.tensors), (b.step, b.optimizer_step, &b.sampler, &b.tensors));
    for k in 0..3 {
        assert!(bits(&a.values[k]) == bits(&b.values[k]), "{what}: state {k} differs");
    }
}

fn store(root: &Path) -> CheckpointStore {
    CheckpointStore::with_catalog(root, 0, Arc::new(MemoryCatalog::default())).unwrap()
}

#[test]
fn resharding_round_trips_between_one_and_four_shards_are_bit_exact() {
    let (config, original) = trained_state();
    let dir = tempfile::tempdir().unwrap();
    for saved_as in 1..=4 {
        let root = dir.path().join(format!("saved-{saved_as}"));
        let path = store(&root).save(&original, &Layout::ddp(saved_as)).unwrap().path;
        let files: Vec<_> = std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(files.len(), saved_as + 1, "{saved_as} shards and the manifest: {files:?}");
        assert_same(&load_state(&path).unwrap(), &original, &format!("saved as {saved_as}"));
        for loaded_as in 1..=4 {
            // Each target shard alone, reading only the files it overlaps: together, the original state.
            let mut joined = [Vec::new(), Vec::new(), Vec::new()];
            for index in 0..loaded_as {
                let (range, values) = load_shard(&path, loaded_as, index).unwrap();
                assert_eq!(range.start, joined[0].len());
                for (j, v) in joined.iter_mut().zip(values) {
                    j.extend(v);
                }
            }
            for (k, joined) in joined.iter().enumerate() {
                assert!(bits(joined) == bits(&original.values[k]), "{saved_as} → {loaded_as} shards: state {k}");
            }
            // And saved again in the other layout, then loaded whole.
            let again = dir.path().join(format!("again-{saved_as}-{loaded_as}"));
            let state = load_state(&path).unwrap();
            let path2 = store(&again).save(&state, &Layout::ddp(loaded_as)).unwrap().path;
            assert_same(&load_state(&path2).unwrap(), &original, &format!("{saved_as} → {loaded_as} → whole"));
        }
        // Into the full reference trainer.
        let mut trainer = Trainer::new(config.clone()).unwrap();
        trainer.restore_checkpoint(&path).unwrap();
        assert_same(&TrainingState::snapshot(&trainer), &original, &format!("{saved_as} shards → trainer"));
    }
}

#[test]
fn shards_are_standard_safetensors_and_one_shard_holds_the_model_by_name() {
    let (_, original) = trained_state();
    let dir = tempfile::tempdir().unwrap();
    let path = store(dir.path()).save(&original, &Layout::ddp(1)).unwrap().path;
    let tensors = Tensor::read_safetensors(path.join("shard-00000-of-00001.safetensors")).unwrap();
    let wte = &tensors.iter().find(|(n, _)| n == "wte.weight").unwrap().1;
    assert_eq!(wte.size(), vec![256, 64]);
    assert!(tensors.iter().any(|(n, _)| n == "exp_avg_sq.lm_head.weight"));
    assert_eq!(tensors.len(), 3 * original.tensors.len());
}

#[test]
fn a_version_1_checkpoint_still_loads() {
    let (config, original) = trained_state();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let offsets = original.offsets();
    let named = |kind: usize, prefix: &str| -> Vec<(String, Tensor)> {
        original
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
                let values =
                    Tensor::from_slice(&original.values[kind][offsets[i]..offsets[i + 1]]).view(shape.as_slice());
                (format!("{prefix}{}", t.name), values)
            })
            .collect()
    };
    let mut optimizer = named(1, "exp_avg.");
    optimizer.extend(named(2, "exp_avg_sq."));
    let mut files = Vec::new();
    for (name, tensors) in [("model.safetensors", named(0, "")), ("optimizer.safetensors", optimizer)] {
        Tensor::write_safetensors(&tensors, dir.join(name)).unwrap();
        let bytes = std::fs::read(dir.join(name)).unwrap();
        files.push(serde_json::json!({ "name": name, "bytes": bytes.len(), "checksum": checksum64(&bytes) }));
    }
    let manifest = serde_json::json!({
        "format": "troupe-checkpoint", "version": 1, "step": original.step, "config": config,
        "sampler": original.sampler, "optimizer_step": original.optimizer_step, "files": files,
    });
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&manifest).unwrap()).unwrap();
    assert_same(&load_state(dir).unwrap(), &original, "version 1");
    let (_, half) = load_shard(dir, 2, 1).unwrap();
    assert!(bits(&half[2]) == bits(&original.values[2][original.flat_len() - half[2].len()..]));
}

#[test]
fn bad_checkpoints_are_refused_with_what_is_wrong_and_the_previous_one_is_found() {
    let (_, original) = trained_state();
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let at = |step: u64| {
        let mut state = original.clone();
        state.step = step;
        state.sampler.next_step = step;
        store.save(&state, &Layout::ddp(2)).unwrap().path
    };
    let (older, newer) = (at(2), at(4));
    let check = |expect: &str| {
        let error = load_state(&newer).unwrap_err().to_string();
        assert!(error.contains(expect), "expected {expect:?} in: {error}");
        let (latest, skipped) = store.latest_valid();
        assert_eq!(latest.as_deref(), Some(older.as_path()));
        assert_eq!(skipped.len(), 1);
    };
    let shard = newer.join("shard-00001-of-00002.safetensors");
    let good = std::fs::read(&shard).unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x01;
    std::fs::write(&shard, &flipped).unwrap();
    check("does not match its checksum");
    std::fs::write(&shard, &good[..good.len() - 8]).unwrap();
    check("is torn or corrupt");
    std::fs::remove_file(&shard).unwrap();
    check("shard-00001-of-00002.safetensors");
    std::fs::write(&shard, &good).unwrap();
    assert_eq!(store.latest_valid().0.as_deref(), Some(newer.as_path()));

    let manifest = newer.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, &text[..text.len() / 2]).unwrap();
    check("manifest is not valid");
    std::fs::write(&manifest, text.replace("\"version\": 2", "\"version\": 4")).unwrap();
    check("upgrade troupe");
    let tampered = text.replacen("\"step\":", "\"unknown_key\": 1, \"step\":", 1);
    std::fs::write(&manifest, tampered).unwrap();
    check("manifest is not valid");
}

/// A catalog whose `record` waits at a gate: holds the writer busy mid-commit, deterministically.
struct GatedCatalog {
    inner: MemoryCatalog,
    entered: Mutex<mpsc::Sender<u64>>,
    gate: Mutex<mpsc::Receiver<()>>,
}

impl Catalog for GatedCatalog {
    fn record(&self, entry: &CatalogEntry) -> Result<(), CheckpointError> {
        self.entered.lock().unwrap().send(entry.step).unwrap();
        self.gate.lock().unwrap().recv_timeout(Duration::from_secs(30)).expect("the test opens the gate");
        self.inner.record(entry)
    }
    fn remove(&self, step: u64) -> Result<(), CheckpointError> {
        self.inner.remove(step)
    }
    fn entries(&self) -> Result<Vec<CatalogEntry>, CheckpointError> {
        self.inner.entries()
    }
}

#[test]
fn the_async_writer_writes_one_at_a_time_and_a_newer_snapshot_replaces_a_queued_one() {
    let (_, original) = trained_state();
    let dir = tempfile::tempdir().unwrap();
    let (entered_tx, entered) = mpsc::channel();
    let (open, gate) = mpsc::channel();
    let catalog = Arc::new(GatedCatalog {
        inner: MemoryCatalog::default(),
        entered: Mutex::new(entered_tx),
        gate: Mutex::new(gate),
    });
    let store = CheckpointStore::with_catalog(dir.path(), 2, catalog.clone()).unwrap();
    let (reports_tx, reports) = mpsc::channel();
    let reports_tx = Mutex::new(reports_tx);
    let writer = CheckpointWriter::spawn(store, move |r| reports_tx.lock().unwrap().send(r).unwrap()).unwrap();
    let request = |step: u64| {
        let mut state = original.clone();
        state.step = step;
        SaveRequest { state: Box::new(state), layout: Layout::ddp(3), tag: step * 100 }
    };
    writer.submit(request(1));
    assert_eq!(entered.recv_timeout(Duration::from_secs(30)).unwrap(), 1, "step 1 is being committed");
    writer.submit(request(2));
    writer.submit(request(3));
    let superseded = reports.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(matches!(superseded, WriteReport::Superseded { tag: 200, step: 2, by: 3 }), "{superseded:?}");
    assert!(!writer.is_idle());
    assert!(entered.recv_timeout(Duration::from_millis(200)).is_err(), "no second write while one is in flight");
    open.send(()).unwrap();
    assert_eq!(entered.recv_timeout(Duration::from_secs(30)).unwrap(), 3);
    open.send(()).unwrap();
    assert!(writer.wait_idle(Duration::from_secs(30)));
    let durable: Vec<(u64, u64)> = reports
        .try_iter()
        .map(|r| match r {
            WriteReport::Durable { tag, saved } => (tag, saved.step),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(durable, vec![(100, 1), (300, 3)]);
    writer.close();
    let steps: Vec<u64> = catalog.entries().unwrap().iter().map(|e| e.step).collect();
    assert_eq!(steps, vec![1, 3]);
}

#[test]
fn refreshing_a_recycled_snapshot_equals_a_fresh_one() {
    tch::set_num_threads(1);
    let mut trainer = Trainer::new(JobConfig::small(4)).unwrap();
    trainer.train_step();
    let mut recycled = TrainingState::snapshot(&trainer);
    trainer.train_step();
    recycled.refresh(&trainer);
    assert_same(&recycled, &TrainingState::snapshot(&trainer), "refreshed");
    assert_eq!(recycled.step, 2);
}
