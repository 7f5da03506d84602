//! A link emulator: slow, uneven networks on one machine, so that the methods for slow links
//! (compression, local updates, the parameter server, backup workers) can be measured where
//! the network is fast (`meshwork bench comm-efficiency`).
//!
//! A [`LinkEmulation`] gives every rank's outgoing link a bandwidth and a latency (one rank may
//! have a slower link, [`SlowLink`]). The transports consult it for every message they send:
//! the in-process transport (`comm::local`) and the TCP transport (`comm::tcp`, on each link's
//! sender thread) hold the message back for [`LinkEmulation::delay`] before it leaves, so a
//! ring all-reduce of `n` bytes over `N` ranks takes about `2(N−1)(latency + n/(N·bandwidth))`,
//! as on a real network of that speed. In-process, a group with an emulated link runs message
//! plans only (a direct shared-memory plan has no messages to hold back).
//!
//! Invariants:
//! - EMU-1 (deterministic cost): the delay of a message depends only on its sender, its size
//!   in bytes (elements × the size of the op's element type, not the transport's working
//!   type) and the emulation, never on timing; it is monotone in the size.
//! - EMU-2 (no effect on values): emulation only holds messages back; every result is bitwise
//!   what the same plan gives without it.
//! - EMU-3 (a plan for the network): under [`Algorithm::Auto`] an emulated group picks ring
//!   or tree per collective by the link's cost model ([`LinkEmulation::choose`]), the same
//!   choice on every rank; an explicit algorithm is kept.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Algorithm, CollectiveKind};
use crate::mesh::Rank;

/// The emulated network: every rank's outgoing link, and the slower ones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkEmulation {
    /// Bytes per second each rank's link carries.
    pub bandwidth: f64,
    /// Added to every message.
    #[serde(with = "crate::config::duration")]
    pub latency: Duration,
    /// Ranks whose link is slower than the others'.
    #[serde(default)]
    pub slow: Vec<SlowLink>,
}

/// A rank whose link is `factor` times slower: its bandwidth divided and its latency
/// multiplied by `factor`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SlowLink {
    /// The rank.
    pub rank: u32,
    /// ≥ 1.
    pub factor: f64,
}

/// Why a link emulation cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EmulationError {
    /// A bandwidth that is not a positive finite number of bytes per second.
    #[error("link bandwidth {0:?}: expected a positive size per second, e.g. 100MB/s or 1Gb/s")]
    Bandwidth(String),
    /// A latency that cannot be read.
    #[error("link latency {0:?}: expected a duration, e.g. 2ms, 500us or 0.1s")]
    Latency(String),
    /// A slow-link factor below 1 or not finite.
    #[error("slow link of rank {rank}: factor {factor} must be a finite number ≥ 1")]
    Factor {
        /// The rank.
        rank: u32,
        /// The factor given.
        factor: f64,
    },
}

/// The largest delay one message can be given (a day): a misconfigured emulation must not
/// make a wait longer than any time-out could report.
const MAX_DELAY: Duration = Duration::from_secs(86_400);

impl LinkEmulation {
    /// Links of `bandwidth` bytes per second and `latency`, the same for every rank.
    pub fn new(bandwidth: f64, latency: Duration) -> Result<Self, EmulationError> {
        if !(bandwidth.is_finite() && bandwidth > 0.0) {
            return Err(EmulationError::Bandwidth(bandwidth.to_string()));
        }
        Ok(Self {
            bandwidth,
            latency,
            slow: Vec::new(),
        })
    }

    /// This emulation with `rank`'s link `factor` times slower.
    pub fn with_slow_link(mut self, rank: u32, factor: f64) -> Result<Self, EmulationError> {
        if !(factor.is_finite() && factor >= 1.0) {
            return Err(EmulationError::Factor { rank, factor });
        }
        self.slow.retain(|s| s.rank != rank);
        self.slow.push(SlowLink { rank, factor });
        Ok(self)
    }

    /// Whether the values are usable (what [`new`](Self::new) and
    /// [`with_slow_link`](Self::with_slow_link) check; a deserialized emulation is checked
    /// with this).
    pub fn validate(&self) -> Result<(), EmulationError> {
        Self::new(self.bandwidth, self.latency)?;
        for s in &self.slow {
            if !(s.factor.is_finite() && s.factor >= 1.0) {
                return Err(EmulationError::Factor {
                    rank: s.rank,
                    factor: s.factor,
                });
            }
        }
        Ok(())
    }

    /// How much slower `rank`'s link is than the others (1 for most).
    pub fn factor_of(&self, rank: Rank) -> f64 {
        self.slow
            .iter()
            .find(|s| s.rank == rank.0)
            .map_or(1.0, |s| s.factor)
    }

    /// How long a message of `bytes` sent by `from` is held back (EMU-1).
    pub fn delay(&self, from: Rank, bytes: usize) -> Duration {
        let factor = self.factor_of(from);
        let seconds =
            (self.latency.as_secs_f64() + bytes as f64 / self.bandwidth) * factor.max(1.0);
        if seconds.is_finite() && seconds >= 0.0 {
            Duration::from_secs_f64(seconds).min(MAX_DELAY)
        } else {
            MAX_DELAY
        }
    }
}

impl LinkEmulation {
    /// The message plan [`Algorithm::Auto`] takes on this network (EMU-3): the cheaper of
    /// ring and recursive doubling (tree) by the cost model of [`delay`](Self::delay) on an
    /// ordinary link — every rank decides alike — for `kind` over `bytes` in a group of
    /// `world`. Ring sends `2(N−1)` messages of `n/N` bytes for an all-reduce (`N−1` for a
    /// reduce-scatter or all-gather); doubling sends `⌈log₂N⌉` messages (two more when `N`
    /// is not a power of two) of `n` bytes for an all-reduce or reduce-scatter, and of
    /// `n/N, 2n/N, …` for an all-gather. So latency-bound collectives go to the tree and
    /// bandwidth-bound ones to the ring, as NCCL's tuner does.
    pub fn choose(&self, kind: CollectiveKind, world: usize, bytes: usize) -> Algorithm {
        let n = world.max(1) as f64;
        let b = bytes as f64;
        let lat = self.latency.as_secs_f64();
        let bw = self.bandwidth;
        let rounds = world.max(1).next_power_of_two().trailing_zeros() as f64
            + if world.is_power_of_two() { 0.0 } else { 2.0 };
        let cost = |messages: f64, sent: f64| messages * lat + sent / bw;
        let (ring, tree) = match kind {
            CollectiveKind::AllReduce => (
                cost(2.0 * (n - 1.0), 2.0 * (n - 1.0) / n * b),
                cost(rounds, rounds * b),
            ),
            CollectiveKind::ReduceScatter => {
                (cost(n - 1.0, (n - 1.0) / n * b), cost(rounds, rounds * b))
            }
            CollectiveKind::AllGather => (
                cost(n - 1.0, (n - 1.0) / n * b),
                cost(rounds, (n - 1.0) / n * b),
            ),
            _ => return Algorithm::Ring,
        };
        if tree < ring {
            Algorithm::Tree
        } else {
            Algorithm::Ring
        }
    }
}

impl fmt::Display for LinkEmulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.1} MB/s, {:.2} ms",
            self.bandwidth / 1e6,
            self.latency.as_secs_f64() * 1e3
        )?;
        for s in &self.slow {
            write!(f, ", rank {} {}× slower", s.rank, s.factor)?;
        }
        Ok(())
    }
}

/// Reads a bandwidth: a number, a unit of bytes (`B`, `KB`, `MB`, `GB`: powers of 1000;
/// `KiB`, `MiB`, `GiB`: powers of 1024) or of bits (`b`, `Kb`, `Mb`, `Gb`), and `/s`
/// (optional). `100MB/s` is 10⁸ bytes per second, `1Gb/s` 1.25·10⁸.
pub fn parse_bandwidth(s: &str) -> Result<f64, EmulationError> {
    let bad = || EmulationError::Bandwidth(s.to_string());
    let t = s.trim();
    let t = t.strip_suffix("/s").unwrap_or(t).trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '-'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    let scale = match unit.trim() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "b" => 1.0 / 8.0,
        "Kb" | "kb" => 1e3 / 8.0,
        "Mb" => 1e6 / 8.0,
        "Gb" => 1e9 / 8.0,
        _ => return Err(bad()),
    };
    let bytes = value * scale;
    if bytes.is_finite() && bytes > 0.0 {
        Ok(bytes)
    } else {
        Err(bad())
    }
}

/// Reads a latency: a number and `s`, `ms`, `us` (or `µs`) or `ns`.
pub fn parse_latency(s: &str) -> Result<Duration, EmulationError> {
    let bad = || EmulationError::Latency(s.to_string());
    let t = s.trim();
    let (number, scale) = [
        ("ns", 1e-9),
        ("us", 1e-6),
        ("µs", 1e-6),
        ("ms", 1e-3),
        ("s", 1.0),
    ]
    .iter()
    .find_map(|(unit, scale)| t.strip_suffix(unit).map(|n| (n, *scale)))
    .ok_or_else(bad)?;
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    let seconds = value * scale;
    if seconds.is_finite() && (0.0..=MAX_DELAY.as_secs_f64()).contains(&seconds) {
        Ok(Duration::from_secs_f64(seconds))
    } else {
        Err(bad())
    }
}

impl FromStr for LinkEmulation {
    type Err = EmulationError;

    /// `BANDWIDTH[,LATENCY]`, e.g. `100MB/s,2ms`.
    fn from_str(s: &str) -> Result<Self, EmulationError> {
        let (bw, lat) = s.split_once(',').unwrap_or((s, "0s"));
        Self::new(parse_bandwidth(bw)?, parse_latency(lat)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn units_read_as_documented() {
        assert_eq!(parse_bandwidth("100MB/s"), Ok(1e8));
        assert_eq!(parse_bandwidth("1Gb/s"), Ok(1.25e8));
        assert_eq!(parse_bandwidth("2 MiB/s"), Ok(2.0 * 1024.0 * 1024.0));
        assert_eq!(parse_latency("2ms"), Ok(Duration::from_millis(2)));
        assert_eq!(parse_latency("500us"), Ok(Duration::from_micros(500)));
        assert!(parse_bandwidth("0MB/s").is_err());
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_latency("2 parsecs").is_err());
        assert!(parse_latency("-1ms").is_err());
        let l: LinkEmulation = "100MB/s,2ms".parse().expect("a valid emulation");
        assert_eq!(l.latency, Duration::from_millis(2));
        assert!(
            LinkEmulation::new(1e6, Duration::ZERO)
                .and_then(|l| l.with_slow_link(1, 0.5))
                .is_err()
        );
    }

    #[test]
    fn small_collectives_take_the_tree_and_large_ones_the_ring() {
        let l = LinkEmulation::new(1e8, Duration::from_millis(2)).expect("valid");
        assert_eq!(l.choose(CollectiveKind::AllReduce, 4, 16), Algorithm::Tree);
        assert_eq!(
            l.choose(CollectiveKind::AllReduce, 4, 64 << 20),
            Algorithm::Ring
        );
        // An all-gather's doubling sends no more bytes than the ring, in fewer messages.
        assert_eq!(
            l.choose(CollectiveKind::AllGather, 8, 64 << 20),
            Algorithm::Tree
        );
        let fast = LinkEmulation::new(1e8, Duration::ZERO).expect("valid");
        assert_eq!(
            fast.choose(CollectiveKind::AllReduce, 4, 1 << 20),
            Algorithm::Ring
        );
    }

    proptest! {
        /// EMU-1: the delay is latency + bytes / bandwidth, times the sender's factor,
        /// and monotone in the size.
        #[test]
        fn delay_is_the_cost_model(
            bw in 1e3f64..1e10,
            lat_us in 0u64..10_000,
            bytes in 0usize..1 << 28,
            more in 0usize..1 << 20,
            factor in 1.0f64..10.0,
            slow in 0u32..4,
            from in 0u32..4,
        ) {
            let l = LinkEmulation::new(bw, Duration::from_micros(lat_us))
                .and_then(|l| l.with_slow_link(slow, factor))
                .expect("valid");
            let f = if from == slow { factor } else { 1.0 };
            let want = (lat_us as f64 * 1e-6 + bytes as f64 / bw) * f;
            let got = l.delay(Rank(from), bytes).as_secs_f64();
            prop_assert!((got - want).abs() <= 1e-9 * want.max(1.0) + 1e-9);
            prop_assert!(l.delay(Rank(from), bytes + more) >= l.delay(Rank(from), bytes));
        }
    }
}
