//! Element types a [`Buffer`](crate::memory::Buffer) can hold.

use half::{bf16, f16};

/// The element types warpdrive moves and computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DTypeKind {
    F32,
    F64,
    F16,
    BF16,
    I32,
    U32,
    I64,
    U64,
    U8,
}

impl DTypeKind {
    /// The name used in kernel symbols and reports (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DTypeKind::F32 => "f32",
            DTypeKind::F64 => "f64",
            DTypeKind::F16 => "f16",
            DTypeKind::BF16 => "bf16",
            DTypeKind::I32 => "i32",
            DTypeKind::U32 => "u32",
            DTypeKind::I64 => "i64",
            DTypeKind::U64 => "u64",
            DTypeKind::U8 => "u8",
        }
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DTypeKind::U8 => 1,
            DTypeKind::F16 | DTypeKind::BF16 => 2,
            DTypeKind::F32 | DTypeKind::I32 | DTypeKind::U32 => 4,
            DTypeKind::F64 | DTypeKind::I64 | DTypeKind::U64 => 8,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain-old-data element type: every bit pattern is a valid value and it has no padding,
/// so it can be copied byte-for-byte between host and device. Sealed: only the types below.
pub trait DType:
    sealed::Sealed + bytemuck::Pod + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static
{
    const KIND: DTypeKind;
    /// The value's bits, zero-extended (kernels that only move data take these).
    fn to_bits_u64(self) -> u64;
    /// The value with these bits (the low `size_of::<Self>()` bytes of `bits`).
    fn from_bits_u64(bits: u64) -> Self;
}

macro_rules! dtype {
    ($($t:ty => $k:ident, |$v:ident| $bits:expr, |$b:ident| $from:expr);* $(;)?) => {$(
        impl sealed::Sealed for $t {}
        impl DType for $t {
            const KIND: DTypeKind = DTypeKind::$k;
            fn to_bits_u64(self) -> u64 { let $v = self; $bits }
            fn from_bits_u64(bits: u64) -> Self { let $b = bits; $from }
        }
    )*};
}

dtype! {
    f32 => F32, |v| v.to_bits() as u64, |b| f32::from_bits(b as u32);
    f64 => F64, |v| v.to_bits(), |b| f64::from_bits(b);
    f16 => F16, |v| v.to_bits() as u64, |b| f16::from_bits(b as u16);
    bf16 => BF16, |v| v.to_bits() as u64, |b| bf16::from_bits(b as u16);
    i32 => I32, |v| v as u32 as u64, |b| b as u32 as i32;
    u32 => U32, |v| v as u64, |b| b as u32;
    i64 => I64, |v| v as u64, |b| b as i64;
    u64 => U64, |v| v, |b| b;
    u8 => U8, |v| v as u64, |b| b as u8;
}

/// Floating-point element types with arithmetic on both backends: f32, f64, f16, bf16.
///
/// Kernels compute in f32 (f64 for f64); the CPU backend computes in f64 and rounds once.
/// Most ops take f32 / f16 / bf16 and return [`Error::Unsupported`](crate::Error) for f64 on
/// both backends; `axpy` and the reductions take f64 too.
pub trait Float: DType + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    fn to_f64(self) -> f64;
    /// The nearest value (16-bit types round through f32, as the kernels do).
    fn from_f64(v: f64) -> Self;
}

impl Float for f32 {
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Float for f64 {
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

impl Float for f16 {
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f32(v as f32)
    }
}

impl Float for bf16 {
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f32(v as f32)
    }
}
