//! A file's direct-I/O alignment (`statx` `STATX_DIOALIGN`, Linux 6.1 and later) and which
//! part of an I/O of the caller's memory goes in place under it: the sectors its address
//! and length allow, the last partial sector (and a write's zero pad) through a bounce.

use std::fs::File;
use std::os::unix::fs::MetadataExt;

use super::DIRECT_ALIGN;

/// The alignment `O_DIRECT` asks of a file's I/O: the memory's address (`mem`) and the
/// file offsets and lengths (`offset`), in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    pub mem: usize,
    pub offset: usize,
}

impl DioAlign {
    /// What a file opened without `O_DIRECT` asks: nothing.
    pub const BUFFERED: DioAlign = DioAlign { mem: 1, offset: 1 };

    /// `file`'s alignment as its file system reports it (`stx_dio_mem_align`,
    /// `stx_dio_offset_align`); where `statx` or its `STATX_DIOALIGN` answer is absent (a
    /// kernel before 6.1), 4 KiB for memory and the device's logical block size (4 KiB
    /// where unknown) for offsets.
    pub fn of(file: &File) -> DioAlign {
        use rustix::fs::{statx, AtFlags, StatxFlags};
        let asked = StatxFlags::DIOALIGN;
        if let Ok(st) = statx(file, "", AtFlags::EMPTY_PATH, asked) {
            let (mem, offset) = (st.stx_dio_mem_align, st.stx_dio_offset_align);
            if st.stx_mask & asked.bits() != 0 && mem != 0 && offset != 0 {
                return DioAlign {
                    mem: mem as usize,
                    offset: offset as usize,
                };
            }
        }
        DioAlign {
            mem: DIRECT_ALIGN as usize,
            offset: logical_block_size(file).unwrap_or(DIRECT_ALIGN as usize),
        }
    }
}

/// The logical block size of the device under `file` (its partition's disk's), from sysfs.
fn logical_block_size(file: &File) -> Option<usize> {
    let dev = file.metadata().ok()?.dev();
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    ["queue", "../queue"].iter().find_map(|q| {
        let text = std::fs::read_to_string(format!("{base}/{q}/logical_block_size")).ok()?;
        text.trim()
            .parse::<usize>()
            .ok()
            .filter(|n| n.is_power_of_two())
    })
}

/// Whether an I/O reads into or writes from the caller's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
}

/// An I/O of the caller's memory in place: its first `head` bytes (whole sectors) moved
/// straight, then `bounce` bytes through an aligned buffer in the same I/O — a read's last
/// partial sector; a write's, with the zeros to the next [`DIRECT_ALIGN`] after the block
/// (the file holds what the bounce path writes). No byte past the caller's memory is read
/// or written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InPlace {
    pub head: usize,
    pub bounce: usize,
}

/// How `len` bytes of memory at `addr` move in place at `offset` under `align`; `None` (the
/// whole I/O through a bounce buffer) where the address or the offset is not aligned, the
/// block is under one sector, or an alignment is not a power of two up to [`DIRECT_ALIGN`]
/// (the bounce buffers' own).
pub fn plan(align: DioAlign, addr: usize, len: usize, offset: u64, op: Op) -> Option<InPlace> {
    let page = DIRECT_ALIGN as usize;
    let ok = |a: usize| a.is_power_of_two() && a <= page;
    if !ok(align.mem) || !ok(align.offset) {
        return None;
    }
    if !addr.is_multiple_of(align.mem) || !offset.is_multiple_of(align.offset as u64) {
        return None;
    }
    let head = len - len % align.offset;
    if head == 0 {
        return None;
    }
    let end = match op {
        Op::Read => len.checked_next_multiple_of(align.offset)?,
        Op::Write => len.checked_next_multiple_of(page)?,
    };
    Some(InPlace {
        head,
        bounce: end - head,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    fn at(mem: usize, offset: usize) -> DioAlign {
        DioAlign { mem, offset }
    }

    #[test]
    fn the_alignment_decides_what_goes_in_place() {
        let whole = |head| Some(InPlace { head, bounce: 0 });
        let nvme = at(4, 512);
        let virtio = at(512, 512);
        let old = at(4096, 4096);
        // A `Vec` (16 B past a page), 512 B and page-aligned memory, 64 KiB at a page.
        for (align, addr, want) in [
            (nvme, 0x1010, whole(64 * KIB)),
            (nvme, 0x1002, None),
            (virtio, 0x1010, None),
            (virtio, 0x1200, whole(64 * KIB)),
            (old, 0x1200, None),
            (old, 0x1000, whole(64 * KIB)),
        ] {
            for op in [Op::Read, Op::Write] {
                assert_eq!(
                    plan(align, addr, 64 * KIB, 8192, op),
                    want,
                    "{align:?} {addr:#x}"
                );
            }
        }
        // Off the sector: the last partial sector through the bounce, a write's padded to
        // the page as the bounce path pads it.
        let len = 64 * KIB + 100;
        let read = plan(virtio, 0x1200, len, 0, Op::Read);
        assert_eq!(
            read,
            Some(InPlace {
                head: 64 * KIB,
                bounce: 512
            })
        );
        let write = plan(virtio, 0x1200, len, 0, Op::Write);
        assert_eq!(
            write,
            Some(InPlace {
                head: 64 * KIB,
                bounce: 4096
            })
        );
        let write = plan(nvme, 0x1010, 64 * KIB + 512, 0, Op::Write);
        assert_eq!(
            write,
            Some(InPlace {
                head: 64 * KIB + 512,
                bounce: 3584
            })
        );
        assert_eq!(
            plan(nvme, 0x1010, 64 * KIB + 512, 0, Op::Read),
            whole(64 * KIB + 512)
        );
        // 4 KiB sectors: a 512-multiple is off the sector there.
        let read = plan(old, 0x1000, 64 * KIB + 512, 0, Op::Read);
        assert_eq!(
            read,
            Some(InPlace {
                head: 64 * KIB,
                bounce: 4096
            })
        );
        // Under one sector, a misaligned offset, an odd or too large alignment: bounced.
        assert_eq!(plan(virtio, 0x1200, 511, 0, Op::Write), None);
        assert_eq!(plan(virtio, 0x1200, 0, 0, Op::Read), None);
        assert_eq!(plan(virtio, 0x1200, 4096, 256, Op::Read), None);
        assert_eq!(plan(at(3, 512), 0x1200, 4096, 0, Op::Read), None);
        assert_eq!(plan(at(8192, 512), 0x2000, 8192, 0, Op::Read), None);
        assert_eq!(plan(at(512, 0), 0x1200, 4096, 0, Op::Read), None);
        // Nothing past usize.
        assert_eq!(plan(at(1, 1), 0, usize::MAX, 0, Op::Write), None);
        // A buffered file takes any memory, any length.
        assert_eq!(plan(DioAlign::BUFFERED, 3, 5, 7, Op::Read), whole(5));
        assert_eq!(
            plan(DioAlign::BUFFERED, 3, 5, 0, Op::Write),
            Some(InPlace {
                head: 5,
                bounce: 4091
            })
        );
    }
}
