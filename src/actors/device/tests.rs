//! RT-2: a device answers heartbeats while its compute thread is busy.

use std::time::{Duration, Instant};

use burn::tensor::{Distribution, Tensor};
use ractor::Actor;

use super::{DeviceActor, heartbeat, run_on};
use crate::device::MeshDevice;

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .expect("test exceeded its 120 s bound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rt_2_device_answers_heartbeat_during_a_2s_computation() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    bounded(async {
        let device = MeshDevice::flex(1).remove(0);
        let id = device.id();
        let burn = device.burn().clone();
        let (actor, _) = Actor::spawn(None, DeviceActor, device).await.unwrap();
        // The computation lasts at least 2 s and until the test has its heartbeat (at most
        // 60 s), so the heartbeat is answered while it runs however slow the machine is.
        let release = Arc::new(AtomicBool::new(false));
        let compute = tokio::spawn({
            let (actor, release) = (actor.clone(), release.clone());
            async move {
                run_on(&actor, "long computation", move || {
                    let start = Instant::now();
                    let a = Tensor::<2>::random([128, 128], Distribution::Default, &burn);
                    let mut acc = a.clone();
                    while (start.elapsed() < Duration::from_secs(2)
                        || !release.load(Ordering::SeqCst))
                        && start.elapsed() < Duration::from_secs(60)
                    {
                        acc = (acc.matmul(a.clone()) * 1e-3).tanh();
                        let _: f32 = acc.clone().sum().into_scalar();
                    }
                    Instant::now()
                })
                .await
            }
        });
        // Eventually the thread reports itself busy; the heartbeat must come back promptly
        // (an actor that waited for the computation would answer after it, or time out).
        let deadline = Instant::now() + Duration::from_secs(30);
        let beat = loop {
            let sent = Instant::now();
            let h = heartbeat(&actor, id, Duration::from_secs(10))
                .await
                .unwrap();
            if h.busy.is_some() {
                break (h, Instant::now(), sent);
            }
            assert!(Instant::now() < deadline, "the thread never reported busy");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let (h, answered, sent) = beat;
        assert!(
            !compute.is_finished(),
            "the computation ended before the heartbeat reply"
        );
        release.store(true, Ordering::SeqCst);
        let ended = compute.await.unwrap().unwrap().unwrap();
        assert_eq!(
            h.busy.as_ref().map(|b| b.0.as_str()),
            Some("long computation")
        );
        assert!(
            answered < ended,
            "heartbeat reply arrived after the computation ended"
        );
        assert!(
            answered - sent < Duration::from_secs(5),
            "heartbeat was slow: {:?}",
            answered - sent
        );
        actor.stop(None);
    })
    .await;
}
