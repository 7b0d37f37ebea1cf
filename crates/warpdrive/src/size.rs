//! Sizes computed from caller input, checked: a shape's element count, a count's bytes and
//! sums of them fail with `InvalidArgument` naming what was asked, instead of wrapping
//! (release builds) or panicking (debug builds).

use std::fmt::Display;

use crate::error::{Error, Result};

/// The product of `dims` (a shape's elements; with an element size last, its bytes), or
/// `InvalidArgument` naming `what` and the shape when it overflows `usize`. `what` is
/// formatted only on failure (`format_args!` costs nothing on a hot path).
pub fn product(what: impl Display, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            let shape: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
            Error::InvalidArgument(format!(
                "{what}: {} overflows the address space",
                shape.join(" × ")
            ))
        })
}

/// Bytes of `len` elements of `T`.
pub(crate) fn bytes_of<T>(what: impl Display, len: usize) -> Result<usize> {
    product(what, &[len, std::mem::size_of::<T>()])
}

/// `a + b`, or `InvalidArgument` naming `what` when it overflows `usize`.
pub(crate) fn sum(what: impl Display, a: usize, b: usize) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {a} + {b} overflows the address space"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_and_sums_are_exact_or_errors_naming_the_request() {
        assert_eq!(product("t", &[]).unwrap(), 1);
        assert_eq!(product("t", &[3, 0, usize::MAX]).unwrap(), 0);
        assert_eq!(product("t", &[1 << 31, 1 << 32]).unwrap(), 1 << 63);
        let err = product("gate", &[1 << 32, 1 << 32])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gate: 4294967296 × 4294967296"), "{err}");
        assert_eq!(bytes_of::<u64>("t", 1 << 60).unwrap(), 1 << 63);
        assert!(matches!(
            bytes_of::<u32>("t", usize::MAX / 2),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(sum("t", usize::MAX - 1, 1).unwrap(), usize::MAX);
        assert!(matches!(
            sum("t", usize::MAX, 1),
            Err(Error::InvalidArgument(_))
        ));
    }
}
