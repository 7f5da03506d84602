use proptest::prelude::*;

use super::*;
use crate::cluster::control::world::{ProcessSlot, assign_ranks};

/// One of each message, with realistic contents.
pub(crate) fn samples() -> Vec<ControlMsg> {
    let spec = JobSpec::new(
        crate::demo::mlp_spec(&[32, 128, 128, 4]),
        crate::job_config::JobConfig {
            seed: 7,
            batch_size: Some(256),
            steps: 300,
            learning_rate: 3e-3,
            ..Default::default()
        },
        crate::device::BackendKind::Flex,
    );
    let addr = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let world = assign_ranks(
        &ProcessSlot {
            name: "head".into(),
            requested: None,
            data_addrs: vec![addr(4000)],
        },
        &[ProcessSlot {
            name: "node-a".into(),
            requested: Some(ProcessIndex(1)),
            data_addrs: vec![addr(4001), addr(4002)],
        }],
    )
    .unwrap();
    vec![
        ControlMsg::Hello(Hello {
            job: "demo".into(),
            head: "head-1".into(),
            spec: spec.clone(),
            fingerprint: ModelFingerprint(0xfeed),
        }),
        ControlMsg::Welcome(NodeInfo {
            name: "node-a".into(),
            devices: 2,
            data_addrs: vec![addr(4001), "[::1]:4002".parse().unwrap()],
            requested: Some(ProcessIndex(1)),
            fingerprint: ModelFingerprint(0xfeed),
        }),
        ControlMsg::Refused(Incompatibility::Fingerprint {
            head: ModelFingerprint(1),
            node: ModelFingerprint(2),
        }),
        ControlMsg::Refused(Incompatibility::ProtocolVersion { head: 1, node: 9 }),
        ControlMsg::Prepare(Prepare {
            token: [9; 32],
            world,
            process: ProcessIndex(1),
        }),
        ControlMsg::Prepared {
            ranks: vec![Rank(1), Rank(2)],
        },
        ControlMsg::Heartbeat { seq: 3 },
        ControlMsg::Alive {
            seq: 3,
            phase: NodePhase::Prepared,
            step: None,
        },
        ControlMsg::Shutdown {
            reason: "dry run".into(),
        },
        ControlMsg::Bye,
        ControlMsg::Hello(Hello {
            job: "named".into(),
            head: "h".into(),
            spec: JobSpec {
                model: ModelSpec {
                    kind: "transformer".into(),
                    config: vec![1, 2, 3],
                },
                // Every field of the description set, the fault plan's tagged kinds included.
                job: crate::job_config::tests::everything(),
                ..spec
            },
            fingerprint: ModelFingerprint(u64::MAX),
        }),
    ]
}

#[test]
fn every_message_round_trips() {
    for msg in samples() {
        let bytes = encode(&msg).unwrap();
        assert_eq!(&bytes[..4], b"MWCT");
        assert_eq!(decode(&bytes).unwrap(), msg);
        exercise_decoder(&bytes);
    }
}

#[test]
fn ctl_1_oversized_message_is_refused_before_sending() {
    let huge = ControlMsg::Shutdown {
        reason: "x".repeat(MAX_CONTROL_MESSAGE),
    };
    assert!(matches!(
        encode(&huge),
        Err(CodecError::TooLarge {
            kind: "Shutdown",
            max: MAX_CONTROL_MESSAGE,
            ..
        })
    ));
    let small = ControlMsg::Shutdown {
        reason: "x".repeat(100),
    };
    assert!(matches!(
        encode_as(&small, CONTROL_PROTOCOL_VERSION, 64),
        Err(CodecError::TooLarge { max: 64, .. })
    ));
}

#[test]
fn ctl_2_bad_headers_are_typed_errors() {
    let good = encode(&ControlMsg::Heartbeat { seq: 1 }).unwrap();
    assert!(matches!(
        decode(&good[..5]),
        Err(CodecError::Truncated {
            expected: CONTROL_HEADER_LEN,
            got: 5
        })
    ));
    let mut magic = good.clone();
    magic[0] = b'X';
    assert!(matches!(decode(&magic), Err(CodecError::BadMagic { .. })));
    assert!(matches!(
        decode(&good[..good.len() - 1]),
        Err(CodecError::Truncated { .. })
    ));
    let mut trailing = good.clone();
    trailing.push(0);
    assert_eq!(
        decode(&trailing),
        Err(CodecError::TrailingBytes { extra: 1 })
    );
    let mut declared = good.clone();
    declared[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode(&declared),
        Err(CodecError::DeclaredTooLarge {
            declared: 0xffff_ffff,
            ..
        })
    ));
    let mut kind = good;
    kind[CONTROL_HEADER_LEN] = 200;
    assert!(matches!(decode(&kind), Err(CodecError::Malformed { .. })));
}

#[test]
fn ctl_2_a_huge_declared_length_inside_the_body_fails_without_allocating_it() {
    // Shutdown's reason declares 2^60 bytes (bincode varint: 0xfd then a u64).
    let mut body = bincode::serde::encode_to_vec(
        ControlMsg::Shutdown { reason: "".into() },
        bincode::config::standard(),
    )
    .unwrap();
    body.pop(); // the empty string's length byte
    body.push(0xfd);
    body.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let mut bytes = CONTROL_MAGIC.to_vec();
    bytes.extend_from_slice(&CONTROL_PROTOCOL_VERSION.to_le_bytes());
    bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&body);
    // Would abort the process (allocation failure) if the length were trusted.
    assert!(matches!(decode(&bytes), Err(CodecError::Malformed { .. })));
    assert!(matches!(
        decode_body(&body),
        Err(CodecError::Malformed { .. })
    ));
}

/// A job spec whose ZeRO stage does not exist does not decode: no node trains a stage it was
/// not asked for (the stage is an enum on the wire; its index is the byte after the
/// optimizer's section, found here by encoding the spec at two stages).
#[test]
fn a_spec_with_an_unknown_zero_stage_is_malformed() {
    let hello = |zero| {
        let mut job = crate::job_config::JobConfig::default();
        job.reduction.zero = zero;
        encode(&ControlMsg::Hello(Hello {
            job: "j".into(),
            head: "h".into(),
            spec: JobSpec::new(
                crate::demo::mlp_spec(&[2, 2]),
                job,
                crate::device::BackendKind::Flex,
            ),
            fingerprint: ModelFingerprint(1),
        }))
        .unwrap()
    };
    let (two, three) = (
        hello(crate::parallel::zero::ZeroStage::Two),
        hello(crate::parallel::zero::ZeroStage::Three),
    );
    assert!(decode(&three).is_ok());
    let at: Vec<usize> = (0..two.len()).filter(|&i| two[i] != three[i]).collect();
    assert_eq!(at.len(), 1, "one byte tells the stages apart");
    let mut bad = three;
    bad[at[0]] = 9;
    assert!(matches!(decode(&bad), Err(CodecError::Malformed { .. })));
}

#[test]
fn ctl_3_another_version_is_named_not_misread() {
    let future = CONTROL_PROTOCOL_VERSION + 1;
    let from_future = encode_as(&ControlMsg::Bye, future, MAX_CONTROL_MESSAGE).unwrap();
    assert_eq!(peek_version(&from_future), Ok(future));
    assert_eq!(
        decode(&from_future),
        Err(CodecError::UnsupportedVersion {
            found: future,
            supported: CONTROL_PROTOCOL_VERSION
        })
    );
    assert_eq!(
        decode_as(&from_future, future, MAX_CONTROL_MESSAGE),
        Ok(ControlMsg::Bye)
    );
}

proptest! {
    /// CTL-2: any bytes, and any valid message with bytes changed or cut, give a message or a
    /// typed error, never a panic.
    #[test]
    fn ctl_2_arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        exercise_decoder(&data);
    }

    #[test]
    fn ctl_2_mutated_messages_never_panic(
        which in 0usize..11,
        at in any::<prop::sample::Index>(),
        xor in 1u8..=255,
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = encode(&samples()[which]).unwrap();
        let mut mutated = bytes.clone();
        let i = at.index(mutated.len());
        mutated[i] ^= xor;
        exercise_decoder(&mutated);
        let _ = decode(&mutated);
        let cut = cut.index(bytes.len());
        prop_assert!(decode(&bytes[..cut]).is_err());
        exercise_decoder(&bytes[..cut]);
    }
}
