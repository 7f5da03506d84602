//! Who gets which rank: the pure rule that turns the processes of a job (the head and the
//! nodes that joined it) into a world of ranks with data-plane addresses, and the view of that
//! world one process needs to open its data plane ([`World::plan_for`]).
//!
//! Pure: no sockets, no actors. Invariants (tests name the id they check):
//!
//! - CTL-4 (deterministic ranks): processes are ordered by their process index when they
//!   announced one (torchrun's `RANK`, Slurm's `SLURM_PROCID`), the others after them in join
//!   order; the head is always process 0. Ranks are handed out in that order, a process's
//!   devices consecutively: ranks are exactly `0..world_size`, each (process, device) has one,
//!   and the same announced indices give the same world whatever the join order.
//! - CTL-5 (conflicts are typed): two processes claiming one index, a node claiming index 0
//!   (the head's), an index beyond the expected process count or a process without devices is
//!   a [`WorldError`], never a silently renumbered world.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::mesh::Rank;

pub use crate::cluster::ProcessIndex;

/// One process as rank assignment sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSlot {
    /// The process's name (the head's, or a node's `host-pid` name), for people and errors.
    pub name: String,
    /// The index it asked for (from `RANK`/`SLURM_PROCID`), if any.
    pub requested: Option<ProcessIndex>,
    /// One data-plane listener address per device it holds, in device order.
    pub data_addrs: Vec<SocketAddr>,
}

/// One rank of the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEntry {
    /// The rank.
    pub rank: Rank,
    /// The process that holds it.
    pub process: ProcessIndex,
    /// Which of that process's devices (0-based).
    pub device: u32,
    /// Where that device's data-plane listener accepts links.
    pub addr: SocketAddr,
}

/// The assembled world: every rank, in rank order, and the processes' names by index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct World {
    /// One entry per rank; `ranks[r].rank == Rank(r)`.
    pub ranks: Vec<RankEntry>,
    /// The processes' names, indexed by [`ProcessIndex`] (0 is the head).
    pub processes: Vec<String>,
}

/// What one process needs to open its side of the data plane: hand `addrs` and one of
/// `ranks` to each device's data-plane group (`comm::tcp::TcpGroup::connect` on the
/// `tcp-transport` branch), with the job token that came with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessPlan {
    /// This process.
    pub process: ProcessIndex,
    /// The ranks this process holds, in device order.
    pub ranks: Vec<Rank>,
    /// Ranks in the world.
    pub world_size: usize,
    /// Every rank's data-plane address, indexed by rank.
    pub addrs: Vec<SocketAddr>,
    /// Every rank's process, indexed by rank (which ranks share a process: the hierarchical
    /// all-reduce).
    pub processes: Vec<ProcessIndex>,
}

/// Why the processes do not make a world (CTL-5).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorldError {
    /// Two processes asked for the same index.
    #[error("processes {first} and {second} both claim process index {index}")]
    DuplicateIndex {
        /// The index.
        index: u32,
        /// The first claimant's name.
        first: String,
        /// The second claimant's name.
        second: String,
    },
    /// A node asked for index 0, which is the head's.
    #[error("node {name} claims process index 0, which is the head's (RANK=0 runs the head)")]
    ClaimsHeadIndex {
        /// The node's name.
        name: String,
    },
    /// An index at or beyond the number of processes the job expects.
    #[error("node {name} claims process index {index}, but the job has {processes} processes")]
    IndexOutOfRange {
        /// The node's name.
        name: String,
        /// The index it asked for.
        index: u32,
        /// Processes expected (head included).
        processes: usize,
    },
    /// The world would have no rank at all.
    #[error("no process holds a device: the world would be empty")]
    Empty,
}

/// Orders the processes and hands out ranks (CTL-4, CTL-5). `head` is process 0 (it may hold
/// no device); `nodes` are in join order.
pub fn assign_ranks(head: &ProcessSlot, nodes: &[ProcessSlot]) -> Result<World, WorldError> {
    let processes = nodes.len() + 1;
    let mut claimed: Vec<Option<&str>> = vec![None; processes];
    claimed[0] = Some(&head.name);
    for node in nodes {
        let Some(ProcessIndex(index)) = node.requested else {
            continue;
        };
        if index == 0 {
            return Err(WorldError::ClaimsHeadIndex {
                name: node.name.clone(),
            });
        }
        let Some(slot) = usize::try_from(index).ok().and_then(|i| claimed.get_mut(i)) else {
            return Err(WorldError::IndexOutOfRange {
                name: node.name.clone(),
                index,
                processes,
            });
        };
        if let Some(first) = slot {
            return Err(WorldError::DuplicateIndex {
                index,
                first: (*first).to_string(),
                second: node.name.clone(),
            });
        }
        *slot = Some(&node.name);
    }
    // Process order: the head, then the indexed nodes at their index, the others in join
    // order in the free places.
    let mut order: Vec<Option<&ProcessSlot>> = vec![None; processes];
    order[0] = Some(head);
    for node in nodes {
        if let Some(ProcessIndex(i)) = node.requested {
            order[i as usize] = Some(node);
        }
    }
    let mut free = order
        .iter()
        .enumerate()
        .filter(|(_, p)| p.is_none())
        .map(|(i, _)| i)
        .collect::<Vec<_>>()
        .into_iter();
    for node in nodes.iter().filter(|n| n.requested.is_none()) {
        let i = free
            .next()
            .expect("as many free places as nodes without an index");
        order[i] = Some(node);
    }
    let mut ranks = Vec::new();
    let mut names = Vec::with_capacity(processes);
    for (p, slot) in order.into_iter().enumerate() {
        let slot = slot.expect("every place was filled above");
        names.push(slot.name.clone());
        for (d, addr) in slot.data_addrs.iter().enumerate() {
            ranks.push(RankEntry {
                rank: Rank(ranks.len() as u32),
                process: ProcessIndex(p as u32),
                device: d as u32,
                addr: *addr,
            });
        }
    }
    if ranks.is_empty() {
        return Err(WorldError::Empty);
    }
    Ok(World {
        ranks,
        processes: names,
    })
}

impl World {
    /// Ranks in the world.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The ranks process `process` holds, in device order.
    pub fn ranks_of(&self, process: ProcessIndex) -> Vec<Rank> {
        self.ranks
            .iter()
            .filter(|e| e.process == process)
            .map(|e| e.rank)
            .collect()
    }

    /// What `process` needs to open its side of the data plane.
    pub fn plan_for(&self, process: ProcessIndex) -> ProcessPlan {
        ProcessPlan {
            process,
            ranks: self.ranks_of(process),
            world_size: self.size(),
            addrs: self.ranks.iter().map(|e| e.addr).collect(),
            processes: self.ranks.iter().map(|e| e.process).collect(),
        }
    }

    /// Checks that the world is well formed (ranks `0..n` in order, processes in range): a
    /// world decoded from the wire is checked before use.
    pub fn validate(&self) -> Result<(), String> {
        for (i, e) in self.ranks.iter().enumerate() {
            if e.rank.index() != i {
                return Err(format!("entry {i} holds rank {}", e.rank.0));
            }
            if e.process.0 as usize >= self.processes.len() {
                return Err(format!(
                    "rank {i} is on process {} of {}",
                    e.process.0,
                    self.processes.len()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn node(name: &str, requested: Option<u32>, devices: u16) -> ProcessSlot {
        ProcessSlot {
            name: name.into(),
            requested: requested.map(ProcessIndex),
            data_addrs: (0..devices).map(|d| addr(1000 * (d + 1))).collect(),
        }
    }

    #[test]
    fn ctl_4_head_first_then_join_order_devices_consecutive() {
        let head = node("head", None, 1);
        let world = assign_ranks(&head, &[node("a", None, 2), node("b", None, 1)]).unwrap();
        assert_eq!(world.processes, vec!["head", "a", "b"]);
        let owners: Vec<(u32, u32)> = world
            .ranks
            .iter()
            .map(|e| (e.process.0, e.device))
            .collect();
        assert_eq!(owners, vec![(0, 0), (1, 0), (1, 1), (2, 0)]);
        let plan = world.plan_for(ProcessIndex(1));
        assert_eq!(plan.ranks, vec![Rank(1), Rank(2)]);
        assert_eq!((plan.world_size, plan.addrs.len()), (4, 4));
    }

    #[test]
    fn ctl_4_requested_indices_win_over_join_order() {
        let head = node("head", None, 0);
        let nodes = [
            node("x", Some(2), 1),
            node("y", None, 1),
            node("z", Some(1), 1),
        ];
        let world = assign_ranks(&head, &nodes).unwrap();
        assert_eq!(world.processes, vec!["head", "z", "x", "y"]);
        assert_eq!(world.ranks_of(ProcessIndex(1)), vec![Rank(0)]);
    }

    #[test]
    fn ctl_5_conflicts_are_typed() {
        let head = node("head", None, 1);
        assert!(matches!(
            assign_ranks(&head, &[node("a", Some(1), 1), node("b", Some(1), 1)]),
            Err(WorldError::DuplicateIndex { index: 1, .. })
        ));
        assert!(matches!(
            assign_ranks(&head, &[node("a", Some(0), 1)]),
            Err(WorldError::ClaimsHeadIndex { .. })
        ));
        assert!(matches!(
            assign_ranks(&head, &[node("a", Some(2), 1)]),
            Err(WorldError::IndexOutOfRange {
                index: 2,
                processes: 2,
                ..
            })
        ));
        assert_eq!(
            assign_ranks(&node("head", None, 0), &[node("a", None, 0)]),
            Err(WorldError::Empty)
        );
    }

    proptest! {
        /// CTL-4: whatever the devices and join order, ranks are 0..n, each (process, device)
        /// once, consecutive per process; with every node indexed, the join order does not
        /// change the world.
        #[test]
        fn ctl_4_ranks_are_a_deterministic_bijection(
            devices in proptest::collection::vec(0u16..4, 1..8),
            head_devices in 0u16..3,
            indexed in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let head = node("head", None, head_devices);
            let nodes: Vec<ProcessSlot> = devices
                .iter()
                .enumerate()
                .map(|(i, &d)| node(&format!("n{i}"), indexed.then_some(i as u32 + 1), d))
                .collect();
            let total = head_devices as usize + devices.iter().map(|&d| d as usize).sum::<usize>();
            let Ok(world) = assign_ranks(&head, &nodes) else {
                prop_assert_eq!(total, 0);
                return Ok(());
            };
            prop_assert_eq!(world.size(), total);
            prop_assert!(world.validate().is_ok());
            let mut seen = std::collections::HashSet::new();
            for (r, e) in world.ranks.iter().enumerate() {
                prop_assert_eq!(e.rank, Rank(r as u32));
                prop_assert!(seen.insert((e.process, e.device)));
                if r > 0 {
                    let prev = world.ranks[r - 1];
                    prop_assert!(
                        (prev.process, prev.device) < (e.process, e.device),
                        "ranks follow process then device order"
                    );
                }
            }
            if indexed {
                // A rotation of the join order gives the same world.
                let mut shuffled = nodes.clone();
                let k = (seed as usize) % shuffled.len();
                shuffled.rotate_left(k);
                prop_assert_eq!(assign_ranks(&head, &shuffled).unwrap(), world);
            }
        }
    }
}
