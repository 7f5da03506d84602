//! The in-process integration tests, as one test binary.
//!
//! Each test binary links the runtime monomorphised for its own models: about 50 s of
//! compilation each on a CI core. One binary for every scenario that needs only the default
//! features keeps that cost once. A file is a module named as the file was (`cargo test
//! --test suite zero::` runs what `--test zero` ran); tests that start their own binary again
//! as a child pass the module path to `--exact`.

mod checkpoint_kill;
mod checkpoints;
mod cli;
mod composition;
mod compression;
mod data_parallel;
mod docs;
mod faults;
mod fsdp;
mod instances;
mod job_files;
mod layering;
mod lifecycle;
mod local_updates;
mod naming;
mod parameter_server;
mod pipeline;
mod planner;
mod precision;
mod reproducible;
mod runtime;
mod scheduler;
mod service;
mod tensor_parallel;
mod zero;
