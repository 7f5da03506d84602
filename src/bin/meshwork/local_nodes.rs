//! `bench comm-efficiency --transport tcp`'s nodes: the demo job over `meshwork node`
//! processes this program starts on this machine, as their head (feature `cluster`).

use std::time::Duration;

use meshwork::cluster::control::{self, ControlError, Head, HeadConfig, JobSpec};
use meshwork::cluster::remote::ClusterMesh;
use meshwork::error::Error;

use crate::cluster::{demo_job, demo_models, ending, runtime};
use crate::demo_job::DemoJob;

/// Child processes killed when dropped (a bench's nodes never outlive it).
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Trains the demo job of `spec` (data parallel) over `nodes` `meshwork node` processes this
/// program starts on this machine, one rank each, with this process as the head holding none;
/// every event of the job goes to `on_event`. The nodes are stopped and reaped at the end,
/// also on an error (what `bench comm-efficiency --transport tcp` runs per method).
pub(crate) fn train_over_local_nodes(
    spec: &JobSpec,
    nodes: u32,
    on_event: &mut dyn FnMut(meshwork::events::JobEvent),
) -> meshwork::error::Result<()> {
    let io = |what: &str, e: std::io::Error| Error::Io {
        path: what.into(),
        reason: e.to_string(),
    };
    let exe = std::env::current_exe().map_err(|e| io("the meshwork binary", e))?;
    let text = format!(
        "bench-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let secret = control::ClusterSecret::new(text.clone()).map_err(ControlError::from)?;
    let job = format!("bench-{}", std::process::id());
    runtime()?.block_on(async move {
        let mut head = Head::start(HeadConfig::new("127.0.0.1:0", job.clone(), secret)).await?;
        let addr = head.local_addr().to_string();
        let mut children = Children(Vec::new());
        for i in 0..nodes {
            let child = std::process::Command::new(&exe)
                .args(["node", "--join", &addr, "--job", &job])
                .args(["--name", &format!("bench-node-{i}")])
                .env("MESHWORK_SECRET", &text)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .map_err(|e| io("meshwork node", e))?;
            children.0.push(child);
        }
        let fingerprint = demo_models(None).fingerprint(spec).map_err(|reason| {
            Error::InvalidConfig(format!("the head cannot build its own model: {reason}"))
        })?;
        let assembled = match head
            .assemble(
                nodes as usize,
                spec,
                fingerprint,
                Vec::new(),
                Duration::from_secs(60),
            )
            .await
        {
            Ok(a) => a,
            Err(e) => {
                head.shutdown(&format!("the head gave up: {e}")).await;
                return Err(Error::from(e));
            }
        };
        let trained = async {
            let mesh = ClusterMesh::new(&assembled, &head.node_handles(), None)?;
            let DemoJob::Replicas(builder) = demo_job(spec)?.0 else {
                return Err(Error::InvalidConfig(
                    "a data-parallel job: the spec names no pipeline".into(),
                ));
            };
            let handle = builder
                .step_timeout(Duration::from_secs(600))
                .cluster(mesh)
                .build()?
                .spawn()
                .await?;
            crate::demo_job::watch(handle, on_event).await.map(|_| ())
        }
        .await;
        let reason = ending(&trained);
        head.shutdown(&reason).await;
        drop(children);
        trained
    })
}
