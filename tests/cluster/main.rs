//! The tests across processes and on the data plane's wire (feature `cluster`), as one test
//! binary: `cargo test --features cluster --test cluster`, or one file of them with a
//! module filter (`--test cluster cluster_training::`). Without the feature it is empty.
//! Children started from this binary name their entry test by its module path.

mod cluster_config;
mod cluster_control;
mod cluster_launchers;
mod cluster_mpi;
mod cluster_procs;
mod cluster_rollback;
mod cluster_slurm;
mod cluster_tcp;
mod cluster_tensor;
mod cluster_training;
mod fuzz_regressions;
