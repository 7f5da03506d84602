//! The hierarchical transport: a group whose ranks live in several processes, some holding
//! several ranks. A collective runs inside each process first (the in-process transport,
//! shared memory), then between one leader per process (the TCP transport), then back inside
//! each process (a broadcast from its leader), so each process sends its data across processes
//! once, not once per rank. The plan ([`HierarchyPlan`]) is a pure function of which process
//! holds each rank, so every rank computes the same one.
//!
//! - HIER-1: all-reduce, broadcast and barrier give every rank what the flat group gives, up
//!   to the order f32 sums are rounded in (Max and Min exactly), bit-identical on every rank.
//!   Reduce-scatter and all-gather run as an all-reduce (all-gather: each rank's chunk into
//!   zeros, summed); send and recv need a link between the two ranks and are
//!   [`CommError::Unsupported`].
//! - HIER-2: a leader's failure across processes shuts its process's in-process group down,
//!   so the ranks waiting on it fail at once (a consequence, [`CommError::Shutdown`]) while
//!   the leader reports the cause, with a lost peer named by its rank in the whole group.

use std::sync::Arc;
use std::time::Duration;

use super::{
    Algorithm, CollectiveKind, CommError, Communicator, Element, LocalGroup, PartialSums, ReduceOp,
};
use crate::mesh::{Generation, Rank};

/// Who does what in a hierarchical group: the ranks of this rank's process (in rank order, the
/// first is its leader) and every process's leader (in rank order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HierarchyPlan {
    /// The group ranks of this rank's process, lowest first (the leader).
    pub local: Vec<Rank>,
    /// Every process's leader, in rank order; a process is named by its position here.
    pub leaders: Vec<Rank>,
}

impl HierarchyPlan {
    /// The plan of `rank` in a group where rank r lives in process `processes[r]`, or `None`
    /// when no process holds two ranks (the flat group is as good) or `rank` is outside.
    pub fn of(rank: Rank, processes: &[u32]) -> Option<Self> {
        let mine = *processes.get(rank.index())?;
        let mut seen = std::collections::HashSet::new();
        let shared = processes.iter().any(|p| !seen.insert(*p));
        if !shared {
            return None;
        }
        let local = (0..processes.len())
            .filter(|&r| processes[r] == mine)
            .map(|r| Rank(r as u32))
            .collect();
        let mut leaders = Vec::new();
        let mut led = std::collections::HashSet::new();
        for (r, p) in processes.iter().enumerate() {
            if led.insert(*p) {
                leaders.push(Rank(r as u32));
            }
        }
        Some(Self { local, leaders })
    }

    /// This rank's index inside its process (0: the leader).
    pub fn local_index(&self, rank: Rank) -> Option<usize> {
        self.local.iter().position(|r| *r == rank)
    }

    /// The index of the process that holds `rank` among the leaders, given every rank's process.
    fn process_of(&self, rank: Rank, processes: &[u32]) -> Option<usize> {
        let p = *processes.get(rank.index())?;
        self.leaders
            .iter()
            .position(|l| processes.get(l.index()) == Some(&p))
    }
}

/// One rank's side of a hierarchical group.
#[derive(Debug)]
pub(crate) struct HierCommunicator {
    rank: Rank,
    world: usize,
    generation: Generation,
    plan: HierarchyPlan,
    /// Every rank's process (to find a root's process).
    processes: Vec<u32>,
    /// This process's ranks (local rank 0 is the leader).
    local: Communicator,
    /// The in-process group, shut down when the leader fails across processes (HIER-2).
    local_group: Arc<LocalGroup>,
    /// The leaders' group across processes: on the leader only, when there are two or more
    /// processes.
    leaders: Option<Communicator>,
    timeout: Duration,
}

impl HierCommunicator {
    /// Bytes this rank sent in its process and, on a leader, across processes.
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.local.bytes_sent() + self.leaders.as_ref().map_or(0, Communicator::bytes_sent)
    }

    /// Rank `rank`'s side: `local` is its communicator in its process's group (in the plan's
    /// local order), `leaders` its communicator among the leaders (leaders of a group of two
    /// or more processes only).
    pub(crate) fn new(
        (rank, generation): (Rank, Generation),
        processes: Vec<u32>,
        plan: HierarchyPlan,
        local: Communicator,
        leaders: Option<Communicator>,
    ) -> Option<Self> {
        let local_group = local.group()?.clone();
        let timeout = local.timeout();
        Some(Self {
            rank,
            world: processes.len(),
            generation,
            plan,
            processes,
            local,
            local_group,
            leaders,
            timeout,
        })
    }

    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn generation(&self) -> Generation {
        self.generation
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.local.next_seq()
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A rank waits inside its process while its leader works across processes: the
    /// in-process ops get twice the time-out, so the cross-process op's own time-out (and its
    /// diagnosis) comes first.
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        self.local.set_timeout(timeout * 2);
        if let Some(l) = &mut self.leaders {
            l.set_timeout(timeout);
        }
    }

    pub(crate) fn algorithm(&self) -> Algorithm {
        self.leaders
            .as_ref()
            .map_or_else(|| self.local.algorithm(), Communicator::algorithm)
    }

    pub(crate) fn set_algorithm(&mut self, algorithm: Algorithm) {
        if let Some(l) = &mut self.leaders {
            l.set_algorithm(algorithm);
        }
    }

    pub(crate) fn partial_sums(&self) -> PartialSums {
        self.local.partial_sums()
    }

    /// Both levels: the local group's ring or tree plans and the leaders' plans.
    pub(crate) fn set_partial_sums(&mut self, partial_sums: PartialSums) {
        self.local.set_partial_sums(partial_sums);
        if let Some(l) = &mut self.leaders {
            l.set_partial_sums(partial_sums);
        }
    }

    pub(crate) fn last_algorithm(&self) -> Option<Algorithm> {
        match &self.leaders {
            Some(l) => l.last_algorithm(),
            None => self.local.last_algorithm(),
        }
    }

    /// Runs `f` on the leaders' group, if this rank leads one; a failure shuts the local group
    /// down (HIER-2) and names a lost leader by its rank in the whole group.
    fn across(
        &mut self,
        f: impl FnOnce(&mut Communicator) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let Some(leaders) = &mut self.leaders else {
            return Ok(());
        };
        f(leaders).map_err(|e| {
            self.local_group.shutdown();
            in_group(e, &self.plan.leaders)
        })
    }

    /// Runs `f` on the in-process group, naming ranks in an error by their rank in the group.
    fn inside(
        &mut self,
        f: impl FnOnce(&mut Communicator) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        f(&mut self.local).map_err(|e| in_group(e, &self.plan.local))
    }

    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let inner = if op == ReduceOp::Mean {
            ReduceOp::Sum
        } else {
            op
        };
        self.inside(|c| c.all_reduce(buf, inner))?;
        self.across(|l| l.all_reduce(buf, inner))?;
        self.inside(|c| c.broadcast(buf, Rank(0)))?;
        if op == ReduceOp::Mean {
            let n = self.world as f32;
            for v in buf.iter_mut() {
                *v = T::from_f32(v.to_f32() / n);
            }
        }
        Ok(())
    }

    pub(crate) fn broadcast<T: Element>(
        &mut self,
        buf: &mut [T],
        root: Rank,
    ) -> Result<(), CommError> {
        let invalid = || CommError::InvalidPeer {
            generation: self.generation,
            op: CollectiveKind::Broadcast,
            rank: self.rank,
            peer: root,
            world: self.world,
        };
        let root_process = self
            .plan
            .process_of(root, &self.processes)
            .ok_or_else(invalid)?;
        let my_process = self
            .plan
            .process_of(self.rank, &self.processes)
            .ok_or_else(invalid)?;
        if my_process == root_process {
            let at = self.plan.local_index(root).ok_or_else(invalid)?;
            self.inside(|c| c.broadcast(buf, Rank(at as u32)))?;
        }
        self.across(|l| l.broadcast(buf, Rank(root_process as u32)))?;
        if my_process != root_process {
            self.inside(|c| c.broadcast(buf, Rank(0)))?;
        }
        Ok(())
    }

    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        self.inside(Communicator::barrier)?;
        self.across(Communicator::barrier)?;
        self.inside(Communicator::barrier)
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let range = super::chunk_range(input.len(), self.world, self.rank.index());
        if output.len() != range.len() {
            return Err(CommError::Unsupported {
                op: CollectiveKind::ReduceScatter,
                why: format!(
                    "rank {} passed {} output elements for its chunk of {}",
                    self.rank.0,
                    output.len(),
                    range.len()
                ),
            });
        }
        let mut all = input.to_vec();
        self.all_reduce(&mut all, op)?;
        output.copy_from_slice(&all[range]);
        Ok(())
    }

    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let range = super::chunk_range(output.len(), self.world, self.rank.index());
        if input.len() != range.len() {
            return Err(CommError::Unsupported {
                op: CollectiveKind::AllGather,
                why: format!(
                    "rank {} passed {} input elements for its chunk of {}",
                    self.rank.0,
                    input.len(),
                    range.len()
                ),
            });
        }
        for v in output.iter_mut() {
            *v = T::from_f32(0.0);
        }
        output[range].copy_from_slice(input);
        self.all_reduce(output, ReduceOp::Sum)
    }

    pub(crate) fn send<T: Element>(&mut self, _buf: &[T], _to: Rank) -> Result<(), CommError> {
        Err(self.no_point_to_point(CollectiveKind::Send))
    }

    pub(crate) fn recv<T: Element>(
        &mut self,
        _buf: &mut [T],
        _from: Rank,
    ) -> Result<(), CommError> {
        Err(self.no_point_to_point(CollectiveKind::Recv))
    }

    fn no_point_to_point(&self, op: CollectiveKind) -> CommError {
        CommError::Unsupported {
            op,
            why: "a hierarchical group has no link between two arbitrary ranks; use a flat \
                  TCP group for point-to-point"
                .into(),
        }
    }
}

/// `e` from a sub-group whose rank i is `ranks[i]` of the whole group, with every rank it
/// names renamed so (HIER-2: the Supervisor reads them as ranks of the group).
fn in_group(e: CommError, ranks: &[Rank]) -> CommError {
    let to = |r: Rank| ranks.get(r.index()).copied().unwrap_or(r);
    match e {
        CommError::Link {
            generation,
            seq,
            op,
            peer,
            failure,
        } => CommError::Link {
            generation,
            seq,
            op,
            peer: to(peer),
            failure,
        },
        CommError::Timeout {
            generation,
            seq,
            op,
            missing,
            waited,
        } => CommError::Timeout {
            generation,
            seq,
            op,
            missing: missing.into_iter().map(to).collect(),
            waited,
        },
        CommError::Mismatch {
            generation,
            seq,
            op,
            calls,
        } => CommError::Mismatch {
            generation,
            seq,
            op,
            calls: calls
                .into_iter()
                .map(|c| super::RankCall {
                    rank: to(c.rank),
                    ..c
                })
                .collect(),
        },
        CommError::Poisoned {
            generation,
            seq,
            op,
            cause,
        } => CommError::Poisoned {
            generation,
            seq,
            op,
            cause: Box::new(in_group(*cause, ranks)),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// HIER plans: every rank of a process agrees on its process's ranks and on the
        /// leaders; each process has exactly one leader, its lowest rank.
        #[test]
        fn every_rank_computes_the_same_hierarchy(processes in prop::collection::vec(0u32..4, 1..10)) {
            let plans: Vec<Option<HierarchyPlan>> = (0..processes.len())
                .map(|r| HierarchyPlan::of(Rank(r as u32), &processes))
                .collect();
            let distinct: std::collections::HashSet<u32> = processes.iter().copied().collect();
            if distinct.len() == processes.len() {
                prop_assert!(plans.iter().all(Option::is_none));
                return Ok(());
            }
            let first = plans[0].clone().unwrap();
            prop_assert_eq!(first.leaders.len(), distinct.len());
            for (r, plan) in plans.iter().enumerate() {
                let plan = plan.as_ref().unwrap();
                prop_assert_eq!(&plan.leaders, &first.leaders);
                prop_assert!(plan.local.contains(&Rank(r as u32)));
                prop_assert!(plan.local.iter().all(|m| processes[m.index()] == processes[r]));
                prop_assert!(plan.leaders.contains(&plan.local[0]));
                prop_assert_eq!(plan.local.len(), processes.iter().filter(|p| **p == processes[r]).count());
            }
        }
    }

    use crate::comm::net::link::{JobToken, LinkConfig, LinkListener};
    use crate::comm::tcp::{TcpConfig, TcpGroup};
    use crate::comm::{CommConfig, chunk_range};

    /// Runs `body` on one thread per rank of a hierarchical group whose rank r lives in
    /// process `processes[r]`: in-process groups per process, leaders over loopback TCP.
    fn on_hier<R: Send>(processes: &[u32], body: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
        let world = processes.len();
        let plans: Vec<HierarchyPlan> = (0..world)
            .map(|r| HierarchyPlan::of(Rank(r as u32), processes).expect("a shared process"))
            .collect();
        let leaders = plans[0].leaders.clone();
        let token = JobToken::from_bytes([5; 32]);
        let config = TcpConfig::default()
            .with_timeout(Duration::from_secs(10))
            .with_link(LinkConfig::default().with_handshake_timeout(Duration::from_secs(10)));
        let listeners: Vec<LinkListener> = (0..leaders.len())
            .map(|i| {
                LinkListener::bind("127.0.0.1:0", Rank(i as u32), token.clone(), config.link)
                    .unwrap()
            })
            .collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        // One in-process group per process, its communicators by local index.
        let mut locals: std::collections::HashMap<u32, Vec<Option<Communicator>>> =
            std::collections::HashMap::new();
        for plan in &plans {
            let p = processes[plan.local[0].index()];
            locals.entry(p).or_insert_with(|| {
                LocalGroup::new(plan.local.len(), Generation(0), CommConfig::default())
                    .communicators()
                    .into_iter()
                    .map(Some)
                    .collect()
            });
        }
        let mut comms: Vec<Option<Communicator>> = (0..world)
            .map(|r| {
                let plan = &plans[r];
                let at = plan.local_index(Rank(r as u32)).unwrap();
                locals.get_mut(&processes[r]).unwrap()[at].take()
            })
            .collect();
        let body = &body;
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    let local = comms[r].take().unwrap();
                    let plan = plans[r].clone();
                    let (listeners, addrs, config) = (&listeners, addrs.clone(), config.clone());
                    let processes = processes.to_vec();
                    scope.spawn(move || {
                        let rank = Rank(r as u32);
                        let lead = plan.leaders.iter().position(|l| *l == rank);
                        let across = lead.map(|i| {
                            TcpGroup::connect(&listeners[i], &addrs, Generation(0), config)
                                .unwrap()
                                .into_communicator()
                        });
                        let mut comm = Communicator::hierarchical(
                            (rank, Generation(0)),
                            processes,
                            plan,
                            local,
                            across,
                        )
                        .unwrap()
                        .with_timeout(Duration::from_secs(10));
                        assert!(comm.is_hierarchical());
                        body(&mut comm)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn input(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * 7919 + i * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// HIER-1: every collective of a hierarchical group (2 processes × 2 ranks, and 3
    /// processes holding 2, 1 and 3 ranks) gives what a flat in-process group gives: Max, Min,
    /// broadcast and all-gather exactly, sums within f32 rounding, the same bits on every rank.
    #[test]
    fn hierarchical_collectives_equal_the_flat_group() {
        for processes in [vec![0u32, 0, 1, 1], vec![0, 1, 0, 2, 2, 2]] {
            let world = processes.len();
            let run = |comm: &mut Communicator| {
                let me = comm.rank().index();
                let mut out: Vec<Vec<f32>> = Vec::new();
                for len in [0usize, 1, 7, 1000] {
                    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
                        let mut buf = input(me, len);
                        comm.all_reduce(&mut buf, op).unwrap();
                        out.push(buf);
                    }
                    let mut chunk = vec![0.0; chunk_range(len, world, me).len()];
                    comm.reduce_scatter(&input(me, len), &mut chunk, ReduceOp::Sum)
                        .unwrap();
                    out.push(chunk);
                    let mine = input(me, chunk_range(len, world, me).len());
                    let mut all = vec![0.0; len];
                    comm.all_gather(&mine, &mut all).unwrap();
                    out.push(all);
                    for root in 0..world {
                        let mut buf = input(me, len);
                        comm.broadcast(&mut buf, Rank(root as u32)).unwrap();
                        out.push(buf);
                    }
                    comm.barrier().unwrap();
                }
                out
            };
            let hier = on_hier(&processes, run);
            let flat: Vec<Vec<Vec<f32>>> = {
                let group = LocalGroup::new(world, Generation(0), CommConfig::default());
                std::thread::scope(|scope| {
                    let handles: Vec<_> = group
                        .communicators()
                        .into_iter()
                        .map(|mut c| scope.spawn(move || run(&mut c)))
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                })
            };
            for (r, (h, f)) in hier.iter().zip(&flat).enumerate() {
                assert_eq!(h.len(), f.len());
                for (i, (a, b)) in h.iter().zip(f).enumerate() {
                    assert_eq!(a.len(), b.len(), "rank {r} output {i}");
                    for (x, y) in a.iter().zip(b) {
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                            "rank {r} output {i}: {x} vs {y}"
                        );
                    }
                }
                // Every rank holds the same bits after each all-reduce.
                for (i, a) in h.iter().enumerate() {
                    let first = &hier[0][i];
                    if i % (4 + 2 + world) < 4 {
                        assert!(a.iter().zip(first).all(|(x, y)| x.to_bits() == y.to_bits()));
                    }
                }
            }
        }
    }

    #[test]
    fn point_to_point_is_a_typed_error() {
        let errors = on_hier(&[0, 0, 1, 1], |comm| {
            let to = Rank((comm.rank().0 + 1) % 4);
            comm.send(&[1.0f32], to).unwrap_err()
        });
        assert!(errors.iter().all(|e| matches!(
            e,
            CommError::Unsupported {
                op: CollectiveKind::Send,
                ..
            }
        )));
    }

    #[test]
    fn one_rank_per_process_is_flat() {
        assert_eq!(HierarchyPlan::of(Rank(1), &[0, 1, 2]), None);
        let plan = HierarchyPlan::of(Rank(3), &[0, 0, 1, 1]).unwrap();
        assert_eq!(plan.local, [Rank(2), Rank(3)]);
        assert_eq!(plan.leaders, [Rank(0), Rank(2)]);
        assert_eq!(plan.local_index(Rank(3)), Some(1));
    }
}
