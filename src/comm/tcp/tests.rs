//! The TCP transport with every rank a thread of this process, each with its own listener and
//! its own TCP links over loopback; results are compared with the in-process transport running
//! the same code. (Real separate processes: `tests/cluster/cluster_tcp.rs`.)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use proptest::prelude::*;

use super::schedule::{SendMode, chosen_modes, completes_with, peers_with_role, resolve};
use super::*;
use crate::comm::net::link::{JobToken, LinkListener};
use crate::comm::test_support::{
    bits, blamed, every_collective, every_narrow_collective, input,
    mismatched_then_agreeing_all_reduce, narrow_ring_all_reduce_bytes, on_local,
    send_recv_in_order_and_a_mismatch,
};
use crate::comm::{DType, chunk_range};

fn token() -> JobToken {
    JobToken::from_bytes([42; 32])
}

fn config() -> TcpConfig {
    TcpConfig::default()
        .with_timeout(Duration::from_secs(10))
        .with_link(LinkConfig::default().with_handshake_timeout(Duration::from_secs(10)))
}

fn listeners(
    world: usize,
    token: &JobToken,
    config: &TcpConfig,
) -> (Vec<LinkListener>, Vec<SocketAddr>) {
    let listeners: Vec<LinkListener> = (0..world)
        .map(|r| {
            LinkListener::bind("127.0.0.1:0", rank_of(r), token.clone(), config.link)
                .expect("a loopback port")
        })
        .collect();
    let addrs = listeners
        .iter()
        .map(|l| l.local_addr().expect("a bound address"))
        .collect();
    (listeners, addrs)
}

/// Runs `body` on one thread per rank of a fresh TCP group over loopback; returns each rank's
/// result in rank order.
fn on_tcp<R: Send>(
    world: usize,
    config: TcpConfig,
    body: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<R> {
    let (listeners, addrs) = listeners(world, &token(), &config);
    let body = &body;
    std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .iter()
            .map(|listener| {
                let (addrs, config) = (addrs.clone(), config.clone());
                scope.spawn(move || {
                    let group = TcpGroup::connect(listener, &addrs, Generation(0), config)
                        .expect("the group forms");
                    let mut comm = group.into_communicator();
                    body(&mut comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

#[test]
fn every_collective_over_tcp_equals_in_process_bit_for_bit() {
    for world in 1..=4 {
        for algorithm in [Algorithm::Ring, Algorithm::Tree] {
            let scenario = |comm: &mut Communicator| {
                let mut out = every_collective::<f32>(comm, algorithm);
                out.extend(every_collective::<f16>(comm, algorithm));
                out.extend(every_collective::<bf16>(comm, algorithm));
                (out, comm.last_algorithm())
            };
            let tcp = on_tcp(world, config(), scenario);
            let local = on_local(world, scenario);
            for (r, ((t, t_algo), (l, l_algo))) in tcp.iter().zip(&local).enumerate() {
                assert_eq!(t_algo, l_algo, "world {world} {algorithm} rank {r}");
                assert!(
                    t == l,
                    "world {world} {algorithm}: rank {r} differs from in-process"
                );
            }
            // PLAN-4 over TCP: every rank ends with the same all-reduced values.
            assert!(tcp.iter().all(|(t, _)| t[0] == tcp[0].0[0]));
        }
    }
}

/// TCP-7: f16 and bf16 final values travel as 2 bytes per element: a broadcast and an
/// all-gather move half the bytes of the same op in f32, a ring all-reduce (partial sums as
/// f32, final values as 16-bit) three quarters; the results stay bit-identical to the
/// in-process transport (`every_collective_over_tcp_equals_in_process_bit_for_bit`).
#[test]
fn sixteen_bit_final_values_travel_as_two_bytes_per_element() {
    fn bytes_of_ops<T: Element>(comm: &mut Communicator) -> [u64; 3] {
        let sent = |c: &Communicator| c.tcp_data_bytes_sent().expect("a TCP communicator");
        let (me, world) = (comm.rank().index(), comm.world());
        let len = 3000;
        let mut out = [0; 3];
        let before = sent(comm);
        let mut buf = input::<T>(me, len, 1);
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .expect("all_reduce");
        out[0] = sent(comm) - before;
        let before = sent(comm);
        comm.broadcast(&mut buf, rank_of(0)).expect("broadcast");
        out[1] = sent(comm) - before;
        let before = sent(comm);
        let mine = input::<T>(me, chunk_range(len, world, me).len(), 2);
        let mut all = vec![T::from_f32(0.0); len];
        comm.all_gather(&mine, &mut all).expect("all_gather");
        out[2] = sent(comm) - before;
        out
    }
    let per_rank = on_tcp(3, config(), |comm| {
        comm.set_algorithm(Algorithm::Ring);
        (
            bytes_of_ops::<f32>(comm),
            bytes_of_ops::<f16>(comm),
            bytes_of_ops::<bf16>(comm),
        )
    });
    for (r, (wide, f16_bytes, bf16_bytes)) in per_rank.iter().enumerate() {
        // A ring all-reduce of 3000 elements over 3 ranks: each rank sends 2 chunks of 1000
        // partial sums and 2 chunks of 1000 final values.
        assert_eq!(wide[0], 4 * 4000, "rank {r}: f32 all-reduce");
        for narrow in [f16_bytes, bf16_bytes] {
            assert_eq!(
                narrow[0],
                4 * 2000 + 2 * 2000,
                "rank {r}: 16-bit all-reduce"
            );
            assert_eq!(2 * narrow[1], wide[1], "rank {r}: 16-bit broadcast");
            assert_eq!(2 * narrow[2], wide[2], "rank {r}: 16-bit all-gather");
        }
    }
    let broadcast: u64 = per_rank.iter().map(|(w, _, _)| w[1]).sum();
    assert!(broadcast > 0, "the broadcast moved data");
}

#[test]
fn auto_runs_ring_for_large_buffers_and_tree_for_small_ones_across_processes() {
    let algos = on_tcp(3, config(), |comm| {
        let mut small = vec![1.0f32; 16];
        comm.all_reduce(&mut small, ReduceOp::Sum).unwrap();
        let small_algo = comm.last_algorithm();
        let mut large = vec![1.0f32; 100_000];
        comm.set_algorithm(Algorithm::Direct);
        comm.all_reduce(&mut large, ReduceOp::Sum).unwrap();
        assert!(large.iter().all(|v| *v == 3.0));
        (small_algo, comm.last_algorithm())
    });
    assert!(
        algos
            .iter()
            .all(|a| *a == (Some(Algorithm::Tree), Some(Algorithm::Ring)))
    );
}

#[test]
fn multi_frame_steps_and_tree_copies_move_large_buffers_without_deadlock() {
    // 8 MiB per rank, frames of 64 KiB: many frames per ring step; the tree all-reduce sends
    // the whole buffer both ways at once (TCP-3: copied sends, no deadlock).
    let len = 2 << 20;
    for algorithm in [Algorithm::Ring, Algorithm::Tree] {
        let scenario = |comm: &mut Communicator| {
            comm.set_algorithm(algorithm);
            let mut buf = input::<f32>(comm.rank().index(), len, 5);
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            bits(&buf)
        };
        let tcp = on_tcp(2, config().with_frame_bytes(64 << 10), scenario);
        let local = on_local(2, scenario);
        assert!(tcp == local, "{algorithm}");
    }
}

/// TCP-8: in a ring of 3, the three received ranges that are sent on (two reduce steps, one
/// gather step) leave in parts before their steps end, never more parts a step than the
/// link's queue share (`SEND_QUEUE / (2·world)`); the results equal the in-process transport's
/// bit for bit, for a sum and for a mean (finished part by part).
#[test]
fn tcp_8_received_ranges_are_sent_on_in_parts_with_the_same_results() {
    let len = 2 << 20;
    let frame = 64 << 10;
    let most = (SEND_QUEUE / (2 * 3)) as u64;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let scenario = |comm: &mut Communicator| {
            comm.set_algorithm(Algorithm::Ring);
            let mut buf = input::<f32>(comm.rank().index(), len, 9);
            comm.all_reduce(&mut buf, op).unwrap();
            (bits(&buf), comm.tcp_forwarded_parts())
        };
        let tcp = on_tcp(3, config().with_frame_bytes(frame), scenario);
        let local = on_local(3, scenario);
        for (r, ((got, parts), (want, _))) in tcp.iter().zip(&local).enumerate() {
            assert!(got == want, "rank {r}, {op:?}: differs from in process");
            let parts = parts.expect("a TCP communicator");
            assert!(
                (3 * 2..=3 * most).contains(&parts),
                "rank {r}: {parts} parts sent on in 3 steps, expected 6 to {}",
                3 * most
            );
        }
    }
}

/// TCP-8 and TCP-3: a received range of far more frames than a link's queue holds (4 KiB
/// frames, 512 of them a step at 2 ranks) is sent on without filling the queue: forwarded
/// bytes are read by the next rank only in its next step, so a full queue would leave every
/// rank waiting in a push until the op's time-out.
#[test]
fn tcp_8_a_step_of_more_frames_than_the_queue_holds_never_waits_for_room() {
    // 32 MiB: a step's forwarded bytes outgrow what loopback sockets buffer (a few MiB).
    let len = 8 << 20;
    for (world, algorithm) in [
        (2, Algorithm::Ring),
        (3, Algorithm::Ring),
        (4, Algorithm::Tree),
    ] {
        let scenario = |comm: &mut Communicator| {
            comm.set_algorithm(algorithm);
            let mut buf = input::<f32>(comm.rank().index(), len, 3);
            comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            bits(&buf)
        };
        let tcp = on_tcp(world, config().with_frame_bytes(4 << 10), scenario);
        let local = on_local(world, scenario);
        assert!(tcp == local, "{world} ranks, {algorithm}");
    }
}

#[test]
fn send_and_recv_match_in_order_and_a_length_mismatch_fails_both_sides() {
    let values: Vec<f16> = input(7, 3000, 1);
    let results = on_tcp(2, config(), |comm| {
        send_recv_in_order_and_a_mismatch(comm, &values)
    });
    for (r, (mismatch, got)) in results.iter().enumerate() {
        let Err(CommError::Mismatch {
            seq: 1, calls, op, ..
        }) = mismatch
        else {
            panic!("rank {r}: expected a mismatch, got {mismatch:?}");
        };
        let expected_op = if r == 0 {
            CollectiveKind::Send
        } else {
            CollectiveKind::Recv
        };
        assert_eq!(*op, expected_op);
        assert_eq!((calls[0].call.len, calls[1].call.len), (10, 11));
        assert_eq!(got, &bits(&values));
    }
}

#[test]
fn comm_2_mismatched_calls_fail_on_every_rank_and_the_group_stays_usable() {
    let results = on_tcp(3, config(), mismatched_then_agreeing_all_reduce);
    for (first, untouched, after) in results {
        let Err(CommError::Mismatch { seq, calls, .. }) = first else {
            panic!("expected a mismatch, got {first:?}");
        };
        assert_eq!((seq, calls.len(), calls[2].call.len), (0, 3, 9));
        assert!(untouched);
        assert_eq!(after, 3.0);
    }
}

/// Forms a TCP group of `world` ranks and runs `bodies[r]` on rank r's thread.
fn on_tcp_each<R: Send>(
    world: usize,
    config: TcpConfig,
    body: impl Fn(usize, Communicator, TcpShutdown) -> R + Sync,
) -> Vec<R> {
    on_tcp_prepared(world, config, |_| {}, body)
}

/// [`on_tcp_each`], with `prepare(r)` run on rank r's thread before its group forms.
fn on_tcp_prepared<R: Send>(
    world: usize,
    config: TcpConfig,
    prepare: impl Fn(usize) + Sync,
    body: impl Fn(usize, Communicator, TcpShutdown) -> R + Sync,
) -> Vec<R> {
    let (listeners, addrs) = listeners(world, &token(), &config);
    let (prepare, body) = (&prepare, &body);
    std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(r, listener)| {
                let (addrs, config) = (addrs.clone(), config.clone());
                scope.spawn(move || {
                    prepare(r);
                    let group = TcpGroup::connect(listener, &addrs, Generation(0), config)
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

#[test]
fn tcp_5_silent_peer_times_out_naming_it_and_the_group_is_poisoned() {
    let timeout = Duration::from_millis(400);
    // Rank 2 stays silent, its links open, until both others have their errors (at most
    // 60 s): they can only end by the time-out.
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let finished = std::sync::Mutex::new(finished);
    let results = on_tcp_each(3, config().with_timeout(timeout), |r, mut comm, _| {
        if r == 2 {
            let finished = finished.lock().unwrap();
            for _ in 0..2 {
                let _ = finished.recv_timeout(Duration::from_secs(60));
            }
            return None;
        }
        let started = Instant::now();
        let mut buf = vec![1.0f32; 1000];
        let error = comm.all_reduce(&mut buf, ReduceOp::Sum);
        let waited = started.elapsed();
        let later = comm.barrier();
        let _ = done.send(());
        Some((error.unwrap_err(), waited, later.unwrap_err()))
    });
    for (error, waited, later) in results.into_iter().flatten() {
        assert_eq!(blamed(&error), vec![Rank(2)], "{error}");
        // Ample slack above the time-out: this only guards against a hang.
        assert!(waited < timeout + Duration::from_secs(5), "{waited:?}");
        assert!(matches!(later, CommError::Poisoned { .. }), "{later}");
        assert_eq!(blamed(&later), vec![Rank(2)]);
    }
}

#[test]
fn tcp_5_peer_gone_mid_collective_is_a_link_error_naming_it_not_a_hang() {
    let timeout = Duration::from_secs(20);
    let results = on_tcp_each(3, config().with_timeout(timeout), |r, mut comm, _| {
        let mut buf = vec![1.0f32; 1 << 20];
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        if r == 1 {
            // Rank 1 goes away: its links close.
            drop(comm);
            return None;
        }
        let started = Instant::now();
        let error = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        Some((error, started.elapsed()))
    });
    for (error, waited) in results.into_iter().flatten() {
        assert_eq!(blamed(&error), vec![Rank(1)], "{error}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }
}

#[test]
fn tcp_6_shutdown_wakes_a_waiting_op_and_refuses_later_ones() {
    // Rank 1 never joins the op and holds its links open until rank 0 is done (at most
    // 60 s): only the shutdown can end rank 0's op, not the 10 s time-out or a closed link.
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let finished = std::sync::Mutex::new(finished);
    let results = on_tcp_each(2, config(), |r, mut comm, stop| {
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
    // Under the 10 s time-out: the shutdown woke it.
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(matches!(later, CommError::Shutdown { .. }), "{later}");
}

#[test]
fn tcp_1_wrong_token_never_becomes_a_link_and_the_group_still_forms() {
    let config = config();
    let (listeners, addrs) = listeners(2, &token(), &config);
    let stranger_addr = addrs[0];
    // A stranger claiming to be rank 1, without the token, reaches rank 0's listener before
    // the group forms: its connection is complete (first in the backlog) and its Hello sent
    // before any rank starts, so rank 0 must turn it away before rank 1's link is accepted.
    let mut stranger = std::net::TcpStream::connect(stranger_addr).expect("the stranger connects");
    stranger
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut hello = [1u8; 32].to_vec(); // the wrong token
    hello.extend_from_slice(&1u32.to_le_bytes()); // rank 1
    std::io::Write::write_all(
        &mut stranger,
        &crate::comm::net::frame::encode(crate::comm::net::frame::FrameKind::Hello, 0, &hello),
    )
    .unwrap();
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = listeners
            .iter()
            .map(|listener| {
                let (addrs, config) = (addrs.clone(), config.clone());
                scope.spawn(move || {
                    let mut comm = TcpGroup::connect(listener, &addrs, Generation(0), config)
                        .unwrap()
                        .into_communicator();
                    let mut buf = vec![2.0f32; 3];
                    comm.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf[0])
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // Turned away: the connection was closed without an Ack.
    let mut answer = Vec::new();
    let read = std::io::Read::read_to_end(&mut stranger, &mut answer);
    assert!(
        answer.is_empty()
            && read.as_ref().map_or_else(
                |e| e.kind() == std::io::ErrorKind::ConnectionReset,
                |n| *n == 0
            ),
        "{read:?}: {answer:?}"
    );
    assert!(results.iter().all(|r| matches!(r, Ok(4.0))), "{results:?}");
}

#[test]
fn tcp_1_a_rank_with_the_wrong_token_cannot_join() {
    let config = config()
        .with_link(LinkConfig::default().with_handshake_timeout(Duration::from_millis(500)));
    let good = LinkListener::bind("127.0.0.1:0", Rank(0), token(), config.link).unwrap();
    let bad = LinkListener::bind(
        "127.0.0.1:0",
        Rank(1),
        JobToken::from_bytes([9; 32]),
        config.link,
    )
    .unwrap();
    let addrs = vec![good.local_addr().unwrap(), bad.local_addr().unwrap()];
    let (zero, one) = std::thread::scope(|scope| {
        let zero = scope.spawn(|| TcpGroup::connect(&good, &addrs, Generation(0), config.clone()));
        let one = scope.spawn(|| TcpGroup::connect(&bad, &addrs, Generation(0), config.clone()));
        (zero.join().unwrap(), one.join().unwrap())
    });
    assert!(
        matches!(&zero, Err(TcpGroupError::Missing { missing, .. }) if missing == &vec![Rank(1)]),
        "{zero:?}"
    );
    assert!(
        matches!(
            &one,
            Err(TcpGroupError::Connect {
                peer: Rank(0),
                source: LinkError::HandshakeRefused { .. },
                ..
            })
        ),
        "{one:?}"
    );
}

proptest! {
    #[test]
    fn tcp_1_every_pair_has_exactly_one_acceptor_and_one_connector(world in 1usize..24) {
        for me in 0..world {
            let accept = peers_with_role(rank_of(me), world, LinkRole::Accept);
            let connect = peers_with_role(rank_of(me), world, LinkRole::Connect);
            prop_assert_eq!(accept.len() + connect.len(), world - 1);
            for peer in 0..world {
                let (a, b) = (link_role(rank_of(me), rank_of(peer)), link_role(rank_of(peer), rank_of(me)));
                match (a, b) {
                    (None, None) => prop_assert_eq!(me, peer),
                    (Some(LinkRole::Accept), Some(LinkRole::Connect)) => prop_assert!(me < peer),
                    (Some(LinkRole::Connect), Some(LinkRole::Accept)) => prop_assert!(me > peer),
                    other => prop_assert!(false, "{me}, {peer}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn tcp_2_and_tcp_3_every_tcp_plan_completes_with_its_send_modes(
        world in 1usize..10,
        len in 0usize..90,
        root in 0usize..10,
        kind in prop::sample::select(vec![
            CollectiveKind::AllReduce,
            CollectiveKind::ReduceScatter,
            CollectiveKind::AllGather,
            CollectiveKind::Broadcast,
        ]),
        requested in prop::sample::select(vec![
            Algorithm::Auto, Algorithm::Ring, Algorithm::Tree, Algorithm::Direct,
        ]),
        bytes in 0usize..100_000,
    ) {
        let algorithm = resolve(requested, kind, world, bytes);
        prop_assert!(matches!(algorithm, Algorithm::Ring | Algorithm::Tree));
        let root = rank_of(root % world);
        let plan = plan::plan(kind, algorithm, world, len, root).unwrap();
        prop_assert!(completes_with(&plan, &chosen_modes(&plan)));
        if algorithm == Algorithm::Ring {
            // Ring never copies: every send goes from the caller's buffer.
            for r in 0..world {
                prop_assert!(send_modes(&plan, rank_of(r)).iter().all(|m| *m == SendMode::Borrow));
            }
        }
    }
}

#[test]
fn tcp_3_tree_all_reduce_would_deadlock_with_borrowed_sends_so_it_copies() {
    let plan = plan::plan(CollectiveKind::AllReduce, Algorithm::Tree, 2, 10, Rank(0)).unwrap();
    assert!(!completes_with(&plan, &|_, _| SendMode::Borrow));
    assert_eq!(send_modes(&plan, Rank(0)), vec![SendMode::Copy]);
}

#[test]
fn dtype_sizes_match_the_wire() {
    assert_eq!(DType::F16.size_bytes(), std::mem::size_of::<f16>());
    assert_eq!(DType::BF16.size_bytes(), std::mem::size_of::<bf16>());
}

/// COMM-9 over TCP: with 16-bit partial sums every 16-bit collective equals the in-process
/// transport's bit for bit, and a ring all-reduce sends 2 bytes per element per message: 4
/// per element per ring pass instead of TCP-7's 6.
#[test]
fn comm_9_sixteen_bit_partial_sums_over_tcp_equal_in_process_and_move_two_bytes() {
    for world in 2..=4 {
        for algorithm in [Algorithm::Ring, Algorithm::Tree] {
            let scenario = |comm: &mut Communicator| every_narrow_collective(comm, algorithm);
            let tcp = on_tcp(world, config(), scenario);
            let local = on_local(world, scenario);
            for (r, (t, l)) in tcp.iter().zip(&local).enumerate() {
                assert!(t == l, "world {world} {algorithm}: rank {r} differs");
            }
        }
    }
    let bytes = on_tcp(3, config(), |comm| {
        narrow_ring_all_reduce_bytes(comm, |c| c.tcp_data_bytes_sent().unwrap_or(0))
    });
    // Each of 3 ranks sends 2 chunks of 1000 partial sums and 2 of 1000 final values.
    assert!(bytes.iter().all(|b| *b == 2 * 4000), "{bytes:?}");
}

proptest! {
    /// A 16-bit send's pieces cover its range in order, each piece once, and an op's sends to
    /// one peer never queue more than the link holds (TCP-3).
    #[test]
    fn narrow_pieces_cover_the_range_and_fit_the_queue(
        start in 0usize..1000,
        len in 0usize..5_000_000,
        world in 1usize..64,
    ) {
        let range = start..start + len;
        let pieces: Vec<_> = super::schedule::narrow_pieces(&range, world).collect();
        prop_assert!(!pieces.is_empty());
        prop_assert_eq!(pieces[0].start, range.start);
        prop_assert_eq!(pieces[pieces.len() - 1].end, range.end);
        for pair in pieces.windows(2) {
            prop_assert_eq!(pair[0].end, pair[1].start);
            prop_assert!(!pair[0].is_empty());
        }
        prop_assert!(2 * world.saturating_sub(1) * pieces.len() <= SEND_QUEUE.max(2 * world));
    }
}

thread_local! {
    /// Set by a test: the next borrowed send queued on this thread panics right after it is
    /// queued, while the link's sender thread may read the range.
    static PANIC_AFTER_BORROWED_SEND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Set by a test on a rank's thread before its group connects: that rank's sender threads
    /// die when they take this ticket (0: never).
    pub(super) static SENDERS_DIE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// TCP-4, TCP-5: a rank whose sender thread died holding a job fails its op within the
/// time-out, and so does its peer: `fail` does not wait for a finished thread to acknowledge
/// the jobs it took.
#[test]
fn tcp_5_a_dead_sender_thread_fails_the_op_instead_of_hanging_it() {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let config = config().with_timeout(Duration::from_secs(2));
        // The op's header is ticket 1: rank 0's first data frame dies with its thread.
        let prepare = |r: usize| SENDERS_DIE.set(if r == 0 { 2 } else { 0 });
        let results = on_tcp_prepared(2, config, prepare, |_, mut comm, _| {
            let mut buf = vec![1.0f32; 1 << 16];
            comm.all_reduce(&mut buf, ReduceOp::Sum).is_err()
        });
        let _ = done.send(results);
    });
    let failed = ended
        .recv_timeout(Duration::from_secs(30))
        .expect("both ranks' ops end within 30 s");
    assert_eq!(failed, [true, true], "both ranks' ops fail");
}

/// The panic [`PANIC_AFTER_BORROWED_SEND`] asks for, once.
pub(super) fn panic_if_asked() {
    if PANIC_AFTER_BORROWED_SEND.replace(false) {
        panic!("a test's panic after a borrowed send");
    }
}

/// Set in the child process of `tcp_4_a_panic_while_links_read_the_buffer_aborts_the_process`.
const UNWIND_CHILD: &str = "MESHWORK_TCP_UNWIND_CHILD";

/// TCP-4: a rank that panics while its links still read its buffer (a borrowed send queued)
/// aborts the process, saying why, instead of unwinding and freeing the buffer under its
/// sender threads. The rank runs in a child process, whose abort this test expects.
#[cfg(unix)]
#[test]
fn tcp_4_a_panic_while_links_read_the_buffer_aborts_the_process() {
    use std::os::unix::process::ExitStatusExt;
    let child = "comm::tcp::tests::a_rank_that_panics_after_a_borrowed_send";
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            child,
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(UNWIND_CHILD, "1")
        .output()
        .expect("the child runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGABRT),
        "{:?}: {stderr}",
        out.status
    );
    assert!(
        stderr.contains("panicked inside a TCP collective while its links still read its buffer"),
        "{stderr}"
    );
}

/// The child of `tcp_4_a_panic_while_links_read_the_buffer_aborts_the_process`: rank 0 of a
/// TCP all-reduce panics after queuing a borrowed send. Does nothing unless that test started
/// it.
#[test]
#[ignore = "a child process of tcp_4_a_panic_while_links_read_the_buffer_aborts_the_process"]
fn a_rank_that_panics_after_a_borrowed_send() {
    if std::env::var_os(UNWIND_CHILD).is_none() {
        return;
    }
    let config = config().with_timeout(Duration::from_secs(5));
    on_tcp(2, config, |comm| {
        if comm.rank() == Rank(0) {
            PANIC_AFTER_BORROWED_SEND.set(true);
        }
        let mut buf = vec![1.0f32; 1 << 20];
        let _ = comm.all_reduce(&mut buf, ReduceOp::Sum);
    });
}
