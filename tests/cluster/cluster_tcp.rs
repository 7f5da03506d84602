//! The TCP transport across real processes: this test binary re-executes itself as the ranks
//! (`child_process_entry_point`, selected by an environment variable), on 127.0.0.1 ports the
//! children pick. Children are killed when the `ProcessGroup` drops, also when an assertion
//! fails. Checks: every collective equals the in-process transport bit for bit (TCP-2), a
//! SIGKILLed rank mid-all-reduce is a typed error naming it on every survivor, never a hang
//! (TCP-5), a silent rank times out naming it (COMM-3), a rank with the wrong token never
//! joins (TCP-1, LINK-1).
#![cfg(feature = "cluster")]

use std::process::Command;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use meshwork::comm::net::link::{JobToken, LinkListener};
use meshwork::comm::tcp::{TcpConfig, TcpGroup, TcpGroupError};
use meshwork::comm::{
    Algorithm, CommConfig, CommError, Communicator, Element, LocalGroup, ReduceOp, chunk_range,
};
use meshwork::mesh::{Generation, Rank};
use meshwork::testing::processes::{ProcessGroup, announce_and_wait_for_peers};

const SCENARIO: &str = "MESHWORK_TCP_TEST_SCENARIO";
const RANK: &str = "MESHWORK_TCP_TEST_RANK";
const TOKEN: &str = "MESHWORK_TCP_TEST_TOKEN";
/// The child entry test's full name in this binary (`--exact` matches the module path too).
const ENTRY: &str = "cluster_tcp::child_process_entry_point";

/// Every rank's result line starts with this.
const RESULT: &str = "result ";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set for a child"))
}

/// Starts `world` children running `scenario`; child r gets token byte `tokens[r]`.
fn start(scenario: &str, tokens: &[u8]) -> ProcessGroup {
    let exe = std::env::current_exe().expect("the test binary");
    let commands = tokens
        .iter()
        .enumerate()
        .map(|(rank, token)| {
            let mut command = Command::new(&exe);
            command
                .args(["--exact", ENTRY, "--nocapture", "--test-threads=1"])
                .env(SCENARIO, scenario)
                .env(RANK, rank.to_string())
                .env(TOKEN, token.to_string());
            command
        })
        .collect();
    ProcessGroup::start(commands, Duration::from_secs(30)).expect("the children start")
}

/// Deterministic inputs in [-1, 1] per rank (the same in parent and children).
fn input<T: Element>(rank: usize, len: usize, seed: u64) -> Vec<T> {
    let mut x = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f32(((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32)
        })
        .collect()
}

/// FNV-1a over the bits of every output, in order.
#[derive(Default)]
struct Digest(u64, usize);

impl Digest {
    fn add<T: Element>(&mut self, values: &[T]) {
        if self.0 == 0 {
            self.0 = 0xcbf2_9ce4_8422_2325;
        }
        for v in values {
            for b in v.to_f32().to_bits().to_le_bytes() {
                self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
            }
        }
        self.1 += values.len();
    }
}

fn collectives_of<T: Element>(comm: &mut Communicator, digest: &mut Digest) {
    let (me, world) = (comm.rank().index(), comm.world());
    for (i, len) in [0usize, 1, 13, 1000, 70_000].into_iter().enumerate() {
        let seed = i as u64 + 3;
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            let mut buf = input::<T>(me, len, seed);
            comm.all_reduce(&mut buf, op).expect("all_reduce");
            digest.add(&buf);
            let full = input::<T>(me, len, seed + 1);
            let mut chunk = vec![T::from_f32(0.0); chunk_range(len, world, me).len()];
            comm.reduce_scatter(&full, &mut chunk, op)
                .expect("reduce_scatter");
            digest.add(&chunk);
        }
        let mine = input::<T>(me, chunk_range(len, world, me).len(), seed + 2);
        let mut gathered = vec![T::from_f32(0.0); len];
        comm.all_gather(&mine, &mut gathered).expect("all_gather");
        digest.add(&gathered);
        let mut buf = input::<T>(me, len, seed + 3);
        comm.broadcast(&mut buf, Rank((world - 1) as u32))
            .expect("broadcast");
        digest.add(&buf);
        comm.barrier().expect("barrier");
    }
    // Point to point around the ring.
    if world > 1 {
        let values = input::<T>(me, 777, 9);
        let mut got = vec![T::from_f32(0.0); 777];
        let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
        if me % 2 == 0 {
            comm.send(&values, Rank(next as u32)).expect("send");
            comm.recv(&mut got, Rank(prev as u32)).expect("recv");
        } else {
            comm.recv(&mut got, Rank(prev as u32)).expect("recv");
            comm.send(&values, Rank(next as u32)).expect("send");
        }
        digest.add(&got);
    }
}

/// The scenario every rank runs, in both transports: a digest per algorithm.
fn every_collective(comm: &mut Communicator) -> Vec<(u64, usize)> {
    [Algorithm::Ring, Algorithm::Tree]
        .into_iter()
        .map(|algorithm| {
            comm.set_algorithm(algorithm);
            let mut digest = Digest::default();
            collectives_of::<f32>(comm, &mut digest);
            collectives_of::<f16>(comm, &mut digest);
            collectives_of::<bf16>(comm, &mut digest);
            (digest.0, digest.1)
        })
        .collect()
}

/// The child: forms its rank of the group, runs `scenario`, prints result lines.
fn child(scenario: &str) {
    let rank: u32 = env(RANK).parse().expect("a rank");
    let token = JobToken::from_bytes([env(TOKEN).parse().expect("a token byte"); 32]);
    // "kill" gets a long time-out too: its survivors must learn of the death from the closed
    // connection, and a 4 MiB all-reduce across loaded debug processes may take seconds.
    let timeout = if scenario == "silent" {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(30)
    };
    let config = TcpConfig {
        comm: CommConfig::default().with_timeout(timeout),
        ..TcpConfig::default()
    };
    let link = config.link.with_handshake_timeout(Duration::from_secs(3));
    let config = config.with_link(link);
    let listener =
        LinkListener::bind("127.0.0.1:0", Rank(rank), token, config.link).expect("a port");
    let addrs = announce_and_wait_for_peers(listener.local_addr().expect("an address"))
        .expect("the peers' addresses");
    let group = match TcpGroup::connect(&listener, &addrs, Generation(0), config) {
        Ok(group) => group,
        Err(e) => {
            let tag = match e {
                TcpGroupError::Missing { missing, .. } => format!("missing {missing:?}"),
                TcpGroupError::Connect { peer, .. } => format!("refused by {}", peer.0),
                other => format!("other {other}"),
            };
            println!("{RESULT}{tag}");
            return;
        }
    };
    let mut comm = group.into_communicator();
    match scenario {
        "collectives" => {
            let digests = every_collective(&mut comm);
            println!("{RESULT}{}", serde_json::to_string(&digests).unwrap());
            comm.barrier().expect("the closing barrier");
        }
        "kill" => {
            // Large all-reduces until a peer dies; report the error.
            let mut buf = vec![1.0f32; 1 << 20];
            for iteration in 0.. {
                if let Err(e) = comm.all_reduce(&mut buf, ReduceOp::Sum) {
                    println!("{RESULT}{}", serde_json::to_string(&e).unwrap());
                    return;
                }
                println!("iteration {iteration}");
            }
        }
        "silent" => {
            if rank == 2 {
                // Silent, links open, until the test ends and kills it.
                std::thread::sleep(Duration::from_secs(120));
                return;
            }
            let mut buf = vec![1.0f32; 1000];
            let e = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
            println!("{RESULT}{}", serde_json::to_string(&e).unwrap());
        }
        other => panic!("unknown scenario {other}"),
    }
}

#[test]
fn child_process_entry_point() {
    if let Ok(scenario) = std::env::var(SCENARIO) {
        child(&scenario);
    }
}

/// The rank an error blames: the missing rank of a time-out, the peer of a link failure,
/// through a poisoned op's cause.
fn blamed(error: &CommError) -> Vec<Rank> {
    match error {
        CommError::Timeout { missing, .. } => missing.clone(),
        CommError::Link { peer, .. } => vec![*peer],
        CommError::Poisoned { cause, .. } => blamed(cause),
        _ => Vec::new(),
    }
}

#[test]
fn every_collective_across_processes_equals_the_in_process_transport() {
    for world in [2usize, 3] {
        let mut group = start("collectives", &vec![7; world]);
        let tcp: Vec<Vec<(u64, usize)>> = (0..world)
            .map(|r| {
                let line = group
                    .next_tagged(r, RESULT, Duration::from_secs(120))
                    .expect("a result");
                serde_json::from_str(&line).expect("digests")
            })
            .collect();
        let statuses = group.wait_all(Duration::from_secs(30));
        assert!(
            statuses.iter().all(|s| s.is_some_and(|s| s.success())),
            "{statuses:?}"
        );

        let local = LocalGroup::new(world, Generation(0), CommConfig::default());
        let reference: Vec<Vec<(u64, usize)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = local
                .communicators()
                .into_iter()
                .map(|mut comm| scope.spawn(move || every_collective(&mut comm)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(tcp, reference, "world {world}");
    }
}

#[test]
fn tcp_5_a_rank_killed_mid_all_reduce_is_a_typed_error_naming_it_on_every_survivor() {
    let mut group = start("kill", &[7, 7, 7]);
    for r in 0..3 {
        for _ in 0..3 {
            group
                .next_tagged(r, "iteration ", Duration::from_secs(30))
                .expect("the ranks all-reduce");
        }
    }
    let killed_at = Instant::now();
    group.kill(1);
    for r in [0, 2] {
        let line = group
            .next_tagged(r, RESULT, Duration::from_secs(60))
            .expect("a survivor reports an error, it does not hang");
        let error: CommError = serde_json::from_str(&line).expect("a CommError");
        assert_eq!(blamed(&error), vec![Rank(1)], "rank {r}: {error}");
    }
    // Well inside the 30 s time-out: the survivors saw the connection end.
    assert!(
        killed_at.elapsed() < Duration::from_secs(15),
        "{:?}",
        killed_at.elapsed()
    );
}

#[test]
fn comm_3_a_silent_rank_process_times_out_naming_it() {
    let mut group = start("silent", &[7, 7, 7]);
    let started = Instant::now();
    for r in [0, 1] {
        let line = group
            .next_tagged(r, RESULT, Duration::from_secs(30))
            .expect("a time-out");
        let error: CommError = serde_json::from_str(&line).expect("a CommError");
        assert_eq!(blamed(&error), vec![Rank(2)], "rank {r}: {error}");
    }
    // The 2 s time-out and the group's forming, with slack for loaded machines; rank 2 stays
    // silent far longer.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn tcp_1_a_rank_process_with_the_wrong_token_never_joins() {
    let mut group = start("collectives", &[7, 8]);
    let zero = group
        .next_tagged(0, RESULT, Duration::from_secs(20))
        .unwrap();
    let one = group
        .next_tagged(1, RESULT, Duration::from_secs(20))
        .unwrap();
    assert_eq!(zero, "missing [Rank(1)]");
    assert_eq!(one, "refused by 0");
}
