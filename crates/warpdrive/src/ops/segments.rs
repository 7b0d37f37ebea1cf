//! Many buffers packed into one and unpacked back, one launch each way (a `Reducer`'s
//! bucket of gradients: a copy per gradient cost a launch each, and a ResNet-50's 161
//! gradients took ~2 ms of copies around a 0.4 ms all-reduce). The device reads the parts'
//! addresses from a [`SegmentTable`], uploaded only when the parts change.

use super::{fill_grid, launch, Args, BLOCK};
use crate::device::Queue;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::SEGMENTS;
use crate::memory::Buffer;
use crate::Stream;

/// The parts' addresses and offsets on the device for [`pack_segments`] / [`unpack_segments`],
/// kept between calls: the upload is skipped while the parts are the same buffers. Keep one
/// per set of parts (a bucket, each way).
#[derive(Default)]
pub struct SegmentTable {
    /// What the device holds: k addresses, then k + 1 offsets in elements.
    host: Vec<u64>,
    device: Option<Buffer<u64>>,
}

impl SegmentTable {
    pub fn new() -> SegmentTable {
        SegmentTable::default()
    }

    /// The total element count and the device table for parts at `ptrs` of `lens`
    /// elements, uploaded on `stream` when it changed.
    fn prepare(
        &mut self,
        stream: &Stream,
        ptrs: &[u64],
        lens: &[usize],
    ) -> Result<(u64, &Buffer<u64>)> {
        let mut table = Vec::with_capacity(2 * ptrs.len() + 1);
        table.extend_from_slice(ptrs);
        let mut total = 0u64;
        table.push(0);
        for &n in lens {
            total = total.checked_add(n as u64).ok_or_else(|| {
                Error::InvalidArgument("segments: more than 2^64 elements".into())
            })?;
            table.push(total);
        }
        let device = match self.device.take() {
            Some(d) if d.len() == table.len() && d.device() == stream.device() => d,
            _ => {
                self.host.clear();
                Buffer::uninit(stream, table.len())?
            }
        };
        let device = self.device.insert(device);
        if self.host != table {
            device.driver_copy_from_host(stream, &table)?;
            self.host = table;
        }
        Ok((total, device))
    }
}

/// The pack and unpack kernels for `T`'s size, or Unsupported.
fn kernels<T: DType>(op: &str) -> Result<(&'static str, &'static str)> {
    match std::mem::size_of::<T>() {
        1 => Ok(("segments_pack_u8", "segments_unpack_u8")),
        2 => Ok(("segments_pack_u16", "segments_unpack_u16")),
        4 => Ok(("segments_pack_u32", "segments_unpack_u32")),
        8 => Ok(("segments_pack_u64", "segments_unpack_u64")),
        n => Err(Error::Unsupported(format!("{op}: {n}-byte elements"))),
    }
}

fn check_parts<'a, T: DType>(
    stream: &Stream,
    packed: &Buffer<T>,
    parts: impl Iterator<Item = &'a Buffer<T>>,
    op: &'static str,
) -> Result<(Vec<u64>, Vec<usize>)> {
    packed.check_stream(stream, op)?;
    let (mut ptrs, mut lens) = (Vec::new(), Vec::new());
    for p in parts {
        p.check_stream(stream, op)?;
        ptrs.push(p.device_ptr());
        lens.push(p.len());
    }
    let total = lens
        .iter()
        .try_fold(0usize, |a, &n| a.checked_add(n))
        .ok_or_else(|| Error::InvalidArgument(format!("{op}: more than usize::MAX elements")))?;
    crate::memory::check_len(op, packed.len(), total)?;
    if u32::try_from(lens.len()).is_err() {
        return Err(Error::InvalidArgument(format!(
            "{op}: {} parts",
            lens.len()
        )));
    }
    Ok((ptrs, lens))
}

/// Launches segment kernel `name` over `packed` and the parts at `ptrs` of `lens` elements,
/// their table uploaded first when it changed.
fn launch_segments<T: DType>(
    q: Queue<'_>,
    stream: &Stream,
    table: &mut SegmentTable,
    (ptrs, lens): (&[u64], &[usize]),
    packed: &Buffer<T>,
    name: &'static str,
) -> Result<()> {
    let (total, device) = table.prepare(stream, ptrs, lens)?;
    let grid = fill_grid(q.gpu, (&SEGMENTS, name), total, BLOCK as u64 * 4)?;
    let args = Args::new()
        .buf(device)
        .u32(ptrs.len() as u32)
        .buf(packed)
        .u64(total);
    // SAFETY: segments_{pack,unpack}_T(const u64* table, u32 k, T* packed, u64 total): the
    // table holds k addresses of live, disjoint buffers of the checked lengths (unpack's
    // borrowed mutably for the call) and k + 1 offsets ending at total = packed's length,
    // all on this stream's device.
    unsafe { launch(q, (&SEGMENTS, name), grid, BLOCK, 0, args) }
}

/// Writes `parts` one after another into `packed` (as long as all of them together).
pub fn pack_segments<T: DType>(
    stream: &Stream,
    parts: &[&Buffer<T>],
    packed: &mut Buffer<T>,
    table: &mut SegmentTable,
) -> Result<()> {
    const OP: &str = "pack_segments";
    let (ptrs, lens) = check_parts(stream, packed, parts.iter().copied(), OP)?;
    if packed.is_empty() {
        return Ok(());
    }
    stream.run(
        packed,
        |packed| {
            let out = packed.host_view_mut()?;
            let mut at = 0;
            for p in parts {
                out[at..at + p.len()].copy_from_slice(p.host_view()?);
                at += p.len();
            }
            Ok(())
        },
        |packed, q| {
            launch_segments(
                q,
                stream,
                table,
                (&ptrs, &lens),
                packed,
                kernels::<T>(OP)?.0,
            )
        },
    )
}

/// Writes `packed` back into `parts`, one after another (the reverse of [`pack_segments`]).
pub fn unpack_segments<T: DType>(
    stream: &Stream,
    packed: &Buffer<T>,
    parts: &mut [&mut Buffer<T>],
    table: &mut SegmentTable,
) -> Result<()> {
    const OP: &str = "unpack_segments";
    let (ptrs, lens) = check_parts(stream, packed, parts.iter().map(|p| &**p), OP)?;
    if packed.is_empty() {
        return Ok(());
    }
    stream.run(
        parts,
        |parts| {
            let src = packed.host_view()?;
            let mut at = 0;
            for p in parts.iter_mut() {
                let n = p.len();
                p.host_view_mut()?.copy_from_slice(&src[at..at + n]);
                at += n;
            }
            Ok(())
        },
        |_parts, q| {
            launch_segments(
                q,
                stream,
                table,
                (&ptrs, &lens),
                packed,
                kernels::<T>(OP)?.1,
            )
        },
    )
}
