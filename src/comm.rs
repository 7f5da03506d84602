//! Collectives inside one process (CONTRACT STUB — the comm work replaces the bodies).
//!
//! Owns: the [`Communicator`] API, the pure algorithm plans ([`plan`]) and the in-process
//! transport ([`LocalGroup`]).
#![allow(missing_docs, unreachable_pub, dead_code, unused_variables)]

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::mesh::{Generation, Rank};

pub mod plan {
    //! Pure plans (stub).
}

/// Element types a collective can move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
}

/// A scalar a collective can move; f16/bf16 accumulate in f32.
pub trait Element: Copy + Send + Sync + 'static + std::fmt::Debug {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Algorithm {
    #[default]
    Auto,
    Ring,
    Tree,
    Direct,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
    Send,
    Recv,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CommConfig {
    pub timeout: Duration,
    pub algorithm: Algorithm,
}
impl Default for CommConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            algorithm: Algorithm::Auto,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    #[error("timeout")]
    Timeout {
        generation: Generation,
        seq: u64,
        op: CollectiveKind,
        missing: Vec<Rank>,
        waited: Duration,
    },
    #[error("group shut down")]
    Shutdown { generation: Generation, seq: u64 },
}

pub fn chunk_range(len: usize, world: usize, index: usize) -> Range<usize> {
    let base = len / world;
    let extra = len % world;
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

#[derive(Debug)]
pub struct LocalGroup {}
impl LocalGroup {
    pub fn new(world: usize, generation: Generation, config: CommConfig) -> Arc<Self> {
        Arc::new(Self {})
    }
    pub fn communicators(self: &Arc<Self>) -> Vec<Communicator> {
        Vec::new()
    }
    pub fn shutdown(&self) {}
    pub fn generation(&self) -> Generation {
        Generation(0)
    }
}

#[derive(Debug)]
pub struct Communicator {
    rank: Rank,
    world: usize,
}
impl Communicator {
    pub fn rank(&self) -> Rank {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<(), CommError> {
        Ok(())
    }
    pub fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
}
