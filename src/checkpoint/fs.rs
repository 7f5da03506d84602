//! The file-system operations a checkpoint needs, behind a trait: the real one, an in-memory
//! one that records every operation (to check CKPT-1's order), and a wrapper that makes
//! writes fail after a number of bytes (to inject a write that fails halfway).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// A file opened for writing by a [`CheckpointFs`].
pub trait CheckpointFile: Send {
    /// Append all of `bytes`.
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Make what was written durable (`fsync`).
    fn sync(&mut self) -> io::Result<()>;
}

/// The file-system operations a [`CheckpointStore`](super::CheckpointStore) performs.
pub trait CheckpointFs: Send + Sync + fmt::Debug {
    /// The files [`create`](Self::create) opens.
    type File: CheckpointFile;
    /// Create `dir` and its missing parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Create (or truncate) `path` for writing.
    fn create(&self, path: &Path) -> io::Result<Self::File>;
    /// Rename `from` to `to`, replacing `to` atomically.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Make the entries of `dir` (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Remove the file `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Remove `dir` and everything in it.
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// The whole content of `path`.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// The length of the file `path`.
    fn file_len(&self, path: &Path) -> io::Result<u64>;
    /// The names of `dir`'s entries, in no particular order.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
}

/// The operating system's file system (`std::fs`): `sync` is `File::sync_all`, a directory is
/// synced by opening it and calling `sync_all` on it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

impl CheckpointFile for std::fs::File {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        Write::write_all(self, bytes)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.sync_all()
    }
}

impl CheckpointFs for RealFs {
    type File = std::fs::File;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Self::File> {
        std::fs::File::create(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::File::open(dir)?.sync_all()
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(dir)
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(path)?.len())
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        std::fs::read_dir(dir)?
            .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
            .collect()
    }
}

/// One operation a [`MemoryFs`] performed, in the order it was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsOp {
    /// `create_dir_all`.
    CreateDir(PathBuf),
    /// `create`.
    Create(PathBuf),
    /// `write_all` of this many bytes.
    Write(PathBuf, usize),
    /// A file's `sync`.
    SyncFile(PathBuf),
    /// `rename(from, to)`.
    Rename(PathBuf, PathBuf),
    /// `sync_dir`.
    SyncDir(PathBuf),
    /// `remove_file`.
    RemoveFile(PathBuf),
    /// `remove_dir_all`.
    RemoveDir(PathBuf),
    /// `read`.
    Read(PathBuf),
    /// `file_len`.
    FileLen(PathBuf),
    /// `list`.
    List(PathBuf),
}

#[derive(Debug, Default)]
struct MemoryState {
    dirs: BTreeSet<PathBuf>,
    files: BTreeMap<PathBuf, Vec<u8>>,
    ops: Vec<FsOp>,
}

/// An in-memory file system that records every operation ([`ops`](Self::ops)); clones share
/// the same files, so a test keeps a handle on what a store wrote.
#[derive(Debug, Clone, Default)]
pub struct MemoryFs {
    state: Arc<Mutex<MemoryState>>,
}

/// A file being written in a [`MemoryFs`].
#[derive(Debug)]
pub struct MemoryFile {
    fs: MemoryFs,
    path: PathBuf,
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} does not exist", path.display()),
    )
}

impl MemoryFs {
    /// An empty file system.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, MemoryState> {
        // A panic while holding the lock leaves plain maps behind: still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every operation so far, in order.
    pub fn ops(&self) -> Vec<FsOp> {
        self.lock().ops.clone()
    }

    /// Forget the operations recorded so far (the files stay).
    pub fn clear_ops(&self) {
        self.lock().ops.clear();
    }

    /// The paths of all files, sorted.
    pub fn files(&self) -> Vec<PathBuf> {
        self.lock().files.keys().cloned().collect()
    }

    /// Change a file's content in place (a test's corruption or truncation); `false` when
    /// there is no such file.
    pub fn modify(&self, path: &Path, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        match self.lock().files.get_mut(path) {
            Some(bytes) => {
                f(bytes);
                true
            }
            None => false,
        }
    }

    fn parent_exists(state: &MemoryState, path: &Path) -> bool {
        path.parent()
            .is_none_or(|p| p.as_os_str().is_empty() || state.dirs.contains(p))
    }
}

impl CheckpointFile for MemoryFile {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut state = self.fs.lock();
        state.ops.push(FsOp::Write(self.path.clone(), bytes.len()));
        match state.files.get_mut(&self.path) {
            Some(file) => {
                file.extend_from_slice(bytes);
                Ok(())
            }
            None => Err(not_found(&self.path)),
        }
    }
    fn sync(&mut self) -> io::Result<()> {
        self.fs.lock().ops.push(FsOp::SyncFile(self.path.clone()));
        Ok(())
    }
}

impl CheckpointFs for MemoryFs {
    type File = MemoryFile;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.ops.push(FsOp::CreateDir(dir.to_path_buf()));
        for d in dir.ancestors() {
            if !d.as_os_str().is_empty() {
                state.dirs.insert(d.to_path_buf());
            }
        }
        Ok(())
    }
    fn create(&self, path: &Path) -> io::Result<Self::File> {
        let mut state = self.lock();
        state.ops.push(FsOp::Create(path.to_path_buf()));
        if !Self::parent_exists(&state, path) {
            return Err(not_found(path));
        }
        state.files.insert(path.to_path_buf(), Vec::new());
        Ok(MemoryFile {
            fs: self.clone(),
            path: path.to_path_buf(),
        })
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state
            .ops
            .push(FsOp::Rename(from.to_path_buf(), to.to_path_buf()));
        let bytes = state.files.remove(from).ok_or_else(|| not_found(from))?;
        state.files.insert(to.to_path_buf(), bytes);
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.ops.push(FsOp::SyncDir(dir.to_path_buf()));
        if state.dirs.contains(dir) {
            Ok(())
        } else {
            Err(not_found(dir))
        }
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.ops.push(FsOp::RemoveFile(path.to_path_buf()));
        state
            .files
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| not_found(path))
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.ops.push(FsOp::RemoveDir(dir.to_path_buf()));
        if !state.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        state.dirs.retain(|d| !d.starts_with(dir));
        state.files.retain(|f, _| !f.starts_with(dir));
        Ok(())
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let mut state = self.lock();
        state.ops.push(FsOp::Read(path.to_path_buf()));
        state
            .files
            .get(path)
            .cloned()
            .ok_or_else(|| not_found(path))
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        let mut state = self.lock();
        state.ops.push(FsOp::FileLen(path.to_path_buf()));
        state
            .files
            .get(path)
            .map(|f| f.len() as u64)
            .ok_or_else(|| not_found(path))
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut state = self.lock();
        state.ops.push(FsOp::List(dir.to_path_buf()));
        if !state.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        let children = state
            .dirs
            .iter()
            .chain(state.files.keys())
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .collect();
        Ok(children)
    }
}

/// Wraps a file system so that writes fail once a byte budget is spent: the write that
/// crosses it writes the bytes up to the budget, then fails, as a disk that fills up or a
/// process killed mid-write would leave it. Clones share the budget, so the fault can be
/// armed while a store owns the file system.
#[derive(Debug, Clone, Default)]
pub struct FaultyFs<F> {
    inner: F,
    budget: Arc<Mutex<Option<u64>>>,
}

impl<F: CheckpointFs> FaultyFs<F> {
    /// `inner`, with no fault armed.
    pub fn new(inner: F) -> Self {
        Self {
            inner,
            budget: Arc::default(),
        }
    }

    /// From now on, fail the write that brings the bytes written past `bytes`, and every
    /// write after it. (A job built over it writes an 8-byte probe when it is built, CKPT-7:
    /// arm this after `build()`, or count those bytes.)
    pub fn fail_after_bytes(&self, bytes: u64) {
        *self.budget.lock().unwrap_or_else(|e| e.into_inner()) = Some(bytes);
    }

    /// Disarm the fault.
    pub fn heal(&self) {
        *self.budget.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The wrapped file system.
    pub fn inner(&self) -> &F {
        &self.inner
    }
}

/// A file of a [`FaultyFs`].
#[derive(Debug)]
pub struct FaultyFile<T> {
    inner: T,
    budget: Arc<Mutex<Option<u64>>>,
}

impl<T: CheckpointFile> CheckpointFile for FaultyFile<T> {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        match *budget {
            Some(left) if (bytes.len() as u64) > left => {
                // `left < bytes.len()`, so it fits in usize.
                let head = left as usize;
                *budget = Some(0);
                drop(budget);
                self.inner.write_all(&bytes[..head])?;
                Err(io::Error::other(format!(
                    "injected fault: write failed after {head} of {} bytes",
                    bytes.len()
                )))
            }
            Some(left) => {
                *budget = Some(left - bytes.len() as u64);
                drop(budget);
                self.inner.write_all(bytes)
            }
            None => {
                drop(budget);
                self.inner.write_all(bytes)
            }
        }
    }
    fn sync(&mut self) -> io::Result<()> {
        self.inner.sync()
    }
}

impl<F: CheckpointFs> CheckpointFs for FaultyFs<F> {
    type File = FaultyFile<F::File>;
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.inner.create_dir_all(dir)
    }
    fn create(&self, path: &Path) -> io::Result<Self::File> {
        Ok(FaultyFile {
            inner: self.inner.create(path)?,
            budget: self.budget.clone(),
        })
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.inner.sync_dir(dir)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.inner.remove_file(path)
    }
    fn remove_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.inner.remove_dir_all(dir)
    }
    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.inner.read(path)
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        self.inner.file_len(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.inner.list(dir)
    }
}
