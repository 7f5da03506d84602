//! Property tests of the compressors (CMP-1..4), on a group simulated by threads.

use std::sync::{Arc, Barrier, Mutex};

use proptest::prelude::*;

use super::*;

/// A group of `world` threads exchanging through shared slots; records the bytes of every
/// collective as the trace does (CMP-4).
struct Threads {
    rank: usize,
    world: usize,
    barrier: Arc<Barrier>,
    slots: Arc<Mutex<Vec<Vec<f32>>>>,
    traced: u64,
}

impl Threads {
    fn exchange(&mut self, mine: &[f32]) -> Vec<Vec<f32>> {
        self.slots.lock().unwrap()[self.rank] = mine.to_vec();
        self.barrier.wait();
        let all = self.slots.lock().unwrap().clone();
        self.barrier.wait();
        all
    }
}

impl Exchange for Threads {
    type Error = CompressError;

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buf: &mut [f32], wire: Precision) -> Result<(), CompressError> {
        if self.world == 1 {
            buf.iter_mut().for_each(|v| *v = round16(*v, wire));
            return Ok(());
        }
        self.traced += (buf.len() * if wire.is_low() { 2 } else { 4 }) as u64;
        let all = self.exchange(buf);
        for (i, v) in buf.iter_mut().enumerate() {
            // Each sum in f32, in rank order, rounded once (COMM-5).
            let s = all.iter().fold(0.0f32, |acc, b| acc + round16(b[i], wire));
            *v = round16(s, wire);
        }
        Ok(())
    }

    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), CompressError> {
        self.traced += 4 * out.len() as u64;
        let all = self.exchange(mine);
        out.copy_from_slice(&all.concat());
        Ok(())
    }
}

/// Run `steps` steps of `scheme` on `world` ranks; rank `r`'s gradient at step `s` is
/// `grads[s][r]`. Returns, per rank, the reduced gradients, the bytes traced, and the
/// compressor.
fn run(
    scheme: Compression,
    shapes: &[Vec<usize>],
    grads: &[Vec<Vec<f32>>],
    world: usize,
) -> Vec<(Vec<Vec<f32>>, u64, Compressor)> {
    let barrier = Arc::new(Barrier::new(world));
    let slots = Arc::new(Mutex::new(vec![Vec::new(); world]));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mut ex = Threads {
                    rank,
                    world,
                    barrier: barrier.clone(),
                    slots: slots.clone(),
                    traced: 0,
                };
                s.spawn(move || {
                    let mut c = Compressor::new(scheme, shapes);
                    let mut outs = Vec::new();
                    for step in grads {
                        let mut g = step[rank].clone();
                        c.reduce(&mut g, &mut ex)
                            .expect("no failure in a simulated group");
                        outs.push(g);
                    }
                    (outs, ex.traced, c)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn shapes_strategy() -> impl Strategy<Value = Vec<Vec<usize>>> {
    prop::collection::vec(
        prop_oneof![
            (1usize..6).prop_map(|n| vec![n]),
            (1usize..7, 1usize..7).prop_map(|(a, b)| vec![a, b]),
            (2usize..4, 1usize..4, 2usize..4).prop_map(|(a, b, c)| vec![a, b, c]),
        ],
        1..4,
    )
}

fn scheme_strategy() -> impl Strategy<Value = Compression> {
    prop_oneof![
        Just(Compression::None),
        Just(Compression::Bf16),
        Just(Compression::F16),
        (0.05f32..1.0).prop_map(|fraction| Compression::TopK { fraction }),
        (1usize..4, 0u64..2)
            .prop_map(|(rank, start_after)| Compression::PowerSgd { rank, start_after }),
    ]
}

/// Gradients for `steps` steps of `world` ranks, from a seed.
fn gradients(shapes: &[Vec<usize>], steps: usize, world: usize, seed: u64) -> Vec<Vec<Vec<f32>>> {
    let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let all = seeded_uniform(seed, steps * world * n);
    all.chunks(world * n.max(1))
        .take(steps)
        .map(|s| {
            s.chunks(n.max(1))
                .take(world)
                .map(<[f32]>::to_vec)
                .collect()
        })
        .collect()
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// CMP-1: over several steps, what a rank contributed plus its last residual equals the
    /// sum of its gradients (one rank: the reduced gradient is its contribution).
    #[test]
    fn error_feedback_loses_nothing(
        shapes in shapes_strategy(),
        scheme in scheme_strategy(),
        steps in 1usize..5,
        seed in any::<u64>(),
    ) {
        let grads = gradients(&shapes, steps, 1, seed);
        let (outs, _, c) = run(scheme, &shapes, &grads, 1).remove(0);
        let n = c.len();
        for i in 0..n {
            let input: f64 = grads.iter().map(|s| f64::from(s[0][i])).sum();
            let sent: f64 = outs.iter().map(|o| f64::from(o[i])).sum();
            let left = c.residual().get(i).map_or(0.0, |e| f64::from(*e));
            prop_assert!(
                (sent + left - input).abs() <= 1e-5 * steps as f64 * 2.0,
                "element {i}: sent {sent} + residual {left} != input {input} ({scheme})"
            );
        }
    }

    /// CMP-2, CMP-3: top-k of everything is the plain sum in rank order, bit for bit, on
    /// every rank.
    #[test]
    fn top_k_of_everything_is_the_plain_sum(
        shapes in shapes_strategy(),
        world in 1usize..4,
        seed in any::<u64>(),
    ) {
        let grads = gradients(&shapes, 2, world, seed);
        let ranks = run(Compression::TopK { fraction: 1.0 }, &shapes, &grads, world);
        for (s, step) in grads.iter().enumerate() {
            let want: Vec<f32> = (0..step[0].len())
                .map(|i| step.iter().fold(0.0f32, |a, g| a + g[i]))
                .collect();
            for (outs, _, c) in &ranks {
                prop_assert_eq!(&outs[s], &want);
                prop_assert!(c.residual().iter().all(|e| *e == 0.0));
            }
        }
    }

    /// CMP-2, CMP-3: PowerSGD at full rank reduces to the plain sum within 1e-5 of its
    /// largest element, the same on every rank, warm-started over several steps.
    #[test]
    fn power_sgd_at_full_rank_is_the_plain_sum(
        shapes in shapes_strategy(),
        world in 1usize..4,
        seed in any::<u64>(),
    ) {
        let grads = gradients(&shapes, 3, world, seed);
        let scheme = Compression::PowerSgd { rank: 8, start_after: 0 };
        let ranks = run(scheme, &shapes, &grads, world);
        for (s, step) in grads.iter().enumerate() {
            let want: Vec<f32> = (0..step[0].len())
                .map(|i| step.iter().map(|g| g[i]).sum())
                .collect();
            let tol = 1e-5 * max_abs(&want).max(f32::MIN_POSITIVE);
            for (outs, _, _) in &ranks {
                for (a, b) in outs[s].iter().zip(&want) {
                    prop_assert!((a - b).abs() <= tol, "step {s}: {a} vs {b} (tol {tol})");
                }
                prop_assert_eq!(&outs[s], &ranks[0].0[s]);
            }
        }
    }

    /// A 16-bit wire rounds each element once: relative error at most 2^-8 (bf16) or 2^-11
    /// (f16, normal range), the rest kept in the residual.
    #[test]
    fn sixteen_bit_rounding_is_bounded(values in prop::collection::vec(-1e3f32..1e3, 1..64)) {
        let shapes = vec![vec![values.len()]];
        for (scheme, bound) in [(Compression::Bf16, 2f32.powi(-8)), (Compression::F16, 2f32.powi(-11))] {
            let (outs, _, c) = run(scheme, &shapes, &[vec![values.clone()]], 1).remove(0);
            for ((x, y), e) in values.iter().zip(&outs[0]).zip(c.residual()) {
                if x.abs() > 1e-4 {
                    prop_assert!((x - y).abs() <= bound * x.abs(), "{scheme}: {x} -> {y}");
                }
                prop_assert_eq!(x - y, *e);
            }
        }
    }

    /// ZSYNC-1: a 16-bit scheme's `narrow_alone` hands the caller what `reduce` hands its
    /// all-reduce: summing every rank's result (in f32, rank order, rounded once, as the
    /// 16-bit reduce-scatter does) gives `reduce`'s output bit for bit over several steps,
    /// with the same residuals; the other schemes refuse, touching nothing.
    #[test]
    fn narrowing_alone_then_summing_is_the_reduction(
        shapes in shapes_strategy(),
        world in 1usize..4,
        seed in any::<u64>(),
    ) {
        let grads = gradients(&shapes, 3, world, seed);
        for (scheme, wire) in [(Compression::Bf16, Precision::Bf16), (Compression::F16, Precision::F16)] {
            let ranks = run(scheme, &shapes, &grads, world);
            let mut alone: Vec<Compressor> =
                (0..world).map(|_| Compressor::new(scheme, &shapes)).collect();
            for (s, step) in grads.iter().enumerate() {
                let sent: Vec<Vec<f32>> = alone
                    .iter_mut()
                    .zip(step)
                    .map(|(c, g)| {
                        let mut g = g.clone();
                        assert_eq!(c.narrow_alone(&mut g), Some(wire));
                        g
                    })
                    .collect();
                let summed: Vec<f32> = (0..sent[0].len())
                    .map(|i| {
                        let total = sent.iter().fold(0.0f32, |a, g| a + round16(g[i], wire));
                        if world == 1 { total } else { round16(total, wire) }
                    })
                    .collect();
                for (outs, _, _) in &ranks {
                    prop_assert_eq!(&outs[s], &summed, "{} step {}", scheme, s);
                }
            }
            for ((_, _, c), a) in ranks.iter().zip(&alone) {
                prop_assert_eq!(c.residual(), a.residual());
            }
        }
        for scheme in [Compression::None, Compression::TopK { fraction: 0.5 }] {
            let mut c = Compressor::new(scheme, &shapes);
            let mut g = grads[0][0].clone();
            prop_assert_eq!(c.narrow_alone(&mut g), None);
            prop_assert_eq!(&g, &grads[0][0]);
        }
    }

    /// CMP-4: the bytes the collectives carry per step are the prediction, and compressing
    /// top-k and low-rank sends what their sizes say.
    #[test]
    fn bytes_are_predicted(
        shapes in shapes_strategy(),
        scheme in scheme_strategy(),
        world in 1usize..4,
        seed in any::<u64>(),
    ) {
        let steps = 3;
        let grads = gradients(&shapes, steps, world, seed);
        let ranks = run(scheme, &shapes, &grads, world);
        let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        let warm = match scheme {
            Compression::PowerSgd { start_after, .. } => start_after.min(steps as u64),
            _ => 0,
        };
        let full = if world > 1 { 4 * n as u64 } else { 0 };
        let want = warm * full + (steps as u64 - warm) * scheme.predicted_bytes(&shapes, world);
        for (_, traced, _) in &ranks {
            prop_assert_eq!(*traced, want);
        }
        if world > 1 {
            let per_step = scheme.predicted_bytes(&shapes, world);
            match scheme {
                Compression::None => prop_assert_eq!(per_step, 4 * n as u64),
                Compression::Bf16 | Compression::F16 => prop_assert_eq!(per_step, 2 * n as u64),
                Compression::TopK { fraction } => {
                    let k = ((f64::from(fraction) * n as f64).ceil() as u64).clamp(1, n as u64);
                    prop_assert_eq!(per_step, 8 * k * world as u64);
                }
                Compression::PowerSgd { .. } => prop_assert!(per_step > 0),
            }
        } else {
            prop_assert_eq!(scheme.predicted_bytes(&shapes, world), 0);
        }
    }

    /// A compressor restored from its state goes on exactly as the one it was taken from.
    #[test]
    fn restored_state_goes_on_alike(
        shapes in shapes_strategy(),
        scheme in scheme_strategy(),
        seed in any::<u64>(),
    ) {
        let grads = gradients(&shapes, 4, 1, seed);
        let (whole, _, _) = run(scheme, &shapes, &grads, 1).remove(0);
        let (_, _, first) = run(scheme, &shapes, &grads[..2], 1).remove(0);
        let mut again = Compressor::new(scheme, &shapes);
        again.restore(first.state()).unwrap();
        let mut ex = Threads {
            rank: 0,
            world: 1,
            barrier: Arc::new(Barrier::new(1)),
            slots: Arc::new(Mutex::new(vec![Vec::new()])),
            traced: 0,
        };
        for (s, step) in grads.iter().enumerate().skip(2) {
            let mut g = step[0].clone();
            again.reduce(&mut g, &mut ex).unwrap();
            prop_assert_eq!(&g, &whole[s]);
        }
    }

    /// The text forms parse back to the scheme they print.
    #[test]
    fn names_round_trip(scheme in scheme_strategy()) {
        prop_assert_eq!(scheme.to_string().parse::<Compression>().unwrap(), scheme);
    }

    /// Orthogonalisation gives orthonormal columns even from dependent or zero ones.
    #[test]
    fn orthogonalised_columns_are_orthonormal(
        n in 1usize..7,
        r in 1usize..7,
        zero in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let r = r.min(n);
        let mut p = if zero { vec![0.0; n * r] } else { seeded_uniform(seed, n * r) };
        if r > 1 && !zero {
            // Column 1 a copy of column 0: dependent.
            for i in 0..n { p[i * r + 1] = p[i * r]; }
        }
        orthogonalise(&mut p, n, r);
        for a in 0..r {
            for b in 0..r {
                let d: f32 = (0..n).map(|i| p[i * r + a] * p[i * r + b]).sum();
                let want = if a == b { 1.0 } else { 0.0 };
                prop_assert!((d - want).abs() < 1e-5, "columns {a}, {b}: {d}");
            }
        }
    }
}

#[test]
fn bad_names_and_values_are_refused() {
    for bad in [
        "topk",
        "topk:0",
        "topk:1.5",
        "powersgd:0",
        "powersgd:x",
        "zip",
        "bf16:2",
    ] {
        assert!(bad.parse::<Compression>().is_err(), "{bad} parsed");
    }
    assert_eq!(
        "topk:0.01".parse::<Compression>().unwrap(),
        Compression::TopK { fraction: 0.01 }
    );
    assert_eq!(
        "PowerSGD:2:100".parse::<Compression>().unwrap(),
        Compression::PowerSgd {
            rank: 2,
            start_after: 100
        }
    );
}

#[test]
fn a_bad_peer_index_is_a_typed_error() {
    struct Liar;
    impl Exchange for Liar {
        type Error = CompressError;
        fn world(&self) -> usize {
            2
        }
        fn all_reduce(&mut self, _: &mut [f32], _: Precision) -> Result<(), CompressError> {
            Ok(())
        }
        fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), CompressError> {
            out[..mine.len()].copy_from_slice(mine);
            out[mine.len()] = f32::from_bits(99);
            Ok(())
        }
    }
    let mut c = Compressor::new(Compression::TopK { fraction: 0.5 }, &[vec![4]]);
    let err = c.reduce(&mut [1.0, 2.0, 3.0, 4.0], &mut Liar).unwrap_err();
    assert_eq!(
        err,
        CompressError::BadIndex {
            rank: 1,
            index: 99,
            len: 4
        }
    );
}
