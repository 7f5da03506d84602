use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn torchrun_variables_make_rank_0_the_head() {
    let vars = [
        ("RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29400"),
    ];
    let r = from_env(env(&vars)).unwrap().unwrap();
    assert_eq!(r.convention, Convention::Torchrun);
    assert_eq!(
        r.role(),
        Role::Head {
            listen: "0.0.0.0:29400".into(),
            nodes: 3
        }
    );
    let mut vars = vars;
    vars[0] = ("RANK", "2");
    let r = from_env(env(&vars)).unwrap().unwrap();
    assert_eq!(
        r.role(),
        Role::Node {
            join: "10.0.0.1:29400".into(),
            process: ProcessIndex(2)
        }
    );
}

#[test]
fn rdv_1_torchrun_missing_and_garbled_variables_are_named() {
    let base = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "head"),
        ("MASTER_PORT", "29500"),
    ];
    for (i, var) in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        .into_iter()
        .enumerate()
    {
        let vars: Vec<_> = base
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, kv)| *kv)
            .collect();
        let err = from_env(env(&vars)).unwrap_err();
        // Without RANK and WORLD_SIZE both, torchrun is still detected by the other one.
        assert_eq!(
            err,
            RendezvousError::Missing {
                convention: Convention::Torchrun,
                var
            }
        );
    }
    let mut garbled = base;
    garbled[3] = ("MASTER_PORT", "70000");
    assert!(matches!(
        from_env(env(&garbled)),
        Err(RendezvousError::Invalid {
            var: "MASTER_PORT",
            ..
        })
    ));
    garbled = base;
    garbled[0] = ("RANK", "-1");
    assert!(matches!(
        from_env(env(&garbled)),
        Err(RendezvousError::Invalid { var: "RANK", .. })
    ));
    garbled = base;
    garbled[0] = ("RANK", "2");
    assert_eq!(
        from_env(env(&garbled)),
        Err(RendezvousError::RankOutOfRange {
            rank_var: "RANK",
            size_var: "WORLD_SIZE",
            process: 2,
            processes: 2
        })
    );
}

#[test]
fn slurm_first_host_is_the_head_and_torchrun_wins() {
    let vars = [
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_NODELIST", "node[01-03,07],gpu5"),
    ];
    let r = from_env(env(&vars)).unwrap().unwrap();
    assert_eq!(r.convention, Convention::Slurm);
    assert_eq!(r.head_addr(), "node01:29500");
    assert_eq!(r.process, ProcessIndex(3));
    let with_port = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "a"),
        ("MESHWORK_PORT", "4000"),
        ("MASTER_PORT", "5000"),
    ];
    let r = from_env(env(&with_port)).unwrap().unwrap();
    assert_eq!(
        r.role(),
        Role::Head {
            listen: "0.0.0.0:4000".into(),
            nodes: 1
        }
    );
    let both = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_NODELIST", "a"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "b"),
        ("MASTER_PORT", "1"),
    ];
    let r = from_env(env(&both)).unwrap().unwrap();
    assert_eq!(
        (r.convention, r.process),
        (Convention::Torchrun, ProcessIndex(1))
    );
    assert_eq!(from_env(env(&[])), Ok(None));
}

#[test]
fn rdv_1_slurm_errors_are_typed() {
    assert_eq!(
        from_env(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])),
        Err(RendezvousError::Missing {
            convention: Convention::Slurm,
            var: "SLURM_NODELIST"
        })
    );
    assert!(matches!(
        from_env(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "node[01-")
        ])),
        Err(RendezvousError::Hostlist {
            var: "SLURM_NODELIST",
            error: HostlistError::Unbalanced(_)
        })
    ));
    assert!(matches!(
        from_env(env(&[
            ("SLURM_PROCID", "x"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "a")
        ])),
        Err(RendezvousError::Invalid {
            var: "SLURM_PROCID",
            ..
        })
    ));
}

#[test]
fn rdv_2_hostlists_expand_in_order() {
    let e = |s| expand_hostlist(s, MAX_HOSTS);
    assert_eq!(
        e("node[01-03,07],gpu5").unwrap(),
        ["node01", "node02", "node03", "node07", "gpu5"]
    );
    assert_eq!(
        e("rack[1-2]-n[08-10]").unwrap(),
        [
            "rack1-n08",
            "rack1-n09",
            "rack1-n10",
            "rack2-n08",
            "rack2-n09",
            "rack2-n10"
        ]
    );
    assert_eq!(e("a,b[9-10],c").unwrap(), ["a", "b9", "b10", "c"]);
    assert_eq!(e(" single ").unwrap(), ["single"]);
    assert_eq!(e("n[007]").unwrap(), ["n007"]);
}

#[test]
fn rdv_2_malformed_hostlists_are_typed() {
    let e = |s| expand_hostlist(s, 100);
    assert!(matches!(e(""), Err(HostlistError::Empty(_))));
    assert!(matches!(e("a,,b"), Err(HostlistError::Empty(_))));
    assert!(matches!(e("n[1-2"), Err(HostlistError::Unbalanced(_))));
    assert!(matches!(e("n1-2]"), Err(HostlistError::Unbalanced(_))));
    assert!(matches!(e("n[[1]]"), Err(HostlistError::Unbalanced(_))));
    assert!(matches!(e("n[3-1]"), Err(HostlistError::BadRange { .. })));
    assert!(matches!(e("n[a-b]"), Err(HostlistError::BadRange { .. })));
    assert!(matches!(e("n[]"), Err(HostlistError::BadRange { .. })));
    assert!(matches!(e("n[1-]"), Err(HostlistError::BadRange { .. })));
    assert!(matches!(
        e("n[0-100]"),
        Err(HostlistError::TooMany { limit: 100, .. })
    ));
    assert!(matches!(
        e("n[0-9][0-9][0-9]"),
        Err(HostlistError::TooMany { .. })
    ));
    assert!(matches!(
        expand_hostlist("n[0-999999999999999999]", MAX_HOSTS),
        Err(HostlistError::TooMany { .. })
    ));
}

proptest! {
    /// RDV-2: a list written from ranges expands to exactly those hosts, in order.
    #[test]
    fn rdv_2_written_ranges_expand_back(
        groups in proptest::collection::vec((0u32..500, 0u32..20, 1usize..5), 1..5),
        prefix in "[a-z]{1,6}",
    ) {
        let mut expected = Vec::new();
        let mut body = Vec::new();
        for &(lo, len, width) in &groups {
            let hi = lo + len;
            let width = width.max(lo.to_string().len());
            body.push(if len == 0 {
                format!("{lo:0width$}")
            } else {
                format!("{lo:0width$}-{hi}")
            });
            expected.extend((lo..=hi).map(|v| format!("{prefix}{v:0width$}")));
        }
        let list = format!("{prefix}[{}],tail", body.join(","));
        expected.push("tail".to_string());
        prop_assert_eq!(expand_hostlist(&list, MAX_HOSTS).unwrap(), expected);
    }

    /// RDV-1/RDV-2: arbitrary variable values give a rendezvous or a typed error, never a panic.
    #[test]
    fn rdv_1_arbitrary_values_never_panic(
        procid in ".{0,8}", ntasks in ".{0,8}", list in "[a-z0-9\\[\\],\\-]{0,24}",
    ) {
        let _ = from_env(env(&[
            ("SLURM_PROCID", &procid),
            ("SLURM_NTASKS", &ntasks),
            ("SLURM_NODELIST", &list),
        ]));
        let _ = expand_hostlist(&list, 1000);
    }
}

/// OpenMPI's and Hydra's variables: rank 0 is the head; on one host (the local size is the
/// world's) the head is the loopback address, over several hosts `MASTER_ADDR` names it and
/// without it the error names it (RDV-3); the port as for Slurm.
#[test]
fn rdv_3_mpi_launchers_make_rank_0_the_head_and_need_master_addr_across_hosts() {
    for (c, rank, size, local) in [
        (
            Convention::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        (Convention::Hydra, "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ] {
        // One host: every rank local.
        let one_host = [(rank, "2"), (size, "3"), (local, "3")];
        let r = from_env(env(&one_host)).unwrap().unwrap();
        assert_eq!(r.convention, c);
        assert_eq!(
            r.role(),
            Role::Node {
                join: format!("127.0.0.1:{DEFAULT_PORT}"),
                process: ProcessIndex(2)
            }
        );
        let head = [
            (rank, "0"),
            (size, "3"),
            (local, "3"),
            ("MESHWORK_PORT", "29601"),
        ];
        assert_eq!(
            from_env(env(&head)).unwrap().unwrap().role(),
            Role::Head {
                listen: "0.0.0.0:29601".into(),
                nodes: 2
            }
        );
        // Several hosts: MASTER_ADDR, or an error naming it.
        let hosts = [(rank, "1"), (size, "4"), (local, "2")];
        assert_eq!(
            from_env(env(&hosts)).unwrap_err(),
            RendezvousError::Missing {
                convention: c,
                var: "MASTER_ADDR"
            }
        );
        let named = [
            (rank, "1"),
            (size, "4"),
            (local, "2"),
            ("MASTER_ADDR", "10.0.0.9"),
            ("MASTER_PORT", "29700"),
        ];
        assert_eq!(
            from_env(env(&named)).unwrap().unwrap().head_addr(),
            "10.0.0.9:29700"
        );
        // No local size at all: not known to be one host.
        assert!(from_env(env(&[(rank, "0"), (size, "2")])).is_err());
        // Garbled and out-of-range ranks are named (RDV-1).
        assert!(matches!(
            from_env(env(&[(rank, "x"), (size, "2"), (local, "2")])),
            Err(RendezvousError::Invalid { var, .. }) if var == rank
        ));
        assert!(matches!(
            from_env(env(&[(rank, "2"), (size, "2"), (local, "2")])),
            Err(RendezvousError::RankOutOfRange { .. })
        ));
        // An MPI launcher inside a Slurm allocation describes its own ranks.
        let inside = [
            (rank, "1"),
            (size, "3"),
            (local, "3"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_NODELIST", "n1"),
        ];
        assert_eq!(from_env(env(&inside)).unwrap().unwrap().convention, c);
    }
}

#[test]
fn rdv_4_mpi_world_puts_the_head_on_loopback_only_when_every_rank_shares_its_host() {
    let none = |_: &str| None;
    let local: Vec<String> = vec!["a".into(); 3];
    let r = from_mpi_hosts(2, &local, none).unwrap();
    assert_eq!(
        (r.convention, r.process, r.processes, r.head_host.as_str()),
        (Convention::MpiWorld, ProcessIndex(2), 3, "127.0.0.1")
    );
    assert_eq!(r.port, DEFAULT_PORT);
    let spread: Vec<String> = vec!["gpu1".into(), "gpu1".into(), "gpu2".into()];
    let r = from_mpi_hosts(0, &spread, none).unwrap();
    assert_eq!(r.head_host, "gpu1");
    assert!(matches!(r.role(), Role::Head { nodes: 2, .. }));
    let named = |k: &str| match k {
        "MASTER_ADDR" => Some("10.0.0.7".to_string()),
        "MESHWORK_PORT" => Some("4000".to_string()),
        _ => None,
    };
    let r = from_mpi_hosts(1, &spread, named).unwrap();
    assert_eq!((r.head_host.as_str(), r.port), ("10.0.0.7", 4000));
    assert_eq!(
        r.role(),
        Role::Node {
            join: "10.0.0.7:4000".into(),
            process: ProcessIndex(1)
        }
    );
    assert!(from_mpi_hosts(3, &spread, none).is_err());
    assert!(from_mpi_hosts(0, &[], none).is_err());
}
