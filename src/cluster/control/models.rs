//! A program's model kinds ([`ModelRegistry`]): what a node builds for a job whose
//! [`ModelSpec`](super::ModelSpec) names a kind — how it fingerprints that model and how it
//! builds its stages — so that one node binary serves every model the program knows, and a
//! job naming another kind is refused at its Hello ([`Incompatibility::UnknownModel`]).
//!
//! `meshwork train`'s demo MLP is one such kind (`meshwork::demo::MLP_KIND`), registered by
//! the binary as any program registers its own.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::agent::FingerprintFn;
use super::protocol::{Incompatibility, JobSpec, ModelFingerprint};
use super::stages::{HostArgs, HostFactory, StageHost};

/// One registered kind: its fingerprint and its stages, both from the job's spec (its
/// [`ModelSpec::config`](super::ModelSpec::config) bytes and the rest of the job).
#[derive(Clone)]
struct Kind {
    fingerprint: FingerprintFn,
    stages: HostFactory,
}

/// The model kinds a program builds, by name. Cheap to clone.
#[derive(Clone, Default)]
pub struct ModelRegistry {
    kinds: Arc<BTreeMap<String, Kind>>,
}

impl std::fmt::Debug for ModelRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.kinds.keys()).finish()
    }
}

impl ModelRegistry {
    /// No kinds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `kind`: `fingerprint` says which model a spec of this kind describes (an
    /// [`Incompatibility`] when its configuration is not one this program builds: the bytes
    /// come from the network), `stages` builds a process's stages for it once the head
    /// prepared the node. Registering a kind again replaces it.
    pub fn register(
        mut self,
        kind: impl Into<String>,
        fingerprint: FingerprintFn,
        stages: HostFactory,
    ) -> Self {
        Arc::make_mut(&mut self.kinds).insert(
            kind.into(),
            Kind {
                fingerprint,
                stages,
            },
        );
        self
    }

    /// The registered kinds, in name order.
    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.kinds.keys().map(String::as_str)
    }

    fn kind(&self, spec: &JobSpec) -> Result<&Kind, Incompatibility> {
        self.kinds
            .get(&spec.model.kind)
            .ok_or_else(|| Incompatibility::UnknownModel {
                kind: spec.model.kind.clone(),
            })
    }

    /// The fingerprint of the model `spec` describes, by its kind's code.
    pub fn fingerprint(&self, spec: &JobSpec) -> Result<ModelFingerprint, Incompatibility> {
        (self.kind(spec)?.fingerprint)(spec)
    }

    /// [`Self::fingerprint`] as a node's [`FingerprintFn`].
    pub fn fingerprint_fn(&self) -> FingerprintFn {
        let models = self.clone();
        Arc::new(move |spec: &JobSpec| models.fingerprint(spec))
    }

    /// The stages of the kind `args.spec` names.
    pub fn stages(&self, args: HostArgs) -> Result<Arc<dyn StageHost>, String> {
        let stages = self
            .kind(&args.spec)
            .map_err(|e| e.to_string())?
            .stages
            .clone();
        stages(args)
    }

    /// [`Self::stages`] as a node's [`HostFactory`].
    pub fn host_factory(&self) -> HostFactory {
        let models = self.clone();
        Arc::new(move |args: HostArgs| models.stages(args))
    }
}
