//! Where a ring copy's chunks and parts lie.

use std::ops::Range;

use super::RingPlan;

/// Where a ring copy's chunks and parts lie. Chunks are `plan.chunk_len` elements in the
/// middle, after a shorter first one of `lead` elements when `0 < lead <= chunk` (so the
/// host side of every later chunk and part starts on an alignment boundary), with a ramp at
/// both ends: chunks of 1/32, 1/16, 1/8, 1/4 and 1/2 of that (while the copy has room for
/// them at both ends, and none empty), so the DMA starts (uploads) or the copy-out starts
/// (downloads) after a small first chunk, and the last one leaves little to do after it.
/// Each chunk is cut into parts of about its length over `plan.threads`, between the
/// alignment and `plan.part_len`, so every thread helps with the small chunks too.
pub(super) struct Grid {
    /// Chunk `c` covers `bounds[c]..bounds[c + 1]`.
    pub(super) bounds: Vec<usize>,
    /// Elements per part in chunk `c`.
    pub(super) part: Vec<usize>,
    /// Parts before chunk `c`; the last entry counts all of them.
    pub(super) first_part: Vec<usize>,
    /// Elements of the short first chunk (0: none).
    #[cfg(test)]
    pub(super) lead: usize,
}

/// `align` bytes in elements of `size` bytes (1 where it is no whole number of them).
pub(super) fn align_elems(align: usize, size: usize) -> usize {
    let size = size.max(1);
    if align % size == 0 {
        (align / size).max(1)
    } else {
        1
    }
}

/// Ramp chunks at each end of a ring copy, as fractions of a chunk: 1/32 to 1/2. After the
/// copy threads idled, the caller writes most of the first chunk alone while they wake, so
/// a small first chunk starts the DMA engine sooner (bench/NOTES.md, staging ring).
pub(super) const RAMP: [u32; 5] = [5, 4, 3, 2, 1];

impl Grid {
    /// `align`: elements the host side of every part past the lead starts a multiple of.
    pub(super) fn new(n: usize, plan: &RingPlan, lead: usize, align: usize) -> Grid {
        let align = align.max(1);
        // Chunks and parts in whole alignment units (a chunk at least one unit).
        let chunk = plan.chunk_len.clamp(1, n.max(1)).next_multiple_of(align);
        let lead = if lead < n && lead <= chunk { lead } else { 0 };
        let mut left = n - lead;
        // The ramp's chunks, taken at both ends.
        let mut ramp = Vec::new();
        for shift in RAMP {
            let size = (chunk >> shift).next_multiple_of(align);
            // Not for chunks of under 32 elements, whose small steps round to nothing: an
            // empty chunk has no last part to send the DMA a ring after it.
            if size == 0 || size >= chunk || left < 2 * size + chunk {
                continue;
            }
            ramp.push(size);
            left -= 2 * size;
        }
        let mut sizes = Vec::new();
        if lead > 0 {
            sizes.push(lead);
        }
        sizes.extend(&ramp);
        // Whole chunks, then the rest: its aligned part as a chunk of its own, what is left
        // under one unit joining the last chunk.
        sizes.extend(std::iter::repeat_n(chunk, left / chunk));
        let rest = left % chunk;
        if rest >= align {
            sizes.push(rest - rest % align);
        }
        sizes.extend(ramp.iter().rev());
        match sizes.last_mut() {
            Some(last) => *last += rest % align,
            // A copy of nothing has no chunks (an empty one would have no last part).
            None if n > 0 => sizes.push(n),
            None => {}
        }
        let threads = plan.threads.max(1);
        let part_cap = plan.part_len.max(1).next_multiple_of(align);
        let (mut bounds, mut part, mut first_part) = (vec![0], Vec::new(), vec![0]);
        for size in sizes {
            let p = size
                .div_ceil(threads)
                .next_multiple_of(align)
                .min(part_cap)
                .max(1);
            bounds.push(bounds[bounds.len() - 1] + size);
            first_part.push(first_part[first_part.len() - 1] + size.div_ceil(p));
            part.push(p);
        }
        Grid {
            bounds,
            part,
            first_part,
            #[cfg(test)]
            lead,
        }
    }

    pub(super) fn chunks(&self) -> usize {
        self.part.len()
    }

    /// The longest chunk (what a ring slot holds).
    pub(super) fn max_chunk(&self) -> usize {
        self.bounds
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    pub(super) fn chunk_range(&self, c: usize) -> Range<usize> {
        self.bounds[c]..self.bounds[c + 1]
    }

    pub(super) fn parts_in(&self, c: usize) -> usize {
        self.first_part[c + 1] - self.first_part[c]
    }

    pub(super) fn total_parts(&self) -> usize {
        self.first_part[self.chunks()]
    }

    /// Part `p` of the whole copy: (its chunk, its element range).
    pub(super) fn part(&self, p: usize) -> (usize, Range<usize>) {
        let c = self.first_part.partition_point(|&f| f <= p) - 1;
        let range = self.chunk_range(c);
        let start = range.start + (p - self.first_part[c]) * self.part[c];
        (c, start..(start + self.part[c]).min(range.end))
    }
}
