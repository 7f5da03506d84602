//! [`CheckpointStore`]: writes checkpoints atomically (CKPT-1), loads the newest one that
//! verifies (CKPT-2), and keeps the last `k` (CKPT-3).

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};

use super::format::{self, Manifest, PartEntry, ShardEntry};
use super::{Checkpoint, CheckpointError, CheckpointFile, CheckpointFs, RealFs, ShardId};
use crate::config::InvalidConfig;

type Result<T, E = CheckpointError> = std::result::Result<T, E>;

const MANIFEST: &str = "manifest";
const STEP_PREFIX: &str = "step-";
const TMP_SUFFIX: &str = ".tmp";

/// A checkpoint that verified, with the newer ones that were refused on the way to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// Its directory.
    pub dir: PathBuf,
    /// Every newer checkpoint directory that was refused, newest first, with the reason.
    pub refused: Vec<RefusedCheckpoint>,
}

/// A checkpoint directory that was not loaded, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedCheckpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Why it was refused.
    pub error: CheckpointError,
}

/// The checkpoints under one root directory: `root/step-<NNNNNNNN>/`, the newest `keep` of
/// them retained. One store (one writer) per root.
#[derive(Debug, Clone)]
pub struct CheckpointStore<F: CheckpointFs = RealFs> {
    fs: F,
    root: PathBuf,
    keep: usize,
}

fn io_error<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> CheckpointError + 'a {
    move |e| CheckpointError::Io {
        op,
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

impl CheckpointStore<RealFs> {
    /// The checkpoints under `root` on the real file system, keeping the newest `keep`
    /// (at least 1).
    pub fn open(root: impl Into<PathBuf>, keep: usize) -> Result<Self, InvalidConfig> {
        Self::with_fs(RealFs, root, keep)
    }
}

impl<F: CheckpointFs> CheckpointStore<F> {
    /// The checkpoints under `root` on `fs`, keeping the newest `keep` (at least 1).
    pub fn with_fs(fs: F, root: impl Into<PathBuf>, keep: usize) -> Result<Self, InvalidConfig> {
        if keep == 0 {
            return Err(InvalidConfig(
                "checkpoints to keep is 0: keep at least 1".into(),
            ));
        }
        Ok(Self {
            fs,
            root: root.into(),
            keep,
        })
    }

    /// The file system it writes through.
    pub fn fs(&self) -> &F {
        &self.fs
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of the checkpoint of `step`.
    pub fn dir_of(&self, step: u64) -> PathBuf {
        self.root.join(format!("{STEP_PREFIX}{step:08}"))
    }

    /// Write `checkpoint` (CKPT-1): each shard file, then the manifest, each to a temporary
    /// name, fsynced, renamed, its directory fsynced; then prune (CKPT-3). Returns the
    /// checkpoint's directory. A checkpoint of the same step already there is replaced. On
    /// failure the partial directory is removed as far as possible; whatever remains has no
    /// manifest and is never loaded.
    pub fn write(&self, checkpoint: &Checkpoint) -> Result<PathBuf> {
        self.write_or_fail_half_way(checkpoint, false)
    }

    /// [`CheckpointStore::write`], or with `fail_half_way` a write that stops after half of
    /// the first shard file's bytes with an I/O error, as a failing disk would (a FaultPlan's
    /// `FailCheckpointWrite`); the partial directory is then cleaned up as after any failure.
    pub fn write_or_fail_half_way(
        &self,
        checkpoint: &Checkpoint,
        fail_half_way: bool,
    ) -> Result<PathBuf> {
        let mut seen = HashSet::new();
        for s in &checkpoint.shards {
            if !seen.insert(s.shard) {
                return Err(CheckpointError::DuplicateShard { shard: s.shard });
            }
        }
        // CKPT-9: the manifest holds one training state, that of every shard.
        if let Some((first, rest)) = checkpoint.shards.split_first()
            && let Some(other) = rest.iter().find(|s| s.training != first.training)
        {
            return Err(CheckpointError::TrainingStateDiffers {
                first: first.shard,
                other: other.shard,
            });
        }
        let dir = self.dir_of(checkpoint.step);
        if let Err(e) = self.write_dir(&dir, checkpoint, fail_half_way) {
            let _ = self.fs.remove_dir_all(&dir);
            return Err(e);
        }
        self.prune()?;
        Ok(dir)
    }

    fn write_dir(
        &self,
        dir: &Path,
        checkpoint: &Checkpoint,
        fail_half_way: bool,
    ) -> Result<(), CheckpointError> {
        self.fs
            .create_dir_all(&self.root)
            .map_err(io_error("create_dir", &self.root))?;
        if self.fs.list(dir).is_ok() {
            self.remove_checkpoint(dir)?;
        }
        self.fs
            .create_dir_all(dir)
            .map_err(io_error("create_dir", dir))?;
        self.fs
            .sync_dir(&self.root)
            .map_err(io_error("sync_dir", &self.root))?;
        let mut entries = Vec::with_capacity(checkpoint.shards.len());
        for shard in &checkpoint.shards {
            let bytes = format::encode_shard(shard);
            let file = shard.shard.file_name();
            if fail_half_way {
                let tmp = dir.join(format!("{file}{TMP_SUFFIX}"));
                let mut f = self.fs.create(&tmp).map_err(io_error("create", &tmp))?;
                f.write_all(&bytes[..bytes.len() / 2])
                    .map_err(io_error("write", &tmp))?;
                return Err(CheckpointError::Io {
                    op: "write",
                    path: tmp,
                    reason: "injected fault: the write stopped half-way".into(),
                });
            }
            self.write_file(dir, &file, &bytes)?;
            // CKPT-8: a sharded optimizer's parts, one file each.
            let all = shard
                .optimizer
                .as_ref()
                .and_then(|o| o.parts())
                .unwrap_or(&[]);
            let of = all.len() as u32;
            let mut parts = Vec::with_capacity(all.len());
            for (i, part) in all.iter().enumerate() {
                let index = i as u32;
                let bytes = format::encode_part(shard.shard, index, of, part);
                let name = shard.shard.part_file_name(index, of);
                self.write_file(dir, &name, &bytes)?;
                parts.push(PartEntry {
                    index,
                    of,
                    file: name,
                    len: bytes.len() as u64,
                    crc32: crc32fast::hash(&bytes),
                });
            }
            entries.push(ShardEntry {
                shard: shard.shard,
                file,
                len: bytes.len() as u64,
                crc32: crc32fast::hash(&bytes),
                parts,
            });
        }
        let manifest = format::encode_manifest(&Manifest::of(checkpoint, entries));
        self.write_file(dir, MANIFEST, &manifest)
    }

    /// One file of CKPT-1: temporary name, write, fsync, rename, fsync the directory.
    fn write_file(&self, dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        let tmp = dir.join(format!("{name}{TMP_SUFFIX}"));
        let path = dir.join(name);
        let mut file = self.fs.create(&tmp).map_err(io_error("create", &tmp))?;
        file.write_all(bytes).map_err(io_error("write", &tmp))?;
        file.sync().map_err(io_error("sync", &tmp))?;
        drop(file);
        self.fs
            .rename(&tmp, &path)
            .map_err(io_error("rename", &tmp))?;
        self.fs.sync_dir(dir).map_err(io_error("sync_dir", dir))
    }

    /// CKPT-7: check that checkpoints can be written here before any training depends on it:
    /// create the root (and its parents) and write, sync and remove a probe file in it. A job
    /// calls this when it is built, so a directory that cannot be created or written is
    /// refused before the first step instead of failing every checkpoint of the run.
    pub fn check_writable(&self) -> Result<()> {
        let refuse = |op: &'static str, path: &Path| {
            let root = self.root.clone();
            let path = path.to_path_buf();
            move |e: io::Error| CheckpointError::NotWritable {
                root,
                op,
                path,
                reason: e.to_string(),
            }
        };
        self.fs
            .create_dir_all(&self.root)
            .map_err(refuse("create_dir", &self.root))?;
        // A name of its own per call, so two jobs probing one directory at once never remove
        // each other's probe.
        static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let probe = self.root.join(format!(
            ".meshwork-probe-{}-{n}{TMP_SUFFIX}",
            std::process::id()
        ));
        let mut file = self.fs.create(&probe).map_err(refuse("create", &probe))?;
        file.write_all(b"meshwork")
            .and_then(|()| file.sync())
            .map_err(refuse("write", &probe))?;
        drop(file);
        match self.fs.remove_file(&probe) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(refuse("remove", &probe)(e)),
            _ => Ok(()),
        }
    }

    /// The checkpoint directories under the root, newest first, with their steps; an absent
    /// root has none.
    pub fn steps(&self) -> Result<Vec<(u64, PathBuf)>> {
        let names = match self.fs.list(&self.root) {
            Ok(names) => names,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error("list", &self.root)(e)),
        };
        let mut steps: Vec<(u64, PathBuf)> = names
            .iter()
            .filter_map(|n| {
                let digits = n.strip_prefix(STEP_PREFIX)?;
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                Some((digits.parse().ok()?, self.root.join(n)))
            })
            .collect();
        steps.sort_by(|a, b| b.cmp(a));
        Ok(steps)
    }

    fn read_manifest(&self, dir: &Path, step: u64) -> Result<Manifest, CheckpointError> {
        let path = dir.join(MANIFEST);
        let bytes = match self.fs.read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(CheckpointError::MissingManifest {
                    dir: dir.to_path_buf(),
                });
            }
            Err(e) => return Err(io_error("read", &path)(e)),
        };
        let manifest = format::decode_manifest(&bytes, &path)?;
        if manifest.step != step {
            return Err(CheckpointError::Malformed {
                path,
                what: format!("step {} in directory of step {step}", manifest.step),
            });
        }
        Ok(manifest)
    }

    /// The length check of CKPT-2 on one listed shard file, without reading it.
    fn check_len(&self, dir: &Path, entry: &ShardEntry) -> Result<PathBuf, CheckpointError> {
        self.check_file_len(dir, entry.shard, &entry.file, entry.len)
    }

    fn check_file_len(
        &self,
        dir: &Path,
        shard: ShardId,
        file: &str,
        expected: u64,
    ) -> Result<PathBuf, CheckpointError> {
        let path = dir.join(file);
        match self.fs.file_len(&path) {
            Ok(len) if len == expected => Ok(path),
            Ok(len) => Err(CheckpointError::ShardLength {
                path,
                expected,
                actual: len,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err(CheckpointError::MissingShard { shard, path })
            }
            Err(e) => Err(io_error("file_len", &path)(e)),
        }
    }

    /// Read a listed file and verify its length and CRC-32 (CKPT-2).
    fn read_verified(
        &self,
        dir: &Path,
        shard: ShardId,
        file: &str,
        (len, crc32): (u64, u32),
    ) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
        let path = self.check_file_len(dir, shard, file, len)?;
        let bytes = self.fs.read(&path).map_err(io_error("read", &path))?;
        if bytes.len() as u64 != len {
            return Err(CheckpointError::ShardLength {
                path,
                expected: len,
                actual: bytes.len() as u64,
            });
        }
        let computed = crc32fast::hash(&bytes);
        if computed != crc32 {
            return Err(CheckpointError::ShardChecksum {
                path,
                expected: crc32,
                computed,
            });
        }
        Ok((path, bytes))
    }

    /// Load and verify the checkpoint in `dir` of step `step` (CKPT-2).
    pub fn load(&self, dir: &Path, step: u64) -> Result<Checkpoint, CheckpointError> {
        let manifest = self.read_manifest(dir, step)?;
        let mut shards = Vec::with_capacity(manifest.shards.len());
        for entry in &manifest.shards {
            let (path, bytes) =
                self.read_verified(dir, entry.shard, &entry.file, (entry.len, entry.crc32))?;
            let mut shard = format::decode_shard(&bytes, &path)?;
            // CKPT-9: every shard continues with the manifest's training state.
            shard.training = manifest.training.clone();
            if !entry.parts.is_empty() {
                // CKPT-8: the sharded optimizer's parts.
                if shard.optimizer.is_some() {
                    return Err(CheckpointError::Malformed {
                        path,
                        what: "holds a whole optimizer state and lists optimizer parts".into(),
                    });
                }
                let mut parts = Vec::with_capacity(entry.parts.len());
                for p in &entry.parts {
                    let (path, bytes) =
                        self.read_verified(dir, entry.shard, &p.file, (p.len, p.crc32))?;
                    parts.push(format::decode_part(
                        &bytes,
                        &path,
                        (entry.shard, p.index, p.of),
                    )?);
                }
                format::check_parts(&mut parts, &path)?;
                shard.optimizer = Some(crate::checkpoint::OptimizerState::from_parts(parts));
            }
            if shard.shard != entry.shard {
                return Err(CheckpointError::Malformed {
                    path,
                    what: format!(
                        "holds {} where the manifest lists {}",
                        shard.shard, entry.shard
                    ),
                });
            }
            shards.push(shard);
        }
        Ok(Checkpoint {
            step: manifest.step,
            layout: manifest.layout,
            cursor: manifest.cursor,
            rng: manifest.rng,
            shards,
        })
    }

    /// The newest checkpoint that verifies (CKPT-2), with every newer one refused on the way
    /// (each also logged as a warning); `None` when none verifies. Only failing to list the
    /// root is an error.
    pub fn latest_valid(&self) -> Result<Option<Loaded>> {
        let mut refused = Vec::new();
        for (step, dir) in self.steps()? {
            match self.load(&dir, step) {
                Ok(checkpoint) => {
                    return Ok(Some(Loaded {
                        checkpoint,
                        dir,
                        refused,
                    }));
                }
                Err(error) => {
                    tracing::warn!(dir = %dir.display(), %error, "checkpoint refused");
                    refused.push(RefusedCheckpoint { dir, error });
                }
            }
        }
        Ok(None)
    }

    /// Whether `dir` holds a complete checkpoint for CKPT-3: its manifest verifies and every
    /// listed shard file is there with its listed length (checksums are left to loading).
    fn is_complete(&self, dir: &Path, step: u64) -> bool {
        self.read_manifest(dir, step).is_ok_and(|m| {
            m.shards.iter().all(|entry| {
                self.check_len(dir, entry).is_ok()
                    && entry.parts.iter().all(|p| {
                        self.check_file_len(dir, entry.shard, &p.file, p.len)
                            .is_ok()
                    })
            })
        })
    }

    /// Remove a checkpoint directory, manifest first, so that a removal cut short leaves an
    /// incomplete checkpoint rather than one with missing shards.
    fn remove_checkpoint(&self, dir: &Path) -> Result<(), CheckpointError> {
        let manifest = dir.join(MANIFEST);
        match self.fs.remove_file(&manifest) {
            Ok(()) => self.fs.sync_dir(dir).map_err(io_error("sync_dir", dir))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error("remove_file", &manifest)(e)),
        }
        self.fs
            .remove_dir_all(dir)
            .map_err(io_error("remove_dir", dir))
    }

    /// Keep the newest `keep` complete checkpoints and every directory newer than the oldest
    /// of them; remove the older ones (CKPT-3). Returns the removed directories.
    pub fn prune(&self) -> Result<Vec<PathBuf>> {
        let steps = self.steps()?;
        let mut complete = 0;
        let mut cut = None;
        for (i, (step, dir)) in steps.iter().enumerate() {
            if self.is_complete(dir, *step) {
                complete += 1;
                if complete == self.keep {
                    cut = Some(i + 1);
                    break;
                }
            }
        }
        let Some(cut) = cut else {
            return Ok(Vec::new());
        };
        let mut removed = Vec::new();
        for (_, dir) in &steps[cut..] {
            self.remove_checkpoint(dir)?;
            removed.push(dir.clone());
        }
        if !removed.is_empty() {
            self.fs
                .sync_dir(&self.root)
                .map_err(io_error("sync_dir", &self.root))?;
        }
        Ok(removed)
    }
}
