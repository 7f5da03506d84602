//! The cluster secret: ractor_cluster's "magic cookie", which every process of a job must
//! hold to join. Read from `MESHWORK_SECRET` or from the file named by
//! `MESHWORK_SECRET_FILE`, never from the command line (where `ps` would show it).

use std::fmt;
use std::path::Path;

/// The variable holding the secret itself.
pub const SECRET_VAR: &str = "MESHWORK_SECRET";
/// The variable naming a file that holds the secret.
pub const SECRET_FILE_VAR: &str = "MESHWORK_SECRET_FILE";

/// The shared secret of a job's processes. Its `Debug` form never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(String);

impl ClusterSecret {
    /// A secret with this text (for programs that get it elsewhere, and tests).
    pub fn new(text: impl Into<String>) -> Result<Self, SecretError> {
        let text = text.into();
        if text.trim().is_empty() {
            return Err(SecretError::Empty { origin: "argument" });
        }
        Ok(Self(text))
    }

    /// The secret's text (ractor_cluster's cookie).
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// Why no secret could be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Neither variable is set.
    #[error(
        "no cluster secret: set {SECRET_VAR} or {SECRET_FILE_VAR} (the same value in every process of the job)"
    )]
    Missing,
    /// Both variables are set: which one was meant is unclear.
    #[error("both {SECRET_VAR} and {SECRET_FILE_VAR} are set: set only one")]
    Ambiguous,
    /// The secret is empty (or only whitespace).
    #[error("the cluster secret from {origin} is empty")]
    Empty {
        /// Where it came from.
        origin: &'static str,
    },
    /// The secret file cannot be read.
    #[error("cannot read the cluster secret file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: String,
        /// The system's account.
        reason: String,
    },
}

/// Reads the secret through `lookup` (the environment) and `read` (a file's text): the
/// variable, else the file (its text without the trailing newline).
pub fn secret_from(
    lookup: impl Fn(&str) -> Option<String>,
    read: impl Fn(&Path) -> std::io::Result<String>,
) -> Result<ClusterSecret, SecretError> {
    match (lookup(SECRET_VAR), lookup(SECRET_FILE_VAR)) {
        (Some(_), Some(_)) => Err(SecretError::Ambiguous),
        (Some(text), None) => {
            if text.trim().is_empty() {
                return Err(SecretError::Empty { origin: SECRET_VAR });
            }
            Ok(ClusterSecret(text))
        }
        (None, Some(path)) => {
            let text = read(Path::new(&path)).map_err(|e| SecretError::Unreadable {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            let text = text.trim_end_matches(['\n', '\r']).to_string();
            if text.trim().is_empty() {
                return Err(SecretError::Empty {
                    origin: SECRET_FILE_VAR,
                });
            }
            Ok(ClusterSecret(text))
        }
        (None, None) => Err(SecretError::Missing),
    }
}

/// The secret from this process's environment ([`secret_from`] with the real environment and
/// file system).
pub fn secret_from_env() -> Result<ClusterSecret, SecretError> {
    secret_from(|k| std::env::var(k).ok(), |p| std::fs::read_to_string(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    fn no_file(_: &Path) -> std::io::Result<String> {
        Err(std::io::Error::from(std::io::ErrorKind::NotFound))
    }

    #[test]
    fn secret_comes_from_the_variable_or_the_file() {
        let s = secret_from(env(&[(SECRET_VAR, "s3cret")]), no_file).unwrap();
        assert_eq!(s.expose(), "s3cret");
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
        let s = secret_from(env(&[(SECRET_FILE_VAR, "/run/x")]), |p| {
            assert_eq!(p, Path::new("/run/x"));
            Ok("from file\n".to_string())
        })
        .unwrap();
        assert_eq!(s.expose(), "from file");
    }

    #[test]
    fn missing_empty_ambiguous_and_unreadable_secrets_are_typed() {
        assert_eq!(secret_from(env(&[]), no_file), Err(SecretError::Missing));
        assert_eq!(
            secret_from(env(&[(SECRET_VAR, "a"), (SECRET_FILE_VAR, "b")]), no_file),
            Err(SecretError::Ambiguous)
        );
        assert_eq!(
            secret_from(env(&[(SECRET_VAR, "  ")]), no_file),
            Err(SecretError::Empty { origin: SECRET_VAR })
        );
        assert!(matches!(
            secret_from(env(&[(SECRET_FILE_VAR, "/nope")]), no_file),
            Err(SecretError::Unreadable { .. })
        ));
        assert_eq!(
            secret_from(env(&[(SECRET_FILE_VAR, "/x")]), |_| Ok("\n".into())),
            Err(SecretError::Empty {
                origin: SECRET_FILE_VAR
            })
        );
    }
}
