//! Rendezvous from the conventions launchers already use: which process is the head, where it
//! listens, and how many processes the job has, read from torchrun-style or Slurm environment
//! variables. Pure: the environment comes in as a lookup function.
//!
//! # Conventions
//!
//! - **torchrun** (detected when `RANK` or `WORLD_SIZE` is set): `RANK` (this process,
//!   `0..WORLD_SIZE`), `WORLD_SIZE` (processes), `MASTER_ADDR` and `MASTER_PORT` (where
//!   process 0 listens). One rank per process; rank 0 is the head.
//! - **Slurm** (detected when `SLURM_PROCID` is set): `SLURM_PROCID` (this task),
//!   `SLURM_NTASKS` (tasks), `SLURM_NODELIST` or `SLURM_JOB_NODELIST` (hostlist syntax such as
//!   `node[01-03,07],gpu5`). Task 0 is the head; it runs on the first host of the list (Slurm's
//!   default block distribution) unless `MASTER_ADDR` names another. The port is
//!   `MESHWORK_PORT`, else `MASTER_PORT`, else [`DEFAULT_PORT`].
//! - **mpirun** of OpenMPI (detected when `OMPI_COMM_WORLD_RANK` is set:
//!   `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`) and of MPICH
//!   or Intel MPI's Hydra (detected when `PMI_RANK` is set: `PMI_RANK`, `PMI_SIZE`,
//!   `MPI_LOCALNRANKS`). Rank 0 is the head. The launcher does not say where rank 0 runs:
//!   `MASTER_ADDR` names it (`mpirun -x MASTER_ADDR=…`), and when every rank runs on this host
//!   (the local size equals the world's) it is the loopback address; a job over several hosts
//!   without `MASTER_ADDR` is an error (RDV-3). The port is `MESHWORK_PORT`, else
//!   `MASTER_PORT`, else [`DEFAULT_PORT`].
//!
//! - **MPI's world** (`from_mpi`, feature `mpi`, with `--transport mpi`): MPI itself gives the rank, the
//!   size and every rank's host, so no launcher variable is read: the head is rank 0, on
//!   `MASTER_ADDR` if set, else on the loopback address when every rank shares rank 0's host,
//!   else on rank 0's host name (RDV-4). The port is rank 0's `MESHWORK_PORT` or
//!   `MASTER_PORT`, else a port free on its host, broadcast over MPI. Any MPI launcher works,
//!   `mpirun`, `mpiexec` or `srun --mpi=pmix`.
//!
//! # Precedence
//!
//! Command-line flags (`--listen`, `--join`) win over the environment; torchrun's variables
//! win over Slurm's (torchrun run inside a Slurm allocation sets both, and its own are the
//! ones that describe its processes), and an MPI launcher's over Slurm's (`mpirun` inside an
//! allocation describes its own ranks, where `SLURM_PROCID` is the one task that ran it).
//!
//! # Invariants (tests name the id they check)
//!
//! - RDV-1: every garbled or missing variable of a detected convention is a typed
//!   [`RendezvousError`] naming the variable; nothing falls back silently.
//! - RDV-3: under an MPI launcher, the head's host is `MASTER_ADDR`, or the loopback address
//!   only when the launcher says every rank is on this host; otherwise
//!   [`RendezvousError::Missing`] names `MASTER_ADDR`.
//! - RDV-4: under MPI's world, the loopback address only when every rank runs on rank 0's
//!   host; otherwise `MASTER_ADDR` or rank 0's host name ([`from_mpi_hosts`]).
//! - RDV-2: [`expand_hostlist`] expands Slurm's syntax (ranges with zero padding, lists,
//!   several bracket groups per name) in order, and rejects malformed lists with a typed
//!   [`HostlistError`]; it never expands more than the limit it is given.

use crate::cluster::ProcessIndex;

/// The port a Slurm job's head listens on when neither `MESHWORK_PORT` nor `MASTER_PORT` is
/// set (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

/// The most hosts [`first_host`] and the environment readers expand.
pub const MAX_HOSTS: usize = 1 << 16;

/// Which convention the variables came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Convention {
    /// `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`.
    Torchrun,
    /// `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_NODELIST`.
    Slurm,
    /// OpenMPI's `mpirun`: `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
    /// MPICH's (or Intel MPI's) Hydra `mpiexec`: `PMI_RANK`/`PMI_SIZE`.
    Hydra,
    /// MPI's own world (`from_mpi`, feature `mpi`): ranks and hosts from MPI itself.
    MpiWorld,
}

/// Where this process stands in the job, as the launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// The convention the variables followed.
    pub convention: Convention,
    /// This process (0 is the head).
    pub process: ProcessIndex,
    /// Processes in the job, head included.
    pub processes: u32,
    /// The head's host name or address.
    pub head_host: String,
    /// The head's control-plane port.
    pub port: u16,
}

/// What this process does in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Run the head: listen on `listen` and wait for `nodes` nodes.
    Head {
        /// The address to listen on (all interfaces, the rendezvous port).
        listen: String,
        /// Nodes to wait for (processes minus the head).
        nodes: u32,
    },
    /// Run a node: join the head at `join` as process `process`.
    Node {
        /// The head's address.
        join: String,
        /// The process index to ask for.
        process: ProcessIndex,
    },
}

impl Rendezvous {
    /// The head's address, `host:port` (IPv6 literals bracketed).
    pub fn head_addr(&self) -> String {
        if self.head_host.contains(':') && !self.head_host.starts_with('[') {
            format!("[{}]:{}", self.head_host, self.port)
        } else {
            format!("{}:{}", self.head_host, self.port)
        }
    }

    /// This process's role: process 0 is the head, listening on every interface.
    pub fn role(&self) -> Role {
        if self.process.0 == 0 {
            Role::Head {
                listen: format!("0.0.0.0:{}", self.port),
                nodes: self.processes - 1,
            }
        } else {
            Role::Node {
                join: self.head_addr(),
                process: self.process,
            }
        }
    }
}

/// Why the environment does not describe a job (RDV-1).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// A variable the convention needs is not set.
    #[error("{convention:?} rendezvous: {var} is not set")]
    Missing {
        /// The convention detected.
        convention: Convention,
        /// The variable.
        var: &'static str,
    },
    /// MPI could not describe its world.
    #[error("MPI rendezvous: {0}")]
    Mpi(String),
    /// A variable does not parse.
    #[error("{var}={value:?}: expected {expected}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// This process's index is not below the process count.
    #[error("{rank_var}={process} is not below {size_var}={processes}")]
    RankOutOfRange {
        /// The index variable.
        rank_var: &'static str,
        /// The size variable.
        size_var: &'static str,
        /// The index.
        process: u32,
        /// The count.
        processes: u32,
    },
    /// The node list is malformed.
    #[error("{var}: {error}")]
    Hostlist {
        /// The variable.
        var: &'static str,
        /// What is wrong.
        error: HostlistError,
    },
}

/// Why a Slurm hostlist does not expand (RDV-2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostlistError {
    /// The list (or one of its names) is empty.
    #[error("empty host name in {0:?}")]
    Empty(String),
    /// A `[` without its `]`, or the reverse.
    #[error("unbalanced brackets in {0:?}")]
    Unbalanced(String),
    /// A range bound is not a number, or a range runs backwards.
    #[error("bad range {range:?} in {list:?}")]
    BadRange {
        /// The range text.
        range: String,
        /// The whole list.
        list: String,
    },
    /// The list expands to more hosts than the limit.
    #[error("{list:?} expands to more than {limit} hosts")]
    TooMany {
        /// The whole list.
        list: String,
        /// The limit.
        limit: usize,
    },
}

fn parse<T: std::str::FromStr>(
    lookup: &impl Fn(&str) -> Option<String>,
    convention: Convention,
    var: &'static str,
    expected: &'static str,
) -> Result<T, RendezvousError> {
    let value = lookup(var).ok_or(RendezvousError::Missing { convention, var })?;
    value.trim().parse().map_err(|_| RendezvousError::Invalid {
        var,
        value,
        expected,
    })
}

fn require(
    lookup: &impl Fn(&str) -> Option<String>,
    convention: Convention,
    var: &'static str,
) -> Result<String, RendezvousError> {
    match lookup(var) {
        Some(v) if !v.trim().is_empty() => Ok(v.trim().to_string()),
        Some(value) => Err(RendezvousError::Invalid {
            var,
            value,
            expected: "a host name or address",
        }),
        None => Err(RendezvousError::Missing { convention, var }),
    }
}

fn check_range(
    rank_var: &'static str,
    size_var: &'static str,
    process: u32,
    processes: u32,
) -> Result<(), RendezvousError> {
    if processes == 0 {
        return Err(RendezvousError::Invalid {
            var: size_var,
            value: "0".into(),
            expected: "a positive number of processes",
        });
    }
    if process >= processes {
        return Err(RendezvousError::RankOutOfRange {
            rank_var,
            size_var,
            process,
            processes,
        });
    }
    Ok(())
}

/// Reads the launcher's variables through `lookup` (`|k| std::env::var(k).ok()` for the real
/// environment). `Ok(None)`: no convention's variables are set.
pub fn from_env(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<Rendezvous>, RendezvousError> {
    if lookup("RANK").is_some() || lookup("WORLD_SIZE").is_some() {
        let c = Convention::Torchrun;
        let process: u32 = parse(&lookup, c, "RANK", "a process index (0, 1, ...)")?;
        let processes: u32 = parse(&lookup, c, "WORLD_SIZE", "a positive number of processes")?;
        check_range("RANK", "WORLD_SIZE", process, processes)?;
        let head_host = require(&lookup, c, "MASTER_ADDR")?;
        let port: u16 = parse(&lookup, c, "MASTER_PORT", "a port number (0-65535)")?;
        return Ok(Some(Rendezvous {
            convention: c,
            process: ProcessIndex(process),
            processes,
            head_host,
            port,
        }));
    }
    let mpi = [
        (
            Convention::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        (Convention::Hydra, "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ];
    for (c, rank_var, size_var, local_var) in mpi {
        if lookup(rank_var).is_none() {
            continue;
        }
        let process: u32 = parse(&lookup, c, rank_var, "a rank (0, 1, ...)")?;
        let processes: u32 = parse(&lookup, c, size_var, "a positive number of ranks")?;
        check_range(rank_var, size_var, process, processes)?;
        let head_host = match lookup("MASTER_ADDR") {
            Some(addr) if !addr.trim().is_empty() => addr.trim().to_string(),
            // RDV-3: the loopback address only when every rank is on this host.
            _ => match lookup(local_var).map(|v| v.trim().parse::<u32>()) {
                Some(Ok(local)) if local == processes => "127.0.0.1".to_string(),
                _ => {
                    return Err(RendezvousError::Missing {
                        convention: c,
                        var: "MASTER_ADDR",
                    });
                }
            },
        };
        return Ok(Some(Rendezvous {
            convention: c,
            process: ProcessIndex(process),
            processes,
            head_host,
            port: port_of(&lookup, c)?,
        }));
    }
    if lookup("SLURM_PROCID").is_some() {
        let c = Convention::Slurm;
        let process: u32 = parse(&lookup, c, "SLURM_PROCID", "a task index (0, 1, ...)")?;
        let processes: u32 = parse(&lookup, c, "SLURM_NTASKS", "a positive number of tasks")?;
        check_range("SLURM_PROCID", "SLURM_NTASKS", process, processes)?;
        let head_host = match lookup("MASTER_ADDR") {
            Some(addr) if !addr.trim().is_empty() => addr.trim().to_string(),
            _ => {
                let (var, list) = match lookup("SLURM_NODELIST") {
                    Some(list) => ("SLURM_NODELIST", list),
                    None => (
                        "SLURM_JOB_NODELIST",
                        require(&lookup, c, "SLURM_JOB_NODELIST").map_err(|_| {
                            RendezvousError::Missing {
                                convention: c,
                                var: "SLURM_NODELIST",
                            }
                        })?,
                    ),
                };
                first_host(&list).map_err(|error| RendezvousError::Hostlist { var, error })?
            }
        };
        return Ok(Some(Rendezvous {
            convention: c,
            process: ProcessIndex(process),
            processes,
            head_host,
            port: port_of(&lookup, c)?,
        }));
    }
    Ok(None)
}

/// Rendezvous from MPI's world (RDV-4): this process is world rank `process` of
/// `hosts.len()`, `hosts[r]` the host rank r runs on (`MPI_Get_processor_name`). The head is
/// rank 0; its host is `MASTER_ADDR` if set, else the loopback address when every rank runs on
/// rank 0's host, else rank 0's host name. The port is as for the other MPI launchers.
pub fn from_mpi_hosts(
    process: u32,
    hosts: &[String],
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Rendezvous, RendezvousError> {
    let c = Convention::MpiWorld;
    let processes = u32::try_from(hosts.len()).unwrap_or(u32::MAX);
    check_range("the MPI rank", "the MPI world size", process, processes)?;
    let head_host = match lookup("MASTER_ADDR") {
        Some(addr) if !addr.trim().is_empty() => addr.trim().to_string(),
        _ if hosts.iter().all(|h| *h == hosts[0]) => "127.0.0.1".to_string(),
        _ => hosts[0].clone(),
    };
    Ok(Rendezvous {
        convention: c,
        process: ProcessIndex(process),
        processes,
        head_host,
        port: port_of(&lookup, c)?,
    })
}

/// Rendezvous from the initialised MPI world (a collective: every process of the world calls
/// it once, before its job starts): [`from_mpi_hosts`] with MPI's rank and hosts, and what
/// rank 0 chooses for everyone, broadcast over MPI: its `MASTER_ADDR` if set, and the port —
/// its `MESHWORK_PORT` or `MASTER_PORT`, else (or if 0) a port free on its host now (so an MPI
/// job needs no port setting, and a requeued one never finds its last run's port taken; the
/// port is free when chosen, and the head binds it a moment later).
#[cfg(feature = "mpi")]
pub fn from_mpi(
    world: &'static crate::comm::mpi::MpiWorld,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Rendezvous, RendezvousError> {
    let mpi = |e: crate::comm::mpi::MpiError| RendezvousError::Mpi(e.to_string());
    // Every process enters each collective whatever happened before (none may be left
    // waiting in one); errors are raised once all three are done.
    let hosts = world.processor_names();
    // Rank 0's choices for everyone: the port (0 = none could be chosen) and MASTER_ADDR.
    let chosen: Result<u16, RendezvousError> = if world.rank() == 0 {
        match port_of(&lookup, Convention::MpiWorld) {
            Ok(port)
                if port != 0
                    && (lookup("MESHWORK_PORT").is_some() || lookup("MASTER_PORT").is_some()) =>
            {
                Ok(port)
            }
            Ok(_) => std::net::TcpListener::bind(("0.0.0.0", 0))
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .map_err(|e| RendezvousError::Mpi(format!("finding a free port: {e}"))),
            Err(e) => Err(e),
        }
    } else {
        Ok(0)
    };
    let port = world.broadcast_bytes(0, &chosen.as_ref().copied().unwrap_or(0).to_le_bytes());
    let master = lookup("MASTER_ADDR")
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .unwrap_or_default();
    let master = world.broadcast_bytes(0, master.as_bytes());
    let hosts = hosts.map_err(mpi)?;
    let port = match port.map_err(mpi)?.as_slice() {
        [a, b] if u16::from_le_bytes([*a, *b]) != 0 => u16::from_le_bytes([*a, *b]),
        _ => {
            chosen?;
            return Err(RendezvousError::Mpi(
                "rank 0 could not choose the head's port".into(),
            ));
        }
    };
    let master = String::from_utf8_lossy(&master.map_err(mpi)?).into_owned();
    let mut rendezvous = from_mpi_hosts(world.rank(), &hosts, |k| {
        (k == "MASTER_ADDR" && !master.is_empty()).then(|| master.clone())
    })?;
    rendezvous.port = port;
    Ok(rendezvous)
}

/// The head's port when the launcher has none of its own: `MESHWORK_PORT`, else
/// `MASTER_PORT`, else [`DEFAULT_PORT`].
fn port_of(
    lookup: &impl Fn(&str) -> Option<String>,
    c: Convention,
) -> Result<u16, RendezvousError> {
    for var in ["MESHWORK_PORT", "MASTER_PORT"] {
        if lookup(var).is_some() {
            return parse(lookup, c, var, "a port number (0-65535)");
        }
    }
    Ok(DEFAULT_PORT)
}

/// Splits `list` at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, HostlistError> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, ch) in list.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(HostlistError::Unbalanced(list.to_string()));
        }
    }
    if depth != 0 {
        return Err(HostlistError::Unbalanced(list.to_string()));
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// The values of one bracket body such as `01-03,07`, zero-padded like their lower bound.
fn expand_ranges(body: &str, list: &str, limit: usize) -> Result<Vec<String>, HostlistError> {
    let bad = |range: &str| HostlistError::BadRange {
        range: range.to_string(),
        list: list.to_string(),
    };
    let mut out = Vec::new();
    for range in body.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 18 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(bad(range));
        }
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad(range))?,
            hi.parse().map_err(|_| bad(range))?,
        );
        if a > b {
            return Err(bad(range));
        }
        if (b - a) as usize >= limit.saturating_sub(out.len()) {
            return Err(HostlistError::TooMany {
                list: list.to_string(),
                limit,
            });
        }
        let width = lo.len();
        out.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(out)
}

/// Expands one name with any number of bracket groups (`rack[1-2]-n[01-02]`).
fn expand_name(name: &str, list: &str, limit: usize) -> Result<Vec<String>, HostlistError> {
    let mut out = vec![String::new()];
    let mut rest = name;
    while !rest.is_empty() {
        match rest.find('[') {
            None => {
                if rest.contains(']') {
                    return Err(HostlistError::Unbalanced(list.to_string()));
                }
                out.iter_mut().for_each(|o| o.push_str(rest));
                rest = "";
            }
            Some(open) => {
                let prefix = &rest[..open];
                let close = rest[open..]
                    .find(']')
                    .map(|c| open + c)
                    .ok_or_else(|| HostlistError::Unbalanced(list.to_string()))?;
                if prefix.contains(']') {
                    return Err(HostlistError::Unbalanced(list.to_string()));
                }
                let values = expand_ranges(&rest[open + 1..close], list, limit)?;
                if out.len().saturating_mul(values.len()) > limit {
                    return Err(HostlistError::TooMany {
                        list: list.to_string(),
                        limit,
                    });
                }
                out = out
                    .iter()
                    .flat_map(|o| values.iter().map(move |v| format!("{o}{prefix}{v}")))
                    .collect();
                rest = &rest[close + 1..];
            }
        }
    }
    Ok(out)
}

/// Expands a Slurm hostlist (`node[01-03,07],gpu5` → node01, node02, node03, node07, gpu5),
/// in order, refusing to produce more than `limit` hosts (RDV-2).
pub fn expand_hostlist(list: &str, limit: usize) -> Result<Vec<String>, HostlistError> {
    let trimmed = list.trim();
    let mut hosts = Vec::new();
    for name in split_top_level(trimmed)? {
        if name.is_empty() {
            return Err(HostlistError::Empty(list.to_string()));
        }
        let expanded = expand_name(name, list, limit)?;
        if hosts.len() + expanded.len() > limit {
            return Err(HostlistError::TooMany {
                list: list.to_string(),
                limit,
            });
        }
        hosts.extend(expanded);
    }
    if hosts.iter().any(String::is_empty) {
        return Err(HostlistError::Empty(list.to_string()));
    }
    Ok(hosts)
}

/// The first host of a Slurm hostlist (the whole list is checked, up to [`MAX_HOSTS`]).
pub fn first_host(list: &str) -> Result<String, HostlistError> {
    expand_hostlist(list, MAX_HOSTS)?
        .into_iter()
        .next()
        .ok_or_else(|| HostlistError::Empty(list.to_string()))
}

#[cfg(test)]
mod tests;
