//! What one rank asks for at a collective step ([`Call`]), how the ranks' calls are compared,
//! and its encoding for ranks in other processes (the process group sends it as the first
//! round of every step).

use std::fmt;

use super::ReduceOp;
use crate::dtype::{DType, DTypeKind};
use crate::error::{Error, Result};

/// What one rank asked for at a step; every rank's must be equal.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Call {
    pub(super) op: &'static str,
    pub(super) dtype: DTypeKind,
    pub(super) input: usize,
    pub(super) output: usize,
    pub(super) root: Option<usize>,
    pub(super) reduce: Option<ReduceOp>,
    /// All-to-all with per-rank counts: what this rank sends to and receives from each rank.
    pub(super) counts: Option<(Vec<usize>, Vec<usize>)>,
}

impl Call {
    pub(super) fn new<T: DType>(op: &'static str, input: usize, output: usize) -> Call {
        Call {
            op,
            dtype: T::KIND,
            input,
            output,
            root: None,
            reduce: None,
            counts: None,
        }
    }

    pub(super) fn counting(self, send: &[usize], recv: &[usize]) -> Call {
        Call {
            counts: Some((send.to_vec(), recv.to_vec())),
            ..self
        }
    }

    /// The error every rank returns when the calls of `step` disagree: each rank's call.
    pub(super) fn disagreement(op: &'static str, step: u64, calls: &[&Call]) -> Error {
        let each: Vec<String> = calls
            .iter()
            .enumerate()
            .map(|(q, c)| format!("rank {q}: {c}"))
            .collect();
        Error::Collective {
            op,
            detail: format!("the ranks disagree at step {step}: {}", each.join("; ")),
        }
    }

    /// Whether every rank's call fits the others': equal calls, or for per-rank counts the
    /// same op and type with what rank `i` sends to `j` what `j` receives from `i`.
    pub(super) fn agree(calls: &[&Call]) -> bool {
        let Some(first) = calls.first() else {
            return true;
        };
        if first.counts.is_none() {
            return calls.iter().all(|c| *c == *first);
        }
        let rows: Option<Vec<&(Vec<usize>, Vec<usize>)>> =
            calls.iter().map(|c| c.counts.as_ref()).collect();
        let Some(rows) = rows else {
            return false;
        };
        let n = calls.len();
        calls
            .iter()
            .all(|c| c.op == first.op && c.dtype == first.dtype)
            && rows.iter().all(|(s, r)| s.len() == n && r.len() == n)
            && (0..n).all(|i| (0..n).all(|j| rows[i].0[j] == rows[j].1[i]))
    }

    pub(super) fn rooted(self, root: usize) -> Call {
        Call {
            root: Some(root),
            ..self
        }
    }

    pub(super) fn reducing(self, op: ReduceOp) -> Call {
        Call {
            reduce: Some(op),
            ..self
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({} × {}", self.op, self.dtype.name(), self.input)?;
        if self.output != self.input {
            write!(f, " → {}", self.output)?;
        }
        if let Some(root) = self.root {
            write!(f, ", root {root}")?;
        }
        if let Some(op) = self.reduce {
            write!(f, ", {op:?}")?;
        }
        if let Some((send, recv)) = &self.counts {
            write!(f, ", sends {send:?}, receives {recv:?}")?;
        }
        write!(f, ")")
    }
}

/// The collectives' names: a call's op travels as its index here.
const OPS: [&str; 7] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "split",
];
const DTYPES: [DTypeKind; 9] = [
    DTypeKind::F32,
    DTypeKind::F64,
    DTypeKind::F16,
    DTypeKind::BF16,
    DTypeKind::I32,
    DTypeKind::U32,
    DTypeKind::I64,
    DTypeKind::U64,
    DTypeKind::U8,
];
const REDUCE: [ReduceOp; 4] = [
    ReduceOp::Sum,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Average,
];
/// Marks an absent root, reduction or count table.
const NONE: u64 = u64::MAX;

/// An element type as it travels between processes.
pub(super) fn dtype_code(kind: DTypeKind) -> u64 {
    DTYPES
        .iter()
        .position(|d| *d == kind)
        .map_or(NONE, |i| i as u64)
}

/// The name of the element type [`dtype_code`] gave `code`.
pub(super) fn dtype_name(code: u64) -> &'static str {
    usize::try_from(code)
        .ok()
        .and_then(|i| DTYPES.get(i))
        .map_or("an unknown type", |d| d.name())
}

impl Call {
    /// The call as little-endian u64 words: op, dtype, input, output, root, reduction, then
    /// the count table (its length first) when there is one.
    pub(super) fn encode(&self) -> Vec<u64> {
        let index = |found: Option<usize>| found.map_or(NONE, |i| i as u64);
        let mut words = vec![
            index(OPS.iter().position(|o| *o == self.op)),
            index(DTYPES.iter().position(|d| *d == self.dtype)),
            self.input as u64,
            self.output as u64,
            self.root.map_or(NONE, |r| r as u64),
            index(
                self.reduce
                    .and_then(|r| REDUCE.iter().position(|o| *o == r)),
            ),
        ];
        match &self.counts {
            None => words.push(NONE),
            Some((send, recv)) => {
                words.push(send.len() as u64);
                words.extend(send.iter().chain(recv).map(|&c| c as u64));
            }
        }
        words
    }

    /// A call another rank encoded with [`encode`](Call::encode).
    pub(super) fn decode(words: &[u64]) -> Result<Call> {
        let bad = || Error::Collective {
            op: "step",
            detail: format!(
                "a rank sent a call this rank cannot read ({} words)",
                words.len()
            ),
        };
        let at = |i: usize| words.get(i).copied().ok_or_else(bad);
        let size = |w: u64| usize::try_from(w).map_err(|_| bad());
        let pick = |w: u64| (w != NONE).then(|| size(w)).transpose();
        let op = *OPS.get(size(at(0)?)?).ok_or_else(bad)?;
        let dtype = *DTYPES.get(size(at(1)?)?).ok_or_else(bad)?;
        let reduce = match pick(at(5)?)? {
            Some(i) => Some(*REDUCE.get(i).ok_or_else(bad)?),
            None => None,
        };
        let counts = match pick(at(6)?)? {
            None => None,
            Some(n) => {
                let end = n
                    .checked_mul(2)
                    .and_then(|m| m.checked_add(7))
                    .ok_or_else(bad)?;
                let table = words.get(7..end).ok_or_else(bad)?;
                let table = table
                    .iter()
                    .map(|&w| size(w))
                    .collect::<Result<Vec<usize>>>()?;
                Some((table[..n].to_vec(), table[n..].to_vec()))
            }
        };
        Ok(Call {
            op,
            dtype,
            input: size(at(2)?)?,
            output: size(at(3)?)?,
            root: pick(at(4)?)?,
            reduce,
            counts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_survive_their_encoding() {
        let calls = [
            Call::new::<f32>("all_reduce", 7, 7).reducing(ReduceOp::Average),
            Call::new::<u8>("broadcast", 0, 0).rooted(3),
            Call::new::<f64>("all_to_all_v", 5, 6).counting(&[1, 4], &[2, 4]),
        ];
        for call in calls {
            assert_eq!(Call::decode(&call.encode()).unwrap(), call);
        }
        assert!(Call::decode(&[0, 0, 1]).is_err());
        assert!(Call::decode(&[0, 0, 1, 1, NONE, NONE, u64::MAX - 1]).is_err());
    }
}
