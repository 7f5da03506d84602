use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use proptest::prelude::*;

use super::format::{self, Manifest, ShardEntry};
use super::*;
use crate::demo::{Mlp, split_mlp};
use crate::mesh::Layout;
use crate::parallel::gradients::parameter_fingerprint;

fn param(name: &str, id: u64, dims: &[usize], seed: f32) -> NamedParam {
    let n = dims.iter().product();
    NamedParam {
        name: name.into(),
        id,
        dims: dims.to_vec(),
        values: (0..n).map(|i| seed + i as f32 * 0.25).collect(),
    }
}

fn shard(pp: u32, seed: f32) -> ShardSnapshot {
    ShardSnapshot {
        shard: ShardId::stage(pp),
        params: ShardParams::from_params(vec![
            param("layers.0.weight", 11 + u64::from(pp), &[3, 2], seed),
            param("layers.0.bias", 21 + u64::from(pp), &[2], -seed),
        ]),
        optimizer: Some(OptimizerState::from_bytes(vec![pp as u8, 7, 7, 7])),
        training: TrainingState::default(),
    }
}

fn checkpoint(step: u64) -> Checkpoint {
    Checkpoint {
        step,
        layout: Layout::new(2, 2, 1).expect("valid layout"),
        cursor: DataCursor {
            epoch: step / 10,
            batch: step % 10,
        },
        rng: RngState {
            seed: 42,
            state: step * 3 + 1,
        },
        shards: vec![shard(0, step as f32), shard(1, step as f32 + 0.5)],
    }
}

fn root() -> PathBuf {
    PathBuf::from("/ckpt")
}

fn memory_store(keep: usize) -> CheckpointStore<MemoryFs> {
    CheckpointStore::with_fs(MemoryFs::new(), root(), keep).expect("keep ≥ 1")
}

fn loaded_step(store: &CheckpointStore<impl CheckpointFs>) -> Option<u64> {
    store
        .latest_valid()
        .expect("root can be listed")
        .map(|l| l.checkpoint.step)
}

/// A temporary directory removed on drop (no extra dev-dependency).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "meshwork-ckpt-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn step_dir(step: u64) -> PathBuf {
    root().join(format!("step-{step:08}"))
}

// ---- format ----

#[test]
fn shard_and_manifest_round_trip() {
    let c = checkpoint(7);
    for s in &c.shards {
        let bytes = format::encode_shard(s);
        assert_eq!(
            &format::decode_shard(&bytes, Path::new("s")).expect("decodes"),
            s
        );
    }
    let manifest = Manifest::of(
        &c,
        vec![ShardEntry {
            shard: ShardId::stage(0),
            file: ShardId::stage(0).file_name(),
            len: 10,
            crc32: 0xdead_beef,
            parts: Vec::new(),
        }],
    );
    let bytes = format::encode_manifest(&manifest);
    assert_eq!(
        format::decode_manifest(&bytes, Path::new("m")).expect("decodes"),
        manifest
    );
}

/// CKPT-4: a header declaring a huge name or parameter is refused, not allocated.
#[test]
fn huge_declared_lengths_are_refused_without_allocating() {
    let s = ShardSnapshot {
        shard: ShardId::stage(0),
        params: ShardParams::from_params(vec![param("w", 1, &[2], 0.0)]),
        optimizer: None,
        training: TrainingState::default(),
    };
    let bytes = format::encode_shard(&s);
    // The header starts at byte 20: shard id (2 varints), params len (1), then the name's
    // varint length. Declare a name of u64::MAX bytes (varint tag 0xFD + 8 bytes).
    let mut huge_name = bytes[..23].to_vec();
    huge_name.push(0xFD);
    huge_name.extend_from_slice(&u64::MAX.to_le_bytes());
    huge_name.extend_from_slice(&bytes[24..]);
    let len = (huge_name.len() - 20) as u64;
    huge_name[12..20].copy_from_slice(&len.to_le_bytes());
    assert!(matches!(
        format::decode_shard(&huge_name, Path::new("s")),
        Err(CheckpointError::Malformed { .. })
    ));

    // A parameter declaring 2^40 × 2^40 elements: the sizes overflow, checked before use.
    let huge_dims = ShardSnapshot {
        shard: ShardId::stage(0),
        params: ShardParams::from_params(vec![NamedParam {
            name: "w".into(),
            id: 1,
            dims: vec![1 << 40, 1 << 40],
            values: vec![],
        }]),
        optimizer: None,
        training: TrainingState::default(),
    };
    let bytes = format::encode_shard(&huge_dims);
    assert!(matches!(
        format::decode_shard(&bytes, Path::new("s")),
        Err(CheckpointError::Malformed { .. })
    ));
    // 2^30 elements declared, 0 present: truncated, nothing allocated.
    let big = ShardSnapshot {
        shard: ShardId::stage(0),
        params: ShardParams::from_params(vec![NamedParam {
            name: "w".into(),
            id: 1,
            dims: vec![1 << 30],
            values: vec![],
        }]),
        optimizer: None,
        training: TrainingState::default(),
    };
    let bytes = format::encode_shard(&big);
    assert!(matches!(
        format::decode_shard(&bytes, Path::new("s")),
        Err(CheckpointError::Truncated { .. })
    ));
}

#[test]
fn manifest_pointing_outside_its_directory_is_refused() {
    let c = checkpoint(1);
    let manifest = Manifest::of(
        &c,
        vec![ShardEntry {
            shard: ShardId::stage(0),
            file: "../../etc/passwd".into(),
            len: 1,
            crc32: 0,
            parts: Vec::new(),
        }],
    );
    let bytes = format::encode_manifest(&manifest);
    assert!(matches!(
        format::decode_manifest(&bytes, Path::new("m")),
        Err(CheckpointError::Malformed { .. })
    ));
}

// ---- store: CKPT-1 ----

/// CKPT-1: each file goes to a temporary name, is fsynced, renamed, and its directory
/// fsynced; the manifest comes last.
#[test]
fn ckpt1_write_order_is_tmp_fsync_rename_dirsync_manifest_last() {
    let store = memory_store(3);
    let c = checkpoint(5);
    let dir = store.write(&c).expect("writes");
    assert_eq!(dir, step_dir(5));
    let ops: Vec<FsOp> = store
        .fs()
        .ops()
        .into_iter()
        .filter(|op| !matches!(op, FsOp::Read(_) | FsOp::List(_) | FsOp::FileLen(_)))
        .collect();
    let mut expected = vec![
        FsOp::CreateDir(root()),
        FsOp::CreateDir(dir.clone()),
        FsOp::SyncDir(root()),
    ];
    let s0 = format::encode_shard(&c.shards[0]).len();
    let s1 = format::encode_shard(&c.shards[1]).len();
    for (name, len) in [
        ("shard-pp0000-tp0000.bin", s0),
        ("shard-pp0001-tp0000.bin", s1),
    ] {
        let tmp = dir.join(format!("{name}.tmp"));
        expected.extend([
            FsOp::Create(tmp.clone()),
            FsOp::Write(tmp.clone(), len),
            FsOp::SyncFile(tmp.clone()),
            FsOp::Rename(tmp, dir.join(name)),
            FsOp::SyncDir(dir.clone()),
        ]);
    }
    let tmp = dir.join("manifest.tmp");
    let manifest_len = match &ops[ops.len() - 4] {
        FsOp::Write(_, n) => *n,
        other => panic!("expected the manifest's write, got {other:?}"),
    };
    expected.extend([
        FsOp::Create(tmp.clone()),
        FsOp::Write(tmp.clone(), manifest_len),
        FsOp::SyncFile(tmp.clone()),
        FsOp::Rename(tmp, dir.join("manifest")),
        FsOp::SyncDir(dir.clone()),
    ]);
    assert_eq!(ops, expected);
    let loaded = store
        .latest_valid()
        .expect("lists")
        .expect("one checkpoint");
    assert_eq!(loaded.checkpoint, c);
    assert!(loaded.refused.is_empty());
}

/// CKPT-1: the same order on the real file system, which leaves no temporary file.
#[test]
fn ckpt1_real_fs_round_trip_leaves_no_temporary_files() {
    let tmp = TempDir::new("real");
    let store = CheckpointStore::open(&tmp.0, 2).expect("keep ≥ 1");
    assert_eq!(loaded_step(&store), None);
    let c = checkpoint(3);
    let dir = store.write(&c).expect("writes");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir exists")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "manifest",
            "shard-pp0000-tp0000.bin",
            "shard-pp0001-tp0000.bin"
        ]
    );
    let loaded = store.latest_valid().expect("lists").expect("found");
    assert_eq!(loaded.checkpoint, c);
    assert_eq!(loaded.dir, dir);
}

/// CKPT-1: a write that fails halfway (the FaultPlan's hook) returns an error, leaves no
/// loadable partial checkpoint, and the previous one is used.
#[test]
fn ckpt1_write_failing_halfway_keeps_previous_checkpoint() {
    let fs = FaultyFs::new(MemoryFs::new());
    let store = CheckpointStore::with_fs(fs.clone(), root(), 3).expect("keep ≥ 1");
    store.write(&checkpoint(1)).expect("first write");
    let one_shard = format::encode_shard(&checkpoint(2).shards[0]).len() as u64;
    fs.fail_after_bytes(one_shard + 5);
    let err = store.write(&checkpoint(2)).expect_err("injected fault");
    assert!(
        matches!(err, CheckpointError::Io { op: "write", .. }),
        "{err:?}"
    );
    fs.heal();
    assert_eq!(loaded_step(&store), Some(1));
    assert!(
        fs.inner()
            .files()
            .iter()
            .all(|f| !f.starts_with(step_dir(2))),
        "the partial directory is removed"
    );
}

/// CKPT-1: a crash before the manifest's rename (simulated by deleting the manifest and
/// leaving a temporary file) leaves an incomplete checkpoint that is refused.
#[test]
fn ckpt1_checkpoint_without_manifest_is_incomplete() {
    let store = memory_store(3);
    store.write(&checkpoint(1)).expect("writes");
    store.write(&checkpoint(2)).expect("writes");
    let fs = store.fs();
    let manifest = step_dir(2).join("manifest");
    fs.rename(&manifest, &step_dir(2).join("manifest.tmp"))
        .expect("exists");
    let loaded = store.latest_valid().expect("lists").expect("falls back");
    assert_eq!(loaded.checkpoint.step, 1);
    assert_eq!(
        loaded.refused,
        vec![RefusedCheckpoint {
            dir: step_dir(2),
            error: CheckpointError::MissingManifest { dir: step_dir(2) },
        }]
    );
}

// ---- store: CKPT-2 ----

fn refused_error(store: &CheckpointStore<MemoryFs>) -> CheckpointError {
    let loaded = store.latest_valid().expect("lists").expect("falls back");
    assert_eq!(loaded.checkpoint.step, 1, "the previous good checkpoint");
    assert_eq!(loaded.refused.len(), 1);
    assert_eq!(loaded.refused[0].dir, step_dir(2));
    loaded.refused[0].error.clone()
}

fn two_checkpoints() -> CheckpointStore<MemoryFs> {
    let store = memory_store(5);
    store.write(&checkpoint(1)).expect("writes");
    store.write(&checkpoint(2)).expect("writes");
    store
}

#[test]
fn ckpt2_truncated_shard_is_refused() {
    let store = two_checkpoints();
    let path = step_dir(2).join("shard-pp0001-tp0000.bin");
    assert!(store.fs().modify(&path, |b| b.truncate(b.len() - 3)));
    assert!(matches!(
        refused_error(&store),
        CheckpointError::ShardLength { path: p, .. } if p == path
    ));
}

#[test]
fn ckpt2_flipped_byte_in_shard_is_refused() {
    let store = two_checkpoints();
    let path = step_dir(2).join("shard-pp0000-tp0000.bin");
    assert!(store.fs().modify(&path, |b| b[40] ^= 0x10));
    assert!(matches!(
        refused_error(&store),
        CheckpointError::ShardChecksum { path: p, .. } if p == path
    ));
}

#[test]
fn ckpt2_flipped_byte_in_manifest_is_refused() {
    let store = two_checkpoints();
    let path = step_dir(2).join("manifest");
    assert!(store.fs().modify(&path, |b| b[25] ^= 0x01));
    assert!(matches!(
        refused_error(&store),
        CheckpointError::ManifestChecksum { path: p, .. } if p == path
    ));
}

#[test]
fn ckpt2_truncated_manifest_is_refused() {
    let store = two_checkpoints();
    let path = step_dir(2).join("manifest");
    assert!(store.fs().modify(&path, |b| b.truncate(b.len() / 2)));
    assert!(matches!(
        refused_error(&store),
        CheckpointError::Truncated { path: p, .. } if p == path
    ));
}

#[test]
fn ckpt2_version_mismatch_is_refused() {
    let store = two_checkpoints();
    let path = step_dir(2).join("manifest");
    // A manifest written by a future version: same envelope, valid checksum.
    assert!(store.fs().modify(&path, |b| {
        b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        let n = b.len() - 4;
        let crc = crc32fast::hash(&b[..n]);
        b[n..].copy_from_slice(&crc.to_le_bytes());
    }));
    assert_eq!(
        refused_error(&store),
        CheckpointError::VersionMismatch {
            path,
            found: FORMAT_VERSION + 1,
            expected: FORMAT_VERSION,
        }
    );
}

#[test]
fn ckpt2_missing_shard_is_refused() {
    let store = two_checkpoints();
    let path = step_dir(2).join("shard-pp0001-tp0000.bin");
    store.fs().remove_file(&path).expect("exists");
    assert_eq!(
        refused_error(&store),
        CheckpointError::MissingShard {
            shard: ShardId::stage(1),
            path,
        }
    );
}

#[test]
fn ckpt2_nothing_valid_gives_none_with_every_refusal() {
    let store = memory_store(5);
    store.write(&checkpoint(1)).expect("writes");
    store
        .fs()
        .remove_file(&step_dir(1).join("manifest"))
        .expect("exists");
    assert_eq!(store.latest_valid().expect("lists"), None);
}

#[test]
fn duplicate_shard_in_snapshot_is_refused_before_writing() {
    let store = memory_store(1);
    let mut c = checkpoint(1);
    c.shards.push(shard(0, 9.0));
    assert!(matches!(
        store.write(&c),
        Err(CheckpointError::DuplicateShard { .. })
    ));
    assert!(store.fs().files().is_empty());
}

// ---- store: CKPT-3 ----

#[test]
fn ckpt3_keeps_the_last_k_complete_checkpoints() {
    let store = memory_store(2);
    for step in 1..=4 {
        store.write(&checkpoint(step)).expect("writes");
    }
    let steps: Vec<u64> = store.steps().expect("lists").iter().map(|s| s.0).collect();
    assert_eq!(steps, [4, 3]);

    // An incomplete newer directory does not count: the two complete ones stay.
    store.write(&checkpoint(5)).expect("writes");
    store
        .fs()
        .remove_file(&step_dir(5).join("shard-pp0000-tp0000.bin"))
        .expect("exists");
    store.write(&checkpoint(6)).expect("writes");
    let steps: Vec<u64> = store.steps().expect("lists").iter().map(|s| s.0).collect();
    assert_eq!(steps, [6, 5, 4]);
    assert_eq!(loaded_step(&store), Some(6));
}

#[test]
fn ckpt3_rewriting_a_step_replaces_it() {
    let store = memory_store(2);
    store.write(&checkpoint(1)).expect("writes");
    let mut again = checkpoint(1);
    again.rng.state = 99;
    store.write(&again).expect("writes");
    let loaded = store.latest_valid().expect("lists").expect("found");
    assert_eq!(loaded.checkpoint, again);
}

#[test]
fn keep_zero_is_a_configuration_error() {
    assert!(matches!(
        CheckpointStore::with_fs(MemoryFs::new(), root(), 0),
        Err(crate::config::InvalidConfig(_))
    ));
}

// ---- CKPT-4 / CKPT-2 properties ----

fn arb_param(i: usize) -> impl Strategy<Value = NamedParam> {
    (prop::collection::vec(0usize..4, 0..3), any::<u64>()).prop_flat_map(move |(dims, id)| {
        let n: usize = dims.iter().product();
        prop::collection::vec(any::<f32>().prop_filter("NaN ≠ NaN", |v| !v.is_nan()), n).prop_map(
            move |values| NamedParam {
                name: format!("m.{i}.w"),
                id,
                dims: dims.clone(),
                values,
            },
        )
    })
}

fn arb_shard(pp: u32) -> impl Strategy<Value = ShardSnapshot> {
    (
        (0usize..4).prop_flat_map(|n| (0..n).map(arb_param).collect::<Vec<_>>()),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..32)),
    )
        .prop_map(move |(params, opt)| ShardSnapshot {
            shard: ShardId::stage(pp),
            params: ShardParams::from_params(params),
            optimizer: opt.map(OptimizerState::from_bytes),
            training: TrainingState::default(),
        })
}

/// CKPT-9: a training state, empty or with a scheduler record of any bytes, and a loss
/// scaler's state or none.
fn arb_training() -> impl Strategy<Value = TrainingState> {
    (
        prop::option::of(prop::collection::vec(any::<u8>(), 0..64)),
        prop::option::of((1.0f32..1e9, 0u32..2000)),
    )
        .prop_map(|(r, scale)| {
            TrainingState::default()
                .with_lr_scheduler(r.map(|record| LrSchedulerState { record }))
                .with_loss_scale(
                    scale.map(|(scale, clean_steps)| crate::precision::ScalerState {
                        scale,
                        clean_steps,
                    }),
                )
        })
}

fn arb_checkpoint() -> impl Strategy<Value = Checkpoint> {
    (
        any::<u64>(),
        (1u32..5, 1u32..4, 1u32..3),
        any::<(u64, u64, u64, u64)>(),
        (0u32..3).prop_flat_map(|n| (0..n).map(arb_shard).collect::<Vec<_>>()),
        arb_training(),
    )
        .prop_map(
            |(step, (dp, pp, tp), (e, b, seed, state), mut shards, training)| {
                // CKPT-9: every shard of a checkpoint carries the same training state.
                for s in &mut shards {
                    s.training = training.clone();
                }
                Checkpoint {
                    step: step % 1_000_000_000,
                    layout: Layout::new(dp, pp, tp).expect("degrees ≥ 1"),
                    cursor: DataCursor { epoch: e, batch: b },
                    rng: RngState { seed, state },
                    shards,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// CKPT-2: what is written is what is loaded.
    #[test]
    fn ckpt2_round_trip(c in arb_checkpoint()) {
        let store = memory_store(1);
        store.write(&c).expect("writes");
        let loaded = store.latest_valid().expect("lists").expect("found");
        prop_assert_eq!(loaded.checkpoint, c);
    }

    /// CKPT-2, CKPT-4: any single-byte change or truncation of any file of a checkpoint is
    /// refused (never a panic), and the previous checkpoint is used.
    #[test]
    fn ckpt2_any_single_byte_corruption_or_truncation_is_refused(
        c in arb_checkpoint(),
        pick in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
        truncate in any::<bool>(),
    ) {
        let store = memory_store(5);
        let mut previous = checkpoint(0);
        previous.step = 0;
        store.write(&previous).expect("writes");
        let c = Checkpoint { step: c.step + 1, ..c };
        store.write(&c).expect("writes");
        let dir = store.dir_of(c.step);
        let files: Vec<PathBuf> =
            store.fs().files().into_iter().filter(|f| f.starts_with(&dir)).collect();
        let file = pick.get(&files).clone();
        store.fs().modify(&file, |b| {
            let i = at.index(b.len());
            if truncate { b.truncate(i) } else { b[i] ^= flip }
        });
        let loaded = store.latest_valid().expect("lists").expect("previous is valid");
        prop_assert_eq!(loaded.checkpoint.step, 0);
        prop_assert_eq!(loaded.refused.len(), 1);
    }

    /// CKPT-4: arbitrary bytes never panic the decoders.
    #[test]
    fn ckpt4_arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = format::decode_shard(&bytes, Path::new("s"));
        let _ = format::decode_manifest(&bytes, Path::new("m"));
    }
}

// ---- CKPT-5: parameters by name, optimizer state ----

fn device() -> Device {
    Device::default()
}

#[test]
fn ckpt5_snapshot_names_are_structural_paths() {
    let model = Mlp::new(&[3, 4, 2], &device());
    let params = snapshot_module(&model);
    let names: Vec<&str> = params.params().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "layers.0.weight",
            "layers.0.bias",
            "layers.1.weight",
            "layers.1.bias"
        ]
    );
    assert_eq!(params.get("layers.0.weight").expect("present").dims, [3, 4]);
}

#[test]
fn ckpt5_restore_onto_a_fresh_model_is_bit_exact() {
    let a = Mlp::new(&[3, 4, 2], &device());
    let b = Mlp::new(&[3, 4, 2], &device());
    assert_ne!(parameter_fingerprint(&a), parameter_fingerprint(&b));
    let b = restore_module(b, &snapshot_module(&a)).expect("same architecture");
    assert_eq!(parameter_fingerprint(&a), parameter_fingerprint(&b));
}

#[test]
fn ckpt5_missing_name_or_wrong_shape_is_refused_naming_the_parameter() {
    let a = Mlp::new(&[3, 4, 2], &device());
    let params = snapshot_module(&a);
    let wider = Mlp::new(&[3, 5, 2], &device());
    assert_eq!(
        restore_module(wider, &params).expect_err("shapes differ"),
        CheckpointError::ShapeMismatch {
            name: "layers.0.weight".into(),
            module: vec![3, 5],
            checkpoint: vec![3, 4],
        }
    );
    let deeper = Mlp::new(&[3, 4, 2, 2], &device());
    assert_eq!(
        restore_module(deeper, &params).expect_err("a layer is missing"),
        CheckpointError::MissingParameter {
            name: "layers.2.weight".into()
        }
    );
}

/// Restore onto a different pipeline split: stages of 2 are merged under whole-model names,
/// then cut into 3 stages.
#[test]
fn ckpt5_restore_onto_a_different_pipeline_split() {
    let widths = [4, 5, 5, 5, 3];
    let two = split_mlp(&widths, &[2, 2], &device()).expect("4 layers, 2 stages");
    // Stage s's local layer i is the model's layer offsets[s] + i.
    let rename = |offset: usize| {
        move |name: &str| {
            let rest = name.strip_prefix("layers.").expect("MlpStage paths");
            let (i, field) = rest.split_once('.').expect("index.field");
            let i: usize = i.parse().expect("an index");
            format!("layers.{}.{field}", i + offset)
        }
    };
    let whole = ShardParams::merge([
        snapshot_module(&two[0]).renamed(rename(0)).expect("unique"),
        snapshot_module(&two[1]).renamed(rename(2)).expect("unique"),
    ])
    .expect("disjoint");
    let three = split_mlp(&widths, &[1, 1, 2], &device()).expect("4 layers, 3 stages");
    // The 3-stage split holds 1, 1, 2 layers: offsets 0, 1, 2.
    let restored: Vec<_> = three
        .into_iter()
        .zip([0usize, 1, 2])
        .map(|(stage, offset)| {
            let local = whole
                .clone()
                .renamed(|n| {
                    let rest = n.strip_prefix("layers.").expect("model paths");
                    let (i, field) = rest.split_once('.').expect("index.field");
                    let i: usize = i.parse().expect("an index");
                    match i.checked_sub(offset) {
                        Some(j) => format!("layers.{j}.{field}"),
                        None => format!("before.{i}.{field}"),
                    }
                })
                .expect("unique");
            restore_module(stage, &local).expect("names and shapes match")
        })
        .collect();
    let all_before: Vec<f32> = two
        .iter()
        .flat_map(|s| snapshot_module(s).params().to_vec())
        .flat_map(|p| p.values)
        .collect();
    let all_after: Vec<f32> = restored
        .iter()
        .flat_map(|s| snapshot_module(s).params().to_vec())
        .flat_map(|p| p.values)
        .collect();
    assert_eq!(all_before, all_after);
}

fn train_steps(model: Mlp, optim: &mut burn::optim::ModuleOptimizer, steps: usize) -> Mlp {
    let ad = device().autodiff();
    let mut model = model.fork(&ad).train();
    for s in 0..steps {
        let x = Tensor::<2>::from_data([[0.5f32, -1.0, s as f32 * 0.1], [1.0, 0.25, -0.5]], &ad);
        let loss = model.forward(x).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    model
}

/// CKPT-5: parameters and Adam's state, written and read back through a store, restore
/// onto a fresh model and optimizer that then continue exactly like the original.
#[test]
fn ckpt5_resumed_adam_matches_uninterrupted_training() {
    let config = AdamConfig::new();
    let mut optim = config.init();
    let model = train_steps(Mlp::new(&[3, 4, 2], &device()), &mut optim, 3);

    let store = memory_store(1);
    let c = Checkpoint {
        shards: vec![ShardSnapshot {
            shard: ShardId::stage(0),
            params: snapshot_module(&model),
            optimizer: Some(OptimizerState::capture(&optim).expect("serializes")),
            training: TrainingState::default(),
        }],
        ..checkpoint(3)
    };
    store.write(&c).expect("writes");

    let reference = train_steps(model, &mut optim, 2);

    let loaded = store.latest_valid().expect("lists").expect("found");
    let shard = &loaded.checkpoint.shards[0];
    let fresh = Mlp::new(&[3, 4, 2], &device());
    let resumed = restore_module(fresh, &shard.params).expect("same architecture");
    let mut resumed_optim = shard
        .optimizer
        .as_ref()
        .expect("stored")
        .restore(config.init())
        .expect("loads");
    let resumed = train_steps(resumed, &mut resumed_optim, 2);
    assert_eq!(
        parameter_fingerprint(&resumed),
        parameter_fingerprint(&reference),
        "bit-identical after resuming"
    );

    // Without the optimizer state, the moments restart and the run diverges: the test
    // above really depends on it.
    let fresh = Mlp::new(&[3, 4, 2], &device());
    let restarted = restore_module(fresh, &shard.params).expect("same architecture");
    let restarted = train_steps(restarted, &mut config.init(), 2);
    assert_ne!(
        parameter_fingerprint(&restarted),
        parameter_fingerprint(&reference)
    );
}

#[test]
fn ckpt5_restore_keeps_require_grad_of_frozen_parameters() {
    struct Grads(Vec<bool>);
    impl ModuleVisitor for Grads {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(p.val().is_require_grad());
        }
    }
    let ad = device().autodiff();
    let a = Mlp::new(&[2, 2], &ad);
    let frozen = Mlp::new(&[2, 2], &ad).no_grad();
    let restored = restore_module(frozen, &snapshot_module(&a)).expect("same architecture");
    let mut g = Grads(Vec::new());
    restored.visit(&mut g);
    assert_eq!(g.0, [false, false]);
}

#[test]
fn ckpt_7_check_writable_creates_the_root_and_leaves_no_file_behind() {
    let root = std::env::temp_dir().join(format!("meshwork-ckpt7-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let nested = root.join("a").join("b");
    let store = CheckpointStore::open(&nested, 2).unwrap();
    store.check_writable().unwrap();
    assert!(nested.is_dir(), "the root and its parents are created");
    let left: Vec<_> = std::fs::read_dir(&nested).unwrap().collect();
    assert!(left.is_empty(), "the probe file is removed");
    assert!(store.latest_valid().unwrap().is_none(), "and nothing loads");
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn ckpt_7_a_root_that_cannot_be_created_is_refused_naming_it() {
    let root = std::env::temp_dir().join(format!("meshwork-ckpt7-file-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    // Under a regular file no directory can be made (whatever the user's permissions).
    let file = root.join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let target = file.join("checkpoints");
    let store = CheckpointStore::open(&target, 2).unwrap();
    match store.check_writable() {
        Err(CheckpointError::NotWritable { root: r, op, .. }) => {
            assert_eq!(r, target);
            assert_eq!(op, "create_dir");
        }
        other => panic!("expected NotWritable, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A stage whose optimizer state is sharded in `of` parts over `total` elements.
fn sharded_checkpoint(step: u64, total: u64, of: u64) -> Checkpoint {
    let mut c = checkpoint(step);
    let parts = (0..of)
        .map(|i| {
            let (s, e) = (total * i / of, total * (i + 1) / of);
            crate::checkpoint::OptimizerPart {
                range: s..e,
                total,
                bytes: vec![i as u8; (e - s) as usize + 3],
            }
        })
        .collect();
    c.shards[0].optimizer = Some(OptimizerState::from_parts(parts));
    c
}

/// CKPT-8: a sharded optimizer's parts are written one file each, listed in the manifest and
/// come back as written.
#[test]
fn ckpt_8_sharded_optimizer_parts_are_one_file_each_and_round_trip() {
    let fs = MemoryFs::new();
    let store = CheckpointStore::with_fs(fs.clone(), root(), 3).expect("keep ≥ 1");
    let c = sharded_checkpoint(4, 10, 3);
    let dir = store.write(&c).expect("written");
    for i in 0..3 {
        let name = ShardId::stage(0).part_file_name(i, 3);
        assert!(fs.read(&dir.join(&name)).is_ok(), "{name} written");
    }
    let back = store.load(&dir, 4).expect("loads");
    assert_eq!(back, c);
}

/// CKPT-8 with CKPT-2: a missing or corrupt part makes the checkpoint invalid, and the store
/// falls back to an older one.
#[test]
fn ckpt_8_a_missing_or_corrupt_part_is_refused() {
    let fs = MemoryFs::new();
    let store = CheckpointStore::with_fs(fs.clone(), root(), 5).expect("keep ≥ 1");
    store.write(&sharded_checkpoint(1, 10, 2)).expect("written");
    let dir = store.write(&sharded_checkpoint(2, 10, 2)).expect("written");
    let part = dir.join(ShardId::stage(0).part_file_name(1, 2));
    assert!(fs.modify(&part, |b| {
        let last = b.len() - 1;
        b[last] ^= 0xff;
    }));
    assert!(matches!(
        store.load(&dir, 2),
        Err(CheckpointError::ShardChecksum { .. })
    ));
    let loaded = store.latest_valid().expect("listed").expect("one valid");
    assert_eq!(loaded.checkpoint.step, 1);
    fs.remove_file(&part).expect("removed");
    assert!(matches!(
        store.load(&dir, 2),
        Err(CheckpointError::MissingShard { .. })
    ));
}

/// CKPT-8: parts that do not tile the flat order are malformed, whatever their checksums.
#[test]
fn ckpt_8_parts_that_do_not_tile_the_order_are_refused() {
    let store = memory_store(5);
    let mut c = sharded_checkpoint(3, 10, 2);
    let mut parts = c.shards[0]
        .optimizer
        .as_ref()
        .and_then(|o| o.parts())
        .expect("parts")
        .to_vec();
    parts[1].range.start += 1;
    c.shards[0].optimizer = Some(OptimizerState::from_parts(parts));
    let dir = store.write(&c).expect("written");
    assert!(matches!(
        store.load(&dir, 3),
        Err(CheckpointError::Malformed { .. })
    ));
}

/// CKPT-8 between processes: a shard and its optimizer parts travel as one byte string and
/// come back whole; a piece cut short is a typed error.
#[test]
fn ckpt_8_a_sharded_snapshot_travels_whole_between_processes() {
    let c = sharded_checkpoint(2, 10, 3);
    let bytes = format::encode_transfer(&c.shards[0]);
    let back = format::decode_transfer(&bytes, Path::new("t")).expect("decodes");
    assert_eq!(back, c.shards[0]);
    let plain = checkpoint(1);
    let bytes = format::encode_transfer(&plain.shards[0]);
    assert_eq!(
        format::decode_transfer(&bytes, Path::new("t")).expect("decodes"),
        plain.shards[0]
    );
    assert!(format::decode_transfer(&bytes[..bytes.len() - 1], Path::new("t")).is_err());
}

fn with_scheduler(mut c: Checkpoint, record: &[u8]) -> Checkpoint {
    let training = TrainingState::default().with_lr_scheduler(Some(LrSchedulerState {
        record: record.to_vec(),
    }));
    for s in &mut c.shards {
        s.training = training.clone();
    }
    c
}

/// CKPT-9: the training state is stored once in the manifest and every shard reads it back;
/// it travels with a shard between processes.
#[test]
fn ckpt9_training_state_is_stored_once_and_given_to_every_shard() {
    let store = memory_store(1);
    let c = with_scheduler(checkpoint(4), &[1, 2, 3, 250]);
    store.write(&c).expect("writes");
    let loaded = store.latest_valid().expect("lists").expect("found");
    assert_eq!(loaded.checkpoint, c);
    assert_eq!(
        loaded.checkpoint.shards[1].training.lr_scheduler,
        Some(LrSchedulerState {
            record: vec![1, 2, 3, 250]
        })
    );
    let bytes = format::encode_transfer(&c.shards[0]);
    let back = format::decode_transfer(&bytes, Path::new("t")).expect("decodes");
    assert_eq!(back, c.shards[0]);
    assert!(format::decode_transfer(&bytes[..bytes.len() - 1], Path::new("t")).is_err());
}

/// CKPT-9: shards that disagree on the training state are not written.
#[test]
fn ckpt9_shards_with_different_training_states_are_refused() {
    let store = memory_store(1);
    let mut c = with_scheduler(checkpoint(4), &[1]);
    c.shards[1].training = TrainingState::default();
    assert_eq!(
        store.write(&c),
        Err(CheckpointError::TrainingStateDiffers {
            first: ShardId::stage(0),
            other: ShardId::stage(1),
        })
    );
}

/// CKPT-9: a version 2 checkpoint (no training state in its manifest) still loads, with an
/// empty training state.
#[test]
fn ckpt9_a_version_2_checkpoint_loads_with_an_empty_training_state() {
    let store = memory_store(1);
    let c = checkpoint(4);
    store.write(&c).expect("writes");
    let path = step_dir(4).join("manifest");
    // Rewrite the manifest as version 2 wrote it: the same body without the training state
    // (an empty one is bincode's two one-byte `None`s), version 2, its checksum.
    assert!(store.fs().modify(&path, |b| {
        let body_len = u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")) - 2;
        let mut v2 = b[..8].to_vec();
        v2.extend_from_slice(&2u32.to_le_bytes());
        v2.extend_from_slice(&body_len.to_le_bytes());
        v2.extend_from_slice(&b[20..20 + body_len as usize]);
        let start = 20 + body_len as usize;
        assert_eq!(b[start..start + 2], [0, 0], "an empty training state");
        let crc = crc32fast::hash(&v2);
        v2.extend_from_slice(&crc.to_le_bytes());
        *b = v2;
    }));
    let loaded = store.latest_valid().expect("lists").expect("found");
    assert!(loaded.refused.is_empty());
    assert_eq!(loaded.checkpoint, c);
    assert!(
        loaded
            .checkpoint
            .shards
            .iter()
            .all(|s| s.training.is_empty())
    );
}

/// `total` elements cut into parts at `cuts`, each `ParamPart` of its own snapshot.
fn param_parts(total: usize, cuts: &[usize]) -> Vec<ShardParams> {
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (total + 1)).collect();
    bounds.extend([0, total]);
    bounds.sort_unstable();
    bounds.dedup();
    bounds
        .windows(2)
        .map(|w| {
            ShardParams::with_part(
                ShardParams::from_params(vec![param("norm.gamma", 5, &[2], 1.0)]),
                ParamPart {
                    range: w[0] as u64..w[1] as u64,
                    total: total as u64,
                    values: (w[0]..w[1]).map(|i| i as f32).collect(),
                },
            )
        })
        .collect()
}

proptest! {
    /// CKPT-10: every rank's parameter part, added in any order and through a shard file,
    /// puts the block's flat parameters back together; the named parameters stay apart.
    #[test]
    fn ckpt_10_parameter_parts_assemble_in_any_order(
        total in 1usize..200,
        cuts in proptest::collection::vec(0usize..200, 0..5),
        rotate in 0usize..8,
    ) {
        let mut snaps = param_parts(total, &cuts);
        let n = snaps.len();
        snaps.rotate_left(rotate % n);
        let mut all = snaps[0].clone();
        for s in snaps.into_iter().skip(1) {
            all.add_parts(s);
        }
        let snapshot = ShardSnapshot {
            shard: ShardId::stage(0),
            params: all,
            optimizer: None,
            training: TrainingState::default(),
        };
        let bytes = format::encode_shard(&snapshot);
        let back = format::decode_shard(&bytes, Path::new("x")).expect("decodes");
        let flat = back.params.flat_parameters(total).expect("parts tile");
        prop_assert_eq!(flat, Some((0..total).map(|i| i as f32).collect::<Vec<_>>()));
        prop_assert_eq!(back.params.named().count(), 1);
    }
}

#[test]
fn ckpt_10_parts_with_a_gap_or_another_total_are_refused() {
    let parts = param_parts(10, &[3, 6]);
    let mut gap = parts[0].clone();
    gap.add_parts(parts[2].clone());
    assert!(matches!(
        gap.flat_parameters(10),
        Err(CheckpointError::ParameterParts { .. })
    ));
    let mut all = parts[0].clone();
    for p in &parts[1..] {
        all.add_parts(p.clone());
    }
    assert!(all.flat_parameters(10).is_ok());
    assert!(matches!(
        all.flat_parameters(11),
        Err(CheckpointError::ParameterParts { .. })
    ));
    assert_eq!(
        ShardParams::from_params(vec![param("a", 1, &[2], 0.0)]).flat_parameters(2),
        Ok(None)
    );
}
