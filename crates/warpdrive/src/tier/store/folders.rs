//! The disk folders a store writes blocks to, checked, and the rule that places a block
//! among them ([`TierConfig::disk_folders`](super::TierConfig::disk_folders)).

use std::path::Path;

use crate::error::{Error, Result};

use super::super::disk::DIRECT_ALIGN;
use super::super::log::Location;
use super::{DiskFolder, Inner};

/// The largest page a folder may have.
const MAX_PAGE: u64 = 1 << 30;

/// The folders of a store in `dir` configured as `list`: the store's folder alone when `list`
/// is empty; else `list`, each page a power of two from 4 KiB to 1 GiB, each budget at least
/// one page, no path twice.
pub(super) fn resolve(dir: &Path, list: &[DiskFolder]) -> Result<Vec<DiskFolder>> {
    if list.is_empty() {
        return Ok(vec![DiskFolder::new(dir, DIRECT_ALIGN, u64::MAX)]);
    }
    if u32::try_from(list.len()).is_err() {
        return Err(Error::InvalidArgument(format!(
            "tier store: {} disk folders",
            list.len()
        )));
    }
    for (i, f) in list.iter().enumerate() {
        let name = f.path.display();
        if !f.page.is_power_of_two() || !(DIRECT_ALIGN..=MAX_PAGE).contains(&f.page) {
            return Err(Error::InvalidArgument(format!(
                "tier store: disk folder {name}: a page of {} bytes (a power of two, \
                 {DIRECT_ALIGN} to {MAX_PAGE})",
                f.page
            )));
        }
        if f.budget < f.page {
            return Err(Error::InvalidArgument(format!(
                "tier store: disk folder {name}: a budget of {} bytes, under one page of {}",
                f.budget, f.page
            )));
        }
        if list[..i].iter().any(|g| g.path == f.path) {
            return Err(Error::InvalidArgument(format!(
                "tier store: disk folder {name} listed twice"
            )));
        }
    }
    Ok(list.to_vec())
}

/// `len` rounded up to `page` (a power of two), or `None` past `u64`.
pub(super) fn in_pages(len: u64, page: u64) -> Option<u64> {
    len.checked_add(page - 1).map(|n| n & !(page - 1))
}

/// The folders to try for a block of `len` unencoded bytes, best first: the smallest page
/// at least `len` (else the largest page), then larger pages ascending, then smaller ones
/// descending; equal pages in list order.
pub(super) fn placement(folders: &[DiskFolder], len: u64) -> Vec<usize> {
    let mut by_page: Vec<usize> = (0..folders.len()).collect();
    by_page.sort_by_key(|&i| folders[i].page);
    let first = by_page
        .iter()
        .position(|&i| folders[i].page >= len)
        .unwrap_or(by_page.len().saturating_sub(1));
    let mut order = by_page[first..].to_vec();
    order.extend(by_page[..first].iter().rev());
    order
}

/// Bytes of pages charged to `folder` now.
pub(super) fn used(g: &Inner, folder: u32) -> u64 {
    g.segments
        .iter()
        .filter(|((f, _), _)| *f == folder)
        .map(|(_, s)| s.charged)
        .sum()
}

/// The folder a block of `len` unencoded bytes goes to: the first in [`placement`] order
/// whose budget takes it on top of `pending` bytes already placed by the same write; a clear
/// error naming the first choice when none does.
pub(super) fn choose(
    folders: &[DiskFolder],
    g: &Inner,
    len: usize,
    pending: &[u64],
) -> Result<u32> {
    // A stored block is never longer than its raw bytes (its header is in the index record).
    let stored = len as u64;
    let order = placement(folders, len as u64);
    for &i in &order {
        let f = &folders[i];
        let Some(need) = in_pages(stored, f.page) else {
            continue;
        };
        // No limit (the default folder): nothing to count on the write path.
        if f.budget == u64::MAX {
            return Ok(i as u32);
        }
        let have = used(g, i as u32).saturating_add(pending.get(i).copied().unwrap_or(0));
        if have.checked_add(need).is_some_and(|n| n <= f.budget) {
            return Ok(i as u32);
        }
    }
    let first = order.first().and_then(|&i| folders.get(i));
    let path = first.map_or_else(Default::default, |f| f.path.clone());
    Err(Error::Io {
        source: std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!(
                "a block of {len} bytes fits no disk folder's budget (first choice {}, {} of \
                 {} bytes used)",
                path.display(),
                order.first().map_or(0, |&i| used(g, i as u32)),
                first.map_or(0, |f| f.budget)
            ),
        ),
        path,
    })
}

/// The bytes `at` is charged in a folder of `page`-byte pages.
pub(super) fn charge(at: &Location, page: u64) -> u64 {
    in_pages(at.len, page).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_go_to_the_smallest_page_that_holds_them_then_spill_up_then_down() {
        let f = |page| DiskFolder::new(format!("/f{page}"), page, u64::MAX);
        let folders = [f(1 << 20), f(4096), f(64 << 10)];
        assert_eq!(placement(&folders, 100), vec![1, 2, 0]);
        assert_eq!(placement(&folders, 4096), vec![1, 2, 0]);
        assert_eq!(placement(&folders, 4097), vec![2, 0, 1]);
        assert_eq!(placement(&folders, 1 << 20), vec![0, 2, 1]);
        assert_eq!(placement(&folders, 5 << 20), vec![0, 2, 1]);
        assert_eq!(in_pages(1, 4096), Some(4096));
        assert_eq!(in_pages(8192, 4096), Some(8192));
        assert_eq!(in_pages(u64::MAX, 4096), None);
    }

    #[test]
    fn bad_folders_are_clear_errors() {
        let dir = Path::new("/s");
        let bad = [
            vec![DiskFolder::new("/a", 1000, 1 << 20)],
            vec![DiskFolder::new("/a", 2048, 1 << 20)],
            vec![DiskFolder::new("/a", 4096, 100)],
            vec![
                DiskFolder::new("/a", 4096, 1 << 20),
                DiskFolder::new("/a", 8192, 1 << 20),
            ],
        ];
        for list in bad {
            let e = resolve(dir, &list).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("/a")),
                "{e}"
            );
        }
        assert_eq!(resolve(dir, &[]).unwrap()[0].path, dir);
    }
}
