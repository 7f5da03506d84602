//! The byte layout of shard files and manifests, as pure encode and decode functions.
//!
//! ```text
//! shard file: "MWCKSHRD" | version u32 | header_len u64 | header (bincode)
//!             | every parameter's values, f32 little-endian, in header order
//!             | optimizer state bytes (whole state only)
//! part file:  "MWCKOPTP" | version u32 | header_len u64 | header (bincode: shard, index, of,
//!             range, total) | the part's optimizer state bytes (a sharded optimizer, CKPT-8)
//! manifest:   "MWCKMANF" | version u32 | body_len u64 | body (bincode) | crc32 u32 of all before
//!             (body: step, layout, cursor, RNG, shard entries, and from version 3 on the
//!             training state, CKPT-9)
//! training:   "MWCKTRNS" | version u32 | body_len u64 | body (bincode): a shard's training
//!             state, the last piece of a transfer (never a file of its own)
//! ```
//!
//! A ZeRO-3 block's parameter part is one more parameter entry of the shard file (CKPT-10).
//!
//! Every file is written in [`FORMAT_VERSION`]; versions from [`OLDEST_READABLE_VERSION`] on
//! are read (shard and part files did not change between 2 and 3).
//!
//! Integers outside the bincode parts are little-endian. Decoding follows CKPT-4: headers are
//! decoded with bincode's borrowing serde decoder, so a string is a slice of the bytes that
//! are there (a declared length beyond them is an error, not an allocation) and serde caps the
//! pre-allocation of every sequence; parameter values are allocated only after their declared
//! sizes have been added up, overflow-checked, and found equal to the bytes present.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{
    Checkpoint, CheckpointError, DataCursor, FORMAT_VERSION, NamedParam, OLDEST_READABLE_VERSION,
    OptimizerPart, OptimizerState, RngState, ShardId, ShardParams, ShardSnapshot, TrainingState,
};
use crate::mesh::Layout;

const SHARD_MAGIC: &[u8; 8] = b"MWCKSHRD";
const MANIFEST_MAGIC: &[u8; 8] = b"MWCKMANF";
const PART_MAGIC: &[u8; 8] = b"MWCKOPTP";
const TRAINING_MAGIC: &[u8; 8] = b"MWCKTRNS";
/// The first version whose manifest ends with the training state.
const TRAINING_SINCE: u32 = 3;
/// Magic, version and the length of the bincode part.
const PREFIX_LEN: usize = 8 + 4 + 8;
const CRC_LEN: usize = 4;

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
}

#[derive(Serialize, Deserialize)]
struct ParamHeader<'a> {
    name: &'a str,
    id: u64,
    dims: Vec<u64>,
}

#[derive(Serialize, Deserialize)]
struct ShardHeader<'a> {
    shard: ShardId,
    #[serde(borrow)]
    params: Vec<ParamHeader<'a>>,
    optimizer_len: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct ShardEntryRef<'a> {
    shard: ShardId,
    file: &'a str,
    len: u64,
    crc32: u32,
    #[serde(borrow)]
    parts: Vec<PartEntryRef<'a>>,
}

#[derive(Serialize, Deserialize)]
struct PartEntryRef<'a> {
    index: u32,
    of: u32,
    file: &'a str,
    len: u64,
    crc32: u32,
}

#[derive(Serialize, Deserialize)]
struct PartHeader {
    shard: ShardId,
    index: u32,
    of: u32,
    start: u64,
    end: u64,
    total: u64,
}

#[derive(Serialize, Deserialize)]
struct ManifestBody<'a> {
    step: u64,
    layout: Layout,
    cursor: DataCursor,
    rng: RngState,
    #[serde(borrow)]
    shards: Vec<ShardEntryRef<'a>>,
}

/// One shard file as the manifest lists it, with its optimizer part files (CKPT-8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShardEntry {
    pub(crate) shard: ShardId,
    pub(crate) file: String,
    pub(crate) len: u64,
    pub(crate) crc32: u32,
    pub(crate) parts: Vec<PartEntry>,
}

/// One optimizer part file as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PartEntry {
    pub(crate) index: u32,
    pub(crate) of: u32,
    pub(crate) file: String,
    pub(crate) len: u64,
    pub(crate) crc32: u32,
}

/// A decoded manifest.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Manifest {
    pub(crate) step: u64,
    pub(crate) layout: Layout,
    pub(crate) cursor: DataCursor,
    pub(crate) rng: RngState,
    pub(crate) shards: Vec<ShardEntry>,
    /// Every shard's training state (CKPT-9); empty in a version 2 manifest.
    pub(crate) training: TrainingState,
}

impl Manifest {
    /// The manifest of `checkpoint` whose shard files have these lengths and checksums.
    pub(crate) fn of(checkpoint: &Checkpoint, shards: Vec<ShardEntry>) -> Self {
        Self {
            step: checkpoint.step,
            layout: checkpoint.layout,
            cursor: checkpoint.cursor,
            rng: checkpoint.rng,
            shards,
            // CKPT-9: equal on every shard (checked before writing).
            training: checkpoint
                .shards
                .first()
                .map(|s| s.training.clone())
                .unwrap_or_default(),
        }
    }
}

fn malformed(path: &Path, what: impl Into<String>) -> CheckpointError {
    CheckpointError::Malformed {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn encode_bincode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, config())
        .expect("encoding plain structs into a Vec cannot fail")
}

fn put_prefix(out: &mut Vec<u8>, magic: &[u8; 8], body_len: usize) {
    out.extend_from_slice(magic);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body_len as u64).to_le_bytes());
}

/// Checks magic and version, and returns the version and the declared length of the bincode
/// part.
fn read_prefix(bytes: &[u8], magic: &[u8; 8], path: &Path) -> Result<(u32, u64), CheckpointError> {
    let actual = bytes.len() as u64;
    if bytes.len() < PREFIX_LEN {
        if bytes.len() >= 8 && &bytes[..8] != magic {
            return Err(CheckpointError::BadMagic {
                path: path.to_path_buf(),
            });
        }
        return Err(CheckpointError::Truncated {
            path: path.to_path_buf(),
            declared: PREFIX_LEN as u64,
            actual,
        });
    }
    if &bytes[..8] != magic {
        return Err(CheckpointError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(CheckpointError::VersionMismatch {
            path: path.to_path_buf(),
            found: version,
            expected: FORMAT_VERSION,
        });
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[12..20]);
    Ok((version, u64::from_le_bytes(len)))
}

/// Borrow-decodes exactly `bytes` as one `T`: trailing bytes are an error.
fn decode_exact<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    path: &Path,
    what: &str,
) -> Result<T, CheckpointError> {
    let (value, used) = bincode::serde::borrow_decode_from_slice::<T, _>(bytes, config())
        .map_err(|e| malformed(path, format!("{what}: {e}")))?;
    if used != bytes.len() {
        return Err(malformed(
            path,
            format!("{what}: {} trailing bytes", bytes.len() - used),
        ));
    }
    Ok(value)
}

/// The bytes of one shard's file.
pub(crate) fn encode_shard(shard: &ShardSnapshot) -> Vec<u8> {
    let header = ShardHeader {
        shard: shard.shard,
        params: shard
            .params
            .params()
            .iter()
            .map(|p| ParamHeader {
                name: &p.name,
                id: p.id,
                dims: p.dims.iter().map(|&d| d as u64).collect(),
            })
            .collect(),
        optimizer_len: shard
            .optimizer
            .as_ref()
            .and_then(OptimizerState::whole_bytes)
            .map(|b| b.len() as u64),
    };
    let header = encode_bincode(&header);
    let values: usize = shard.params.params().iter().map(|p| p.values.len()).sum();
    let optimizer = shard
        .optimizer
        .as_ref()
        .and_then(OptimizerState::whole_bytes)
        .unwrap_or(&[]);
    let mut out = Vec::with_capacity(PREFIX_LEN + header.len() + 4 * values + optimizer.len());
    put_prefix(&mut out, SHARD_MAGIC, header.len());
    out.extend_from_slice(&header);
    for p in shard.params.params() {
        for v in &p.values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out.extend_from_slice(optimizer);
    out
}

/// Decodes a shard file (CKPT-4).
pub(crate) fn decode_shard(bytes: &[u8], path: &Path) -> Result<ShardSnapshot, CheckpointError> {
    let (_, header_len) = read_prefix(bytes, SHARD_MAGIC, path)?;
    let rest = &bytes[PREFIX_LEN..];
    let truncated = |declared: u64| CheckpointError::Truncated {
        path: path.to_path_buf(),
        declared,
        actual: bytes.len() as u64,
    };
    let header_end = usize::try_from(header_len)
        .ok()
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| truncated((PREFIX_LEN as u64).saturating_add(header_len)))?;
    let header: ShardHeader<'_> = decode_exact(&rest[..header_end], path, "shard header")?;
    let body = &rest[header_end..];

    // Every declared size, added up with overflow checks, must equal the bytes present
    // before anything is allocated.
    let overflow = || malformed(path, "declared sizes overflow");
    let mut sizes = Vec::with_capacity(header.params.len());
    let mut declared: u64 = 0;
    for p in &header.params {
        let count = p
            .dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .ok_or_else(overflow)?;
        let size = count.checked_mul(4).ok_or_else(overflow)?;
        declared = declared.checked_add(size).ok_or_else(overflow)?;
        sizes.push(size);
    }
    declared = declared
        .checked_add(header.optimizer_len.unwrap_or(0))
        .ok_or_else(overflow)?;
    let body_len = body.len() as u64;
    if declared > body_len {
        return Err(truncated(
            (PREFIX_LEN as u64 + header_len).saturating_add(declared),
        ));
    }
    if declared < body_len {
        return Err(malformed(
            path,
            format!("{} bytes after the declared contents", body_len - declared),
        ));
    }

    let mut names = HashSet::with_capacity(header.params.len());
    let mut params = Vec::with_capacity(header.params.len());
    let mut at = 0usize;
    for (p, size) in header.params.iter().zip(sizes) {
        if !names.insert(p.name) {
            return Err(malformed(path, format!("parameter {} twice", p.name)));
        }
        // Sizes sum to at most `body.len()`, so they fit in usize.
        let size = size as usize;
        let raw = &body[at..at + size];
        at += size;
        let dims = p
            .dims
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| overflow()))
            .collect::<Result<Vec<_>, _>>()?;
        let values = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        params.push(NamedParam {
            name: p.name.to_owned(),
            id: p.id,
            dims,
            values,
        });
    }
    let optimizer = header
        .optimizer_len
        .map(|_| OptimizerState::from_bytes(body[at..].to_vec()));
    Ok(ShardSnapshot {
        shard: header.shard,
        params: ShardParams::from_params(params),
        optimizer,
        training: TrainingState::default(),
    })
}

/// The bytes of part `index` of `of` of `shard`'s sharded optimizer state.
pub(crate) fn encode_part(shard: ShardId, index: u32, of: u32, part: &OptimizerPart) -> Vec<u8> {
    let header = encode_bincode(&PartHeader {
        shard,
        index,
        of,
        start: part.range.start,
        end: part.range.end,
        total: part.total,
    });
    let mut out = Vec::with_capacity(PREFIX_LEN + header.len() + part.bytes.len());
    put_prefix(&mut out, PART_MAGIC, header.len());
    out.extend_from_slice(&header);
    out.extend_from_slice(&part.bytes);
    out
}

/// Decodes a part file, checking it is part `index` of `of` of `shard` (CKPT-4, CKPT-8).
pub(crate) fn decode_part(
    bytes: &[u8],
    path: &Path,
    (shard, index, of): (ShardId, u32, u32),
) -> Result<OptimizerPart, CheckpointError> {
    let (_, header_len) = read_prefix(bytes, PART_MAGIC, path)?;
    let rest = &bytes[PREFIX_LEN..];
    let header_end = usize::try_from(header_len)
        .ok()
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| CheckpointError::Truncated {
            path: path.to_path_buf(),
            declared: (PREFIX_LEN as u64).saturating_add(header_len),
            actual: bytes.len() as u64,
        })?;
    let h: PartHeader = decode_exact(&rest[..header_end], path, "part header")?;
    if (h.shard, h.index, h.of) != (shard, index, of) {
        return Err(malformed(
            path,
            format!(
                "holds part {} of {} of {} where the manifest lists part {index} of {of} of {shard}",
                h.index, h.of, h.shard
            ),
        ));
    }
    if h.start > h.end || h.end > h.total {
        return Err(malformed(
            path,
            format!("range {}..{} of {} elements", h.start, h.end, h.total),
        ));
    }
    Ok(OptimizerPart {
        range: h.start..h.end,
        total: h.total,
        bytes: rest[header_end..].to_vec(),
    })
}

/// Parts that tile `0..total` exactly once, in order (CKPT-8); anything else is malformed.
pub(crate) fn check_parts(parts: &mut [OptimizerPart], path: &Path) -> Result<(), CheckpointError> {
    parts.sort_by_key(|p| (p.range.start, p.range.end));
    let total = parts.first().map_or(0, |p| p.total);
    let mut at = 0;
    for p in parts.iter() {
        if p.total != total || p.range.start != at {
            return Err(malformed(
                path,
                format!(
                    "optimizer parts do not tile 0..{total}: a part covers {:?} of {} where \
                     element {at} was next",
                    p.range, p.total
                ),
            ));
        }
        at = p.range.end;
    }
    if at != total {
        return Err(malformed(
            path,
            format!("optimizer parts stop at element {at} of {total}"),
        ));
    }
    Ok(())
}

/// One shard with its optimizer parts as one byte string, for moving a snapshot between
/// processes: the shard file's bytes, then each part file's, then its training state if it
/// has one (CKPT-9), each preceded by its length (u64, little-endian). Every piece keeps its
/// own magic, version and checks.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) fn encode_transfer(shard: &ShardSnapshot) -> Vec<u8> {
    let parts = shard
        .optimizer
        .as_ref()
        .and_then(|o| o.parts())
        .unwrap_or(&[]);
    let of = parts.len() as u32;
    let mut pieces = vec![encode_shard(shard)];
    pieces.extend(
        parts
            .iter()
            .enumerate()
            .map(|(i, p)| encode_part(shard.shard, i as u32, of, p)),
    );
    if !shard.training.is_empty() {
        pieces.push(encode_training(&shard.training));
    }
    let mut out = Vec::with_capacity(pieces.iter().map(|p| p.len() + 8).sum());
    for p in &pieces {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// Decodes [`encode_transfer`]'s bytes (CKPT-4: every length is checked against the bytes
/// there before use).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) fn decode_transfer(bytes: &[u8], path: &Path) -> Result<ShardSnapshot, CheckpointError> {
    let mut pieces = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let (len, tail) = rest
            .split_first_chunk::<8>()
            .ok_or_else(|| malformed(path, "a piece length cut short"))?;
        let len = usize::try_from(u64::from_le_bytes(*len))
            .ok()
            .filter(|&l| l <= tail.len())
            .ok_or_else(|| malformed(path, "a piece declares more bytes than are left"))?;
        pieces.push(&tail[..len]);
        rest = &tail[len..];
    }
    let (first, mut parts) = pieces
        .split_first()
        .ok_or_else(|| malformed(path, "no shard in the transfer"))?;
    let mut shard = decode_shard(first, path)?;
    if let Some((last, before)) = parts.split_last()
        && last.starts_with(TRAINING_MAGIC)
    {
        shard.training = decode_training(last, path)?;
        parts = before;
    }
    if !parts.is_empty() {
        let of = parts.len() as u32;
        // One rank's snapshot holds its own part only: the parts tile the order once the
        // Supervisor has gathered every rank's (checked when a checkpoint is read, CKPT-8, and
        // when restored state is re-sharded, ZERO-3).
        let decoded = parts
            .iter()
            .enumerate()
            .map(|(i, p)| decode_part(p, path, (shard.shard, i as u32, of)))
            .collect::<Result<Vec<_>, _>>()?;
        shard.optimizer = Some(OptimizerState::from_parts(decoded));
    }
    Ok(shard)
}

/// The bytes of a shard's training state on its own (the last piece of a transfer).
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
fn encode_training(training: &TrainingState) -> Vec<u8> {
    let body = encode_bincode(training);
    let mut out = Vec::with_capacity(PREFIX_LEN + body.len());
    put_prefix(&mut out, TRAINING_MAGIC, body.len());
    out.extend_from_slice(&body);
    out
}

/// Decodes [`encode_training`]'s bytes.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
fn decode_training(bytes: &[u8], path: &Path) -> Result<TrainingState, CheckpointError> {
    let (_, body_len) = read_prefix(bytes, TRAINING_MAGIC, path)?;
    let body = &bytes[PREFIX_LEN..];
    if body_len != body.len() as u64 {
        return Err(CheckpointError::Truncated {
            path: path.to_path_buf(),
            declared: (PREFIX_LEN as u64).saturating_add(body_len),
            actual: bytes.len() as u64,
        });
    }
    decode_exact(body, path, "training state")
}

/// The bytes of a manifest.
pub(crate) fn encode_manifest(manifest: &Manifest) -> Vec<u8> {
    let body = ManifestBody {
        step: manifest.step,
        layout: manifest.layout,
        cursor: manifest.cursor,
        rng: manifest.rng,
        shards: manifest
            .shards
            .iter()
            .map(|s| ShardEntryRef {
                shard: s.shard,
                file: &s.file,
                len: s.len,
                crc32: s.crc32,
                parts: s
                    .parts
                    .iter()
                    .map(|p| PartEntryRef {
                        index: p.index,
                        of: p.of,
                        file: &p.file,
                        len: p.len,
                        crc32: p.crc32,
                    })
                    .collect(),
            })
            .collect(),
    };
    // CKPT-9: the training state follows the version 2 body.
    let mut body = encode_bincode(&body);
    body.extend_from_slice(&encode_bincode(&manifest.training));
    let mut out = Vec::with_capacity(PREFIX_LEN + body.len() + CRC_LEN);
    put_prefix(&mut out, MANIFEST_MAGIC, body.len());
    out.extend_from_slice(&body);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes a manifest: magic, version, length, checksum, then the body (CKPT-2, CKPT-4).
pub(crate) fn decode_manifest(bytes: &[u8], path: &Path) -> Result<Manifest, CheckpointError> {
    let (version, body_len) = read_prefix(bytes, MANIFEST_MAGIC, path)?;
    let expected = (PREFIX_LEN as u64 + CRC_LEN as u64).saturating_add(body_len);
    let actual = bytes.len() as u64;
    if expected > actual {
        return Err(CheckpointError::Truncated {
            path: path.to_path_buf(),
            declared: expected,
            actual,
        });
    }
    if expected < actual {
        return Err(malformed(
            path,
            format!("{} bytes after the checksum", actual - expected),
        ));
    }
    // `expected == actual`, so the body length fits in usize.
    let crc_at = PREFIX_LEN + body_len as usize;
    let stored = u32::from_le_bytes([
        bytes[crc_at],
        bytes[crc_at + 1],
        bytes[crc_at + 2],
        bytes[crc_at + 3],
    ]);
    let computed = crc32fast::hash(&bytes[..crc_at]);
    if stored != computed {
        return Err(CheckpointError::ManifestChecksum {
            path: path.to_path_buf(),
            stored,
            computed,
        });
    }
    let all = &bytes[PREFIX_LEN..crc_at];
    let (body, training) = if version < TRAINING_SINCE {
        let body: ManifestBody<'_> = decode_exact(all, path, "manifest")?;
        (body, TrainingState::default())
    } else {
        let (body, used) =
            bincode::serde::borrow_decode_from_slice::<ManifestBody<'_>, _>(all, config())
                .map_err(|e| malformed(path, format!("manifest: {e}")))?;
        let training = decode_exact(&all[used..], path, "manifest's training state")?;
        (body, training)
    };
    let layout = Layout::new(body.layout.dp(), body.layout.pp(), body.layout.tp())
        .map_err(|e| malformed(path, format!("layout: {e}")))?;
    let mut seen = HashSet::with_capacity(body.shards.len());
    let mut shards = Vec::with_capacity(body.shards.len());
    for s in body.shards {
        if !seen.insert(s.shard) {
            return Err(malformed(path, format!("{} listed twice", s.shard)));
        }
        // The file name is derived from the shard id: a manifest cannot point outside its
        // directory.
        if s.file != s.shard.file_name() {
            return Err(malformed(
                path,
                format!("{} has file name {:?}", s.shard, s.file),
            ));
        }
        let of = s.parts.len() as u32;
        let mut parts = Vec::with_capacity(s.parts.len());
        for (i, p) in s.parts.iter().enumerate() {
            if p.index != i as u32 || p.of != of || p.file != s.shard.part_file_name(p.index, of) {
                return Err(malformed(
                    path,
                    format!(
                        "{} lists part {} of {} as {:?} at position {i} of {of}",
                        s.shard, p.index, p.of, p.file
                    ),
                ));
            }
            parts.push(PartEntry {
                index: p.index,
                of: p.of,
                file: p.file.to_owned(),
                len: p.len,
                crc32: p.crc32,
            });
        }
        shards.push(ShardEntry {
            shard: s.shard,
            file: s.file.to_owned(),
            len: s.len,
            crc32: s.crc32,
            parts,
        });
    }
    Ok(Manifest {
        step: body.step,
        layout,
        cursor: body.cursor,
        rng: body.rng,
        shards,
        training,
    })
}
