//! What every layer says when a value cannot configure a job: [`InvalidConfig`]. It sits at
//! the bottom (core) so that pure code (a layout, a sampler, a fault plan) can refuse a value
//! without knowing the crate's [`Error`](crate::Error), which becomes `Error::InvalidConfig`.

/// A value that cannot configure a job; the message says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidConfig(pub String);

/// A [`Duration`](std::time::Duration) as a file states it: `"60s"`, `"250ms"`, `"1.5s"`,
/// `"5m"`, `"2h"` (or a number of seconds) in a human-readable format (TOML, JSON); as
/// Duration's own encoding in a binary one (bincode on the control plane), so the wire is
/// unchanged. Use with `#[serde(with = "crate::config::duration")]`.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

    /// Writes `d` as `"<n>ms"` or `"<n>s"` (exact: whole milliseconds or seconds; a finer
    /// duration as `"<n>ns"`).
    pub fn serialize<S: Serializer>(d: &Duration, to: S) -> Result<S::Ok, S::Error> {
        if !to.is_human_readable() {
            return d.serialize(to);
        }
        to.serialize_str(&text(*d))
    }

    /// The text a duration is written as.
    pub fn text(d: Duration) -> String {
        let nanos = d.as_nanos();
        if nanos.is_multiple_of(1_000_000_000) {
            format!("{}s", d.as_secs())
        } else if nanos.is_multiple_of(1_000_000) {
            format!("{}ms", d.as_millis())
        } else {
            format!("{nanos}ns")
        }
    }

    /// Reads a duration with a unit (`ns`, `us`, `ms`, `s`, `m`, `h`) or a number of seconds.
    pub fn deserialize<'de, D: Deserializer<'de>>(from: D) -> Result<Duration, D::Error> {
        if !from.is_human_readable() {
            return Duration::deserialize(from);
        }
        /// A number of seconds, or a text with a unit.
        struct Seconds;
        impl de::Visitor<'_> for Seconds {
            type Value = f64;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration such as \"250ms\", \"60s\", \"5m\" or a number of seconds")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
                Ok(v)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
                Ok(v as f64)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
                Ok(v as f64)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
                parse(v).map_err(E::custom)
            }
        }
        let seconds = from.deserialize_any(Seconds)?;
        if !(seconds >= 0.0 && seconds.is_finite() && seconds < 1e12) {
            return Err(de::Error::custom(format!(
                "{seconds} s: a duration of at least 0 and below 10^12 s"
            )));
        }
        Ok(Duration::from_secs_f64(seconds))
    }

    /// Seconds in `text` (`"1.5s"`, `"250ms"`, `"5m"`).
    fn parse(text: &str) -> Result<f64, String> {
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let scale = match unit.trim() {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "" | "s" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            _ => f64::NAN,
        };
        match number.parse::<f64>() {
            Ok(n) if !scale.is_nan() => Ok(n * scale),
            _ => Err(format!(
                "\"{text}\": a duration such as \"250ms\", \"60s\", \"5m\" or \"2h\""
            )),
        }
    }
}

/// An `Option` whose default is `Some`, as a file states it: `"off"` for `None`, the value
/// itself for `Some` (a missing key keeps the default, so `None` needs a word of its own). In
/// a binary format, the `Option` as it is.
pub mod on_by_default {
    use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

    /// Writes `None` as `"off"`.
    pub fn serialize<S: Serializer, T: Serialize>(
        value: &Option<T>,
        to: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            _ if !to.is_human_readable() => value.serialize(to),
            None => to.serialize_str("off"),
            Some(v) => v.serialize(to),
        }
    }

    /// Reads `"off"` as `None`, anything else as the value.
    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        from: D,
    ) -> Result<Option<T>, D::Error> {
        if !from.is_human_readable() {
            return Option::<T>::deserialize(from);
        }
        /// `"off"`, or the value's own table (whose errors keep their keys).
        struct OffOr<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> de::Visitor<'de> for OffOr<T> {
            type Value = Option<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"off\", or the settings as a table")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<T>, E> {
                match v {
                    "off" => Ok(None),
                    other => Err(E::custom(format!(
                        "\"{other}\": \"off\", or the settings as a table"
                    ))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Option<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Some)
            }
        }
        from.deserialize_any(OffOr(std::marker::PhantomData))
    }
}
