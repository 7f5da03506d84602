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

/// The same mesh with another number of replicas (ELASTIC-6): the new layout, and for each of
/// its ranks the rank of the old layout at the same coordinates (`None`: a rank that joins);
/// the old ranks whose replica is not in the new layout leave. Every block keeps its place:
/// only the data-parallel degree changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remesh {
    /// The layout after the resize.
    pub layout: Layout,
    /// Per rank of [`Remesh::layout`], the old rank at its coordinates, if there was one.
    pub origin: Vec<Option<Rank>>,
    /// The old ranks that leave, in rank order.
    pub leaving: Vec<Rank>,
}

impl Remesh {
    /// The ranks of the new layout that join (no old rank at their coordinates), in rank
    /// order.
    pub fn joining(&self) -> Vec<Rank> {
        self.origin
            .iter()
            .enumerate()
            .filter(|(_, o)| o.is_none())
            .map(|(r, _)| Rank(r as u32))
            .collect()
    }
}

impl Layout {
    /// This layout with `dp` replicas instead of its own, the pipeline and tensor-parallel
    /// degrees kept (ELASTIC-6).
    pub fn remesh(&self, dp: u32) -> Result<Remesh, InvalidConfig> {
        let layout = Layout::new(dp, self.pp, self.tp)?;
        let origin = layout
            .ranks()
            .map(|r| layout.coord_of(r).and_then(|c| self.rank_of(c)))
            .collect();
        let leaving = self
            .ranks()
            .filter(|&r| self.coord_of(r).is_some_and(|c| c.dp >= dp))
            .collect();
        Ok(Remesh {
            layout,
            origin,
            leaving,
        })
    }

    /// The ranks of replica `replica` (every stage and tensor-parallel rank of it), in rank
    /// order: stage by stage, tensor-parallel rank fastest.
    pub fn replica_ranks(&self, replica: u32) -> Vec<Rank> {
        self.ranks()
            .filter(|&r| self.coord_of(r).is_some_and(|c| c.dp == replica))
            .collect()
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

    proptest::proptest! {
        /// ELASTIC-6: a remeshed layout keeps pp and tp; each new rank comes from the old
        /// rank at the same coordinates exactly when its replica existed; the old ranks of
        /// replicas beyond the new degree leave; nothing else is lost or made up.
        #[test]
        fn elastic_6_a_remesh_keeps_every_block_in_its_place(
            dp in 1u32..6, pp in 1u32..4, tp in 1u32..4, to in 1u32..6,
        ) {
            let old = Layout::new(dp, pp, tp).unwrap();
            let m = old.remesh(to).unwrap();
            proptest::prop_assert_eq!((m.layout.dp(), m.layout.pp(), m.layout.tp()), (to, pp, tp));
            proptest::prop_assert_eq!(m.origin.len(), m.layout.world_size() as usize);
            for (r, origin) in m.origin.iter().enumerate() {
                let c = m.layout.coord_of(Rank(r as u32)).unwrap();
                match origin {
                    Some(o) => proptest::prop_assert_eq!(old.coord_of(*o), Some(c)),
                    None => proptest::prop_assert!(c.dp >= dp),
                }
            }
            let kept: BTreeSet<Rank> = m.origin.iter().flatten().copied().collect();
            let leaving: BTreeSet<Rank> = m.leaving.iter().copied().collect();
            proptest::prop_assert!(kept.is_disjoint(&leaving));
            proptest::prop_assert_eq!(kept.len() + leaving.len(), old.world_size() as usize);
            proptest::prop_assert_eq!(
                m.joining().len(),
                (to.saturating_sub(dp) * pp * tp) as usize
            );
            for r in &m.leaving {
                proptest::prop_assert!(old.coord_of(*r).unwrap().dp >= to);
            }
            let replica0 = m.layout.replica_ranks(0);
            proptest::prop_assert_eq!(replica0.len(), (pp * tp) as usize);
            proptest::prop_assert!(replica0.windows(2).all(|w| w[0] < w[1]));
        }
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
