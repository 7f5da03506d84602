//! A small HTTP service that embeds a training job: `GET /status`, `POST /scale` (body: the
//! number of replicas), `POST /stop`. It binds 127.0.0.1 on a free port and prints
//! `listening on ADDR`; `POST /stop` stops the job at its next step boundary, answers with the
//! run's summary and ends the service.
//!
//! Run with `cargo run --release --example service`, then e.g.
//! `curl -X POST -d 3 http://ADDR/scale`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::job::{JobControl, JobHandle};
use meshwork::prelude::*;
use tokio::sync::{Mutex, oneshot};

// ANCHOR: service
/// What the handlers share: the job's controls, and the handle to join it once stopped.
struct Service {
    control: JobControl,
    handle: Mutex<Option<JobHandle<Mlp>>>,
    shutdown: Mutex<Option<oneshot::Sender<()>>>,
}

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

async fn stop(State(s): State<Arc<Service>>) -> (StatusCode, String) {
    let Some(handle) = s.handle.lock().await.take() else {
        return (StatusCode::CONFLICT, "already stopped".into());
    };
    let outcome = handle.stop().await;
    if let Some(tx) = s.shutdown.lock().await.take() {
        let _ = tx.send(());
    }
    match outcome {
        Ok(t) => (
            StatusCode::OK,
            serde_json::to_string(&t.summary).unwrap_or_default(),
        ),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let device = Device::flex();
    device.seed(1);
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    let handle = Job::builder()
        .initial_model(Mlp::new(&[16, 64, 2], &device))
        .loss(mse_loss)
        .data(task.dataset(4096))
        .optimizer(AdamConfig::new())
        .learning_rate(1e-3)
        .data_parallel(2)
        .elastic(1, 4)
        .batch_size(48)
        .steps(u64::MAX)
        .build()?
        .spawn()
        .await?;
    let (tx, rx) = oneshot::channel();
    let service = Arc::new(Service {
        control: handle.control(),
        handle: Mutex::new(Some(handle)),
        shutdown: Mutex::new(Some(tx)),
    });
    let app = Router::new()
        .route("/status", get(status))
        .route("/scale", post(scale))
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
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = rx.await;
        })
        .await
        .map_err(io)?;
    Ok(())
}
// ANCHOR_END: service
