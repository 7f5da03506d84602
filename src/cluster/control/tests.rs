use std::net::{IpAddr, Ipv4Addr};
use std::thread;

use super::*;
use crate::comm::net::link::{JobToken, Link, LinkConfig, LinkError};
use crate::mesh::Rank;

#[test]
fn adopted_data_plane_listeners_admit_the_token_for_their_ranks() {
    let listeners = bind_data_plane(IpAddr::V4(Ipv4Addr::LOCALHOST), 2).unwrap();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let plan = ProcessPlan {
        process: ProcessIndex(1),
        ranks: vec![Rank(1), Rank(2)],
        world_size: 3,
        addrs: vec![addrs[0], addrs[0], addrs[1]],
        processes: vec![ProcessIndex(0), ProcessIndex(1), ProcessIndex(1)],
    };
    let token = JobToken::from_bytes([3; 32]);
    let config = LinkConfig::default()
        .with_handshake_timeout(Duration::from_secs(5))
        .with_io_timeout(Duration::from_secs(5));
    let links = link_listeners(listeners, &plan, &token, config).unwrap();
    let to = addrs[1];
    let good = thread::spawn(move || Link::connect(to, Rank(0), Rank(2), &token, config));
    let accepted = links[1].accept().unwrap();
    assert_eq!(accepted.peer().rank, Some(Rank(0)));
    good.join().unwrap().unwrap();
    let to = addrs[0];
    let stranger = thread::spawn(move || {
        Link::connect(to, Rank(0), Rank(1), &JobToken::from_bytes([4; 32]), config)
    });
    assert!(matches!(links[0].accept(), Err(LinkError::Rejected { .. })));
    assert!(stranger.join().unwrap().is_err());
    assert!(matches!(
        link_listeners(Vec::new(), &plan, &JobToken::random(), config),
        Err(ControlError::InvalidPrepare(_))
    ));
}

/// A one-step job of the demo MLP of `widths`.
fn demo_spec(widths: &[usize]) -> JobSpec {
    JobSpec::new(
        crate::demo::mlp_spec(widths),
        crate::job_config::JobConfig {
            batch_size: Some(1),
            steps: 1,
            learning_rate: 0.1,
            ..Default::default()
        },
        crate::device::BackendKind::Flex,
    )
}

#[test]
fn structure_fingerprint_follows_shapes_not_values() {
    let device = burn::tensor::Device::default();
    let spec = |widths: Vec<usize>| demo_spec(&widths);
    let a = crate::demo::cluster_fingerprint(&spec(vec![4, 8, 2]), &device).unwrap();
    let b = crate::demo::cluster_fingerprint(&spec(vec![4, 8, 2]), &device).unwrap();
    let c = crate::demo::cluster_fingerprint(&spec(vec![4, 9, 2]), &device).unwrap();
    assert_eq!(a, b, "two initializations of one model");
    assert_ne!(a, c);
    assert!(matches!(
        crate::demo::cluster_fingerprint(&spec(vec![1 << 20, 1 << 20]), &device),
        Err(Incompatibility::Other(_))
    ));
    let named = JobSpec {
        model: ModelSpec {
            kind: "gpt".into(),
            config: vec![],
        },
        ..spec(vec![1, 1])
    };
    assert_eq!(
        crate::demo::cluster_fingerprint(&named, &device),
        Err(Incompatibility::UnknownModel { kind: "gpt".into() })
    );
}

/// A registry fingerprints and builds the kind a spec names, and refuses one it has not
/// registered with `UnknownModel` naming it (a node's Hello answer), whatever its bytes.
#[test]
fn a_registry_dispatches_on_the_kind_and_refuses_an_unknown_one() {
    use std::sync::Arc;

    use crate::cluster::control::{FingerprintFn, HostFactory, ModelRegistry};
    let of = |tag: u64| -> FingerprintFn {
        Arc::new(move |spec: &JobSpec| Ok(ModelFingerprint(tag ^ spec.model.config.len() as u64)))
    };
    let refuse: HostFactory =
        Arc::new(|args| Err(format!("no stages for {}", args.spec.model.kind)));
    let models = ModelRegistry::new()
        .register("a", of(1), refuse.clone())
        .register("b", of(2), refuse);
    assert_eq!(models.kinds().collect::<Vec<_>>(), ["a", "b"]);
    let mut spec = demo_spec(&[4, 8, 2]);
    for (kind, expected) in [("a", 1 ^ 3), ("b", 2 ^ 3)] {
        spec.model = ModelSpec {
            kind: kind.into(),
            config: vec![0; 3],
        };
        assert_eq!(models.fingerprint(&spec), Ok(ModelFingerprint(expected)));
        assert_eq!(
            models.fingerprint_fn()(&spec),
            Ok(ModelFingerprint(expected))
        );
    }
    // Stages: the kind's own factory, or the unknown kind named.
    let host_args = |spec: &JobSpec| HostArgs {
        spec: spec.clone(),
        plan: ProcessPlan {
            process: ProcessIndex(0),
            ranks: Vec::new(),
            world_size: 1,
            addrs: Vec::new(),
            processes: Vec::new(),
        },
        token: JobToken::from_bytes([1; 32]),
        listeners: Vec::new(),
        head: None,
    };
    let refused = |r: Result<std::sync::Arc<dyn StageHost>, String>| r.err().unwrap_or_default();
    assert_eq!(refused(models.stages(host_args(&spec))), "no stages for b");
    spec.model.kind = "c".into();
    assert_eq!(
        models.fingerprint(&spec),
        Err(Incompatibility::UnknownModel { kind: "c".into() })
    );
    assert_eq!(
        refused(models.host_factory()(host_args(&spec))),
        "node cannot build model c"
    );
    // The demo MLP is a kind like any other: its checks refuse bytes that are not widths.
    let demo = crate::demo::mlp_spec(&[4, 8, 2]);
    assert_eq!(crate::demo::mlp_widths(&demo), Ok(vec![4, 8, 2]));
    for bad in [vec![1, 2, 3], vec![0; 4], Vec::new()] {
        let spec = ModelSpec {
            config: bad,
            ..demo.clone()
        };
        assert!(matches!(
            crate::demo::mlp_widths(&spec),
            Err(Incompatibility::Other(_))
        ));
    }
    // So is the demo GPT: its five sizes round-trip, and sizes that are not a model it builds
    // (a zero, heads not dividing d_model, too many parameters, other lengths) are refused
    // before anything is built.
    let config = crate::demo::gpt::GptConfig {
        vocab: 63,
        context: 16,
        d_model: 32,
        heads: 4,
        layers: 1,
    };
    let gpt = crate::demo::gpt::gpt_spec(&config);
    assert_eq!(crate::demo::gpt::gpt_config(&gpt), Ok(config));
    let sizes = |s: [u32; 5]| ModelSpec {
        config: s.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..gpt.clone()
    };
    for bad in [
        sizes([63, 16, 32, 0, 1]),
        sizes([63, 16, 30, 4, 1]),
        sizes([63, 16, u32::MAX, 1, u32::MAX]),
        ModelSpec {
            config: vec![1; 19],
            ..gpt.clone()
        },
        ModelSpec {
            config: Vec::new(),
            ..gpt.clone()
        },
    ] {
        assert!(matches!(
            crate::demo::gpt::gpt_config(&bad),
            Err(Incompatibility::Other(_))
        ));
    }
    assert!(matches!(
        crate::demo::gpt::gpt_config(&demo),
        Err(Incompatibility::UnknownModel { .. })
    ));
}
