//! The control plane across real processes: `meshwork train --listen 127.0.0.1:0 --nodes N`
//! as the head and `meshwork node --join …` as nodes, all on this machine. Every child is
//! killed when its handle drops, also when a test fails; every wait is bounded.
#![cfg(feature = "cluster")]

use crate::cluster_procs;

use std::time::{Duration, Instant};

use cluster_procs::{Proc, SECRET, head, node};
use meshwork::cluster::control::protocol::CONTROL_PROTOCOL_VERSION as VERSION;

#[test]
fn three_nodes_join_and_every_one_acknowledges_prepare() {
    let (mut head, addr) = head("three", 3, 60, &[]);
    let mut nodes = [
        node("node-a", &addr, "three", &["--devices", "2"], SECRET),
        node("node-b", &addr, "three", &[], SECRET),
        node("node-c", &addr, "three", &[], SECRET),
    ];
    let (status, _) = head.wait_exit(Duration::from_secs(90));
    let out = head.output();
    assert!(status.success(), "head failed:\n{out}");
    assert!(
        out.contains(
            "world assembled: 4 rank(s) over 4 process(es); token distributed; every node acknowledged Prepare"
        ),
        "{out}"
    );
    // CTL-4: ranks 0..4, each once, the two-device node's ranks consecutive.
    let ranks: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("rank "))
        .collect();
    assert_eq!(ranks.len(), 4, "{out}");
    for (r, line) in ranks.iter().enumerate() {
        assert!(
            line.trim_start().starts_with(&format!("rank {r}:")),
            "{out}"
        );
    }
    let a_ranks: Vec<&&str> = ranks.iter().filter(|l| l.contains("(node-a)")).collect();
    assert_eq!(a_ranks.len(), 2, "{out}");
    assert_eq!(out.matches("heartbeat: ").count(), 3, "{out}");
    assert_eq!(out.matches(" Prepared").count(), 3, "{out}");
    for n in &mut nodes {
        let (status, _) = n.wait_exit(Duration::from_secs(30));
        let nout = n.output();
        assert!(status.success(), "{} failed:\n{nout}", n.name);
        assert!(nout.contains(": prepared: process "), "{nout}");
        assert!(nout.contains("stopped by the head: dry run over"), "{nout}");
    }
    assert!(nodes[0].output().contains("of 4"), "{}", nodes[0].output());
}

#[test]
fn ctl_8_node_with_a_wrong_secret_is_refused() {
    let (mut head, addr) = head("secret", 1, 6, &[]);
    let mut intruder = node("intruder", &addr, "secret", &[], "another-secret");
    let (status, took) = intruder.wait_exit(Duration::from_secs(30));
    let out = intruder.output();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("closed the connection before authentication"),
        "{out}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");
    let (status, _) = head.wait_exit(Duration::from_secs(30));
    let out = head.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("only 0 of 1 node(s) joined"), "{out}");
    assert!(out.contains("failed authentication"), "{out}");
}

#[test]
fn ctl_8_missing_secret_is_a_clear_error() {
    let mut lone = Proc::spawn(
        "no-secret",
        &["node", "--join", "127.0.0.1:9", "--join-timeout", "5"],
        None,
    );
    let (status, _) = lone.wait_exit(Duration::from_secs(30));
    let out = lone.output();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("no cluster secret: set MESHWORK_SECRET or MESHWORK_SECRET_FILE"),
        "{out}"
    );
}

#[test]
fn ctl_6_mismatched_version_and_fingerprint_are_refused_on_both_sides() {
    let (mut head, addr) = head("mismatch", 2, 10, &[]);
    let mut future = node(
        "future",
        &addr,
        "mismatch",
        &["--pretend-protocol-version", "999"],
        SECRET,
    );
    let mut other = node(
        "other-model",
        &addr,
        "mismatch",
        &["--pretend-model-variant", "wider"],
        SECRET,
    );
    let mut good = node("good", &addr, "mismatch", &[], SECRET);
    let (status, _) = future.wait_exit(Duration::from_secs(30));
    let out = future.output();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("this node refused the head")
            && out.contains(&format!(
                "protocol version mismatch: head speaks {VERSION}, node speaks 999"
            )),
        "{out}"
    );
    let (status, _) = other.wait_exit(Duration::from_secs(30));
    let out = other.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("model fingerprint mismatch"), "{out}");
    let (status, _) = head.wait_exit(Duration::from_secs(40));
    let out = head.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("only 1 of 2 node(s) joined"), "{out}");
    assert!(
        out.contains(&format!(
            "protocol version mismatch: head speaks {VERSION}, node speaks 999"
        )),
        "{out}"
    );
    assert!(out.contains("model fingerprint mismatch"), "{out}");
    // The node that did join is released, not left waiting.
    let (status, _) = good.wait_exit(Duration::from_secs(30));
    let gout = good.output();
    assert!(status.success(), "{gout}");
    assert!(
        gout.contains("stopped by the head: the head gave up"),
        "{gout}"
    );
}

#[test]
fn ctl_7_too_few_nodes_fail_within_the_join_timeout_naming_how_many_came() {
    // 15 s: time enough for both nodes to start and join while other tests load the machine.
    let (mut head, addr) = head("few", 3, 15, &[]);
    let started = Instant::now();
    let _a = node("few-a", &addr, "few", &[], SECRET);
    let _b = node("few-b", &addr, "few", &[], SECRET);
    let (status, _) = head.wait_exit(Duration::from_secs(60));
    let took = started.elapsed();
    let out = head.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("only 2 of 3 node(s) joined within"), "{out}");
    assert!(out.contains("few-a") && out.contains("few-b"), "{out}");
    assert!(took < Duration::from_secs(15 + 20), "took {took:?}");
}

#[test]
fn ctl_7_node_stops_when_its_head_dies() {
    let (head, addr) = head("dies", 2, 60, &[]);
    let mut n = node("orphan", &addr, "dies", &["--head-timeout", "5"], SECRET);
    n.wait_line("joined, head", Duration::from_secs(30));
    let killed = Instant::now();
    drop(head); // SIGKILL
    let (status, _) = n.wait_exit(Duration::from_secs(30));
    let took = killed.elapsed();
    let out = n.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("lost the head at"), "{out}");
    assert!(took < Duration::from_secs(5 + 5), "took {took:?}");
}

#[test]
fn ctl_7_node_stops_when_its_head_is_silent() {
    let (head, addr) = head("silent", 2, 60, &[]);
    let mut n = node("waiting", &addr, "silent", &["--head-timeout", "3"], SECRET);
    n.wait_line("joined, head", Duration::from_secs(30));
    head.signal("-STOP");
    let stopped = Instant::now();
    let (status, _) = n.wait_exit(Duration::from_secs(30));
    let took = stopped.elapsed();
    let out = n.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("no heartbeat for 3s"), "{out}");
    // The 3 s time-out plus slack for a loaded machine (the wait above bounds it at 30 s).
    assert!(took < Duration::from_secs(3 + 12), "took {took:?}");
}

/// The library's head, in this process, with a node process: `Head::keep_alive` keeps a
/// prepared node past several of its head time-outs, and reports the node once it is killed.
#[test]
fn keep_alive_holds_prepared_nodes_and_reports_a_killed_one() {
    use meshwork::cluster::control::{ClusterSecret, Head, HeadConfig, JobSpec};
    use meshwork::device::{BackendKind, MeshDevice};

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut config =
            HeadConfig::new("127.0.0.1:0", "kept", ClusterSecret::new(SECRET).unwrap());
        // Heartbeats every 300 ms against a 5 s node time-out and a 5 s answer bound: a
        // loaded machine delaying a few of them neither makes the node leave nor the head
        // count it lost.
        config.heartbeat_interval = Duration::from_millis(300);
        config.rpc_timeout = Duration::from_secs(5);
        let mut head = Head::start(config).await.unwrap();
        let addr = head.local_addr().to_string();
        let mut n = node("kept-node", &addr, "kept", &["--head-timeout", "5"], SECRET);
        let spec = JobSpec::new(
            meshwork::demo::mlp_spec(&[32, 128, 128, 4]),
            meshwork::job_config::JobConfig {
                batch_size: Some(256),
                steps: 300,
                learning_rate: 3e-3,
                ..Default::default()
            },
            BackendKind::Flex,
        );
        let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap();
        let fingerprint = {
            // It draws the model (unseeded): not in the middle of another test's draw.
            let _draw = meshwork::testing::draw_lock();
            meshwork::demo::cluster_fingerprint(&spec, device[0].burn()).unwrap()
        };
        let assembled = tokio::time::timeout(
            Duration::from_secs(60),
            head.assemble(1, &spec, fingerprint, Vec::new(), Duration::from_secs(60)),
        )
        .await
        .expect("assembled in time")
        .unwrap_or_else(|e| panic!("{e}\n{}", n.output()));
        assert_eq!(assembled.world.size(), 1);
        assert!(assembled.head_plan().ranks.is_empty());
        assert_eq!(head.nodes()[0].info.name, "kept-node");
        let mut keep = head.keep_alive();
        // Three of the node's head time-outs: it is still there.
        tokio::time::sleep(Duration::from_secs(15)).await;
        assert!(
            n.child.try_wait().unwrap().is_none(),
            "the node left:\n{}",
            n.output()
        );
        assert!(n.output().contains("prepared: process 1, ranks [0] of 1"));
        n.child.kill().unwrap();
        let (name, _) = tokio::time::timeout(Duration::from_secs(30), keep.next_lost())
            .await
            .expect("the lost node is reported within the RPC time-out")
            .expect("one node lost");
        assert_eq!(name, "kept-node");
        drop(keep);
        let byes = head.shutdown("test over").await;
        assert!(byes[0].1.is_err(), "a killed node says no Bye");
    });
}

/// A test-only certificate or key of `tests/fixtures/tls` (made by its `make.sh`).
fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn ctl_10_over_tls_nodes_that_trust_the_head_train_and_the_others_are_refused() {
    let (cert, key, ca, other_ca) = (
        fixture("head.pem"),
        fixture("head.key"),
        fixture("ca.pem"),
        fixture("other-ca.pem"),
    );
    let (mut head, addr) = cluster_procs::training_head(
        "tls",
        2,
        60,
        &["--steps", "3", "--tls-cert", &cert, "--tls-key", &key],
    );
    // A node that trusts another authority refuses the head's certificate at once.
    let mut wary = node("wary", &addr, "tls", &["--tls-ca", &other_ca], SECRET);
    let (status, took) = wary.wait_exit(Duration::from_secs(30));
    let out = wary.output();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("TLS: the TLS handshake with the head"),
        "{out}"
    );
    assert!(out.contains("UnknownIssuer"), "{out}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    // A node without TLS never gets past the head's handshake (closed within its time-out).
    let mut plain = node("plain", &addr, "tls", &[], SECRET);
    let (status, _) = plain.wait_exit(Duration::from_secs(30));
    let out = plain.output();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("closed the connection before authentication"),
        "{out}"
    );
    // Nodes that trust the head's authority join (by IP address, and by the name
    // `localhost` the certificate also carries) and train over the encrypted control plane.
    let mut nodes = [
        node("node-a", &addr, "tls", &["--tls-ca", &ca], SECRET),
        node(
            "node-b",
            &addr,
            "tls",
            &["--tls-ca", &ca, "--tls-server-name", "localhost"],
            SECRET,
        ),
    ];
    let (status, _) = head.wait_exit(Duration::from_secs(90));
    let out = head.output();
    assert!(status.success(), "head failed:\n{out}");
    assert!(out.contains("control plane: TLS, certificate"), "{out}");
    assert!(out.contains("closed the control connection from"), "{out}");
    for n in &mut nodes {
        let (status, _) = n.wait_exit(Duration::from_secs(30));
        let nout = n.output();
        assert!(status.success(), "{} failed:\n{nout}", n.name);
        assert!(nout.contains("trained 3 step(s)"), "{nout}");
    }
}

/// A flag the job spec cannot carry to the nodes is an error naming it, before the head waits
/// for a single node (the join time-out is long; the head answers at once).
#[test]
fn a_flag_nodes_cannot_apply_is_refused_before_anyone_joins() {
    let not_yet = |flag: &str| format!("{flag} is not supported across processes yet");
    let dir = meshwork::testing::TempDir::new("refused-flags");
    std::fs::create_dir_all(dir.path()).unwrap();
    let plan = dir.join("drop.json");
    std::fs::write(
        &plan,
        r#"{ "seed": 1, "faults": [{ "device": 0, "step": 1, "kind": "drop_message" }] }"#,
    )
    .unwrap();
    let plan = plan.display().to_string();
    for (extra, expected) in [
        // A fault plan crosses to the nodes, but its message faults cannot act on TCP links.
        (
            &["--faults", plan.as_str()][..],
            "a TCP data plane's messages do not pass the fault hooks".to_string(),
        ),
        (&["--timeline", "t.svg"][..], not_yet("--timeline")),
        (&["--dp", "2"][..], not_yet("--dp")),
        // A combination the one table refuses, named by its row.
        (
            &["--precision", "f16", "--compression", "topk:0.1"][..],
            "a step skipped by the loss scaler would leave an overflow in the residual".to_string(),
        ),
        // A combination that depends on values: a row of the same table.
        (
            &["--zero", "2", "--compression", "topk:0.1"][..],
            "top-k and PowerSGD compress an all-reduce, and ZeRO-2 reduce-scatters".to_string(),
        ),
    ] {
        let mut args = vec![
            "train",
            "--listen",
            "127.0.0.1:0",
            "--nodes",
            "1",
            "--join-timeout",
            "300",
        ];
        args.extend_from_slice(extra);
        let mut head = Proc::spawn("head", &args, Some(SECRET));
        let (status, _) = head.wait_exit(Duration::from_secs(60));
        let out = head.output();
        assert!(!status.success(), "{extra:?}: {out}");
        assert!(out.contains(&expected), "{extra:?}: {out}");
        assert!(
            !out.contains("listening on"),
            "refused before listening: {out}"
        );
    }
}

/// `--collective-timeout` must be below `--step-timeout`: refused up front, naming both.
#[test]
fn a_collective_timeout_not_below_the_step_timeout_is_refused() {
    let mut head = Proc::spawn(
        "head",
        &[
            "train",
            "--listen",
            "127.0.0.1:0",
            "--nodes",
            "1",
            "--collective-timeout",
            "30",
            "--step-timeout",
            "30",
        ],
        Some(SECRET),
    );
    let (status, _) = head.wait_exit(Duration::from_secs(30));
    let out = head.output();
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("--collective-timeout 30 is not below --step-timeout 30"),
        "{out}"
    );
}
