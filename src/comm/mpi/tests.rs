//! The MPI transport with every rank a thread of this process (a singleton MPI world: each
//! rank its own endpoint, messages through MPI's self/shared-memory path), compared with the
//! in-process transport running the same code. (Separate processes under `mpirun`:
//! `tests/cluster/cluster_launchers.rs`.)

use std::time::{Duration, Instant};

use half::{bf16, f16};
use proptest::prelude::*;

use super::*;
use crate::comm::test_support::{
    bits, blamed, every_collective, every_narrow_collective, input,
    mismatched_then_agreeing_all_reduce, narrow_ring_all_reduce_bytes, on_local,
    send_recv_in_order_and_a_mismatch,
};
use crate::comm::{Element, ReduceOp, chunk_range};

fn mpi_world() -> &'static MpiWorld {
    init().expect("MPI initialises (a singleton world when not under mpirun)")
}

fn config() -> MpiConfig {
    MpiConfig {
        comm: CommConfig::default().with_timeout(Duration::from_secs(20)),
        ..MpiConfig::default()
    }
}

/// Forms an MPI group of `world` ranks of this process and runs `body(rank, comm, shutdown)`
/// on one thread per rank; returns each rank's result in rank order.
fn on_mpi_each<R: Send>(
    world: usize,
    config: MpiConfig,
    body: impl Fn(usize, Communicator, MpiShutdown) -> R + Sync,
) -> Vec<R> {
    let mpi = mpi_world();
    let endpoints: Vec<MpiEndpoint> = (0..world).map(|_| mpi.endpoint()).collect();
    let body = &body;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (endpoints, config) = (endpoints.clone(), config.clone());
                scope.spawn(move || {
                    let group =
                        MpiGroup::new(mpi, endpoints, Rank(r as u32), Generation(0), config)
                            .expect("the group forms");
                    let stop = group.shutdown_handle();
                    body(r, group.into_communicator(), stop)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

fn on_mpi<R: Send>(
    world: usize,
    config: MpiConfig,
    body: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<R> {
    on_mpi_each(world, config, |_, mut comm, _| body(&mut comm))
}

#[test]
fn every_collective_over_mpi_equals_in_process_bit_for_bit() {
    for world in 1..=4 {
        for algorithm in [Algorithm::Ring, Algorithm::Tree] {
            let scenario = |comm: &mut Communicator| {
                let mut out = every_collective::<f32>(comm, algorithm);
                out.extend(every_collective::<f16>(comm, algorithm));
                out.extend(every_collective::<bf16>(comm, algorithm));
                (out, comm.last_algorithm(), comm.is_mpi())
            };
            let over_mpi = on_mpi(world, config(), scenario);
            let local = on_local(world, |c| {
                let (out, algo, _) = scenario(c);
                (out, algo)
            });
            for (r, ((m, m_algo, is_mpi), (l, l_algo))) in over_mpi.iter().zip(&local).enumerate() {
                assert!(is_mpi, "rank {r} ran on MPI");
                assert_eq!(m_algo, l_algo, "world {world} {algorithm} rank {r}");
                assert!(m == l, "world {world} {algorithm}: rank {r} differs");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, .. ProptestConfig::default() })]

    /// The same over random worlds, lengths and message sizes (steps split into several
    /// messages): all-reduce, reduce-scatter and all-gather bit-equal to in-process.
    #[test]
    fn mpi_collectives_with_split_messages_equal_in_process(
        world in 1usize..6,
        len in 0usize..3000,
        max_message in 1usize..64,
        seed in 0u64..1000,
        tree in any::<bool>(),
        sixteen in any::<bool>(),
    ) {
        let algorithm = if tree { Algorithm::Tree } else { Algorithm::Ring };
        let config = MpiConfig { max_message_bytes: max_message * 4, ..config() };
        let scenario = |comm: &mut Communicator| {
            comm.set_algorithm(algorithm);
            let (me, world) = (comm.rank().index(), comm.world());
            let mut out = Vec::new();
            if sixteen {
                let mut buf = input::<bf16>(me, len, seed);
                comm.all_reduce(&mut buf, ReduceOp::Mean).unwrap();
                out.push(bits(&buf));
            } else {
                let mut buf = input::<f32>(me, len, seed);
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                out.push(bits(&buf));
            }
            let full = input::<f32>(me, len, seed + 1);
            let mut chunk = vec![0.0f32; chunk_range(len, world, me).len()];
            comm.reduce_scatter(&full, &mut chunk, ReduceOp::Sum).unwrap();
            out.push(bits(&chunk));
            let mine = input::<f16>(me, chunk_range(len, world, me).len(), seed + 2);
            let mut all = vec![f16::ZERO; len];
            comm.all_gather(&mine, &mut all).unwrap();
            out.push(bits(&all));
            out
        };
        let over_mpi = on_mpi(world, config, scenario);
        let local = on_local(world, scenario);
        prop_assert_eq!(over_mpi, local);
    }

    /// MPI-1: tags of different (receiver endpoint, sender) pairs differ, whatever the
    /// groups' sizes, and stay inside the tag space with the kind bit clear.
    #[test]
    fn mpi_1_tags_are_distinct_and_fit(
        endpoints in proptest::collection::vec(0u32..1_000_000, 2),
        senders in proptest::collection::vec(0usize..4096, 2),
        tag_bits in 21u32..32,
    ) {
        // Ids below the limit MpiGroup::new enforces.
        let e = endpoint_bits(tag_bits);
        let endpoints: Vec<u32> = endpoints.iter().map(|&x| x & ((1u32 << e) - 1)).collect();
        let same_endpoint = endpoints[0] == endpoints[1];
        let (a, b) = (
            tag(endpoints[0], senders[0], tag_bits),
            tag(endpoints[1], senders[1], tag_bits),
        );
        for t in [a, b] {
            prop_assert!(t >= 0 && i64::from(t) < (1i64 << tag_bits));
            prop_assert_eq!(t & 1, 0);
        }
        prop_assert_eq!(a == b, same_endpoint && senders[0] == senders[1]);
    }
}

/// TCP-7 over MPI: 16-bit final values travel as 2 bytes an element.
#[test]
fn sixteen_bit_final_values_travel_as_two_bytes_per_element() {
    fn bytes_of_ops<T: Element>(comm: &mut Communicator) -> [u64; 2] {
        let (me, world) = (comm.rank().index(), comm.world());
        let len = 3000;
        let before = comm.bytes_sent();
        let mut buf = input::<T>(me, len, 1);
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        let reduce = comm.bytes_sent() - before;
        let before = comm.bytes_sent();
        let mine = input::<T>(me, chunk_range(len, world, me).len(), 2);
        let mut all = vec![T::from_f32(0.0); len];
        comm.all_gather(&mine, &mut all).unwrap();
        [reduce, comm.bytes_sent() - before]
    }
    let per_rank = on_mpi(3, config(), |comm| {
        comm.set_algorithm(Algorithm::Ring);
        (bytes_of_ops::<f32>(comm), bytes_of_ops::<bf16>(comm))
    });
    for (r, (wide, narrow)) in per_rank.iter().enumerate() {
        assert_eq!(wide[0], 4 * 4000, "rank {r}: f32 all-reduce");
        assert_eq!(narrow[0], 4 * 2000 + 2 * 2000, "rank {r}: bf16 all-reduce");
        assert_eq!(2 * narrow[1], wide[1], "rank {r}: bf16 all-gather");
    }
}

#[test]
fn send_and_recv_match_in_order_and_a_length_mismatch_fails_both_sides() {
    let values: Vec<f16> = input(7, 3000, 1);
    let results = on_mpi(2, config(), |comm| {
        send_recv_in_order_and_a_mismatch(comm, &values)
    });
    for (r, (mismatch, got)) in results.iter().enumerate() {
        let Err(CommError::Mismatch { seq: 1, calls, .. }) = mismatch else {
            panic!("rank {r}: expected a mismatch, got {mismatch:?}");
        };
        assert_eq!((calls[0].call.len, calls[1].call.len), (10, 11));
        assert_eq!(got, &bits(&values));
    }
}

#[test]
fn comm_2_mismatched_calls_fail_on_every_rank_and_the_group_stays_usable() {
    let results = on_mpi(3, config(), mismatched_then_agreeing_all_reduce);
    for (first, untouched, after) in results {
        let Err(CommError::Mismatch { seq, calls, .. }) = first else {
            panic!("expected a mismatch, got {first:?}");
        };
        assert_eq!((seq, calls.len(), calls[2].call.len), (0, 3, 9));
        assert!(untouched);
        assert_eq!(after, 3.0);
    }
}

/// MPI-1: two groups over the same endpoints' processes, running at once, never take each
/// other's messages.
#[test]
fn mpi_1_two_groups_at_once_stay_apart() {
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| {
            on_mpi(3, config(), |comm| {
                let mut buf = vec![1.0f32; 5000];
                for _ in 0..20 {
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                }
                buf[0]
            })
        });
        let b = s.spawn(|| {
            on_mpi(3, config(), |comm| {
                let mut buf = vec![2.0f32; 5000];
                for _ in 0..20 {
                    comm.all_reduce(&mut buf, ReduceOp::Mean).unwrap();
                }
                buf[0]
            })
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a, vec![3f32.powi(20); 3]);
    assert_eq!(b, vec![2.0; 3]);
}

/// MPI-2 and MPI-3: a silent rank is named by the rank whose time-out expires first, and
/// that rank's abort reaches the third, which fails at once with the cause instead of
/// waiting out its own (long) time-out.
#[test]
fn mpi_2_and_3_a_silent_peer_is_named_and_the_failure_reaches_the_others() {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let finished = std::sync::Mutex::new(finished);
    let results = on_mpi_each(3, config(), |r, mut comm, _| {
        if r == 2 {
            // Silent until both others have their errors (at most 60 s).
            let finished = finished.lock().unwrap();
            for _ in 0..2 {
                let _ = finished.recv_timeout(Duration::from_secs(60));
            }
            return None;
        }
        if r == 0 {
            comm.set_timeout(Duration::from_millis(300));
        }
        let started = Instant::now();
        let mut buf = vec![1.0f32; 1000];
        let error = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        let waited = started.elapsed();
        let later = comm.barrier().unwrap_err();
        let _ = done.send(());
        Some((error, waited, later))
    });
    let (first, waited0, later0) = results[0].clone().unwrap();
    assert!(matches!(first, CommError::Timeout { .. }), "{first}");
    assert_eq!(blamed(&first), vec![Rank(2)], "{first}");
    assert!(waited0 < Duration::from_secs(5), "{waited0:?}");
    assert!(matches!(later0, CommError::Poisoned { .. }), "{later0}");
    let (second, waited1, _) = results[1].clone().unwrap();
    // Rank 1's own time-out is 20 s: only rank 0's abort ends its op this early.
    assert!(matches!(second, CommError::Poisoned { .. }), "{second}");
    assert_eq!(blamed(&second), vec![Rank(2)], "{second}");
    assert!(waited1 < Duration::from_secs(10), "{waited1:?}");
}

/// MPI-4: a shutdown wakes a waiting op and refuses later ones.
#[test]
fn mpi_4_shutdown_wakes_a_waiting_op_and_refuses_later_ones() {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let finished = std::sync::Mutex::new(finished);
    let results = on_mpi_each(2, config(), |r, mut comm, stop| {
        if r == 1 {
            let _ = finished
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(60));
            return None;
        }
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            stop.shutdown();
        });
        let started = Instant::now();
        let mut buf = vec![1.0f32; 10];
        let first = comm.all_reduce(&mut buf, ReduceOp::Sum);
        let waited = started.elapsed();
        stopper.join().unwrap();
        let later = comm.barrier();
        let _ = done.send(());
        Some((first.unwrap_err(), waited, later.unwrap_err()))
    });
    let (first, waited, later) = results[0].clone().unwrap();
    assert!(matches!(first, CommError::Shutdown { .. }), "{first}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    assert!(matches!(later, CommError::Shutdown { .. }), "{later}");
}

#[test]
fn bad_groups_are_refused_with_a_reason() {
    let mpi = mpi_world();
    let a = mpi.endpoint();
    let elsewhere = MpiEndpoint {
        process: mpi.rank() + 1,
        id: 0,
    };
    let e = MpiGroup::new(mpi, vec![a, a], Rank(0), Generation(0), config()).unwrap_err();
    assert!(matches!(e, MpiError::Endpoints(_)), "{e}");
    let e = MpiGroup::new(mpi, vec![a], Rank(1), Generation(0), config()).unwrap_err();
    assert!(matches!(e, MpiError::InvalidRank { .. }), "{e}");
    let e = MpiGroup::new(mpi, vec![elsewhere, a], Rank(0), Generation(0), config()).unwrap_err();
    assert!(matches!(e, MpiError::Endpoints(_)), "{e}");
    assert_eq!(MpiEndpoint::from_bytes(&a.to_bytes()), Some(a));
    assert_eq!(MpiEndpoint::from_bytes(&[1, 2, 3]), None);
}

/// Ranks that split steps into messages of different sizes are told so at their first op,
/// naming the setting, instead of misreading each other's messages.
#[test]
fn ranks_with_different_message_sizes_fail_naming_the_setting() {
    let mpi = mpi_world();
    let endpoints: Vec<MpiEndpoint> = (0..2).map(|_| mpi.endpoint()).collect();
    let errors: Vec<CommError> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u32)
            .map(|r| {
                let endpoints = endpoints.clone();
                scope.spawn(move || {
                    let config = MpiConfig {
                        max_message_bytes: 64 * (r as usize + 1),
                        ..config()
                    };
                    let group = MpiGroup::new(mpi, endpoints, Rank(r), Generation(0), config)
                        .expect("the group forms");
                    let mut comm = group.into_communicator();
                    let mut buf = vec![1.0f32; 1000];
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.to_string().contains("max_message_bytes"), "{e}");
    }
}

/// Packets between two endpoints arrive whole and in order, whatever their sizes; one over
/// the receiver's limit is refused, a silent peer is a time-out, a closed channel says so.
#[test]
fn packets_arrive_whole_and_in_order_and_every_wait_ends() {
    let mpi = mpi_world();
    let (a, b) = (mpi.endpoint(), mpi.endpoint());
    let (left, right) = (
        MpiPackets::new(mpi, (a, 0), (b, 1), 2).expect("an end"),
        MpiPackets::new(mpi, (b, 1), (a, 0), 2).expect("an end"),
    );
    let sizes = [0usize, 1, 7, 4096, 1 << 20, 3];
    let deadline = || Instant::now() + Duration::from_secs(20);
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, &n) in sizes.iter().enumerate() {
                let packet: Vec<u8> = (0..n).map(|j| (i + j) as u8).collect();
                left.send(&packet, deadline()).expect("sent");
            }
        });
        let mut got = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            right.recv(&mut got, 1 << 21, deadline()).expect("received");
            assert_eq!(got.len(), n);
            assert!(got.iter().enumerate().all(|(j, v)| *v == (i + j) as u8));
        }
    });
    left.send(&[0; 100], deadline()).unwrap();
    let mut got = Vec::new();
    let too_large = right.recv(&mut got, 10, deadline()).unwrap_err();
    assert_eq!(too_large, PacketsError::TooLarge { len: 100, max: 10 });
    let silent = right.recv(&mut got, 10, Instant::now() + Duration::from_millis(50));
    assert_eq!(silent.unwrap_err(), PacketsError::TimedOut);
    right
        .closer()
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        right.recv(&mut got, 10, deadline()).unwrap_err(),
        PacketsError::Closed
    );
    let twice = MpiPackets::new(mpi, (a, 0), (a, 0), 1).unwrap_err();
    assert!(matches!(twice, MpiError::Endpoints(_)), "{twice}");
}

/// COMM-9 over MPI: with 16-bit partial sums every 16-bit collective equals the in-process
/// transport's bit for bit, and a ring all-reduce sends 2 bytes per element per message.
#[test]
fn comm_9_sixteen_bit_partial_sums_over_mpi_equal_in_process_and_move_two_bytes() {
    for world in 2..=4 {
        for algorithm in [Algorithm::Ring, Algorithm::Tree] {
            let scenario = |comm: &mut Communicator| every_narrow_collective(comm, algorithm);
            let over_mpi = on_mpi(world, config(), scenario);
            let local = on_local(world, scenario);
            for (r, (m, l)) in over_mpi.iter().zip(&local).enumerate() {
                assert!(m == l, "world {world} {algorithm}: rank {r} differs");
            }
        }
    }
    let bytes = on_mpi(3, config(), |comm| {
        narrow_ring_all_reduce_bytes(comm, Communicator::bytes_sent)
    });
    assert!(bytes.iter().all(|b| *b == 2 * 4000), "{bytes:?}");
}
