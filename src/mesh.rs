//! Topology: ranks, the dp × pp × tp layout and which ranks form which group.
//!
//! Pure: no actors, no I/O. Rank order in every layout is fixed (MESH-1): tensor-parallel
//! index fastest, then data-parallel, then pipeline, so
//! `rank = tp + TP·(dp + DP·pp)`.

use serde::{Deserialize, Serialize};

use crate::config::InvalidConfig;

/// A position in the world of one job: `0..world_size`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as an index into per-rank vectors.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// Membership version of a group or mesh; bumped whenever a group is formed anew (a shrink,
/// a retry, a rewired pipeline, a resize: REC-1, REC-4, REC-6, ELASTIC-1).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
pub struct Generation(pub u64);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "generation {}", self.0)
    }
}

/// A rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Coord {
    /// Data-parallel replica index.
    pub dp: u32,
    /// Pipeline stage index.
    pub pp: u32,
    /// Tensor-parallel shard index.
    pub tp: u32,
}

/// The shape of a job's mesh: `dp × pp × tp` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    dp: u32,
    pp: u32,
    tp: u32,
}

impl Layout {
    /// A layout with the given degrees; every degree must be at least 1.
    pub fn new(dp: u32, pp: u32, tp: u32) -> Result<Self, InvalidConfig> {
        for (name, value) in [
            ("data_parallel", dp),
            ("pipeline", pp),
            ("tensor_parallel", tp),
        ] {
            if value == 0 {
                return Err(InvalidConfig(format!("{name} degree is 0: use at least 1")));
            }
            if value > u32::from(u16::MAX) {
                return Err(InvalidConfig(format!(
                    "{name} degree {value}: at most {} per axis",
                    u16::MAX
                )));
            }
        }
        Ok(Self { dp, pp, tp })
    }

    /// A pure data-parallel layout of `dp` replicas.
    pub fn data_parallel(dp: u32) -> Result<Self, InvalidConfig> {
        Self::new(dp, 1, 1)
    }

    /// Number of data-parallel replicas.
    pub fn dp(&self) -> u32 {
        self.dp
    }
    /// Number of pipeline stages.
    pub fn pp(&self) -> u32 {
        self.pp
    }
    /// Number of tensor-parallel shards.
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// Total number of ranks: `dp · pp · tp`.
    pub fn world_size(&self) -> u32 {
        self.dp * self.pp * self.tp
    }

    /// All ranks of the layout in order.
    pub fn ranks(&self) -> impl Iterator<Item = Rank> + use<> {
        (0..self.world_size()).map(Rank)
    }

    /// The rank at `coord` (MESH-1), or `None` if the coordinate lies outside the layout.
    pub fn rank_of(&self, coord: Coord) -> Option<Rank> {
        (coord.dp < self.dp && coord.pp < self.pp && coord.tp < self.tp)
            .then(|| Rank(coord.tp + self.tp * (coord.dp + self.dp * coord.pp)))
    }

    /// The coordinates of `rank`, or `None` if the rank lies outside the layout.
    pub fn coord_of(&self, rank: Rank) -> Option<Coord> {
        (rank.0 < self.world_size()).then(|| Coord {
            tp: rank.0 % self.tp,
            dp: (rank.0 / self.tp) % self.dp,
            pp: rank.0 / (self.tp * self.dp),
        })
    }

    /// The data-parallel group `rank` belongs to: the ranks with its `pp` and `tp`, ordered by
    /// `dp`. These ranks hold replicas of the same parameters and all-reduce their gradients.
    pub fn data_parallel_group(&self, rank: Rank) -> Option<Vec<Rank>> {
        let c = self.coord_of(rank)?;
        (0..self.dp)
            .map(|dp| self.rank_of(Coord { dp, ..c }))
            .collect()
    }

    /// The pipeline `rank` belongs to: the ranks with its `dp` and `tp`, ordered by stage.
    pub fn pipeline_group(&self, rank: Rank) -> Option<Vec<Rank>> {
        let c = self.coord_of(rank)?;
        (0..self.pp)
            .map(|pp| self.rank_of(Coord { pp, ..c }))
            .collect()
    }

    /// The tensor-parallel group `rank` belongs to: the ranks with its `dp` and `pp`.
    pub fn tensor_parallel_group(&self, rank: Rank) -> Option<Vec<Rank>> {
        let c = self.coord_of(rank)?;
        (0..self.tp)
            .map(|tp| self.rank_of(Coord { tp, ..c }))
            .collect()
    }

    /// Every distinct data-parallel group, each ordered by `dp`.
    pub fn data_parallel_groups(&self) -> Vec<Vec<Rank>> {
        let mut groups = Vec::new();
        for pp in 0..self.pp {
            for tp in 0..self.tp {
                let first = self
                    .rank_of(Coord { dp: 0, pp, tp })
                    .expect("coordinate inside layout");
                groups.push(self.data_parallel_group(first).expect("rank inside layout"));
            }
        }
        groups
    }
}

/// A logical device of the job (one OS thread).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct DeviceId(pub u32);

impl std::fmt::Display for DeviceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A pipeline stage of one data-parallel replica.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct StageId {
    /// The data-parallel replica.
    pub replica: u32,
    /// The stage index in the pipeline (0 without pipeline parallelism).
    pub stage: u32,
    /// The rank in the stage's tensor-parallel group (0 without tensor parallelism).
    #[serde(default)]
    pub tp: u32,
}

impl std::fmt::Display for StageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.tp > 0 {
            write!(
                f,
                "stage {} (tensor-parallel rank {}) of replica {}",
                self.stage, self.tp, self.replica
            )
        } else {
            write!(f, "stage {} of replica {}", self.stage, self.replica)
        }
    }
}

/// The elements of a buffer of `len` elements that rank `index` of `world` owns: contiguous,
/// in rank order, covering `0..len`; the first `len % world` chunks are one element longer.
/// A world of 0 is treated as 1. The layout rule of every collective (COMM-6) and of the
/// sampler's shares; re-exported as `comm::chunk_range`.
pub fn chunk_range(len: usize, world: usize, index: usize) -> std::ops::Range<usize> {
    let world = world.max(1);
    let base = len / world;
    let extra = len % world;
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn mesh_1_tp_fastest_then_dp_then_pp() {
        let l = Layout::new(2, 3, 2).unwrap();
        assert_eq!(l.world_size(), 12);
        assert_eq!(
            l.rank_of(Coord {
                dp: 0,
                pp: 0,
                tp: 1
            }),
            Some(Rank(1))
        );
        assert_eq!(
            l.rank_of(Coord {
                dp: 1,
                pp: 0,
                tp: 0
            }),
            Some(Rank(2))
        );
        assert_eq!(
            l.rank_of(Coord {
                dp: 0,
                pp: 1,
                tp: 0
            }),
            Some(Rank(4))
        );
        for r in l.ranks() {
            assert_eq!(l.rank_of(l.coord_of(r).unwrap()), Some(r));
        }
        assert_eq!(l.coord_of(Rank(12)), None);
    }

    #[test]
    fn groups_partition_the_world() {
        let l = Layout::new(3, 2, 2).unwrap();
        let groups = l.data_parallel_groups();
        assert_eq!(groups.len(), 4);
        let all: BTreeSet<Rank> = groups.iter().flatten().copied().collect();
        assert_eq!(all.len(), 12);
        for g in &groups {
            assert_eq!(g.len(), 3);
            for r in g {
                assert_eq!(l.data_parallel_group(*r).as_ref(), Some(g));
            }
        }
        assert_eq!(l.pipeline_group(Rank(1)).unwrap(), vec![Rank(1), Rank(7)]);
        assert_eq!(
            l.tensor_parallel_group(Rank(5)).unwrap(),
            vec![Rank(4), Rank(5)]
        );
    }

    #[test]
    fn pure_data_parallel_layout() {
        let l = Layout::data_parallel(4).unwrap();
        assert_eq!(
            l.data_parallel_group(Rank(2)).unwrap(),
            (0..4).map(Rank).collect::<Vec<_>>()
        );
        assert_eq!(l.pipeline_group(Rank(2)).unwrap(), vec![Rank(2)]);
    }

    #[test]
    fn zero_degree_is_refused() {
        assert!(matches!(Layout::new(0, 1, 1), Err(InvalidConfig(_))));
    }
}
