//! The data-plane groups a process's ranks join across processes (feature `cluster`): a flat
//! TCP group of every rank, or, when a process holds two or more members, a hierarchical
//! group (HIER-1): an in-process [`LocalGroup`] of the process's members and a TCP group of
//! one leader per process. The cluster's node host asks for a group at every (re)wiring and
//! keeps the [`GroupShutdown`] to end it.
//!
//! Under the MPI transport ([`DataTransport::Mpi`]) the TCP group is a bootstrap, as NCCL's
//! socket bootstrap is: once formed (token-checked), its ranks all-gather their
//! [`MpiEndpoint`](super::mpi::MpiEndpoint)s over it, and the communicator the rank gets is an
//! MPI one; the TCP links close. The in-process part of a hierarchical group stays in
//! process.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

use super::hierarchical::HierarchyPlan;
use super::net::link::{JobToken, LinkListener};
use super::tcp::{TcpConfig, TcpGroup, TcpGroupError, TcpShutdown};
use super::{Communicator, DataTransport, LocalGroup};
use crate::mesh::{Generation, Rank};

/// In-process groups being formed, by generation and members: each member's communicator
/// until it takes it.
type Forming = HashMap<(u64, Vec<u32>), Vec<Option<Communicator>>>;

/// Why a rank could not join its data-plane group. Every variant names the rank.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum JoinError {
    /// The rank's listener could not be used.
    #[error("the data-plane listener: {0}")]
    Listener(std::io::Error),
    /// The blocking connect task died.
    #[error("the connect task failed: {0}")]
    Task(String),
    /// The TCP group could not be formed.
    #[error("rank {} could not join the data plane of generation {}: {source}", rank.0, generation.0)]
    Connect {
        /// The rank (in the TCP group) that failed to join.
        rank: Rank,
        /// The group's generation.
        generation: Generation,
        /// What went wrong.
        source: TcpGroupError,
    },
    /// Fewer addresses than the hierarchical group's leaders need.
    #[error("{addresses} addresses for leaders {leaders:?}")]
    LeaderAddresses {
        /// How many addresses were given.
        addresses: usize,
        /// The leaders (one rank per process).
        leaders: Vec<Rank>,
    },
    /// The rank is not a member of its process's part of the group.
    #[error("rank {} is not among {local:?}", rank.0)]
    NotLocal {
        /// The rank.
        rank: Rank,
        /// The members in this process.
        local: Vec<Rank>,
    },
    /// The rank asked twice for its communicator of one in-process group.
    #[error("rank {} joined the in-process group of generation {} twice", rank.0, generation.0)]
    JoinedTwice {
        /// The rank.
        rank: Rank,
        /// The group's generation.
        generation: Generation,
    },
    /// The in-process and cross-process parts do not make one hierarchical group.
    #[error("the in-process part of a hierarchical group")]
    Hierarchical,
    /// The job's transport is MPI and this process cannot use it.
    #[error("the job's data plane is MPI, and MPI is not initialised in this process")]
    NoMpi,
    /// The MPI group could not be formed over the TCP bootstrap.
    #[cfg(feature = "mpi")]
    #[error("rank {} could not form its MPI group of generation {}: {detail}", rank.0, generation.0)]
    Mpi {
        /// The rank.
        rank: Rank,
        /// The group's generation.
        generation: Generation,
        /// What went wrong.
        detail: String,
    },
}

/// Shuts a rank's data-plane group down: its TCP links, and its process's in-process group
/// when the group is hierarchical.
#[derive(Debug)]
pub(crate) struct GroupShutdown {
    tcp: Option<TcpShutdown>,
    #[cfg(feature = "mpi")]
    mpi: Option<super::mpi::MpiShutdown>,
    local: Option<Arc<LocalGroup>>,
}

impl GroupShutdown {
    fn none() -> Self {
        Self {
            tcp: None,
            #[cfg(feature = "mpi")]
            mpi: None,
            local: None,
        }
    }

    /// Ends the group: every op of every member fails at once (RT-4).
    pub(crate) fn shutdown(&self) {
        if let Some(t) = &self.tcp {
            t.shutdown();
        }
        #[cfg(feature = "mpi")]
        if let Some(m) = &self.mpi {
            m.shutdown();
        }
        if let Some(l) = &self.local {
            l.shutdown();
        }
    }
}

/// A cross-process group as the job's transport runs it: the communicator and what ends it.
struct CrossProcess {
    communicator: Communicator,
    shutdown: GroupShutdown,
}

/// A rank's place in a data-plane group it joined.
#[derive(Debug)]
pub(crate) struct JoinedGroup {
    /// The rank's communicator.
    pub(crate) communicator: Communicator,
    /// Ends the group.
    pub(crate) shutdown: GroupShutdown,
    /// How it joined, in words (for `meshwork cluster` status and logs).
    pub(crate) description: String,
}

/// One process's side of every data-plane group its ranks join.
#[derive(Debug)]
pub(crate) struct ProcessGroups {
    token: JobToken,
    tcp: TcpConfig,
    transport: DataTransport,
    forming: Mutex<Forming>,
}

impl ProcessGroups {
    /// Groups whose links authenticate with `token`, under `tcp`'s settings, moving their
    /// bytes over `transport`.
    pub(crate) fn new(token: JobToken, tcp: TcpConfig, transport: DataTransport) -> Self {
        Self {
            token,
            tcp,
            transport,
            forming: Mutex::new(HashMap::new()),
        }
    }

    /// The transport the groups move their bytes on.
    pub(crate) fn transport(&self) -> DataTransport {
        self.transport
    }

    /// Joins the group of `generation` whose ranks listen at `addrs`, as `rank`, through
    /// `listener`. With `processes` (each member's process) and a process holding two or
    /// more members, the group is hierarchical (HIER-1): an in-process group of this
    /// process's members, and a TCP group of one leader per process on the leaders'
    /// listeners; otherwise a flat TCP group.
    pub(crate) async fn join(
        &self,
        listener: std::io::Result<TcpListener>,
        rank: Rank,
        generation: Generation,
        addrs: Vec<SocketAddr>,
        processes: Option<Vec<u32>>,
    ) -> Result<JoinedGroup, JoinError> {
        let hierarchy = processes
            .as_ref()
            .and_then(|p| HierarchyPlan::of(rank, p).map(|plan| (plan, p.clone())));
        let Some((plan, processes)) = hierarchy else {
            let group = self.tcp_group(listener, rank, generation, addrs).await?;
            let world = group.world();
            let cross = self.over_transport(group, rank, generation).await?;
            return Ok(JoinedGroup {
                shutdown: cross.shutdown,
                description: format!(
                    "generation {}: flat {} group of {world} rank(s)",
                    generation.0,
                    self.transport.to_string().to_uppercase(),
                ),
                communicator: cross.communicator,
            });
        };
        let local = self.local_member(&plan, rank, generation)?;
        let leaders = match plan.local_index(rank) {
            Some(0) if plan.leaders.len() > 1 => {
                let index = plan.leaders.iter().position(|l| *l == rank).unwrap_or(0);
                let leader_addrs = plan
                    .leaders
                    .iter()
                    .map(|l| addrs.get(l.index()).copied())
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| JoinError::LeaderAddresses {
                        addresses: addrs.len(),
                        leaders: plan.leaders.clone(),
                    })?;
                let group = self
                    .tcp_group(listener, Rank(index as u32), generation, leader_addrs)
                    .await?;
                Some(
                    self.over_transport(group, Rank(index as u32), generation)
                        .await?,
                )
            }
            _ => None,
        };
        let (leaders, mut shutdown) = match leaders {
            Some(cross) => (Some(cross.communicator), cross.shutdown),
            None => (None, GroupShutdown::none()),
        };
        shutdown.local = local.group().cloned();
        let description = format!(
            "generation {}: hierarchical group of {} rank(s), {} in this process, {} process(es) \
             over {}{}",
            generation.0,
            processes.len(),
            plan.local.len(),
            plan.leaders.len(),
            self.transport.to_string().to_uppercase(),
            if leaders.is_some() {
                ", this rank leads its process across processes"
            } else {
                ""
            }
        );
        let timeout = self.tcp.comm.timeout;
        match Communicator::hierarchical((rank, generation), processes, plan, local, leaders) {
            Some(c) => Ok(JoinedGroup {
                communicator: c.with_timeout(timeout),
                shutdown,
                description,
            }),
            None => {
                // Nobody will hold these links: end them rather than leave peers waiting.
                shutdown.shutdown();
                Err(JoinError::Hierarchical)
            }
        }
    }

    /// A flat TCP group of `generation` whose rank r listens at `addrs[r]`, joined as `rank`
    /// on `listener`.
    async fn tcp_group(
        &self,
        listener: std::io::Result<TcpListener>,
        rank: Rank,
        generation: Generation,
        addrs: Vec<SocketAddr>,
    ) -> Result<TcpGroup, JoinError> {
        let listener = listener
            .and_then(|l| LinkListener::from_std(l, rank, self.token.clone(), self.tcp.link))
            .map_err(JoinError::Listener)?;
        let tcp = self.tcp.clone();
        tokio::task::spawn_blocking(move || TcpGroup::connect(&listener, &addrs, generation, tcp))
            .await
            .map_err(|e| JoinError::Task(e.to_string()))?
            .map_err(|source| JoinError::Connect {
                rank,
                generation,
                source,
            })
    }

    /// The communicator of a formed TCP group on the job's transport: the TCP one, or (MPI)
    /// an MPI group whose endpoints the ranks all-gathered over it.
    async fn over_transport(
        &self,
        group: TcpGroup,
        rank: Rank,
        generation: Generation,
    ) -> Result<CrossProcess, JoinError> {
        if self.transport == DataTransport::Tcp {
            return Ok(CrossProcess {
                shutdown: GroupShutdown {
                    tcp: Some(group.shutdown_handle()),
                    ..GroupShutdown::none()
                },
                communicator: group.into_communicator(),
            });
        }
        #[cfg(feature = "mpi")]
        {
            let comm = self.tcp.comm.clone();
            let bootstrap = move || mpi_over_tcp(group, rank, generation, comm);
            tokio::task::spawn_blocking(bootstrap)
                .await
                .map_err(|e| JoinError::Task(e.to_string()))?
        }
        #[cfg(not(feature = "mpi"))]
        {
            drop((group, rank, generation));
            Err(JoinError::NoMpi)
        }
    }

    /// `rank`'s communicator in the in-process group of its process's members: the first of
    /// them to ask makes the group (one per generation and membership), each takes its own.
    fn local_member(
        &self,
        plan: &HierarchyPlan,
        rank: Rank,
        generation: Generation,
    ) -> Result<Communicator, JoinError> {
        let index = plan.local_index(rank).ok_or_else(|| JoinError::NotLocal {
            rank,
            local: plan.local.clone(),
        })?;
        let key = (
            generation.0,
            plan.local.iter().map(|r| r.0).collect::<Vec<_>>(),
        );
        let mut groups = self.forming.lock().unwrap_or_else(|e| e.into_inner());
        // Groups of older generations are over: drop what no member took.
        groups.retain(|(g, _), _| *g >= generation.0);
        let members = groups.entry(key.clone()).or_insert_with(|| {
            LocalGroup::new(plan.local.len(), generation, self.tcp.comm.clone())
                .communicators()
                .into_iter()
                .map(Some)
                .collect()
        });
        let mine = members.get_mut(index).and_then(Option::take);
        if members.iter().all(Option::is_none) {
            groups.remove(&key);
        }
        mine.ok_or(JoinError::JoinedTwice { rank, generation })
    }
}

/// The MPI group of the ranks of a formed TCP `group`: each rank's endpoint (two u32s)
/// all-gathered over TCP as the bit patterns of two f32s (an all-gather only copies bits),
/// then the TCP links close.
#[cfg(feature = "mpi")]
fn mpi_over_tcp(
    group: TcpGroup,
    rank: Rank,
    generation: Generation,
    config: super::CommConfig,
) -> Result<CrossProcess, JoinError> {
    use super::mpi::{MpiEndpoint, MpiGroup};
    let failed = |detail: String| JoinError::Mpi {
        rank,
        generation,
        detail,
    };
    let world = super::mpi::world().ok_or(JoinError::NoMpi)?;
    let mine = world.endpoint();
    let mut tcp = group.into_communicator();
    let size = tcp.world();
    let me = [f32::from_bits(mine.process), f32::from_bits(mine.id)];
    let mut all = vec![0f32; 2 * size];
    tcp.all_gather(&me, &mut all)
        .map_err(|e| failed(format!("exchanging endpoints over TCP: {e}")))?;
    let endpoints: Vec<MpiEndpoint> = all
        .chunks_exact(2)
        .map(|p| MpiEndpoint {
            process: p[0].to_bits(),
            id: p[1].to_bits(),
        })
        .collect();
    if endpoints.get(tcp.rank().index()) != Some(&mine) {
        return Err(failed(
            "the endpoint exchange did not return this rank's own".into(),
        ));
    }
    let group = MpiGroup::new(world, endpoints, tcp.rank(), generation, config)
        .map_err(|e| failed(e.to_string()))?;
    let shutdown = GroupShutdown {
        mpi: Some(group.shutdown_handle()),
        ..GroupShutdown::none()
    };
    Ok(CrossProcess {
        communicator: group.into_communicator(),
        shutdown,
    })
}
