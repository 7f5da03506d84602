//! A tensor-parallel checkpoint onto another degree (TP-7): one block's slices, written by a
//! group of `T` ranks, joined into whole parameters and optimizer state, then cut into the
//! part a rank of a group of `T'` holds — Megatron-LM's checkpoint conversion, done when the
//! checkpoint is restored.
//!
//! What is re-sliced, along each split parameter's axis ([`chunk_range`]'s rule, TP-3):
//! - the parameters by name (a replicated one is the same on every rank: rank 0's is kept);
//! - Burn's optimizer state (SGD's momentum, Adam's and AdamW's moments): each tensor of the
//!   burnpack record whose parameter is split and whose shape is that parameter's slice is
//!   joined and cut like it; every other tensor and scalar (step counts) is rank 0's;
//! - a ZeRO-1/2 shard's flat state (every buffer of [`FlatState`]): each rank's flat order is
//!   its trainable slices in visit order, so the buffers are cut into parameters, re-sliced,
//!   and laid out in the new rank's flat order as one part, which the restore re-shards onto
//!   the rank's data-parallel group (CKPT-8).
//!
//! ZeRO-3's parameter parts (CKPT-10) are not re-sliced: they hold a rank's flat order without
//! its shapes. Local-updates and compressor states are a rank's own and are not re-sliced
//! either. Each says so in its error.
//!
//! Invariant TP-7: cutting a whole block for every rank of any degree and joining the parts
//! gives the whole back bitwise, so re-slicing onto the same degree is the identity and onto
//! another degree keeps every value where the one-device model has it.

use crate::checkpoint::{
    BurnRecord, CheckpointError, NamedParam, OptimizerState, RecordTensor, ShardId, ShardParams,
    ShardSnapshot,
};
use crate::mesh::chunk_range;
use crate::parallel::sync::{decode_zero_parts, shard_state};
use crate::parallel::zero::{FlatState, OptimizerShard, StateBuffer, reshard};

/// One float parameter of a tensor-parallel block as the block holds it, in visit order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeldParam {
    /// Its structural path (the checkpoint's name for it).
    pub name: String,
    /// The axis it is split along; `None` for a replicated parameter.
    pub axis: Option<usize>,
    /// Whether it is in the block's flat trainable order (ZeRO's state covers only those).
    pub trainable: bool,
}

/// A checkpoint's slices of one block (`parts`, one per rank of the old group, in rank
/// order) as the shard rank `rank` of a group of `degree` holds: parameters and optimizer
/// state re-sliced (TP-7). The training state (learning-rate schedule, loss scale) is the
/// same on every part; rank 0's is kept.
pub(crate) fn reslice(
    parts: &[&ShardSnapshot],
    held: &[HeldParam],
    rank: usize,
    degree: usize,
) -> Result<ShardSnapshot, CheckpointError> {
    let Some(first) = parts.first() else {
        return Err(refused(
            "a block",
            "the checkpoint holds none of its slices",
        ));
    };
    if parts.iter().any(|p| p.params.has_parts()) {
        return Err(CheckpointError::ParameterParts {
            reason: format!(
                "{} holds ZeRO-3 parameter parts, which keep a rank's flat order without its \
                 shapes: a ZeRO-3 tensor-parallel checkpoint restores onto its own degree \
                 ({}) only",
                first.shard,
                parts.len()
            ),
        });
    }
    let axis_of = |name: &str| held.iter().find(|h| h.name == name).and_then(|h| h.axis);
    let mut params = Vec::with_capacity(first.params.len());
    for p in first.params.params() {
        let same: Vec<&NamedParam> = parts
            .iter()
            .map(|s| {
                s.params
                    .get(&p.name)
                    .ok_or_else(|| CheckpointError::MissingParameter {
                        name: format!("{} of {}", p.name, s.shard),
                    })
            })
            .collect::<Result<_, _>>()?;
        let (dims, values) = match axis_of(&p.name) {
            None => (p.dims.clone(), p.values.clone()),
            Some(axis) => {
                let slices: Vec<(&[usize], &[f32])> = same
                    .iter()
                    .map(|q| (q.dims.as_slice(), q.values.as_slice()))
                    .collect();
                let (whole_dims, whole) = join(&slices, axis, &p.name)?;
                cut(&whole_dims, &whole, axis, rank, degree)
            }
        };
        params.push(NamedParam {
            name: p.name.clone(),
            id: p.id,
            dims,
            values,
        });
    }
    let optimizer = match parts
        .iter()
        .map(|p| p.optimizer.as_ref())
        .collect::<Option<Vec<_>>>()
    {
        None => None,
        Some(states) => Some(reslice_optimizer(parts, &states, held, rank, degree)?),
    };
    Ok(ShardSnapshot {
        shard: ShardId {
            pp: first.shard.pp,
            tp: rank as u32,
        },
        params: ShardParams::from_params(params),
        optimizer,
        training: first.training.clone(),
    })
}

fn refused(what: impl Into<String>, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Reslice {
        what: what.into(),
        reason: reason.into(),
    }
}

/// The optimizer states of every old rank (`states[r]` of `parts[r]`) as rank `rank` of
/// `degree` holds it.
fn reslice_optimizer(
    parts: &[&ShardSnapshot],
    states: &[&OptimizerState],
    held: &[HeldParam],
    rank: usize,
    degree: usize,
) -> Result<OptimizerState, CheckpointError> {
    if let Some(whole) = states
        .iter()
        .map(|s| s.whole_bytes())
        .collect::<Option<Vec<_>>>()
    {
        return reslice_burn(parts, &whole, held, rank, degree).map(OptimizerState::from_bytes);
    }
    let decoded = states
        .iter()
        .map(|s| decode_zero_parts(s))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            refused(
                "the optimizer state",
                format!("only Burn's optimizer state and ZeRO-1/2's are re-sliced ({e})"),
            )
        })?;
    reslice_zero(parts, &decoded, held, rank, degree).and_then(|s| shard_state(&s))
}

/// Burn's records of each old rank (burnpack bytes) as rank `rank` of `degree` holds it.
fn reslice_burn(
    parts: &[&ShardSnapshot],
    records: &[&[u8]],
    held: &[HeldParam],
    rank: usize,
    degree: usize,
) -> Result<Vec<u8>, CheckpointError> {
    let bad = |e: burn_pack::Error| refused("Burn's optimizer record", e.to_string());
    let mut tensors = Vec::with_capacity(records.len());
    let mut first = None;
    for bytes in records {
        let record = BurnRecord::read(bytes).map_err(bad)?;
        tensors.push(record.tensors);
        first.get_or_insert((record.scalars, record.metadata));
    }
    let Some((scalars, metadata)) = first else {
        return Err(refused("Burn's optimizer record", "no old rank's record"));
    };
    // A split parameter by id, with its slice's dims on each old rank.
    let split_by_id = |id: u64| -> Option<(usize, Vec<&[usize]>)> {
        let name = &parts[0].params.params().iter().find(|p| p.id == id)?.name;
        let axis = held.iter().find(|h| &h.name == name)?.axis?;
        let dims = parts
            .iter()
            .map(|s| s.params.get(name).map(|p| p.dims.as_slice()))
            .collect::<Option<Vec<_>>>()?;
        Some((axis, dims))
    };
    let mut out = Vec::with_capacity(tensors[0].len());
    for e in &tensors[0] {
        let split = e.param_id.and_then(split_by_id);
        let bytes = match split {
            Some((axis, dims)) if dims[0] == e.dims.as_slice() => {
                let width = e.dtype.size();
                // The element's bytes as a last axis of its own: the same cut on any type.
                let mut slices = Vec::with_capacity(parts.len());
                for (r, d) in dims.iter().enumerate() {
                    let other = tensors[r]
                        .iter()
                        .find(|x| x.name == e.name)
                        .ok_or_else(|| {
                            refused(&e.name, format!("old rank {r}'s record has none"))
                        })?;
                    if other.dims.as_slice() != *d {
                        return Err(refused(
                            &e.name,
                            format!(
                                "on old rank {r} it has shape {:?}, its parameter {d:?}",
                                other.dims
                            ),
                        ));
                    }
                    slices.push((with_width(d, width), other.bytes.as_slice()));
                }
                let borrowed: Vec<(&[usize], &[u8])> =
                    slices.iter().map(|(d, b)| (d.as_slice(), *b)).collect();
                let (whole_dims, whole) = join(&borrowed, axis, &e.name)?;
                let (mut dims, bytes) = cut(&whole_dims, &whole, axis, rank, degree);
                dims.pop();
                (dims, bytes)
            }
            _ => (e.dims.clone(), e.bytes.clone()),
        };
        out.push(RecordTensor {
            name: e.name.clone(),
            dtype: e.dtype,
            dims: bytes.0,
            param_id: e.param_id,
            bytes: bytes.1,
        });
    }
    BurnRecord {
        tensors: out,
        scalars,
        metadata,
    }
    .write()
    .map_err(|e| refused("Burn's optimizer record", format!("writing it: {e}")))
}

fn with_width(dims: &[usize], width: usize) -> Vec<usize> {
    let mut d = dims.to_vec();
    d.push(width);
    d
}

/// ZeRO-1/2's state of each old rank (`shards[r]`: its parts, tiling its flat order) as one
/// part covering the whole flat order of rank `rank` of `degree`.
fn reslice_zero(
    parts: &[&ShardSnapshot],
    shards: &[Vec<OptimizerShard>],
    held: &[HeldParam],
    rank: usize,
    degree: usize,
) -> Result<OptimizerShard, CheckpointError> {
    let trainable: Vec<&HeldParam> = held.iter().filter(|h| h.trainable).collect();
    // Each old rank's whole flat state, and its trainable slices' dims in flat order.
    let mut wholes = Vec::with_capacity(parts.len());
    let mut dims = Vec::with_capacity(parts.len());
    for (s, own) in parts.iter().zip(shards) {
        let d = trainable
            .iter()
            .map(|h| {
                s.params
                    .get(&h.name)
                    .map(|p| p.dims.clone())
                    .ok_or_else(|| CheckpointError::MissingParameter {
                        name: format!("{} of {}", h.name, s.shard),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let len = d.iter().map(|d| d.iter().product::<usize>()).sum();
        let whole = reshard(own, len, 1, 0)
            .map_err(|e| refused(format!("the ZeRO state of {}", s.shard), e.to_string()))?;
        wholes.push(whole);
        dims.push(d);
    }
    let pick: [fn(&FlatState) -> &[f32]; 3] = [|s| &s.first, |s| &s.second, |s| &s.max_second];
    let mut buffers: [Vec<f32>; 3] = Default::default();
    let mut total = 0;
    for (i, h) in trainable.iter().enumerate() {
        let offset = |r: usize| -> usize {
            dims[r][..i]
                .iter()
                .map(|d| d.iter().product::<usize>())
                .sum()
        };
        for (b, pick) in pick.iter().enumerate() {
            if wholes.iter().all(|w| pick(&w.state).is_empty()) {
                continue;
            }
            let slices: Vec<(&[usize], &[f32])> = (0..parts.len())
                .map(|r| {
                    let n: usize = dims[r][i].iter().product();
                    let buf = pick(&wholes[r].state);
                    let at = offset(r);
                    buf.get(at..at + n)
                        .map(|v| (dims[r][i].as_slice(), v))
                        .ok_or_else(|| {
                            refused(&h.name, format!("old rank {r}'s ZeRO state is short"))
                        })
                })
                .collect::<Result<_, _>>()?;
            let v = match h.axis {
                Some(axis) => {
                    let (whole_dims, whole) = join(&slices, axis, &h.name)?;
                    cut(&whole_dims, &whole, axis, rank, degree).1
                }
                None => slices[0].1.to_vec(),
            };
            buffers[b].extend_from_slice(&v);
        }
        let new_dims = match h.axis {
            Some(axis) => {
                let mut whole = dims[0][i].clone();
                if axis >= whole.len() {
                    return Err(refused(
                        &h.name,
                        format!("axis {axis} of a {}-d tensor", whole.len()),
                    ));
                }
                whole[axis] = (0..parts.len())
                    .map(|r| dims[r][i].get(axis).copied().unwrap_or(0))
                    .sum();
                cut_dims(&whole, axis, rank, degree)
            }
            None => dims[0][i].clone(),
        };
        total += new_dims.iter().product::<usize>();
    }
    let [first, second, max_second] = buffers;
    let old = &wholes[0];
    Ok(OptimizerShard {
        rule: old.rule,
        range: 0..total,
        total,
        state: FlatState {
            steps: old.state.steps,
            first: StateBuffer::staggered(&first, 1),
            second: StateBuffer::staggered(&second, 2),
            max_second: StateBuffer::staggered(&max_second, 3),
        },
    })
}

/// The slices of one tensor (each `(dims, values)` in row-major order), one per rank in
/// rank order, put together along `axis`: the whole tensor. The slices must agree on every
/// other axis.
pub(crate) fn join<T: Copy>(
    slices: &[(&[usize], &[T])],
    axis: usize,
    name: &str,
) -> Result<(Vec<usize>, Vec<T>), CheckpointError> {
    let bad = |why: String| refused(name, why);
    let Some(&(first, _)) = slices.first() else {
        return Err(bad("no slices".into()));
    };
    if axis >= first.len() {
        return Err(bad(format!("axis {axis} of a {}-d tensor", first.len())));
    }
    for (d, v) in slices {
        let agree = d.len() == first.len()
            && d.iter()
                .zip(first)
                .enumerate()
                .all(|(k, (a, b))| k == axis || a == b);
        if !agree || v.len() != d.iter().product::<usize>() {
            return Err(bad(format!(
                "a slice of shape {d:?} with {} values",
                v.len()
            )));
        }
    }
    let outer: usize = first[..axis].iter().product();
    let inner: usize = first[axis + 1..].iter().product();
    let mut dims = first.to_vec();
    dims[axis] = slices.iter().map(|(d, _)| d[axis]).sum();
    let mut out = Vec::with_capacity(dims.iter().product());
    for o in 0..outer {
        for (d, v) in slices {
            let run = d[axis] * inner;
            out.extend_from_slice(&v[o * run..(o + 1) * run]);
        }
    }
    Ok((dims, out))
}

/// The dims of rank `rank`'s slice of a tensor of `dims` split along `axis` over `degree`.
fn cut_dims(dims: &[usize], axis: usize, rank: usize, degree: usize) -> Vec<usize> {
    let mut d = dims.to_vec();
    d[axis] = chunk_range(dims[axis], degree, rank).len();
    d
}

/// Rank `rank`'s slice along `axis` of a whole tensor over `degree` ranks (TP-3's rule);
/// `axis` must be one of `dims`' (as [`join`] checked).
pub(crate) fn cut<T: Copy>(
    dims: &[usize],
    values: &[T],
    axis: usize,
    rank: usize,
    degree: usize,
) -> (Vec<usize>, Vec<T>) {
    let r = chunk_range(dims[axis], degree, rank);
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let run = dims[axis] * inner;
    let mut out = Vec::with_capacity(outer * r.len() * inner);
    for o in 0..outer {
        out.extend_from_slice(&values[o * run + r.start * inner..o * run + r.end * inner]);
    }
    (cut_dims(dims, axis, rank, degree), out)
}

#[cfg(test)]
mod tests;
