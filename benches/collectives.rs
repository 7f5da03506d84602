//! Criterion bench of the in-process all-reduce through the public API: a few sizes and
//! algorithms on two ranks. Kept short: small sample counts and measurement times.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use meshwork::comm::{Algorithm, CommConfig, LocalGroup, ReduceOp};
use meshwork::mesh::Generation;

/// Runs `iters` all-reduces on every rank of a fresh 2-rank group; returns rank 0's time.
fn run_all_reduce(world: usize, len: usize, algorithm: Algorithm, iters: u64) -> Duration {
    let group = LocalGroup::new(
        world,
        Generation(0),
        CommConfig::default().with_algorithm(algorithm),
    );
    std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .communicators()
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || {
                    let mut buf = vec![1.0f32; len];
                    comm.all_reduce(&mut buf, ReduceOp::Sum)
                        .expect("warm-up all-reduce");
                    let start = std::time::Instant::now();
                    for _ in 0..iters {
                        comm.all_reduce(&mut buf, ReduceOp::Sum)
                            .expect("all-reduce");
                    }
                    start.elapsed()
                })
            })
            .collect();
        let times: Vec<Duration> = handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect();
        times[0]
    })
}

fn all_reduce(c: &mut Criterion) {
    let mut group = c.benchmark_group("all_reduce_f32_world2");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for bytes in [4 << 10, 1 << 20, 16 << 20] {
        group.throughput(Throughput::Bytes(bytes as u64));
        for algorithm in [Algorithm::Direct, Algorithm::Ring, Algorithm::Tree] {
            group.bench_with_input(
                BenchmarkId::new(algorithm.to_string(), bytes),
                &bytes,
                |b, &bytes| b.iter_custom(|iters| run_all_reduce(2, bytes / 4, algorithm, iters)),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, all_reduce);
criterion_main!(benches);
