//! A launcher's process (`mpirun`) run by a bench: its standard output read line by line, every
//! wait bounded, killed when dropped (feature `cluster`).

use std::process::Command;
use std::time::Duration;

use meshwork::error::{Error, Result};

fn runtime(what: impl std::fmt::Display) -> Error {
    Error::Runtime(what.to_string())
}

/// A launcher (`mpirun`) and the lines of its standard output, every wait bounded; killed when
/// dropped.
pub(crate) struct Launched {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    what: &'static str,
}

impl Launched {
    /// Starts `command` with its standard output piped (its errors go to ours).
    pub(crate) fn start(mut command: Command, what: &'static str) -> Result<Self> {
        let mut child = command
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| runtime(format!("{what}: {e}")))?;
        let stdout = child.stdout.take();
        let (tx, lines) = std::sync::mpsc::channel();
        if let Some(stdout) = stdout {
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(stdout)
                    .lines()
                    .map_while(|l| l.ok())
                {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self { child, lines, what })
    }

    /// The next line of output, within `timeout`.
    #[cfg_attr(
        not(feature = "mpi"),
        allow(dead_code, reason = "the MPI bench reads lines")
    )]
    pub(crate) fn next_line(&mut self, timeout: Duration) -> Result<String> {
        self.lines.recv_timeout(timeout).map_err(|e| {
            runtime(format!(
                "{}: no line of output within {timeout:?} ({e})",
                self.what
            ))
        })
    }

    /// Every remaining line, once the process ended (within `timeout`); an error if it failed.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Result<Vec<String>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => break,
                Ok(Some(status)) => {
                    return Err(runtime(format!("{} failed: {status}", self.what)));
                }
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(None) => {
                    return Err(runtime(format!(
                        "{} still running after {timeout:?}",
                        self.what
                    )));
                }
                Err(e) => return Err(runtime(format!("{}: {e}", self.what))),
            }
        }
        let mut rest = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
            rest.push(line);
        }
        Ok(rest)
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
