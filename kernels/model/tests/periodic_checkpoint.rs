//! Checkpoints of periodically synchronizing jobs (`parallel.sync = "local_sgd" | "diloco"`), on the
//! single-process reference (`ReplicaSet`), through the disk format: a resume on the same world is the
//! uninterrupted run bit for bit (every replica's own inner optimizer state and DiLoCo's outer momentum
//! are saved; without them it is not); a resume on another world gives replica `r` saved replica
//! `r mod n`'s state, as a membership change at that synchronization does; the periodic part reshards;
//! checkpoints without it (version 2) are still written and read as before.

use std::path::Path;
use std::sync::Arc;

use troupe_model::checkpoint::{load_state, CheckpointStore, Layout, MemoryCatalog, TrainingState, MANIFEST};
use troupe_model::config::JobConfig;
use troupe_model::oracle::compare_params;
use troupe_model::periodic::ReplicaSet;

const SAVED: u64 = 8;
const STEPS: u64 = 16;

fn job(sync: &str, fragments: usize) -> JobConfig {
    tch::set_num_threads(1);
    let mut config = JobConfig::default();
    (config.model.n_layers, config.model.d_model, config.model.context) = (2, 64, 32);
    (config.train.steps, config.train.global_batch, config.train.micro_batch) = (STEPS, 6, 2);
    config.train.warmup_steps = 2;
    (config.parallel.sync, config.parallel.sync_every, config.parallel.fragments) = (sync.into(), 4, fragments);
    config
}

fn store(root: &Path) -> CheckpointStore {
    CheckpointStore::with_catalog(root, 0, Arc::new(MemoryCatalog::default())).unwrap()
}

/// `world` replicas trained to step `to`.
fn trained(config: &JobConfig, world: usize, to: u64) -> ReplicaSet {
    let mut set = ReplicaSet::new(config, world).unwrap();
    while set.step() < to {
        set.train_step();
    }
    set
}

fn finish(mut set: ReplicaSet) -> ReplicaSet {
    while set.step() < STEPS {
        set.train_step();
    }
    set
}

/// Saves `state` in `shards` files under `root` and loads it back.
fn through_disk(state: &TrainingState, root: &Path, shards: usize) -> (TrainingState, serde_json::Value) {
    let path = store(root).save(state, &Layout::ddp(shards)).unwrap().path;
    let manifest = serde_json::from_slice(&std::fs::read(path.join(MANIFEST)).unwrap()).unwrap();
    (load_state(&path).unwrap(), manifest)
}

fn worst(a: &ReplicaSet, b: &ReplicaSet) -> f64 {
    compare_params(a.first().model.specs(), &a.params(), &b.params()).worst
}

#[test]
fn a_periodic_checkpoint_resumed_on_the_same_world_is_the_uninterrupted_run_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for (sync, world, fragments) in [("diloco", 2, 1), ("local_sgd", 3, 1), ("diloco", 2, 2)] {
        let what = format!("{sync} H=4 P={fragments} on {world} replicas");
        let config = job(sync, fragments);
        let uninterrupted = finish(trained(&config, world, STEPS));
        let saved = trained(&config, world, SAVED).checkpoint_state();
        let (loaded, manifest) = through_disk(&saved, &dir.path().join(&what), 2);
        assert_eq!(manifest["version"], 3, "{what}: a periodic part is format version 3");
        assert_eq!(loaded, saved, "{what}: the periodic part round-trips");
        let resumed = finish(ReplicaSet::resume(&config, &loaded, world).unwrap());
        assert_eq!(worst(&resumed, &uninterrupted), 0.0, "{what}: resumed vs uninterrupted");
        // What a checkpoint without the part (rank 0's moments for every rank, no outer momentum) gave.
        let mut without = loaded.clone();
        without.periodic = None;
        let old = finish(ReplicaSet::resume(&config, &without, world).unwrap());
        let off = worst(&old, &uninterrupted);
        assert!(off > 1e-5, "{what}: without the ranks' own states the resume is another run ({off:e})");
    }
}

/// Adafactor as the inner optimizer: each replica's factored statistics (packed in the optimizer's two
/// slots) are its own part of the checkpoint, as AdamW's moments are; resumed, the run is the
/// uninterrupted one bit for bit, and without the ranks' own states it is not.
#[test]
fn an_adafactor_periodic_checkpoint_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    for (sync, fragments) in [("local_sgd", 1), ("diloco", 2)] {
        let what = format!("{sync} P={fragments} with Adafactor");
        let mut config = job(sync, fragments);
        config.train.optimizer = "adafactor".into();
        troupe_model::optim::validate(&config.train, std::iter::empty()).unwrap();
        let uninterrupted = finish(trained(&config, 2, STEPS));
        let adamw = finish(trained(&job(sync, fragments), 2, STEPS));
        assert!(worst(&uninterrupted, &adamw) > 1e-3, "{what}: Adafactor trained, not AdamW");
        let saved = trained(&config, 2, SAVED).checkpoint_state();
        let (loaded, _) = through_disk(&saved, &dir.path().join(&what), 2);
        assert_eq!(loaded, saved, "{what}: the periodic part round-trips");
        let resumed = finish(ReplicaSet::resume(&config, &loaded, 2).unwrap());
        assert_eq!(worst(&resumed, &uninterrupted), 0.0, "{what}: resumed vs uninterrupted");
        let mut without = loaded.clone();
        without.periodic = None;
        let off = worst(&finish(ReplicaSet::resume(&config, &without, 2).unwrap()), &uninterrupted);
        assert!(off > 1e-6, "{what}: without the ranks' own states the resume is another run ({off:e})");
    }
}

#[test]
fn a_resume_on_another_world_gives_replica_r_the_state_of_saved_replica_r_mod_n() {
    let dir = tempfile::tempdir().unwrap();
    let config = job("diloco", 1);
    let saved = trained(&config, 2, SAVED).checkpoint_state();
    let (loaded, _) = through_disk(&saved, dir.path(), 1);
    for (world, members) in [(3, vec![0, 1, 0]), (1, vec![0])] {
        let resumed = finish(ReplicaSet::resume(&config, &loaded, world).unwrap());
        let mut regrouped = trained(&config, 2, SAVED);
        regrouped.regroup(&members).unwrap();
        let regrouped = finish(regrouped);
        assert_eq!(worst(&resumed, &regrouped), 0.0, "2 → {world} replicas: a regroup to {members:?} at step {SAVED}");
    }
}

#[test]
fn the_periodic_part_reshards_and_a_version_2_checkpoint_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let config = job("diloco", 1);
    let set = trained(&config, 3, SAVED);
    let saved = set.checkpoint_state();
    let outer_files = |m: &serde_json::Value| {
        let names = m["files"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap().to_owned());
        names.filter(|n| n.starts_with("outer-")).count()
    };
    let (as2, m2) = through_disk(&saved, &dir.path().join("two"), 2);
    let (as4, m4) = through_disk(&as2, &dir.path().join("four"), 4);
    assert_eq!((outer_files(&m2), outer_files(&m4)), (2, 4), "the outer momentum is cut like the parameters");
    assert_eq!(m4["periodic"]["ranks"], 3);
    assert_eq!(as4, saved, "2 → 4 shards: bit for bit");

    // A plain state is written as version 2, as before, and a periodic job resumes from it with every
    // replica on rank 0's inner state and the outer momentum at zero.
    let mut plain = saved.clone();
    plain.periodic = None;
    let (loaded, manifest) = through_disk(&plain, &dir.path().join("plain"), 2);
    assert_eq!((manifest["version"].as_u64(), manifest.get("periodic")), (Some(2), None));
    assert_eq!(loaded, plain);
    let resumed = ReplicaSet::resume(&config, &loaded, 3).unwrap();
    assert_eq!(resumed.step(), SAVED);

    // A version-2 manifest that claims a periodic part, and a version newer than this build, are refused.
    let path = dir.path().join("two").join("step-00000008");
    let mut m = m2.clone();
    m["version"] = 2.into();
    std::fs::write(path.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
    let err = load_state(&path).unwrap_err().to_string();
    assert!(err.contains("version 2 with a periodic part"), "{err}");
    m["version"] = 4.into();
    std::fs::write(path.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();
    let err = load_state(&path).unwrap_err().to_string();
    assert!(err.contains("newer than this troupe reads") && err.contains("upgrade troupe"), "{err}");
}
