//! A module's float parameters by structural path, and its optimizer state as bytes.
//!
//! Paths come from the `enter_module`/`exit_module` calls Burn's derived `Module::visit` and
//! `Module::map` make around every field (`layers.0.weight`); `Option` fields add no level.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Bytes, DType, Tensor, TensorData};

use super::CheckpointError;

/// One float parameter's values.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedParam {
    /// Its structural path in the module, e.g. `layers.0.weight`.
    pub name: String,
    /// The id (`ParamId`) it had when snapshotted; [`restore_module`] gives it back (CKPT-5).
    pub id: u64,
    /// Its shape.
    pub dims: Vec<usize>,
    /// Its values in row-major order, as `f32` (`dims`' product of them).
    pub values: Vec<f32>,
}

/// A shard's float parameters, in the module's visit order, names unique.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardParams {
    params: Vec<NamedParam>,
}

impl ShardParams {
    /// Parameters whose names the caller guarantees unique (decoded files are checked).
    pub(crate) fn from_params(params: Vec<NamedParam>) -> Self {
        Self { params }
    }

    /// The parameters, in visit order.
    pub fn params(&self) -> &[NamedParam] {
        &self.params
    }

    /// The parameter with this path.
    pub fn get(&self, name: &str) -> Option<&NamedParam> {
        self.params.iter().find(|p| p.name == name)
    }

    /// How many parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The union of several shards' parameters (e.g. the stages a new pipeline split puts
    /// together); a name held by two of them is an error.
    pub fn merge(shards: impl IntoIterator<Item = ShardParams>) -> Result<Self, CheckpointError> {
        let mut seen = HashSet::new();
        let mut params = Vec::new();
        for shard in shards {
            for p in shard.params {
                if !seen.insert(p.name.clone()) {
                    return Err(CheckpointError::DuplicateParameter { name: p.name });
                }
                params.push(p);
            }
        }
        Ok(Self { params })
    }

    /// The same parameters under new names, e.g. a stage's `layers.0.weight` as the whole
    /// model's `layers.3.weight`; two parameters renamed alike are an error.
    pub fn renamed(self, mut rename: impl FnMut(&str) -> String) -> Result<Self, CheckpointError> {
        let params = self
            .params
            .into_iter()
            .map(|p| NamedParam {
                name: rename(&p.name),
                ..p
            })
            .collect();
        Self::merge([Self { params }])
    }

    /// Only the parameters whose name `keep` accepts, e.g. one stage's share of a whole
    /// model's parameters.
    pub fn filtered(self, mut keep: impl FnMut(&str) -> bool) -> Self {
        Self {
            params: self.params.into_iter().filter(|p| keep(&p.name)).collect(),
        }
    }
}

/// The name prefix of a parameter part's entry (CKPT-10): no module path starts with `#`.
const PART_PREFIX: &str = "#flat[";

/// One data-parallel rank's part of a ZeRO-3 block's parameters (CKPT-10): which elements of
/// the block's flat trainable-parameter order it covers, and their values.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamPart {
    /// The elements covered.
    pub range: std::ops::Range<u64>,
    /// The length of the whole flat order.
    pub total: u64,
    /// Their values, `range`'s length of them.
    pub values: Vec<f32>,
}

impl ParamPart {
    /// The entry that stores it among named parameters: `#flat[start..end]/total`, one
    /// dimension; it travels and is checksummed like any parameter of the shard file.
    fn into_named(self) -> NamedParam {
        NamedParam {
            name: format!(
                "{PART_PREFIX}{}..{}]/{}",
                self.range.start, self.range.end, self.total
            ),
            id: 0,
            dims: vec![self.values.len()],
            values: self.values,
        }
    }

    /// The part an entry stores; `None` for a module's parameter, an error for an entry
    /// named as a part that does not parse or whose length is not its range's.
    fn of_named(p: &NamedParam) -> Option<Result<Self, CheckpointError>> {
        let rest = p.name.strip_prefix(PART_PREFIX)?;
        let bad = || CheckpointError::ParameterParts {
            reason: format!("entry {} is not a well-formed part", p.name),
        };
        let parse = || -> Option<(u64, u64, u64)> {
            let (range, total) = rest.split_once("]/")?;
            let (start, end) = range.split_once("..")?;
            Some((start.parse().ok()?, end.parse().ok()?, total.parse().ok()?))
        };
        Some(match parse() {
            Some((start, end, total))
                if start <= end && end <= total && (end - start) as usize == p.values.len() =>
            {
                Ok(ParamPart {
                    range: start..end,
                    total,
                    values: p.values.clone(),
                })
            }
            _ => Err(bad()),
        })
    }
}

impl ShardParams {
    /// `named` (a sharded block's parameters that are not in its flat order, such as
    /// buffers) with `part` of its flat trainable parameters (CKPT-10).
    pub fn with_part(named: ShardParams, part: ParamPart) -> Self {
        let mut params = named.params;
        params.push(part.into_named());
        Self { params }
    }

    /// The module parameters by name, without parameter parts.
    pub fn named(&self) -> impl Iterator<Item = &NamedParam> {
        self.params
            .iter()
            .filter(|p| !p.name.starts_with(PART_PREFIX))
    }

    /// Whether it holds parameter parts (a ZeRO-3 block's snapshot, CKPT-10).
    pub fn has_parts(&self) -> bool {
        self.params.iter().any(|p| p.name.starts_with(PART_PREFIX))
    }

    /// These parameters with `other`'s parameter parts added (every rank's snapshot of a
    /// ZeRO-3 block holds its own part); a part already held is not added twice.
    pub fn add_parts(&mut self, other: ShardParams) {
        for p in other.params {
            if p.name.starts_with(PART_PREFIX) && self.get(&p.name).is_none() {
                self.params.push(p);
            }
        }
    }

    /// The flat trainable parameters of a block of `total` elements, put together from the
    /// parameter parts (CKPT-10): `None` when there are none; an error unless they tile
    /// `0..total` exactly once.
    pub fn flat_parameters(&self, total: usize) -> Result<Option<Vec<f32>>, CheckpointError> {
        let mut parts = self
            .params
            .iter()
            .filter_map(ParamPart::of_named)
            .collect::<Result<Vec<_>, _>>()?;
        if parts.is_empty() {
            return Ok(None);
        }
        parts.sort_by_key(|p| (p.range.start, p.range.end));
        let mut flat = Vec::with_capacity(total);
        for p in parts {
            if p.total != total as u64 || p.range.start != flat.len() as u64 {
                return Err(CheckpointError::ParameterParts {
                    reason: format!(
                        "a part covers {:?} of {} where the block has {total} elements and \
                         the parts so far end at {}",
                        p.range,
                        p.total,
                        flat.len()
                    ),
                });
            }
            flat.extend_from_slice(&p.values);
        }
        if flat.len() != total {
            return Err(CheckpointError::ParameterParts {
                reason: format!("the parts stop at element {} of {total}", flat.len()),
            });
        }
        Ok(Some(flat))
    }
}

/// Tracks the path of the parameter being visited; a path seen twice (a module that visits
/// the same field twice) gets a `#n` suffix so names stay unique, the same way every time.
#[derive(Default)]
struct PathTracker {
    stack: Vec<String>,
    seen: HashMap<String, usize>,
}

impl PathTracker {
    fn enter(&mut self, name: &str) {
        self.stack.push(name.to_owned());
    }

    fn exit(&mut self) {
        self.stack.pop();
    }

    fn next_name(&mut self) -> String {
        let path = self.stack.join(".");
        let n = self.seen.entry(path.clone()).or_insert(0);
        *n += 1;
        if *n == 1 {
            path
        } else {
            format!("{path}#{}", *n - 1)
        }
    }
}

/// A copy of every float parameter of `module`, by structural path, as `f32`.
///
/// Integer and boolean parameters are not stored. Call it where the module lives (its
/// device thread): reading values back may wait for the device.
pub fn snapshot_module<M: Module>(module: &M) -> ShardParams {
    struct Snapshot {
        path: PathTracker,
        params: Vec<NamedParam>,
    }
    impl ModuleVisitor for Snapshot {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            let dims = tensor.shape().to_vec();
            let data = tensor.into_data();
            let data = if data.dtype() == DType::F32 {
                data
            } else {
                data.convert::<f32>()
            };
            let values = data
                .try_into_vec::<f32>()
                .expect("tensor data converted to f32 reads as f32");
            self.params.push(NamedParam {
                name: self.path.next_name(),
                id: param.id.val(),
                dims,
                values,
            });
        }
    }
    let mut s = Snapshot {
        path: PathTracker::default(),
        params: Vec::new(),
    };
    module.visit(&mut s);
    ShardParams { params: s.params }
}

/// `module` with every float parameter set from the entry of the same path in `params`
/// (CKPT-5): values, shape-checked, converted to the parameter's dtype, on its device, with
/// its `require_grad`, and with the id recorded in the checkpoint so a restored optimizer
/// state applies. Every name is checked before anything changes: a missing name or another
/// shape is an error naming the parameter. Entries the module does not have are ignored, so
/// a merged set of several shards can restore each of them.
pub fn restore_module<M: Module>(module: M, params: &ShardParams) -> Result<M, CheckpointError> {
    let by_name: HashMap<&str, &NamedParam> =
        params.params.iter().map(|p| (p.name.as_str(), p)).collect();

    struct Check<'a> {
        path: PathTracker,
        by_name: &'a HashMap<&'a str, &'a NamedParam>,
        error: Option<CheckpointError>,
    }
    impl ModuleVisitor for Check<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let name = self.path.next_name();
            if self.error.is_some() {
                return;
            }
            let shape = param.val().shape().to_vec();
            self.error = match self.by_name.get(name.as_str()) {
                None => Some(CheckpointError::MissingParameter { name }),
                Some(p) if p.dims != shape || p.values.len() != shape.iter().product::<usize>() => {
                    Some(CheckpointError::ShapeMismatch {
                        name,
                        module: shape,
                        checkpoint: p.dims.clone(),
                    })
                }
                Some(_) => None,
            };
        }
    }
    let mut check = Check {
        path: PathTracker::default(),
        by_name: &by_name,
        error: None,
    };
    module.visit(&mut check);
    if let Some(e) = check.error {
        return Err(e);
    }

    struct Restore<'a> {
        path: PathTracker,
        by_name: &'a HashMap<&'a str, &'a NamedParam>,
    }
    impl ModuleMapper for Restore<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let name = self.path.next_name();
            let stored = *self
                .by_name
                .get(name.as_str())
                .expect("every name was checked before mapping");
            let mut param = param.map(|old| {
                let device = old.device();
                let dtype = old.dtype();
                let grad = old.is_require_grad();
                let data = TensorData::new(stored.values.clone(), stored.dims.clone());
                let mut t = Tensor::<D>::from_data(data, &device);
                if t.dtype() != dtype {
                    t = t.cast(dtype);
                }
                if grad { t.require_grad() } else { t }
            });
            param.id = ParamId::from(stored.id);
            param
        }
    }
    let mut restore = Restore {
        path: PathTracker::default(),
        by_name: &by_name,
    };
    Ok(module.map(&mut restore))
}

/// A shard's optimizer state: either the whole block's, as the bytes Burn serializes it to
/// (burnpack, through `ModuleOptimizer::into_bytes`), or, for a sharded optimizer (ZeRO), one
/// part per data-parallel rank, each covering a range of the block's flat trainable-parameter
/// order. Burn keys whole state by parameter id, so it applies to a module restored by
/// [`restore_module`] from the same shard (CKPT-5).
///
/// Burn 0.22 gives no public way to merge or split an optimizer record (its fields are
/// crate-private and `load_record` replaces the whole state), so after a different pipeline
/// split the parameters restore but each new stage starts with fresh optimizer state. Parts
/// re-shard onto any group size (CKPT-8).
#[derive(Clone, PartialEq, Eq)]
pub struct OptimizerState {
    repr: Repr,
}

#[derive(Clone, PartialEq, Eq)]
enum Repr {
    Whole(Vec<u8>),
    Parts(Vec<OptimizerPart>),
}

/// One data-parallel rank's part of a sharded optimizer state (ZeRO): which elements of the
/// block's flat trainable-parameter order it covers, and their state, opaque to the storage
/// layer (the training layer encodes and decodes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptimizerPart {
    /// The elements covered.
    pub range: std::ops::Range<u64>,
    /// The length of the whole flat order.
    pub total: u64,
    /// The encoded state of those elements.
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for OptimizerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.repr {
            Repr::Whole(bytes) => write!(f, "OptimizerState({} bytes)", bytes.len()),
            Repr::Parts(parts) => write!(f, "OptimizerState({} parts)", parts.len()),
        }
    }
}

impl OptimizerState {
    /// The state of `optimizer` (moments, step counts) for every parameter it has stepped.
    pub fn capture(optimizer: &ModuleOptimizer) -> Result<Self, CheckpointError> {
        let bytes = optimizer
            .into_bytes()
            .map_err(|e| CheckpointError::Optimizer {
                reason: e.to_string(),
            })?;
        Ok(Self::from_bytes(bytes.to_vec()))
    }

    /// `optimizer` (built from the same configuration) with this state loaded in place of its
    /// own. Sharded state cannot be loaded into Burn's whole-model optimizer.
    pub fn restore(&self, optimizer: ModuleOptimizer) -> Result<ModuleOptimizer, CheckpointError> {
        let Repr::Whole(bytes) = &self.repr else {
            return Err(CheckpointError::Optimizer {
                reason: "the checkpoint holds a sharded (ZeRO) optimizer state; resume it \
                         with the same kind of sharding (`JobBuilder::zero`)"
                    .into(),
            });
        };
        optimizer
            .from_bytes(Bytes::from_bytes_vec(bytes.clone()))
            .map_err(|e| CheckpointError::Optimizer {
                reason: e.to_string(),
            })
    }

    /// The same whole state keyed by other parameter ids: Burn keys a parameter's state by
    /// its id (tensors `"{id}.{field}"` carrying the id, scalars `"{id}.{field}"`), and a
    /// module rebuilt in another process draws other ids. Each id of `map` becomes its value;
    /// other entries stay. Sharded state is returned as it is.
    pub fn with_param_ids(&self, map: &HashMap<u64, u64>) -> Result<Self, CheckpointError> {
        let Repr::Whole(bytes) = &self.repr else {
            return Ok(self.clone());
        };
        let bad = |e: burn_pack::Error| CheckpointError::Optimizer {
            reason: format!("re-keying Burn's optimizer record: {e}"),
        };
        let rename = |key: &str| -> String {
            let (head, rest) = key.split_once('.').unwrap_or((key, ""));
            match head.parse::<u64>().ok().and_then(|id| map.get(&id)) {
                Some(new) if rest.is_empty() => new.to_string(),
                Some(new) => format!("{new}.{rest}"),
                None => key.to_string(),
            }
        };
        let record = BurnRecord::read(bytes).map_err(bad)?;
        let renamed = BurnRecord {
            tensors: record
                .tensors
                .into_iter()
                .map(|t| RecordTensor {
                    name: rename(&t.name),
                    param_id: t.param_id.map(|i| map.get(&i).copied().unwrap_or(i)),
                    ..t
                })
                .collect(),
            scalars: record
                .scalars
                .into_iter()
                .map(|(k, v)| (rename(&k), v))
                .collect(),
            metadata: record
                .metadata
                .into_iter()
                .map(|(k, v)| (rename(&k), v))
                .collect(),
        };
        Ok(Self::from_bytes(renamed.write().map_err(bad)?))
    }

    /// Whole state bytes as stored (opaque: Burn's format).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self {
            repr: Repr::Whole(bytes),
        }
    }

    /// Sharded state, one part per rank (in any order).
    pub fn from_parts(parts: Vec<OptimizerPart>) -> Self {
        Self {
            repr: Repr::Parts(parts),
        }
    }

    /// The whole state's bytes; `None` for sharded state.
    pub fn whole_bytes(&self) -> Option<&[u8]> {
        match &self.repr {
            Repr::Whole(bytes) => Some(bytes),
            Repr::Parts(_) => None,
        }
    }

    /// The parts of sharded state; `None` for whole state.
    pub fn parts(&self) -> Option<&[OptimizerPart]> {
        match &self.repr {
            Repr::Parts(parts) => Some(parts),
            Repr::Whole(_) => None,
        }
    }

    /// The parts of several ranks' sharded states as one state (a checkpoint of a ZeRO
    /// block gathers every rank's part); `None` if any is whole state.
    pub fn merge_parts(states: impl IntoIterator<Item = OptimizerState>) -> Option<Self> {
        let mut all = Vec::new();
        for s in states {
            match s.repr {
                Repr::Parts(mut p) => all.append(&mut p),
                Repr::Whole(_) => return None,
            }
        }
        Some(Self::from_parts(all))
    }

    /// Bytes held (whole state, or every part's encoded state).
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Whole(bytes) => bytes.len(),
            Repr::Parts(parts) => parts.iter().map(|p| p.bytes.len()).sum(),
        }
    }

    /// Whether no bytes are held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Burn's optimizer record (burnpack, `ModuleOptimizer::into_bytes`) as plain parts: what a
/// rewrite of it (re-keyed ids, re-sliced tensors) reads and writes back.
pub(crate) struct BurnRecord {
    /// Its tensors, in the record's order.
    pub tensors: Vec<RecordTensor>,
    /// Its scalars (step counts), by key.
    pub scalars: std::collections::BTreeMap<String, burn_pack::Scalar>,
    /// Its metadata, by key.
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// One tensor of a [`BurnRecord`].
pub(crate) struct RecordTensor {
    /// Its name (`"{param_id}.{field}"`).
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its shape.
    pub dims: Vec<usize>,
    /// The parameter it belongs to.
    pub param_id: Option<u64>,
    /// Its raw little-endian bytes.
    pub bytes: Vec<u8>,
}

impl BurnRecord {
    /// The record of these bytes.
    pub(crate) fn read(bytes: &[u8]) -> Result<Self, burn_pack::Error> {
        let reader = burn_pack::Reader::from_bytes(Bytes::from_bytes_vec(bytes.to_vec()))?;
        let scalars = reader.scalars().clone();
        let metadata = reader.metadata().clone();
        let tensors = reader
            .into_tensors()?
            .into_iter()
            .map(|t| {
                let (name, dtype, shape, param_id, bytes) = t.into_parts()?;
                Ok(RecordTensor {
                    name,
                    dtype,
                    dims: shape.as_slice().to_vec(),
                    param_id,
                    bytes: bytes.to_vec(),
                })
            })
            .collect::<Result<_, burn_pack::Error>>()?;
        Ok(Self {
            tensors,
            scalars,
            metadata,
        })
    }

    /// The record's bytes.
    pub(crate) fn write(self) -> Result<Vec<u8>, burn_pack::Error> {
        let tensors = self
            .tensors
            .into_iter()
            .map(|t| {
                burn_pack::Tensor::new(
                    t.name,
                    t.dtype,
                    t.dims,
                    t.param_id,
                    Bytes::from_bytes_vec(t.bytes),
                )
            })
            .collect();
        let mut writer = burn_pack::Writer::new(tensors);
        for (k, v) in &self.scalars {
            writer = writer.with_scalar(k, *v);
        }
        for (k, v) in &self.metadata {
            writer = writer.with_metadata(k, v);
        }
        Ok(writer.into_bytes()?.to_vec())
    }
}
