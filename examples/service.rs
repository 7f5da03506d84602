//! A small HTTP service that embeds a training job: `GET /status`, `POST /scale` (body: the
//! number of replicas), `POST /pause`, `POST /resume`, `POST /stop`. It binds 127.0.0.1 on a
//! free port and prints `listening on ADDR` on stdout (its log goes to stderr). The job keeps
//! 2 to 4 replicas: a lost one is dropped, and one left waits for `/scale` or `/resume`.
//! The service ends when the job does: after its steps (the first argument, default 300), or
//! after `POST /stop`, which answers with the run's summary.
//!
//! Run with `cargo run --release --example service -- 100000`, then e.g.
//! `curl -X POST -d 3 http://ADDR/scale`.

// ANCHOR: imports
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::job::JobControl;
use meshwork::prelude::*;
use tokio::sync::{Mutex, oneshot};
// ANCHOR_END: imports

// ANCHOR: state
/// What the handlers share: the job's controls, and its handle, taken by whoever joins the
/// job (`/stop`, or the event watcher when the job ends by itself).
struct Service {
    control: JobControl,
    handle: Mutex<Option<JobHandle<Mlp>>>,
}
// ANCHOR_END: state

// ANCHOR: handlers
async fn status(State(s): State<Arc<Service>>) -> (StatusCode, String) {
    match s.control.status(Duration::from_secs(10)).await {
        Ok(st) => (
            StatusCode::OK,
            serde_json::to_string(&st).unwrap_or_default(),
        ),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn scale(State(s): State<Arc<Service>>, body: String) -> (StatusCode, String) {
    match body.trim().parse::<u32>() {
        Ok(n) => {
            // Taken at the next step boundary; `Resized` or `ResizeRefused` follows.
            s.control.scale_to(n);
            (
                StatusCode::ACCEPTED,
                format!("scaling to {n} at the next step"),
            )
        }
        Err(_) => (
            StatusCode::BAD_REQUEST,
            format!("not a replica count: {body:?}"),
        ),
    }
}

async fn pause(State(s): State<Arc<Service>>) -> StatusCode {
    s.control.pause();
    StatusCode::ACCEPTED
}

async fn resume(State(s): State<Arc<Service>>) -> StatusCode {
    s.control.resume();
    StatusCode::ACCEPTED
}

async fn stop(State(s): State<Arc<Service>>) -> (StatusCode, String) {
    let Some(handle) = s.handle.lock().await.take() else {
        return (StatusCode::CONFLICT, "the job has ended".into());
    };
    // Stops at the next step boundary (the running step finishes) and joins the job.
    match handle.stop().await {
        Ok(t) => (
            StatusCode::OK,
            serde_json::to_string(&t.summary).unwrap_or_default(),
        ),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
// ANCHOR_END: handlers

// ANCHOR: events
/// Logs the job's events until the stream closes (the job finished, failed or was stopped),
/// then joins the job if `/stop` has not, and ends the service.
async fn watch(
    mut events: EventStream,
    service: Arc<Service>,
    shutdown: oneshot::Sender<()>,
) -> meshwork::Result<()> {
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) if s.step % 100 == 0 => {
                eprintln!("step {}: loss {:.4}", s.step, s.loss)
            }
            Ok(JobEvent::Resized { step, from, to, .. }) => {
                eprintln!("step {step}: {from} → {to} replicas")
            }
            Ok(JobEvent::ResizeRefused { requested, reason }) => {
                eprintln!("not resized to {requested}: {reason}")
            }
            Ok(JobEvent::DeviceLost { step, device, .. }) => {
                eprintln!("step {step}: lost device {device}")
            }
            Ok(JobEvent::WaitingForDevices { replicas, min, .. }) => {
                eprintln!("{replicas} replica(s) left, fewer than {min}: POST /scale or /resume")
            }
            Ok(JobEvent::Paused) => eprintln!("paused"),
            Ok(JobEvent::Resumed) => eprintln!("resumed"),
            Ok(JobEvent::Failed(e)) => eprintln!("the job failed: {e}"),
            Ok(_) => {}
            // This reader fell behind: the oldest `n` events were dropped for it, and the
            // next `recv` goes on with the oldest one still held.
            Err(EventsError::Missed(n)) => eprintln!("missed {n} events"),
            Err(EventsError::Closed) => break,
        }
    }
    let handle = service.handle.lock().await.take();
    let outcome = match handle {
        Some(handle) => handle.join().await.map(|t| {
            eprintln!(
                "trained {} steps, loss {:.4}",
                t.summary.steps,
                t.summary.last_loss.unwrap_or(f32::NAN)
            )
        }),
        None => Ok(()),
    };
    let _ = shutdown.send(());
    outcome
}
// ANCHOR_END: events

#[tokio::main]
async fn main() -> meshwork::Result<()> {
    // ANCHOR: tracing
    // meshwork logs through `tracing`: what it refused, lost, retried or could not write, at
    // `warn`; joins and the job a node runs, at `info`. `RUST_LOG` chooses; stdout stays the
    // program's own.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,meshwork=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    // ANCHOR_END: tracing
    let steps = match std::env::args().nth(1) {
        Some(a) => a
            .parse()
            .map_err(|_| Error::InvalidConfig(format!("not a step count: {a}")))?,
        None => 300,
    };
    let device = Device::flex();
    device.seed(1);
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    // ANCHOR: job
    let handle = Job::builder()
        .initial_model(Mlp::new(&[16, 64, 2], &device))
        .loss(mse_loss)
        .data(task.dataset(4096))
        .optimizer(AdamConfig::new())
        .learning_rate(1e-3)
        .data_parallel(2)
        .batch_size(48)
        .steps(steps)
        // 2 to 4 replicas. A lost one is dropped; left with one, the job holds its next step
        // for up to 2 minutes, until `/scale` adds a device or `/resume` accepts one.
        .fault_tolerance(
            FaultTolerance::new()
                .recovery(RecoveryPolicy::shrink())
                .elastic(2, 4)
                .elastic_wait(Duration::from_secs(120)),
        )
        .build()?
        .spawn()
        .await?;
    // ANCHOR_END: job

    // ANCHOR: serve
    // The first `events()` call sees every event since the job started.
    let events = handle.events();
    let service = Arc::new(Service {
        control: handle.control(),
        handle: Mutex::new(Some(handle)),
    });
    let (shutdown, ended) = oneshot::channel();
    let watcher = tokio::spawn(watch(events, service.clone(), shutdown));
    let app = Router::new()
        .route("/status", get(status))
        .route("/scale", post(scale))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/stop", post(stop))
        .with_state(service);
    let io = |e: std::io::Error| Error::Io {
        path: "127.0.0.1:0".into(),
        reason: e.to_string(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(io)?;
    println!("listening on {}", listener.local_addr().map_err(io)?);
    // Requests under way when the job ends (a `/stop`) are answered before the server stops.
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = ended.await;
        })
        .await
        .map_err(io)?;
    watcher
        .await
        .map_err(|e| Error::Runtime(format!("the event watcher panicked: {e}")))?
    // ANCHOR_END: serve
}
