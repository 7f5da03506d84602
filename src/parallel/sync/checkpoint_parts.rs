//! A stage's part of a checkpoint: the parameter and optimizer-state parts a rank writes and
//! how a model and a flat shard are restored from them (CKPT-10).

use super::*;

/// `model` with the parameters of `params` (CKPT-10): its flat trainable parameters (in
/// `layout`'s order) put together from the parameter parts, the other float parameters by
/// name; the flat vector is returned too. Without parts, every parameter by name (and no flat
/// vector). The trainable parameters keep `model`'s ids, which `layout` is keyed by.
pub(crate) fn restore_flat<M: Module>(
    model: M,
    layout: &ParamLayout,
    params: &ShardParams,
) -> Result<(M, Option<Vec<f32>>), CheckpointError> {
    let Some(flat) = params.flat_parameters(layout.len())? else {
        return Ok((restore_module(model, params)?, None));
    };
    let model = with_flat_and_named(model, layout, &flat, params)?;
    Ok((model, Some(flat)))
}

/// `model` with its trainable parameters set from `flat` (in `layout`'s order; they keep
/// `model`'s ids) and its other float parameters (buffers) taken by name from `named`.
pub(crate) fn with_flat_and_named<M: Module>(
    model: M,
    layout: &ParamLayout,
    flat: &[f32],
    named: &ShardParams,
) -> Result<M, CheckpointError> {
    let model = set_trainable(model, layout, flat);
    let trainable: std::collections::HashSet<u64> =
        layout.slots().iter().map(|s| s.id.val()).collect();
    let merged = snapshot_module(&model)
        .params()
        .iter()
        .map(|p| {
            if trainable.contains(&p.id) {
                Ok(p.clone())
            } else {
                named
                    .get(&p.name)
                    .cloned()
                    .ok_or_else(|| CheckpointError::MissingParameter {
                        name: p.name.clone(),
                    })
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    restore_module(model, &ShardParams::from_params(merged))
}

/// A rank's own state as its one part of the group's optimizer state (rank `rank` of
/// `world`): how strategies whose ranks each keep state of their own (a compressor's
/// residual, a local-updates rank's parameters) checkpoint it.
pub(crate) fn rank_part(bytes: Vec<u8>, (rank, world): (usize, usize)) -> OptimizerState {
    OptimizerState::from_parts(vec![OptimizerPart {
        range: rank as u64..rank as u64 + 1,
        total: world as u64,
        bytes,
    }])
}

/// A ZeRO optimizer shard as its checkpoint part (CKPT-8).
pub(crate) fn shard_state(own: &OptimizerShard) -> Result<OptimizerState, CheckpointError> {
    let bytes = bincode::serde::encode_to_vec(own, bincode::config::standard()).map_err(|e| {
        CheckpointError::Optimizer {
            reason: format!("encoding the ZeRO shard: {e}"),
        }
    })?;
    Ok(OptimizerState::from_parts(vec![OptimizerPart {
        range: own.range.start as u64..own.range.end as u64,
        total: own.total as u64,
        bytes,
    }]))
}

/// `state`'s parts re-sharded onto rank `rank` of `world` (ZERO-3) with `own`'s rule, and
/// the decoded parts; an error unless they are ZeRO parts of the same kind of rule.
pub(crate) fn restore_shard(
    state: &OptimizerState,
    own: &OptimizerShard,
    len: usize,
    rank: usize,
    world: usize,
) -> Result<(OptimizerShard, Vec<OptimizerShard>), CheckpointError> {
    let decoded = decode_zero_parts(state)?;
    let mut shard =
        reshard(&decoded, len, world, rank).map_err(|e| CheckpointError::Optimizer {
            reason: e.to_string(),
        })?;
    // The configured rule steps on (a resumed job may change, say, its weight decay), as
    // long as its state has the same buffers.
    if shard.rule.state_words() != own.rule.state_words()
        || std::mem::discriminant(&shard.rule) != std::mem::discriminant(&own.rule)
    {
        return Err(CheckpointError::Optimizer {
            reason: format!(
                "the checkpoint's optimizer is {:?}, this job's is {:?}",
                shard.rule, own.rule
            ),
        });
    }
    shard.rule = own.rule;
    Ok((shard, decoded))
}

/// The ZeRO shards a sharded optimizer state's parts hold (CKPT-8), each checked against its
/// part's range; an error for whole state or parts of another kind.
pub(crate) fn decode_zero_parts(
    state: &OptimizerState,
) -> Result<Vec<OptimizerShard>, CheckpointError> {
    let Some(parts) = state.parts() else {
        return Err(CheckpointError::Optimizer {
            reason: "the checkpoint holds a whole-model optimizer state (no ZeRO); it \
                     cannot be sharded: resume without `zero` or start afresh"
                .into(),
        });
    };
    parts
        .iter()
        .map(|p| {
            let (shard, used) = bincode::serde::decode_from_slice::<OptimizerShard, _>(
                &p.bytes,
                bincode::config::standard(),
            )
            .map_err(|e| CheckpointError::Optimizer {
                reason: format!("a ZeRO part does not decode: {e}"),
            })?;
            let matches = used == p.bytes.len()
                && shard.range.start as u64 == p.range.start
                && shard.range.end as u64 == p.range.end
                && shard.total as u64 == p.total;
            if !matches {
                return Err(CheckpointError::Optimizer {
                    reason: format!(
                        "a ZeRO part listed as {:?} of {} holds {:?} of {}",
                        p.range, p.total, shard.range, shard.total
                    ),
                });
            }
            Ok(shard)
        })
        .collect()
}
