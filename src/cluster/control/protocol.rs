//! The control plane's messages and their wire form. Pure: no sockets, no actors.
//!
//! # Wire form (fixed for every protocol version)
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0..4 | magic | `b"MWCT"` |
//! | 4..6 | version | the sender's protocol version, little-endian `u16` |
//! | 6..10 | body length | bytes that follow, little-endian `u32` |
//! | 10.. | body | one [`ControlMsg`], bincode 2 (serde, standard config) |
//!
//! The header never changes between versions, so a process always learns the version its
//! peer speaks, even when it cannot read the body: that is how a version mismatch is told
//! apart from garbage on both sides.
//!
//! # Invariants (tests name the id they check)
//!
//! - CTL-1 (size before sending): [`encode`] refuses a message whose encoded form exceeds the
//!   maximum ([`MAX_CONTROL_MESSAGE`] by default, far below ractor_cluster's 16 MiB frame
//!   limit, one frame over which drops the whole node session) with
//!   [`CodecError::TooLarge`]; nothing is sent.
//! - CTL-2 (decoding never trusts the input): [`decode`] rejects bad magic, an unknown
//!   version, a declared length over the maximum or different from the bytes there, a body
//!   that does not decode or has bytes left over, each with a typed [`CodecError`], and never
//!   panics. The body decoder runs under bincode's limit: a length declared inside the body
//!   is checked against the maximum before anything is allocated for it, so no input makes it
//!   allocate more than the maximum message size.
//! - CTL-3 (version first): magic and version are checked before anything else, so a peer of
//!   another version gets [`CodecError::UnsupportedVersion`] naming both versions.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::world::{ProcessIndex, World};
use crate::mesh::Rank;

/// The first four bytes of every control message.
pub const CONTROL_MAGIC: [u8; 4] = *b"MWCT";

/// The control protocol version this build speaks.
pub const CONTROL_PROTOCOL_VERSION: u16 = 13;

/// Bytes of the fixed header.
pub const CONTROL_HEADER_LEN: usize = 10;

/// The largest control message (header and body) sent or accepted: 1 MiB. A `Prepare` for
/// ten thousand ranks takes about 300 KiB.
pub const MAX_CONTROL_MESSAGE: usize = 1 << 20;

/// A fingerprint of a model's structure (its parameters' shapes in visit order and the model
/// kind): equal fingerprints mean both processes build models whose parameters line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelFingerprint(pub u64);

impl std::fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The model a job trains, as the processes build it from their own code: a kind the
/// program registered ([`super::ModelRegistry`]) and its configuration. `meshwork train`'s
/// demo MLP is the kind `meshwork::demo::MLP_KIND` (version 9 on: no variant of its own).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// What kind of model (the program maps it to its code).
    pub kind: String,
    /// Its configuration, in the program's own encoding (checked by its code: it comes
    /// from the network).
    pub config: Vec<u8>,
}

/// What every process needs to build the same job: sent by the head with [`Hello`] and
/// [`Prepare`]. The job's whole description travels as it is (CONF-1): every node trains with
/// the head's [`JobConfig`](crate::job_config::JobConfig)
/// ([`crate::job::JobBuilder::with_config`]), version 13 on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The model.
    pub model: ModelSpec,
    /// How the job trains: every setting of the head's builder.
    pub job: crate::job_config::JobConfig,
    /// What every rank computes on: each process's devices are of this backend, and a node of
    /// another refuses the job ([`Incompatibility::Backend`]).
    pub backend: crate::device::BackendKind,
}

impl JobSpec {
    /// The spec of `model` trained as `job` describes, on `backend`.
    pub fn new(
        model: ModelSpec,
        job: crate::job_config::JobConfig,
        backend: crate::device::BackendKind,
    ) -> Self {
        Self {
            model,
            job,
            backend,
        }
    }
}

/// The head's first message to a node that appeared in the job's process group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The job's name (the process group scope the node joined).
    pub job: String,
    /// The head's name.
    pub head: String,
    /// The job.
    pub spec: JobSpec,
    /// The fingerprint of the model the head builds from `spec`.
    pub fingerprint: ModelFingerprint,
}

/// A node's answer to [`Hello`]: who it is and where its devices listen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's name (`host-pid` unless given).
    pub name: String,
    /// Devices it holds.
    pub devices: u32,
    /// One data-plane listener per device, bound before answering (port 0: the system chose).
    pub data_addrs: Vec<SocketAddr>,
    /// The process index it asks for (from `RANK` or `SLURM_PROCID`).
    pub requested: Option<ProcessIndex>,
    /// The fingerprint of the model the node builds from the Hello's spec.
    pub fingerprint: ModelFingerprint,
}

/// Why one side refused the other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum Incompatibility {
    /// The two speak different control protocol versions.
    #[error("protocol version mismatch: head speaks {head}, node speaks {node}")]
    ProtocolVersion {
        /// The head's version.
        head: u16,
        /// The node's version.
        node: u16,
    },
    /// The two build models whose structure differs (another model or another build).
    #[error("model fingerprint mismatch: head {head}, node {node}")]
    Fingerprint {
        /// The head's fingerprint.
        head: ModelFingerprint,
        /// The node's fingerprint.
        node: ModelFingerprint,
    },
    /// The node computes on another backend than the job's (a job never mixes backends:
    /// replicas stepping on different arithmetic would drift apart).
    #[error(
        "backend mismatch: the job computes on {head:?}, the node on {node:?} (start the node \
         with the job's --device)"
    )]
    Backend {
        /// The job's backend.
        head: crate::device::BackendKind,
        /// The node's.
        node: crate::device::BackendKind,
    },
    /// The job's data plane runs on a transport this node cannot use (an MPI job, a node
    /// built without the `mpi` feature or not started by an MPI launcher).
    #[error(
        "transport mismatch: the job moves its data over {job}, which this node cannot use \
         (start every process of an MPI job under the MPI launcher, with a meshwork built with \
         the `mpi` feature)"
    )]
    Transport {
        /// The job's transport.
        job: crate::comm::DataTransport,
    },
    /// The node cannot build this kind of model.
    #[error("node cannot build model {kind}")]
    UnknownModel {
        /// The model kind.
        kind: String,
    },
    /// The head turned the node away for a reason of its own (world full, rank conflict).
    #[error("{0}")]
    Other(String),
}

/// The head's second message: the world, this node's place in it, the data-plane token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prepare {
    /// The per-job data-plane token (`comm::net::link::JobToken`'s bytes).
    pub token: [u8; 32],
    /// Every rank with its process and address.
    pub world: World,
    /// The receiving node's process index.
    pub process: ProcessIndex,
}

/// What a node is doing, reported in answer to a [`ControlMsg::Heartbeat`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodePhase {
    /// Joined, waiting for `Prepare`.
    Joined,
    /// Prepared: ranks known, data plane listening.
    Prepared,
    /// Training (the data plane is in use).
    Training,
}

/// One control message. Requests go from the head to a node's agent (`Hello`, `Prepare`,
/// `Heartbeat`, `Shutdown`), each answered by one reply.
// A Hello is a few hundred bytes, once per node: boxing it would buy nothing measurable and
// cost every sender a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ControlMsg {
    /// Head → node: the job and the head's fingerprint.
    Hello(Hello),
    /// Node → head: the answer to `Hello`.
    Welcome(NodeInfo),
    /// Either way: the sender refuses the other side.
    Refused(Incompatibility),
    /// Head → node: the world and the token.
    Prepare(Prepare),
    /// Node → head: ready; these are the ranks it holds.
    Prepared {
        /// The node's ranks, in device order.
        ranks: Vec<Rank>,
    },
    /// Head → node: are you there? (the head's own liveness check; ractor_cluster's ping
    /// never times out).
    Heartbeat {
        /// Numbered by the head.
        seq: u64,
    },
    /// Node → head: the answer to `Heartbeat`.
    Alive {
        /// The heartbeat's number.
        seq: u64,
        /// What the node is doing.
        phase: NodePhase,
        /// The last step it finished, if training.
        step: Option<u64>,
    },
    /// Head → node: stop; the node process exits.
    Shutdown {
        /// Why, for the node's log.
        reason: String,
    },
    /// Node → head: the answer to `Shutdown`.
    Bye,
    /// Head → node: a request for one of its stages (version 2).
    Stage(super::stages::StageRequest),
    /// Node → head: the answer to `Stage`.
    StageDone(super::stages::StageAnswer),
}

impl ControlMsg {
    /// The message's name, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Hello(_) => "Hello",
            Self::Welcome(_) => "Welcome",
            Self::Refused(_) => "Refused",
            Self::Prepare(_) => "Prepare",
            Self::Prepared { .. } => "Prepared",
            Self::Heartbeat { .. } => "Heartbeat",
            Self::Alive { .. } => "Alive",
            Self::Shutdown { .. } => "Shutdown",
            Self::Bye => "Bye",
            Self::Stage(_) => "Stage",
            Self::StageDone(_) => "StageDone",
        }
    }
}

/// Why bytes were not sent or not accepted as a control message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// CTL-1: the encoded message is over the maximum; it was not sent.
    #[error("control message {kind} is {bytes} bytes, over the maximum of {max}: not sent")]
    TooLarge {
        /// The message kind.
        kind: &'static str,
        /// Its encoded size.
        bytes: usize,
        /// The maximum.
        max: usize,
    },
    /// The input ends before the header does, or before the body it declares.
    #[error("control message ends early: {got} of {expected} bytes")]
    Truncated {
        /// Bytes needed.
        expected: usize,
        /// Bytes there were.
        got: usize,
    },
    /// Not a meshwork control message.
    #[error("bad magic {found:02x?}: not a meshwork control message")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// CTL-3: the sender speaks another protocol version.
    #[error("control protocol version {found} is not supported (this process speaks {supported})")]
    UnsupportedVersion {
        /// The sender's version.
        found: u16,
        /// The version this side speaks.
        supported: u16,
    },
    /// The header declares a body over the maximum (checked before reading it).
    #[error("control message declares {declared} body bytes, over the maximum of {max}")]
    DeclaredTooLarge {
        /// The declared length.
        declared: u64,
        /// The maximum body length.
        max: usize,
    },
    /// Bytes follow the declared body.
    #[error("{extra} bytes follow the control message")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
    /// The body is not a control message of this version.
    #[error("malformed control message body: {detail}")]
    Malformed {
        /// The decoder's account, for people.
        detail: String,
    },
}

/// bincode under a limit: a length inside the body is checked against the maximum before
/// anything is allocated for it (CTL-2).
fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_CONTROL_MESSAGE>()
}

/// Encodes `msg` as protocol version `version` (a build encodes with
/// [`CONTROL_PROTOCOL_VERSION`]; tests pretend to be another build). Refuses a message over
/// `max` bytes (CTL-1).
pub fn encode_as(msg: &ControlMsg, version: u16, max: usize) -> Result<Vec<u8>, CodecError> {
    let body = bincode::serde::encode_to_vec(msg, bincode_config()).map_err(|e| {
        CodecError::Malformed {
            detail: e.to_string(),
        }
    })?;
    let bytes = CONTROL_HEADER_LEN + body.len();
    if bytes > max {
        return Err(CodecError::TooLarge {
            kind: msg.kind(),
            bytes,
            max,
        });
    }
    let mut out = Vec::with_capacity(bytes);
    out.extend_from_slice(&CONTROL_MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Encodes `msg` in this build's version, refusing it over [`MAX_CONTROL_MESSAGE`] (CTL-1).
pub fn encode(msg: &ControlMsg) -> Result<Vec<u8>, CodecError> {
    encode_as(msg, CONTROL_PROTOCOL_VERSION, MAX_CONTROL_MESSAGE)
}

/// The version in a message's header (magic checked), whatever the body: how a process learns
/// which version a peer speaks when it cannot read the rest (CTL-3).
pub fn peek_version(bytes: &[u8]) -> Result<u16, CodecError> {
    let Some(header) = bytes.first_chunk::<CONTROL_HEADER_LEN>() else {
        return Err(CodecError::Truncated {
            expected: CONTROL_HEADER_LEN,
            got: bytes.len(),
        });
    };
    let magic = [header[0], header[1], header[2], header[3]];
    if magic != CONTROL_MAGIC {
        return Err(CodecError::BadMagic { found: magic });
    }
    Ok(u16::from_le_bytes([header[4], header[5]]))
}

/// Decodes one whole message of protocol version `version`, at most `max` bytes (CTL-2,
/// CTL-3).
pub fn decode_as(bytes: &[u8], version: u16, max: usize) -> Result<ControlMsg, CodecError> {
    let found = peek_version(bytes)?;
    if found != version {
        return Err(CodecError::UnsupportedVersion {
            found,
            supported: version,
        });
    }
    let declared = u32::from_le_bytes([bytes[6], bytes[7], bytes[8], bytes[9]]) as u64;
    let max_body = max.saturating_sub(CONTROL_HEADER_LEN);
    if declared > max_body as u64 {
        return Err(CodecError::DeclaredTooLarge {
            declared,
            max: max_body,
        });
    }
    let declared = declared as usize;
    let body = &bytes[CONTROL_HEADER_LEN..];
    if body.len() < declared {
        return Err(CodecError::Truncated {
            expected: CONTROL_HEADER_LEN + declared,
            got: bytes.len(),
        });
    }
    if body.len() > declared {
        return Err(CodecError::TrailingBytes {
            extra: body.len() - declared,
        });
    }
    decode_body(body)
}

/// Decodes one whole message in this build's version (CTL-2, CTL-3).
pub fn decode(bytes: &[u8]) -> Result<ControlMsg, CodecError> {
    decode_as(bytes, CONTROL_PROTOCOL_VERSION, MAX_CONTROL_MESSAGE)
}

/// Decodes a body (no header): the whole slice must be one message.
pub fn decode_body(body: &[u8]) -> Result<ControlMsg, CodecError> {
    let (msg, used): (ControlMsg, usize) =
        bincode::serde::decode_from_slice(body, bincode_config()).map_err(|e| {
            CodecError::Malformed {
                detail: e.to_string(),
            }
        })?;
    if used != body.len() {
        return Err(CodecError::TrailingBytes {
            extra: body.len() - used,
        });
    }
    Ok(msg)
}

/// The body of the `control_decoder` fuzz target, shared with the test that replays its
/// corpus: arbitrary bytes, as a whole message and as a bare body, must decode to a message or
/// a typed error, never a panic (CTL-2), and a decoded message must encode again to bytes that
/// decode to the same encoding. Panics (the fuzzer's signal) when that does not hold.
pub fn exercise_decoder(data: &[u8]) {
    for decoded in [decode(data), decode_body(data)] {
        let Ok(msg) = decoded else { continue };
        let again = match encode(&msg) {
            Ok(bytes) => bytes,
            // A bare body of nearly the maximum has no room left for the header.
            Err(CodecError::TooLarge { .. })
                if data.len() + CONTROL_HEADER_LEN > MAX_CONTROL_MESSAGE =>
            {
                continue;
            }
            Err(e) => panic!("a decoded {} does not encode: {e}", msg.kind()),
        };
        let twice = decode(&again).expect("an encoded message decodes");
        assert_eq!(encode(&twice).expect("and encodes again"), again);
    }
}

#[cfg(test)]
mod tests;
