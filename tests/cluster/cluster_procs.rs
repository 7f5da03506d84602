//! Child `meshwork` processes for the multi-process tests: output collected line by line,
//! every wait bounded, every child killed when its handle drops (also when a test fails).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const SECRET: &str = "test-secret-0123456789";

/// A child process whose output lines are collected; killed on drop.
pub struct Proc {
    pub name: String,
    pub child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    status: Option<ExitStatus>,
}

fn collect(reader: impl Read + Send + 'static, lines: Arc<Mutex<Vec<String>>>) {
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            lines.lock().unwrap().push(line);
        }
    });
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str], secret: Option<&str>) -> Proc {
        Self::launch(name, env!("CARGO_BIN_EXE_meshwork"), args, secret, &[])
    }

    /// `program` (`meshwork`, or a launcher such as `mpirun` running it) with `args`, in the
    /// environment every test child gets: no launcher variables of the caller's, the secret
    /// if given, and `vars`.
    pub fn launch(
        name: &str,
        program: &str,
        args: &[&str],
        secret: Option<&str>,
        vars: &[(&str, &str)],
    ) -> Proc {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("MESHWORK_SECRET")
            .env_remove("MESHWORK_SECRET_FILE")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("SLURM_PROCID")
            .env_remove("OMPI_COMM_WORLD_RANK")
            .env_remove("PMI_RANK")
            .env("RUST_LOG", "warn,ractor_cluster=error");
        if let Some(s) = secret {
            cmd.env("MESHWORK_SECRET", s);
        }
        cmd.envs(vars.iter().copied());
        // A process computing on wgpu (`--device wgpu`) finds Mesa's software Vulkan on a
        // machine without a GPU (CI's), which wants a runtime directory; the caller's own
        // settings win.
        if std::env::var_os("CUBECL_WGPU_DEFAULT_DEVICE").is_none() {
            cmd.env("CUBECL_WGPU_DEFAULT_DEVICE", "Cpu");
        }
        if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
            cmd.env("XDG_RUNTIME_DIR", std::env::temp_dir());
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {program}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        collect(child.stdout.take().unwrap(), lines.clone());
        collect(child.stderr.take().unwrap(), lines.clone());
        Proc {
            name: name.to_string(),
            child,
            lines,
            status: None,
        }
    }

    pub fn output(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits until a line contains `needle`; returns it.
    pub fn wait_line(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "{}: no line with {needle:?} within {timeout:?}; output:\n{}",
                self.name,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the process to exit; returns its status and how long it took.
    pub fn wait_exit(&mut self, timeout: Duration) -> (ExitStatus, Duration) {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.status = Some(status);
                // Let the reader threads take the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return (status, started.elapsed());
            }
            assert!(
                started.elapsed() < timeout,
                "{} still running after {timeout:?}; output:\n{}",
                self.name,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.signal_cont();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Proc {
    pub fn signal_cont(&self) -> std::io::Result<ExitStatus> {
        Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
    }
}

/// A head waiting for `nodes` nodes of job `job`; returns it and its address.
pub fn head(job: &str, nodes: u32, join_timeout: u32, extra: &[&str]) -> (Proc, String) {
    let mut args = vec!["--dry-run"];
    args.extend_from_slice(extra);
    training_head(job, nodes, join_timeout, &args)
}

/// A head that trains `meshwork train`'s demo job (flags in `extra`) once `nodes` nodes of
/// job `job` joined; returns it and its address.
pub fn training_head(job: &str, nodes: u32, join_timeout: u32, extra: &[&str]) -> (Proc, String) {
    let nodes = nodes.to_string();
    let join_timeout = join_timeout.to_string();
    let mut args = vec![
        "train",
        "--listen",
        "127.0.0.1:0",
        "--nodes",
        &nodes,
        "--job",
        job,
        "--join-timeout",
        &join_timeout,
    ];
    args.extend_from_slice(extra);
    let head = Proc::spawn("head", &args, Some(SECRET));
    let line = head.wait_line("listening on", Duration::from_secs(60));
    let addr = line
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .expect("the head prints its address")
        .to_string();
    (head, addr)
}

pub fn node(name: &str, addr: &str, job: &str, extra: &[&str], secret: &str) -> Proc {
    let mut args = vec![
        "node",
        "--join",
        addr,
        "--job",
        job,
        "--name",
        name,
        "--join-timeout",
        "30",
    ];
    args.extend_from_slice(extra);
    Proc::spawn(name, &args, Some(secret))
}
