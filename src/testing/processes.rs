//! Child processes that form one group on this machine, for multi-process tests and benches:
//! started together, told each other's addresses, killed when the handle drops (also when a
//! test fails and unwinds), every wait for them bounded.
//!
//! The protocol, parent side [`ProcessGroup`], child side [`announce_and_wait_for_peers`]:
//! each child binds its listener and prints `listening <addr>` on a line of stdout (other
//! output before it is skipped: a re-executed test binary prints the harness's own first); once
//! every child did, the parent writes all addresses, comma-separated in rank order, as one
//! line to every child's stdin. After that a child's stdout lines are the caller's business
//! ([`ProcessGroup::next_line`]).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// What the first stdout line of a child starts with.
pub const LISTENING: &str = "listening ";

/// Why a process group could not start or a child did not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError {
    /// A child could not be started.
    #[error("starting child {rank} failed: {source}")]
    Spawn {
        /// The child's rank.
        rank: usize,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// A child printed nothing in time, or ended its output.
    #[error("child {rank} said nothing within {waited:?} (or exited)")]
    Silent {
        /// The child's rank.
        rank: usize,
        /// How long the parent waited.
        waited: Duration,
    },
    /// A child's first line was not `listening <addr>`.
    #[error("child {rank} announced {line:?}, not a listening address")]
    BadAnnouncement {
        /// The child's rank.
        rank: usize,
        /// What it printed.
        line: String,
    },
    /// Writing the addresses to a child failed (it exited early).
    #[error("child {rank} did not take its peers' addresses: {source}")]
    Stdin {
        /// The child's rank.
        rank: usize,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
}

/// Children started together, one per rank, killed on drop.
#[derive(Debug)]
pub struct ProcessGroup {
    children: Vec<Child>,
    stdins: Vec<Option<ChildStdin>>,
    lines: Vec<Receiver<String>>,
    addrs: Vec<SocketAddr>,
}

impl ProcessGroup {
    /// Starts `commands` (child r runs `commands[r]`, with stdin and stdout piped, stderr
    /// inherited), waits up to `timeout` for each to announce its address, and gives every
    /// child all addresses.
    pub fn start(commands: Vec<Command>, timeout: Duration) -> Result<Self, ProcessError> {
        let mut group = ProcessGroup {
            children: Vec::new(),
            stdins: Vec::new(),
            lines: Vec::new(),
            addrs: Vec::new(),
        };
        for (rank, mut command) in commands.into_iter().enumerate() {
            let mut child = command
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|source| ProcessError::Spawn { rank, source })?;
            let stdout = child.stdout.take();
            group.stdins.push(child.stdin.take());
            group.children.push(child);
            let (tx, rx) = std::sync::mpsc::channel();
            if let Some(stdout) = stdout {
                // Forwards lines so every read of a child's output can be bounded; ends with
                // the child's output.
                std::thread::spawn(move || {
                    for line in BufReader::new(stdout).lines() {
                        let Ok(line) = line else { break };
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                });
            }
            group.lines.push(rx);
        }
        let deadline = Instant::now() + timeout;
        for rank in 0..group.children.len() {
            let line = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let line = group.next_line(rank, left)?;
                if let Some(at) = line.find(LISTENING) {
                    break line[at..].to_string();
                }
            };
            let addr = line
                .strip_prefix(LISTENING)
                .and_then(|a| a.trim().parse().ok())
                .ok_or_else(|| ProcessError::BadAnnouncement {
                    rank,
                    line: line.clone(),
                })?;
            group.addrs.push(addr);
        }
        let list: Vec<String> = group.addrs.iter().map(SocketAddr::to_string).collect();
        let list = list.join(",");
        for (rank, stdin) in group.stdins.iter_mut().enumerate() {
            if let Some(stdin) = stdin {
                writeln!(stdin, "{list}")
                    .and_then(|()| stdin.flush())
                    .map_err(|source| ProcessError::Stdin { rank, source })?;
            }
        }
        Ok(group)
    }

    /// The children's listening addresses, in rank order.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Child `rank`'s next stdout line that starts with `prefix`, without the prefix; other
    /// lines are skipped. Waits at most `timeout` in all.
    pub fn next_tagged(
        &mut self,
        rank: usize,
        prefix: &str,
        timeout: Duration,
    ) -> Result<String, ProcessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.next_line(rank, left)?;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.to_string());
            }
        }
    }

    /// Child `rank`'s next stdout line, waiting at most `timeout`.
    pub fn next_line(&mut self, rank: usize, timeout: Duration) -> Result<String, ProcessError> {
        let silent = ProcessError::Silent {
            rank,
            waited: timeout,
        };
        let Some(lines) = self.lines.get(rank) else {
            return Err(silent);
        };
        match lines.recv_timeout(timeout) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => Err(silent),
        }
    }

    /// Kills child `rank` (SIGKILL on Unix) and reaps it.
    pub fn kill(&mut self, rank: usize) {
        if let Some(child) = self.children.get_mut(rank) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `timeout` for every child to exit; returns their statuses in rank order
    /// (`None`: still running at the deadline, then killed).
    pub fn wait_all(&mut self, timeout: Duration) -> Vec<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        self.stdins.iter_mut().for_each(|s| drop(s.take()));
        self.children
            .iter_mut()
            .map(|child| {
                loop {
                    match child.try_wait() {
                        Ok(Some(status)) => break Some(status),
                        Ok(None) if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        _ => {
                            let _ = child.kill();
                            let _ = child.wait();
                            break None;
                        }
                    }
                }
            })
            .collect()
    }
}

impl Drop for ProcessGroup {
    /// Kills every child still running and reaps it, so none outlives the group's owner.
    fn drop(&mut self) {
        for child in &mut self.children {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// Child side of the protocol: prints `listening <addr>` for the listener at `addr` and reads
/// the group's addresses from stdin (one line, comma-separated, in rank order).
pub fn announce_and_wait_for_peers(addr: SocketAddr) -> std::io::Result<Vec<SocketAddr>> {
    let mut stdout = std::io::stdout();
    // On a line of its own, whatever was printed before (a test harness leaves its "test
    // name ... " line open).
    writeln!(stdout, "\n{LISTENING}{addr}")?;
    stdout.flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    line.trim()
        .split(',')
        .map(|a| {
            a.parse().map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("not a socket address: {a:?}"),
                )
            })
        })
        .collect()
}
