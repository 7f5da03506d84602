//! Devices: meshwork's logical compute units.
//!
//! A [`MeshDevice`] is one logical device with its own OS thread (its "stream"). On CPU, Burn's
//! Flex backend is a single device for the whole process, so N CPU mesh devices are N threads
//! computing on Flex, one core each. A GPU mesh device maps to one Burn device (a wgpu adapter).

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::config::InvalidConfig;
use crate::mesh::DeviceId;

/// The Burn backend behind a mesh device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BackendKind {
    /// Burn's pure-Rust CPU backend.
    Flex,
    /// Burn's wgpu backend (a GPU, or Mesa's software Vulkan).
    Wgpu,
}

impl std::str::FromStr for BackendKind {
    type Err = InvalidConfig;
    fn from_str(s: &str) -> Result<Self, InvalidConfig> {
        match s {
            "flex" => Ok(Self::Flex),
            "wgpu" => Ok(Self::Wgpu),
            other => Err(InvalidConfig(format!(
                "unknown device kind {other:?}: use flex or wgpu"
            ))),
        }
    }
}

/// One logical device of a job.
#[derive(Debug, Clone)]
pub struct MeshDevice {
    id: DeviceId,
    kind: BackendKind,
    burn: Device,
}

impl MeshDevice {
    /// `n` logical CPU devices on Burn's Flex backend.
    #[cfg(feature = "flex")]
    pub fn flex(n: usize) -> Vec<MeshDevice> {
        (0..n)
            .map(|i| MeshDevice {
                id: DeviceId(i as u32),
                kind: BackendKind::Flex,
                burn: Device::flex(),
            })
            .collect()
    }

    /// `n` logical devices on wgpu's default adapter (set `CUBECL_WGPU_DEFAULT_DEVICE=Cpu` to use
    /// Mesa's software Vulkan on a machine without a GPU). They share the adapter; each has its
    /// own thread and so its own stream.
    #[cfg(feature = "wgpu")]
    pub fn wgpu(n: usize) -> Vec<MeshDevice> {
        (0..n)
            .map(|i| MeshDevice {
                id: DeviceId(i as u32),
                kind: BackendKind::Wgpu,
                burn: Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
            })
            .collect()
    }

    /// `n` logical devices of the given backend, or an error naming the cargo feature to enable.
    pub fn of_kind(kind: BackendKind, n: usize) -> Result<Vec<MeshDevice>, InvalidConfig> {
        match kind {
            #[cfg(feature = "flex")]
            BackendKind::Flex => Ok(Self::flex(n)),
            #[cfg(feature = "wgpu")]
            BackendKind::Wgpu => Ok(Self::wgpu(n)),
            #[allow(unreachable_patterns)]
            other => Err(InvalidConfig(format!(
                "backend {other:?} is not compiled in: build meshwork with `--features {}`",
                format!("{other:?}").to_lowercase()
            ))),
        }
    }

    /// Wrap an existing Burn device as a mesh device with this id.
    pub fn from_burn(id: DeviceId, kind: BackendKind, burn: Device) -> Self {
        Self { id, kind, burn }
    }

    /// The device's id inside the job.
    pub fn id(&self) -> DeviceId {
        self.id
    }

    /// The backend.
    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// The Burn device (without autodiff).
    pub fn burn(&self) -> &Device {
        &self.burn
    }
}
