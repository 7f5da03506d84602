//! What every layer says when a value cannot configure a job: [`InvalidConfig`]. It sits at
//! the bottom (core) so that pure code (a layout, a sampler, a fault plan) can refuse a value
//! without knowing the crate's [`Error`](crate::Error), which becomes `Error::InvalidConfig`.

/// A value that cannot configure a job; the message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidConfig(pub String);
