//! A [`JobConfig`] as a file: TOML (or JSON) in, TOML out, and the errors that name the key
//! (CONF-2).

use std::path::Path;

use serde::Deserializer;

use super::JobConfig;

/// The formats a job description is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigFormat {
    /// TOML (what `--print-config` writes).
    Toml,
    /// JSON.
    Json,
}

impl ConfigFormat {
    /// The format a file's name says: `.json` is JSON, anything else TOML.
    pub fn of(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => ConfigFormat::Json,
            _ => ConfigFormat::Toml,
        }
    }
}

/// Why a job description could not be read (CONF-2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The text is not TOML (or JSON) at all.
    #[error("not valid {format}: {reason}")]
    Syntax {
        /// `TOML` or `JSON`.
        format: &'static str,
        /// The parser's message, with the line.
        reason: String,
    },
    /// A key the description does not have, a value of the wrong type, or one out of range.
    #[error("key `{key}`: {reason}")]
    Key {
        /// The key's path (`reduction.zero`; `.` for the top level).
        key: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
    /// The description could not be written (a value TOML cannot hold).
    #[error("could not write the description: {0}")]
    Write(String),
}

impl From<ConfigError> for crate::config::InvalidConfig {
    fn from(e: ConfigError) -> Self {
        crate::config::InvalidConfig(format!("job description: {e}"))
    }
}

impl JobConfig {
    /// Reads a description from TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let value: toml::Value = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            format: "TOML",
            reason: e.to_string(),
        })?;
        Self::from_deserializer(value)
    }

    /// Reads a description from JSON text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_str(text);
        let config = Self::from_deserializer(&mut de).map_err(|e| match e {
            ConfigError::Key { key, reason } if reason.contains("line ") && key == "." => {
                ConfigError::Syntax {
                    format: "JSON",
                    reason,
                }
            }
            other => other,
        })?;
        de.end().map_err(|e| ConfigError::Syntax {
            format: "JSON",
            reason: e.to_string(),
        })?;
        Ok(config)
    }

    /// Reads a description from any self-describing serde format (a program's own config
    /// file holding it as a section), the error naming the key's path.
    pub fn from_deserializer<'de, D: Deserializer<'de>>(from: D) -> Result<Self, ConfigError> {
        serde_path_to_error::deserialize(from).map_err(|e| {
            let key = e.path().to_string();
            // TOML's own message adds the key again on a line of its own: the path says it.
            let reason = e.into_inner().to_string();
            ConfigError::Key {
                key,
                reason: reason.lines().next().unwrap_or_default().trim().to_string(),
            }
        })
    }

    /// Reads a description from a file: JSON when its name ends in `.json`, else TOML.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        match ConfigFormat::of(path) {
            ConfigFormat::Toml => Self::from_toml(&text),
            ConfigFormat::Json => Self::from_json(&text),
        }
    }

    /// The description as TOML, every key written (what `from_toml` reads back equal). An
    /// `f32` setting is written as its shortest decimal (`beta_1 = 0.9`, not the `f64` it
    /// widens to).
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        let mut value =
            toml::Value::try_from(self).map_err(|e| ConfigError::Write(e.to_string()))?;
        for path in F32_SETTINGS {
            if let Some(v) = at(&mut value, path) {
                shorten_floats(v);
            }
        }
        toml::to_string(&value).map_err(|e| ConfigError::Write(e.to_string()))
    }

    /// The description as pretty JSON.
    pub fn to_json(&self) -> Result<String, ConfigError> {
        serde_json::to_string_pretty(self).map_err(|e| ConfigError::Write(e.to_string()))
    }
}

/// The settings held as `f32`s (an optimizer's hyper-parameters are Burn's `f32`s but for
/// SGD's momentum, an `f64` whose value a user writes in decimal anyway).
const F32_SETTINGS: [&[&str]; 4] = [
    &["optimizer"],
    &["clip_norm"],
    &["precision", "loss_scaler"],
    &["reduction", "compression"],
];

/// The value at `path` in a table, if there is one.
fn at<'a>(value: &'a mut toml::Value, path: &[&str]) -> Option<&'a mut toml::Value> {
    path.iter().try_fold(value, |v, key| {
        v.as_table_mut().and_then(|t| t.get_mut(*key))
    })
}

/// Every float that is exactly an `f32` written as the `f32`'s shortest decimal: TOML holds
/// floats as `f64`, and an `f32` setting widened to it prints as `0.8999999761581421`. Reading
/// the shorter decimal back into the `f32` gives the same bits. Only the `f32` settings go
/// through it ([`F32_SETTINGS`]), so an `f64` setting is written as it is.
fn shorten_floats(value: &mut toml::Value) {
    match value {
        toml::Value::Float(f) => {
            let narrow = *f as f32;
            if narrow.is_finite()
                && f64::from(narrow) == *f
                && let Ok(short) = narrow.to_string().parse::<f64>()
            {
                *f = short;
            }
        }
        toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| shorten_floats(v)),
        toml::Value::Array(a) => a.iter_mut().for_each(shorten_floats),
        _ => {}
    }
}
