//! What the benches share (`bench tensor`, with and without a mesh; `bench pipeline`): run one job
//! to its end collecting its steps, the median run, and how far two runs' losses are apart;
//! where the PyTorch peers' scripts are (`bench layer`, `bench gpt`).

use meshwork::error::{Error, Result};
use meshwork::events::{JobEvent, StepDone};
use meshwork::job::{EventsError, Job};

/// Run `job` on a runtime of its own and return every step it reported; an error naming
/// `what` unless it reported `want` of them.
pub(crate) fn collect_steps<M, I>(job: Job<M, I>, want: u64, what: &str) -> Result<Vec<StepDone>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    let steps = runtime.block_on(async move {
        let handle = job.spawn().await?;
        let mut events = handle.events();
        let mut steps = Vec::new();
        loop {
            match events.recv().await {
                Ok(JobEvent::StepDone(s)) => steps.push(s),
                Ok(_) | Err(EventsError::Missed(_)) => {}
                Err(EventsError::Closed) => break,
            }
        }
        handle.join().await?;
        Ok::<_, Error>(steps)
    })?;
    if steps.len() as u64 != want {
        return Err(Error::Runtime(format!(
            "{what}: saw {} of {want} steps",
            steps.len()
        )));
    }
    Ok(steps)
}

/// The run whose `samples_per_s` is the median of `runs` (not empty).
pub(crate) fn median<T>(mut runs: Vec<T>, samples_per_s: impl Fn(&T) -> f64) -> T {
    runs.sort_by(|a, b| samples_per_s(a).total_cmp(&samples_per_s(b)));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
}

/// The median of `values` (not empty).
pub(crate) fn median_of(values: Vec<f64>) -> f64 {
    median(values, |x| *x)
}

/// The largest difference of `run`'s and `base`'s losses at the same steps, as a share of
/// `base`'s largest loss.
pub(crate) fn loss_max_rel_diff(run: &[f32], base: &[f32]) -> f64 {
    let scale = base
        .iter()
        .fold(0f64, |m, l| m.max(f64::from(l.abs())))
        .max(f64::MIN_POSITIVE);
    run.iter()
        .zip(base)
        .map(|(a, c)| f64::from((a - c).abs()) / scale)
        .fold(0.0, f64::max)
}

/// `benches/peers/NAME`, PyTorch's side of a bench: beside the binary's sources, or under the
/// working directory.
pub(crate) fn peer_script(name: &str) -> Result<std::path::PathBuf> {
    let rel = std::path::Path::new("benches/peers").join(name);
    [
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&rel),
        rel.clone(),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .ok_or_else(|| Error::InvalidConfig(format!("--pytorch: {} not found", rel.display())))
}

/// This binary, to start a bench's child process.
pub(crate) fn this_binary() -> Result<std::path::PathBuf> {
    std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })
}

/// Runs `command` to its end and gives its standard output; one that cannot start or fails
/// is an error naming `what`, with its standard error.
pub(crate) fn stdout_of(mut command: std::process::Command, what: &str) -> Result<String> {
    let out = command.output().map_err(|e| Error::Io {
        path: what.to_string(),
        reason: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(Error::Runtime(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
