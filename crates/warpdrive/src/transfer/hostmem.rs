//! Filling fresh host memory fast. A copy into just-allocated memory is bound by its page
//! faults (one per 4 KiB page), and `vec![0; n]` adds a zeroing pass on one thread where
//! the allocator recycles memory. [`FreshVec`] grows a `Vec` in place without zeroing it
//! first, on the copy threads (each faulting the pages it writes), and asks for transparent
//! huge pages on large allocations (one fault per 2 MiB). Also the stores a staged copy
//! writes host memory with: [`stream_copy`] (non-temporal) and [`demote_copy`] (plain, then
//! pushed to the shared cache for the DMA engine).

use std::mem::MaybeUninit;

use super::workers::{Workers, PAGE};
use crate::device::Stream;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::memory::{host_vec, Buffer};

/// The transparent huge page size on x86-64 and most aarch64 kernels.
pub const HUGE_PAGE: usize = 2 << 20;
/// Allocations of at least this many bytes get the huge-page advice: glibc serves them with a
/// mapping of their own (its largest mmap threshold is 32 MiB), so the advice touches no
/// memory other allocations share.
pub const HUGE_FROM: usize = 32 << 20;

/// A `Vec` filled from the front into its spare capacity, never zeroed first.
pub struct FreshVec<T> {
    vec: Vec<T>,
    /// Piece alignment for parallel writes: huge pages when advised, else pages.
    align: usize,
}

impl<T> std::fmt::Debug for FreshVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FreshVec[{}/{}]", self.vec.len(), self.vec.capacity())
    }
}

impl<T: Copy + Send + Sync> FreshVec<T> {
    /// Room for `len` elements, untouched (huge pages advised from [`HUGE_FROM`] bytes);
    /// refused as [`host_vec`] refuses.
    pub fn with_capacity(len: usize) -> Result<Self> {
        let mut vec = host_vec("host copy", len)?;
        let huge = std::mem::size_of_val(vec.spare_capacity_mut()) >= HUGE_FROM;
        if huge {
            advise_huge_pages(vec.spare_capacity_mut());
        }
        Ok(FreshVec {
            vec,
            align: if huge { HUGE_PAGE } else { PAGE },
        })
    }

    /// Elements that still fit.
    pub fn room(&self) -> usize {
        self.vec.capacity() - self.vec.len()
    }

    fn check_room(&self, n: usize) -> Result<()> {
        if n > self.room() {
            return Err(Error::LengthMismatch {
                op: "FreshVec::extend",
                left: self.room(),
                right: n,
            });
        }
        Ok(())
    }

    /// The next `n` spare elements, to be written before [`FreshVec::add_len`] counts them.
    pub(crate) fn spare_mut(&mut self, n: usize) -> Result<&mut [MaybeUninit<T>]> {
        self.check_room(n)?;
        Ok(&mut self.vec.spare_capacity_mut()[..n])
    }

    /// Counts the next `n` spare elements as part of the `Vec`.
    ///
    /// # Safety
    /// All `n` of them (within the room) have been written.
    pub(crate) unsafe fn add_len(&mut self, n: usize) {
        debug_assert!(n <= self.room());
        // SAFETY: forwarded from this function's contract.
        unsafe { self.vec.set_len(self.vec.len() + n) };
    }

    /// Appends a copy of `src` on one thread.
    pub fn extend_from_slice(&mut self, src: &[T]) -> Result<()> {
        self.check_room(src.len())?;
        self.vec.extend_from_slice(src);
        Ok(())
    }

    /// Appends a copy of `src` on up to `threads` copy threads, each writing (and so
    /// faulting) whole pages of its own; on huge pages each first populates its piece in
    /// one call (faster than faulting while copying; bench/NOTES.md, fresh memory).
    pub fn extend_par(&mut self, workers: &Workers, threads: usize, src: &[T]) -> Result<()> {
        self.check_room(src.len())?;
        let huge = self.align == HUGE_PAGE;
        let spare = &mut self.vec.spare_capacity_mut()[..src.len()];
        workers.map(threads, self.align, spare, src, |d, s| {
            if huge {
                populate(d);
            }
            write_copy(d, s);
        })?;
        // SAFETY: `map` returned Ok, so it called `write_copy` on pieces covering all of `spare`, which wrote
        // every one of its elements; they follow the initialised ones directly.
        unsafe { self.vec.set_len(self.vec.len() + src.len()) };
        Ok(())
    }

    /// Appends `n` zeros on up to `threads` copy threads, each faulting and writing whole
    /// pages of its own (a buffer to decode into).
    pub fn extend_zeroed_par(&mut self, workers: &Workers, threads: usize, n: usize) -> Result<()>
    where
        T: DType,
    {
        self.check_room(n)?;
        let huge = self.align == HUGE_PAGE;
        let units = vec![(); n];
        let spare = &mut self.vec.spare_capacity_mut()[..n];
        workers.map(threads, self.align, spare, &units, |d, _| {
            if huge {
                populate(d);
            }
            d.iter_mut().for_each(|x| {
                x.write(T::zeroed());
            });
        })?;
        // SAFETY: `map` returned Ok, so every piece of `spare` had each element written.
        unsafe { self.vec.set_len(self.vec.len() + n) };
        Ok(())
    }

    /// Faults in the pages of the next `n` spare elements (at most the room) on up to
    /// `threads` copy threads, without appending anything: work done ahead while waiting.
    pub fn prefault(&mut self, workers: &Workers, threads: usize, n: usize) -> Result<()> {
        let n = n.min(self.room());
        let stride = (PAGE / std::mem::size_of::<T>().max(1)).max(1);
        // Zero-sized stand-ins for a source: `map` only needs matching lengths.
        let units = vec![(); n];
        let spare = &mut self.vec.spare_capacity_mut()[..n];
        workers.map(threads, self.align, spare, &units, |d, _| {
            if !populate(d) {
                for x in d.iter_mut().step_by(stride) {
                    *x = MaybeUninit::zeroed();
                }
            }
        })
    }

    /// The filled `Vec`.
    pub fn into_vec(self) -> Vec<T> {
        self.vec
    }
}

impl<T: DType> FreshVec<T> {
    /// Appends the first `n` elements of `src` through the driver's own copy (straight into
    /// the spare capacity), waiting for the stream.
    pub(crate) fn extend_from_device(
        &mut self,
        stream: &Stream,
        src: &Buffer<T>,
        n: usize,
    ) -> Result<()> {
        src.driver_copy_prefix_to_uninit(stream, self.spare_mut(n)?)?;
        // SAFETY: the copy returned Ok, so it wrote all `n` spare elements.
        unsafe { self.add_len(n) };
        Ok(())
    }
}

/// `dst.copy_from_slice(src)` into uninitialised memory.
pub(crate) fn write_copy<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
    let n = dst.len().min(src.len());
    // SAFETY: both ranges hold `n` elements, `&mut` excludes overlap, and `MaybeUninit<T>`
    // has `T`'s layout.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<T>(), n) };
}

/// Faults in the whole pages inside `mem` writable in one call (`MADV_POPULATE_WRITE`,
/// Linux 5.14+); false where that is unavailable (the caller's writes fault them instead).
pub(crate) fn populate<T>(mem: &mut [MaybeUninit<T>]) -> bool {
    let start = (mem.as_mut_ptr() as usize).next_multiple_of(PAGE);
    let end = (mem.as_mut_ptr() as usize + std::mem::size_of_val(mem)) / PAGE * PAGE;
    if end <= start {
        return true;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the range lies inside memory `mem` exclusively borrows; populating only
        // maps pages (fresh anonymous ones read as zeros) and never changes what a page
        // already mapped holds.
        let r = unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// Asks the kernel to back the whole huge pages inside `mem` with transparent huge pages
/// (`MADV_HUGEPAGE`); a hint, so failure (no THP, another OS) is ignored.
pub(crate) fn advise_huge_pages<T>(mem: &mut [T]) {
    let start = (mem.as_mut_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (mem.as_mut_ptr() as usize + std::mem::size_of_val(mem)) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: the range lies inside memory `mem` exclusively borrows; MADV_HUGEPAGE only
        // changes how its future page faults are served, never its contents.
        let r =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        if r != 0 {
            tracing::debug!(
                "madvise(MADV_HUGEPAGE) failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// `dst.copy_from_slice(src)` with non-temporal stores where the CPU has them (x86-64):
/// each destination cache line is written whole without first being read, so a large copy
/// moves its bytes through host memory twice instead of three times and leaves the cache to
/// others. For copies whose destination is read next by a DMA engine or not soon (staging
/// blocks, large downloads; bench/NOTES.md, staging stores). Ends with a store fence, so
/// the bytes are visible to every agent once it returns.
pub fn stream_copy<T: Copy>(dst: &mut [T], src: &[T]) {
    let n = std::mem::size_of_val(dst).min(std::mem::size_of_val(src));
    let (d, s) = (dst.as_mut_ptr().cast::<u8>(), src.as_ptr().cast::<u8>());
    #[cfg(target_arch = "x86_64")]
    {
        // Plain copies up to the first line boundary of `dst` and for the tail; whole lines
        // streamed in between.
        let head = d.align_offset(LINE).min(n);
        let lines = (n - head) / LINE * LINE;
        // SAFETY: both ranges hold `n` bytes and `&mut` excludes overlap; `d + head` is
        // line-aligned and `lines` a multiple of LINE, as the line copies need; AVX2 is
        // checked just before its use, SSE2 is part of x86-64.
        unsafe {
            std::ptr::copy_nonoverlapping(s, d, head);
            let (ld, ls) = (d.add(head), s.add(head));
            if std::arch::is_x86_feature_detected!("avx2") {
                stream_lines_avx2(ld, ls, lines);
            } else {
                stream_lines_sse2(ld, ls, lines);
            }
            let tail = head + lines;
            std::ptr::copy_nonoverlapping(s.add(tail), d.add(tail), n - tail);
            // Streamed stores are weakly ordered: fence them before anyone hears they are
            // done.
            std::arch::x86_64::_mm_sfence();
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: both ranges hold `n` bytes and `&mut` excludes overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(s, d, n)
    };
}

/// Pushes the cache lines of `mem` from this core's private caches out to the shared
/// last-level cache (`cldemote`, a hint: a no-op on CPUs without it, whose encoding is a
/// NOP there), where another agent reads them without asking this core for them. For a
/// staging block the DMA engine reads next: written with plain stores, its lines sit
/// modified in the writing core's L2, where the engine reads them slowly; demoted, the ring
/// feeds uploads faster than non-temporal stores, which send every line to memory and back
/// (bench/NOTES.md, staging stores).
pub fn demote_lines<T>(mem: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let start = mem.as_ptr() as usize & !(LINE - 1);
        let end = mem.as_ptr() as usize + std::mem::size_of_val(mem);
        for line in (start..end).step_by(LINE) {
            // SAFETY: `cldemote` only moves a line between cache levels: it changes no
            // memory, and the line holds bytes of `mem`, mapped and borrowed here.
            unsafe {
                std::arch::asm!("cldemote [{0}]", in(reg) line, options(nostack, preserves_flags, readonly))
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = mem;
}

/// `dst.copy_from_slice(src)` with plain stores, then [`demote_lines`] on `dst`: for
/// staging blocks that stay cached for the DMA engine to read.
pub fn demote_copy<T: Copy>(dst: &mut [T], src: &[T]) {
    dst.copy_from_slice(src);
    demote_lines(dst);
}

/// Bytes per streamed line (the cache line).
const LINE: usize = 64;

/// Streams `n` bytes of whole lines with 32-byte loads and non-temporal stores.
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes, not overlapping; `dst` line-aligned and
/// `n` a multiple of [`LINE`]; the CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_lines_avx2(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    for i in (0..n).step_by(LINE) {
        // SAFETY: the line lies inside the `n` bytes the caller vouches for, and `dst + i`
        // is line-aligned (so 32-byte-aligned).
        unsafe {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
            _mm256_stream_si256(d, a);
            _mm256_stream_si256(d.add(1), b);
        }
    }
}

/// [`stream_lines_avx2`] with 16-byte loads and stores (every x86-64 CPU).
///
/// # Safety
/// As for [`stream_lines_avx2`], AVX2 aside.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines_sse2(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    for i in (0..n).step_by(LINE) {
        // SAFETY: as in `stream_lines_avx2`; line-aligned stores are 16-byte aligned.
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            for k in 0..4 {
                _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_in_parallel_and_refuses_overflow() {
        let w = Workers::new(3, None);
        // Over HUGE_FROM, so the advice and huge-page pieces are exercised too.
        let n = (HUGE_FROM / 4) + 12_345;
        let src: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let mut v = FreshVec::with_capacity(n).unwrap();
        let half = n / 2 + 3;
        v.prefault(&w, 3, half).unwrap();
        v.extend_par(&w, 3, &src[..half]).unwrap();
        v.prefault(&w, 3, usize::MAX).unwrap();
        v.extend_from_slice(&src[half..half + 5]).unwrap();
        v.extend_par(&w, 3, &src[half + 5..]).unwrap();
        assert_eq!(v.room(), 0);
        assert!(matches!(
            v.extend_par(&w, 3, &src[..1]),
            Err(Error::LengthMismatch { .. })
        ));
        assert_eq!(v.into_vec(), src);
        let mut empty = FreshVec::<u8>::with_capacity(0).unwrap();
        empty.extend_par(&w, 3, &[]).unwrap();
        assert!(empty.into_vec().is_empty());
    }

    #[test]
    fn zero_fills_in_parallel_after_what_is_there() {
        let w = Workers::new(3, None);
        for n in [0, 1, 4097, HUGE_FROM + 12_345] {
            let mut v = FreshVec::<u8>::with_capacity(n + 3).unwrap();
            v.extend_from_slice(&[7, 8, 9]).unwrap();
            v.extend_zeroed_par(&w, 3, n).unwrap();
            assert_eq!(v.room(), 0);
            assert!(matches!(
                v.extend_zeroed_par(&w, 3, 1),
                Err(Error::LengthMismatch { .. })
            ));
            let v = v.into_vec();
            assert_eq!(&v[..3], &[7, 8, 9]);
            assert_eq!(v.len(), n + 3);
            assert!(v[3..].iter().all(|&b| b == 0), "n {n}");
        }
    }

    #[test]
    fn stream_and_demote_copies_copy_every_byte_at_odd_offsets_and_lengths() {
        let src: Vec<u8> = (0..70_001u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        type CopyFn = fn(&mut [u8], &[u8]);
        let copies: [CopyFn; 2] = [stream_copy, demote_copy];
        for (copy, (at, len)) in copies.into_iter().flat_map(|c| {
            [
                (0, 0),
                (0, 1),
                (3, 63),
                (1, 64),
                (5, 65),
                (17, 4_099),
                (0, 70_001),
                (7, 69_990),
            ]
            .map(|r| (c, r))
        }) {
            for dst_at in [0, 1, 33] {
                let mut dst = vec![0xa5u8; len + dst_at + 8];
                copy(&mut dst[dst_at..dst_at + len], &src[at..at + len]);
                assert_eq!(
                    &dst[dst_at..dst_at + len],
                    &src[at..at + len],
                    "{at}+{len} at {dst_at}"
                );
                assert!(dst[..dst_at]
                    .iter()
                    .chain(&dst[dst_at + len..])
                    .all(|&b| b == 0xa5));
            }
        }
        // The SSE2 lines too (the AVX2 ones run above where the CPU has AVX2).
        #[cfg(target_arch = "x86_64")]
        for (at, len) in [(0, 64), (3, 128), (5, 4_096)] {
            let mut buf = vec![0xa5u8; len + LINE];
            let off = buf.as_ptr().align_offset(LINE);
            let dst = &mut buf[off..off + len];
            // SAFETY: `dst` (line-aligned) and `src[at..]` hold `len` bytes each, apart, and
            // `len` is a multiple of LINE.
            unsafe { stream_lines_sse2(dst.as_mut_ptr(), src[at..].as_ptr(), len) };
            assert_eq!(&*dst, &src[at..at + len]);
        }
        let wide: Vec<u32> = (0..1_001).map(|i| i * 7 + 1).collect();
        let mut out = vec![0u32; 1_001];
        stream_copy(&mut out, &wide);
        assert_eq!(out, wide);
    }

    #[test]
    fn fresh_vecs_beyond_the_machine_are_errors_not_aborts() {
        for len in [usize::MAX, usize::MAX / 8, 1 << 60] {
            assert!(FreshVec::<u64>::with_capacity(len).is_err());
        }
    }
}
