//! Which of a plan's messages travel as 16-bit elements and what each send costs on the
//! wire: an f16 or bf16 op's final values always (TCP-7), its partial sums when the call asks
//! for 16-bit partial sums (COMM-9). Pure: every transport asks the same questions of the same
//! plan, so they round at the same steps and count the same bytes.

use super::{Plan, Step};
use crate::comm::{CallShape, DType};
use crate::mesh::Rank;

/// For each send among `rank`'s steps, in order: whether its receiver copies the range
/// (`RecvCopy`: the op's final values) rather than reducing it (`RecvReduce`: a partial sum).
/// PLAN-1 pairs the k-th send from a to b with b's k-th receive from a. A 16-bit collective
/// sends final values as 16-bit (TCP-7): rounding a final value is what the op's end does
/// anyway, so only partial sums need their f32 bytes.
fn sends_of_final_values(plan: &Plan, rank: Rank) -> Vec<bool> {
    let me = rank.index();
    let mut nth = vec![0usize; plan.world];
    plan.steps_of(rank)
        .iter()
        .filter_map(|s| match s {
            Step::Send { to, .. } => Some(to.index()),
            _ => None,
        })
        .map(|to| {
            let Some(k) = nth.get_mut(to) else {
                return false;
            };
            let receive = plan
                .steps
                .get(to)
                .into_iter()
                .flatten()
                .filter_map(|s| match s {
                    Step::RecvCopy { from, .. } if from.index() == me => Some(true),
                    Step::RecvReduce { from, .. } if from.index() == me => Some(false),
                    _ => None,
                })
                .nth(*k);
            *k += 1;
            receive.unwrap_or(false)
        })
        .collect()
}

/// Which of a 16-bit op's messages travel as 16-bit elements: its final values always
/// (TCP-7), its partial sums when the call says so (COMM-9). `None` for an f32 op.
#[derive(Debug, Clone)]
pub(crate) struct Narrowing {
    dtype: DType,
    /// Per send of this rank, in order: whether it travels as 16-bit.
    sends: Vec<bool>,
    /// Whether partial sums (what receivers reduce) travel as 16-bit.
    partials: bool,
}

impl Narrowing {
    /// How `rank`'s messages of `call`, run as `plan`, travel.
    pub(crate) fn of(call: &CallShape, plan: &Plan, rank: Rank) -> Option<Self> {
        let dtype = match call.dtype {
            Some(d @ (DType::F16 | DType::BF16)) => d,
            _ => return None,
        };
        let mut sends = sends_of_final_values(plan, rank);
        if call.narrow_partials {
            sends.fill(true);
        }
        Some(Self {
            dtype,
            sends,
            partials: call.narrow_partials,
        })
    }

    /// The type the `nth` send of the rank travels in, if 16-bit.
    pub(crate) fn send(&self, nth: usize) -> Option<DType> {
        self.sends
            .get(nth)
            .copied()
            .unwrap_or(false)
            .then_some(self.dtype)
    }

    /// The 16-bit type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether a send rounds its range in place first (COMM-9: with 16-bit partial sums the
    /// sender keeps what it sent, so ranks that exchange sums hold the same values). Every
    /// send of such an op travels owned, so no borrowed send reads the range meanwhile.
    pub(crate) fn rounds_in_place(&self) -> bool {
        self.partials
    }

    /// The type a receive travels in, if 16-bit: a copy (final values) always, a reduce
    /// (partial sums) when they are narrow.
    #[cfg_attr(
        not(feature = "cluster"),
        allow(dead_code, reason = "the cross-process wire")
    )]
    pub(crate) fn recv(&self, reduce: bool) -> Option<DType> {
        (!reduce || self.partials).then_some(self.dtype)
    }

    /// Bytes the `nth` send of `elements` elements puts on the wire: 2 per element when it
    /// travels 16-bit, else 4 (an f32 partial sum of a 16-bit op).
    pub(crate) fn send_bytes(&self, nth: usize, elements: usize) -> usize {
        elements * if self.send(nth).is_some() { 2 } else { 4 }
    }
}
