//! COMM-11: a poisoned group's cause, decoded with its nesting bounded. `CommError::Poisoned`
//! holds the error that poisoned the group, which could itself be `Poisoned`; a decoder that
//! followed a peer's nesting would recurse once per level, and a message of a few hundred
//! kilobytes could nest deep enough to overflow a thread's stack and abort the process. The
//! depth is counted per thread while a `CommError` decodes, so every decoder of every plane
//! (bincode on the control plane, data-plane close reasons, MPI abort messages) refuses the
//! same nesting.

use std::cell::Cell;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};

use super::CommError;

/// The most poisoned causes a decoded [`CommError`] may nest. A group wraps its first failure
/// once (`Poisoned { cause }`) and sends only root causes to its peers, so real errors nest
/// one or two levels.
pub const MAX_CAUSE_DEPTH: u32 = 8;

thread_local! {
    /// Causes being decoded on this thread, outermost first.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Leaves one level of nesting when dropped, also when decoding unwinds.
struct Level;

impl Drop for Level {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// `#[serde(deserialize_with)]` of `CommError::Poisoned::cause`: the cause, or an error once
/// the causes being decoded nest deeper than [`MAX_CAUSE_DEPTH`].
pub(super) fn bounded<'de, D: Deserializer<'de>>(d: D) -> Result<Box<CommError>, D::Error> {
    let depth = DEPTH.with(|c| {
        let depth = c.get() + 1;
        c.set(depth);
        depth
    });
    let _level = Level;
    if depth > MAX_CAUSE_DEPTH {
        return Err(D::Error::custom(format!(
            "a poisoned group's cause nests deeper than {MAX_CAUSE_DEPTH} levels"
        )));
    }
    CommError::deserialize(d).map(Box::new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CollectiveKind;
    use crate::mesh::Generation;

    fn poisoned(cause: CommError) -> CommError {
        CommError::Poisoned {
            generation: Generation(3),
            seq: 7,
            op: CollectiveKind::AllReduce,
            cause: Box::new(cause),
        }
    }

    fn leaf() -> CommError {
        CommError::Shutdown {
            generation: Generation(3),
            seq: 6,
            op: CollectiveKind::AllReduce,
        }
    }

    fn config() -> impl bincode::config::Config {
        bincode::config::standard()
    }

    /// The bytes of `levels` poisoned causes around a leaf, built without building the value
    /// (whose drop would recurse as deep).
    fn nested_bytes(levels: usize) -> Vec<u8> {
        let leaf_bytes = bincode::serde::encode_to_vec(leaf(), config()).unwrap();
        let one = bincode::serde::encode_to_vec(poisoned(leaf()), config()).unwrap();
        assert!(
            one.ends_with(&leaf_bytes),
            "a cause is encoded after its wrapper"
        );
        let wrapper = &one[..one.len() - leaf_bytes.len()];
        let mut bytes = wrapper.repeat(levels);
        bytes.extend_from_slice(&leaf_bytes);
        bytes
    }

    fn decode(bytes: &[u8]) -> Result<CommError, String> {
        bincode::serde::decode_from_slice::<CommError, _>(bytes, config())
            .map(|(e, _)| e)
            .map_err(|e| e.to_string())
    }

    /// COMM-11: up to the bound a nested cause round-trips; one level more is refused.
    #[test]
    fn comm_11_causes_nest_up_to_the_bound_and_no_further() {
        let mut error = leaf();
        for _ in 0..MAX_CAUSE_DEPTH {
            error = poisoned(error);
        }
        let bytes = bincode::serde::encode_to_vec(&error, config()).unwrap();
        assert_eq!(decode(&bytes), Ok(error.clone()));
        assert_eq!(bytes, nested_bytes(MAX_CAUSE_DEPTH as usize));
        let deeper = decode(&nested_bytes(MAX_CAUSE_DEPTH as usize + 1)).unwrap_err();
        assert!(deeper.contains("nests deeper than 8"), "{deeper}");
        // The count is back at zero: the next decode on this thread starts fresh.
        assert_eq!(decode(&bytes), Ok(error));
    }

    /// COMM-11: 100,000 nested causes (about 400 KB, under the control plane's 1 MiB limit)
    /// are refused on a 2 MiB stack, a tokio worker's, instead of overflowing it. Before the
    /// bound this aborted the process.
    #[test]
    fn comm_11_a_deeply_nested_cause_is_refused_on_a_small_stack() {
        let bytes = nested_bytes(100_000);
        assert!(bytes.len() < 1 << 20, "{} bytes", bytes.len());
        let refused = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || decode(&bytes))
            .unwrap()
            .join()
            .expect("the decoder returns");
        assert!(refused.unwrap_err().contains("nests deeper"));
    }
}
