//! # meshwork
//!
//! Train [Burn](https://burn.dev) models on many devices at once, as actors embedded in your
//! own program. See `ARCHITECTURE.md` for the code map and the book for a tutorial.
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod actors;
pub mod comm;
pub mod data;
pub mod device;
pub mod error;
pub mod job;
pub mod mesh;
pub mod parallel;
pub mod trace;
