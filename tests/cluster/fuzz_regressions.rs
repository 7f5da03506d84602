//! Replays the fuzzers' committed inputs (the seed corpus in `fuzz/corpus/<target>/` and any
//! crash in `fuzz/artifacts/<target>/`) through the decoder each target fuzzes, so CI checks
//! them without a fuzzing toolchain. FRAME-5 and CTL-2: no input panics.
#![cfg(feature = "cluster")]

use std::fs;
use std::path::{Path, PathBuf};

use meshwork::cluster::control::protocol::{self as control, ControlMsg};
use meshwork::comm::net::frame::{self, FrameKind, HEADER_LEN, exercise_decoder};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Every file in `fuzz/<kind>/<target>/`.
fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(fuzz_dir().join(kind).join(target)) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|f| f.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `exercise` on every committed input of `target`; the seed corpus must hold at least
/// `min_seeds` files.
fn replay(target: &str, min_seeds: usize, exercise: fn(&[u8])) {
    let corpus = inputs("corpus", target);
    assert!(
        corpus.len() >= min_seeds,
        "the {target} seed corpus is missing: {} files",
        corpus.len()
    );
    for path in corpus.iter().chain(&inputs("artifacts", target)) {
        let data = fs::read(path).unwrap();
        let outcome = std::panic::catch_unwind(|| exercise(&data));
        assert!(outcome.is_ok(), "{} panicked the decoder", path.display());
    }
}

#[test]
fn frame_5_committed_fuzz_inputs_never_panic() {
    replay("frame_decoder", 8, exercise_decoder);
}

#[test]
fn ctl_2_committed_control_fuzz_inputs_never_panic() {
    replay("control_decoder", 8, control::exercise_decoder);
}

/// Rewrites the control decoder's seed corpus: one valid message of each kind, truncated,
/// corrupted, oversized and other-version ones.
/// `cargo test --features cluster --test cluster -- --ignored write_control_seed_corpus`.
#[test]
#[ignore = "writes fuzz/corpus/control_decoder; run by hand when the protocol changes"]
fn write_control_seed_corpus() {
    use control::{
        CONTROL_HEADER_LEN, Hello, Incompatibility, JobSpec, ModelFingerprint, ModelSpec, NodeInfo,
        NodePhase,
    };
    let dir = fuzz_dir().join("corpus").join("control_decoder");
    fs::create_dir_all(&dir).unwrap();
    let spec = JobSpec::new(
        meshwork::demo::mlp_spec(&[32, 128, 128, 4]),
        meshwork::job_config::JobConfig {
            seed: 1,
            batch_size: Some(256),
            steps: 10,
            learning_rate: 3e-3,
            ..Default::default()
        },
        meshwork::device::BackendKind::Flex,
    );
    let messages = [
        (
            "hello",
            ControlMsg::Hello(Hello {
                job: "demo".into(),
                head: "head-host-1".into(),
                spec: spec.clone(),
                fingerprint: ModelFingerprint(0x1234_5678_9abc_def0),
            }),
        ),
        (
            "welcome",
            ControlMsg::Welcome(NodeInfo {
                name: "host-2".into(),
                devices: 2,
                data_addrs: vec![
                    "127.0.0.1:4000".parse().unwrap(),
                    "[::1]:4001".parse().unwrap(),
                ],
                requested: Some(meshwork::cluster::control::ProcessIndex(1)),
                fingerprint: ModelFingerprint(7),
            }),
        ),
        (
            "refused_version",
            ControlMsg::Refused(Incompatibility::ProtocolVersion { head: 1, node: 2 }),
        ),
        (
            "refused_fingerprint",
            ControlMsg::Refused(Incompatibility::Fingerprint {
                head: ModelFingerprint(1),
                node: ModelFingerprint(2),
            }),
        ),
        (
            "prepared",
            ControlMsg::Prepared {
                ranks: vec![meshwork::mesh::Rank(1), meshwork::mesh::Rank(2)],
            },
        ),
        ("heartbeat", ControlMsg::Heartbeat { seq: 42 }),
        (
            "alive",
            ControlMsg::Alive {
                seq: 42,
                phase: NodePhase::Prepared,
                step: Some(3),
            },
        ),
        (
            "shutdown",
            ControlMsg::Shutdown {
                reason: "dry run over".into(),
            },
        ),
        ("bye", ControlMsg::Bye),
        (
            "hello_named_model",
            ControlMsg::Hello(Hello {
                job: "j".into(),
                head: "h".into(),
                spec: JobSpec {
                    model: ModelSpec {
                        kind: "transformer".into(),
                        config: vec![0, 1, 2, 3],
                    },
                    ..spec.clone()
                },
                fingerprint: ModelFingerprint(0),
            }),
        ),
    ];
    let world = {
        use meshwork::cluster::control::world::{ProcessSlot, assign_ranks};
        let slot = |name: &str, ports: &[u16]| ProcessSlot {
            name: name.into(),
            requested: None,
            data_addrs: ports
                .iter()
                .map(|p| format!("127.0.0.1:{p}").parse().unwrap())
                .collect(),
        };
        assign_ranks(
            &slot("head", &[]),
            &[slot("a", &[5000, 5001]), slot("b", &[5002])],
        )
        .unwrap()
    };
    let prepare = ControlMsg::Prepare(meshwork::cluster::control::protocol::Prepare {
        token: [0xab; 32],
        world,
        process: meshwork::cluster::control::ProcessIndex(2),
    });
    let stages = {
        use meshwork::cluster::control::{PipelineListeners, StageAnswer, StageOp, StageRequest};
        let request = |op| {
            ControlMsg::Stage(StageRequest {
                slot: meshwork::mesh::Rank(3),
                timeout_ms: 20_000,
                op,
            })
        };
        [
            (
                "hello_pipeline",
                ControlMsg::Hello(Hello {
                    job: "pp".into(),
                    head: "h".into(),
                    spec: {
                        let mut spec = spec.clone();
                        spec.job.pipeline = Some(meshwork::job_config::PipelineConfig {
                            stages: 2,
                            schedule: meshwork::job::Schedule::Interleaved {
                                micro_batches: 4,
                                virtual_stages: 2,
                            },
                        });
                        spec
                    },
                    fingerprint: ModelFingerprint(9),
                }),
            ),
            (
                "stage_start_alone",
                request(StageOp::Start {
                    id: meshwork::error::StageId {
                        replica: 2,
                        stage: 0,
                        tp: 0,
                    },
                    alone: true,
                    server: Some(29_600),
                }),
            ),
            (
                "stage_wire",
                request(StageOp::Wire {
                    generation: meshwork::mesh::Generation(1),
                    dp: vec!["127.0.0.1:5000".parse().unwrap()],
                    links: vec![
                        "127.0.0.1:6000".parse().unwrap(),
                        "[::1]:6001".parse().unwrap(),
                    ],
                    tp: vec!["127.0.0.1:6100".parse().unwrap()],
                    model: vec![
                        "127.0.0.1:6200".parse().unwrap(),
                        "[::1]:6201".parse().unwrap(),
                    ],
                }),
            ),
            ("stage_model_snapshot", request(StageOp::ModelSnapshot)),
            (
                "stage_restore_part",
                request(StageOp::RestorePart {
                    transfer: 9,
                    part: 1,
                    parts: 3,
                    bytes: vec![7; 64],
                }),
            ),
            (
                "stage_done_parts",
                ControlMsg::StageDone(StageAnswer::SnapshotParts {
                    transfer: 3,
                    parts: 7,
                }),
            ),
            (
                "stage_done_listening",
                ControlMsg::StageDone(StageAnswer::Listening(PipelineListeners {
                    links: "10.0.0.2:7000".parse().unwrap(),
                    tp: "10.0.0.2:7001".parse().unwrap(),
                    model: "[::1]:7002".parse().unwrap(),
                })),
            ),
        ]
    };
    let mut seeds: Vec<(String, Vec<u8>)> = messages
        .iter()
        .chain(&stages)
        .map(|(name, m)| (name.to_string(), control::encode(m).unwrap()))
        .collect();
    seeds.push(("prepare".into(), control::encode(&prepare).unwrap()));
    let hello = seeds[0].1.clone();
    seeds.push(("bare_body".into(), hello[CONTROL_HEADER_LEN..].to_vec()));
    seeds.push(("truncated_header".into(), hello[..6].to_vec()));
    seeds.push(("truncated_body".into(), hello[..hello.len() - 3].to_vec()));
    let mut trailing = hello.clone();
    trailing.extend_from_slice(b"xyz");
    seeds.push(("trailing".into(), trailing));
    let mut magic = hello.clone();
    magic[1] ^= 0x20;
    seeds.push(("bad_magic".into(), magic));
    seeds.push((
        "other_version".into(),
        control::encode_as(&ControlMsg::Bye, 2, control::MAX_CONTROL_MESSAGE).unwrap(),
    ));
    let mut declared = hello.clone();
    declared[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
    seeds.push(("declared_too_large".into(), declared));
    let mut variant = hello.clone();
    variant[CONTROL_HEADER_LEN] = 0x7f;
    seeds.push(("unknown_variant".into(), variant));
    // A Shutdown whose reason declares 2^60 bytes.
    let mut huge = control::encode(&ControlMsg::Shutdown {
        reason: String::new(),
    })
    .unwrap();
    huge.pop();
    huge.push(0xfd);
    huge.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let body = (huge.len() - CONTROL_HEADER_LEN) as u32;
    huge[6..10].copy_from_slice(&body.to_le_bytes());
    seeds.push(("huge_string_length".into(), huge));
    for (name, bytes) in seeds {
        fs::write(dir.join(name), bytes).unwrap();
    }
}

/// Rewrites the seed corpus: valid frames of each kind, truncated and corrupted ones.
/// `cargo test --features cluster --test cluster -- --ignored write_seed_corpus`.
#[test]
#[ignore = "writes fuzz/corpus/frame_decoder; run by hand when the format changes"]
fn write_seed_corpus() {
    let dir = fuzz_dir().join("corpus").join("frame_decoder");
    fs::create_dir_all(&dir).unwrap();
    let data: Vec<u8> = (0..64u8).collect();
    let mut f32s = Vec::new();
    frame::put_f32s(&[1.0, -2.5, f32::NAN, 0.0], &mut f32s);
    let mut seeds: Vec<(String, Vec<u8>)> = vec![
        ("hello".into(), frame::encode(FrameKind::Hello, 0, &[7; 36])),
        ("ack".into(), frame::encode(FrameKind::Ack, 0, &[0; 4])),
        ("data".into(), frame::encode(FrameKind::Data, 1, &data)),
        ("data_f32".into(), frame::encode(FrameKind::Data, 2, &f32s)),
        ("empty".into(), frame::encode(FrameKind::Data, 3, &[])),
        ("close".into(), frame::encode(FrameKind::Close, 9, &[])),
    ];
    let two: Vec<u8> = [
        frame::encode(FrameKind::Data, 1, b"first"),
        frame::encode(FrameKind::Data, 2, b"second"),
    ]
    .concat();
    seeds.push(("two_frames".into(), two));
    let valid = frame::encode(FrameKind::Data, 1, &data);
    seeds.push(("truncated_header".into(), valid[..HEADER_LEN / 2].to_vec()));
    seeds.push((
        "truncated_payload".into(),
        valid[..HEADER_LEN + 10].to_vec(),
    ));
    for (name, at) in [
        ("bad_magic", 0),
        ("bad_version", 4),
        ("bad_kind", 6),
        ("bad_length", 16),
        ("bad_header_crc", HEADER_LEN - 1),
        ("bad_payload", HEADER_LEN + 5),
    ] {
        let mut bytes = valid.clone();
        bytes[at] ^= 0x40;
        seeds.push((name.into(), bytes));
    }
    let mut oversize = frame::encode_header(FrameKind::Data, 1, &[]);
    oversize[15..23].copy_from_slice(&u64::MAX.to_le_bytes());
    seeds.push(("oversize_declared".into(), oversize.to_vec()));
    for (name, bytes) in seeds {
        fs::write(dir.join(name), bytes).unwrap();
    }
}
