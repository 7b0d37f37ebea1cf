//! The disks against what the `Disk` trait says: the OS disk on each engine and the simulator.

use super::*;

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wd-disk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The thread pool, io_uring at depths 1, 2 and 8 where this kernel offers it, and the
/// simulator.
fn every_disk() -> Vec<Arc<dyn Disk>> {
    let mut disks: Vec<Arc<dyn Disk>> = vec![Arc::new(OsDisk::new()), Arc::new(SimDisk::new())];
    match uring::probe() {
        Ok(()) => {
            for queue_depth in [1, 2, 8] {
                let io = DiskIo {
                    engine: IoEngine::Uring,
                    queue_depth,
                };
                disks.push(Arc::new(OsDisk::with_io(io).unwrap()));
            }
        }
        Err(e) => eprintln!("no io_uring here ({e}): the ring's cases are skipped"),
    }
    disks
}

#[test]
fn fill_from_copies_any_window_of_the_parts_then_zeros() {
    let (a, b) = (
        (0..37u8).collect::<Vec<_>>(),
        (100..=250u8).collect::<Vec<_>>(),
    );
    let parts: [&[u8]; 3] = [&a, &[], &b];
    let whole: Vec<u8> = [a.clone(), b.clone()].concat();
    for from in [0, 1, 36, 37, 38, 100, 187, 188, 300] {
        for len in [0, 1, 5, 64, 400] {
            let mut out = vec![0xeeu8; len];
            fill_from(&parts, from, &mut out);
            let want: Vec<u8> = (from..from + len)
                .map(|i| whole.get(i).copied().unwrap_or(0))
                .collect();
            assert_eq!(out, want, "from {from} len {len}");
        }
    }
}

/// A framer whose header is an order-dependent digest of every body byte it copied, and
/// that records where each copy started in the body.
struct Digest {
    header_len: usize,
    sum: u64,
    seen: usize,
    starts: Vec<usize>,
    body: Vec<u8>,
}

impl Framer for Digest {
    fn copy(&mut self, src: &[u8], dst: &mut [u8]) {
        assert_eq!(src.len(), dst.len());
        // Each copy takes the body's next bytes: the framer sees it in order.
        assert!(src == &self.body[self.seen..self.seen + src.len()]);
        self.starts.push(self.seen);
        dst.copy_from_slice(src);
        for &b in src {
            self.sum = self.sum.wrapping_mul(31).wrapping_add(u64::from(b));
        }
        self.seen += src.len();
    }
    fn absorb(&mut self, src: &[u8]) {
        assert!(src == &self.body[self.seen..self.seen + src.len()]);
        for &b in src {
            self.sum = self.sum.wrapping_mul(31).wrapping_add(u64::from(b));
        }
        self.seen += src.len();
    }
    fn header(&mut self) -> Vec<u8> {
        let mut h = self.sum.to_le_bytes().repeat(4);
        h.resize(self.header_len, 0xab);
        h
    }
}

#[test]
fn a_framed_block_lands_whole_its_header_last_and_a_wrong_header_is_refused() {
    let dir = tempdir("framed");
    for len in [SPLIT_FROM + 12_345, 3 * SPLIT_FROM + 4000, 5000] {
        let body: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        for disk in every_disk() {
            disk.create_dir_all(&dir).unwrap();
            let path = dir.join("framed.seg");
            disk.append_aligned(&path, &[b"x"]).unwrap();
            let framer = |header_len| Digest {
                header_len,
                sum: 0,
                seen: 0,
                starts: Vec::new(),
                body: body.clone(),
            };
            let mut good = framer(32);
            let at = disk
                .append_aligned_framed(&path, 32, &body, &mut good)
                .unwrap();
            assert_eq!(at % DIRECT_ALIGN, 0);
            assert_eq!(
                good.seen,
                body.len(),
                "the whole body went through the framer"
            );
            let back = disk.read_aligned(&path, at, 32 + body.len()).unwrap();
            assert_eq!(back[..32], good.header()[..]);
            assert!(back[32..] == body[..], "{len} bytes");
            // A header of another length than announced is refused, and the next append
            // lands after whatever the refused one left.
            let mut short = framer(32);
            short.header_len = 5;
            let r = disk.append_aligned_framed(&path, 32, &body, &mut short);
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
            let next = disk.append_aligned(&path, &[b"after"]).unwrap();
            assert!(next > at && next % DIRECT_ALIGN == 0);
            assert_eq!(disk.read_aligned(&path, next, 5).unwrap(), b"after");
            disk.remove(&path).unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A block filled in place lands aligned after the file's end, wherever that end came
/// from: an aligned append (the end remembered) or a plain one (the end asked for).
#[test]
fn filled_appends_land_after_every_kind_of_append() {
    let dir = tempdir("filled");
    for disk in every_disk() {
        disk.create_dir_all(&dir).unwrap();
        let path = dir.join("filled.seg");
        let mut at = Vec::new();
        for (i, len) in [5000usize, 1, 8192].into_iter().enumerate() {
            let mut fill = |out: &mut [u8]| {
                out.fill(i as u8 + 1);
                Ok(())
            };
            at.push((
                disk.append_aligned_filled(&path, len, &mut fill).unwrap(),
                len,
            ));
            if i == 1 {
                disk.append(&path, b"plain bytes").unwrap();
            }
        }
        assert_eq!(at[0].0, 0);
        assert_eq!(at[1].0, 8192);
        assert_eq!(at[2].0, 16384, "after the plain append's page");
        for (i, (offset, len)) in at.into_iter().enumerate() {
            let back = disk.read_aligned(&path, offset, len).unwrap();
            assert!(back.iter().all(|&b| b == i as u8 + 1), "block {i}");
        }
        let failed = disk
            .append_aligned_filled(&path, 10, &mut |_| Err(Error::InvalidArgument("no".into())));
        assert!(
            matches!(failed, Err(Error::InvalidArgument(_))),
            "{failed:?}"
        );
        assert_eq!(
            disk.append_aligned(&path, &[b"next"]).unwrap(),
            16384 + 8192
        );
        disk.remove(&path).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn os_disk_does_what_the_trait_says() {
    let dir = tempdir("os");
    let disk = OsDisk::new();
    assert_eq!(disk.io(), Some(Io::threads()));
    disk.create_dir_all(&dir.join("sub")).unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    assert_eq!(disk.len(&a).unwrap(), None);
    assert_eq!(disk.append(&a, b"abc").unwrap(), 0);
    assert_eq!(disk.append(&a, b"def").unwrap(), 3);
    disk.sync(&a).unwrap();
    assert_eq!(disk.read_at(&a, 2, 10).unwrap(), b"cdef");
    disk.truncate(&a, 4).unwrap();
    assert_eq!(disk.read_all(&a).unwrap(), b"abcd");
    disk.write_new(&b, b"xy").unwrap();
    disk.write_new(&b, b"z").unwrap();
    assert_eq!(disk.len(&b).unwrap(), Some(1));
    assert_eq!(disk.list(&dir).unwrap(), vec![a.clone(), b.clone()]);
    disk.rename(&b, &a).unwrap();
    disk.sync_dir(&dir).unwrap();
    assert_eq!(disk.read_all(&a).unwrap(), b"z");
    disk.remove(&b).unwrap();
    disk.remove(&a).unwrap();
    assert_eq!(disk.list(&dir).unwrap(), Vec::<PathBuf>::new());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The handles kept open never outlive what they name: a file cut, replaced, renamed
/// over or removed and made again is appended to and read as the new file.
#[test]
fn kept_handles_follow_the_files() {
    let dir = tempdir("kept");
    let disk = OsDisk::new();
    disk.create_dir_all(&dir).unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    disk.append(&a, b"12345").unwrap();
    disk.truncate(&a, 2).unwrap();
    assert_eq!(disk.append(&a, b"x").unwrap(), 2);
    assert_eq!(disk.read_all(&a).unwrap(), b"12x");
    disk.write_new(&a, b"").unwrap();
    assert_eq!(disk.append(&a, b"y").unwrap(), 0);
    disk.remove(&a).unwrap();
    assert_eq!(
        disk.append(&a, b"z").unwrap(),
        0,
        "a new file after the removal"
    );
    assert_eq!(disk.read_all(&a).unwrap(), b"z");

    let first = disk.append_aligned(&b, &[b"old", b"er"]).unwrap();
    assert_eq!(disk.read_aligned(&b, first, 5).unwrap(), b"older");
    disk.remove(&b).unwrap();
    assert!(disk.read_aligned(&b, 0, 5).is_err(), "removed: not found");
    assert_eq!(disk.append_aligned(&b, &[b"new"]).unwrap(), 0);
    assert_eq!(disk.read_aligned(&b, 0, 3).unwrap(), b"new");
    let at = disk.append_aligned(&a, &[b"moved"]).unwrap();
    disk.rename(&a, &b).unwrap();
    assert_eq!(disk.read_aligned(&b, at, 5).unwrap(), b"moved");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn os_disk_reports_a_full_disk_as_enospc() {
    // /dev/full fails every write with ENOSPC.
    let full = Path::new("/dev/full");
    let e = OsDisk::new().append(full, b"x").unwrap_err();
    assert!(is_no_space(&e), "{e}");
    assert!(e.to_string().contains("/dev/full"), "{e}");
}

/// Without a ring (`ENOSYS`: an old kernel; `EPERM`: seccomp or `io_uring_disabled`),
/// `Auto` runs on the threads and `Uring` is a clear error; `Threads` never asks.
#[test]
fn auto_falls_back_to_the_threads_where_no_ring_can_be_set_up() {
    for errno in [libc::ENOSYS, libc::EPERM, libc::EINVAL] {
        let no_ring = || Err(std::io::Error::from_raw_os_error(errno));
        let auto = DiskIo::default().resolve_after(no_ring()).unwrap();
        assert_eq!(auto.engine, Engine::Threads, "errno {errno}");
        let uring = DiskIo {
            engine: IoEngine::Uring,
            queue_depth: 4,
        };
        let e = uring.resolve_after(no_ring()).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("io_uring"), "{e}");
    }
    let threads = DiskIo {
        engine: IoEngine::Threads,
        queue_depth: 3,
    };
    let io = threads.resolve_after(Ok(())).unwrap();
    assert_eq!((io.engine, io.queue_depth), (Engine::Threads, 3));
    let auto = DiskIo {
        engine: IoEngine::Auto,
        ..DiskIo::default()
    };
    let ring = auto.resolve_after(Ok(())).unwrap();
    assert_eq!(ring.engine, Engine::Uring);
    // The default runs on the threads whatever the kernel offers.
    let default = DiskIo::default().resolve_after(Ok(())).unwrap();
    assert_eq!(default.engine, Engine::Threads);
    for queue_depth in [0, MAX_QUEUE_DEPTH + 1] {
        let bad = DiskIo {
            engine: IoEngine::Auto,
            queue_depth,
        };
        let e = bad.resolve_after(Ok(())).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    // This kernel's answer, whichever it is, resolves `Auto` to a working engine.
    let here = auto.resolve().unwrap();
    let want = match uring::probe() {
        Ok(()) => Engine::Uring,
        Err(_) => Engine::Threads,
    };
    assert_eq!(here.engine, want);
}

/// Split direct I/O on each engine and depth: every byte lands where it belongs, each
/// piece is handed over once with its own bytes, and a read past the end stops there.
#[test]
fn split_direct_io_is_the_same_on_every_engine_and_depth() {
    let dir = tempdir("split");
    std::fs::create_dir_all(&dir).unwrap();
    let mut ios = vec![Io::threads()];
    if uring::probe().is_ok() {
        for queue_depth in [1, 2, 3, 8] {
            ios.push(Io {
                engine: Engine::Uring,
                queue_depth,
            });
        }
    }
    let len = 3 * SPLIT_FROM + 5 * DIRECT_ALIGN as usize;
    let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
    for io in ios {
        let path = dir.join(format!("split-{}-{}", io.engine.name(), io.queue_depth));
        let file = DirectFile::open_with(&path, io).unwrap();
        assert_eq!(file.io(), io);
        let mut buf = AlignedBuf::new(len).unwrap();
        buf.as_mut_slice().copy_from_slice(&data);
        file.write_at_depth(&buf, 0, QUEUE_DEPTH).unwrap();
        // A filled write after it: the fill sees every piece once, in order on the ring.
        let seen = Mutex::new(Vec::new());
        let fill = |at: usize, piece: &mut [u8]| {
            seen.lock().push(at);
            for (i, b) in piece.iter_mut().enumerate() {
                *b = data[(at + i) % len] ^ 0x5a;
            }
            Ok(())
        };
        let at = len as u64;
        file.write_at_depth_filled(&mut buf, 0, at, &fill).unwrap();
        let mut starts = seen.into_inner();
        starts.sort_unstable();
        let piece = piece_bytes(len);
        let want: Vec<usize> = (0..len.div_ceil(piece)).map(|k| k * piece).collect();
        assert_eq!(starts, want, "{io:?}");
        file.sync().unwrap();
        // Read back both halves, the second past the file's end by a page.
        let mut back = AlignedBuf::new(len).unwrap();
        assert_eq!(file.read_at_depth(&mut back, 0, QUEUE_DEPTH).unwrap(), len);
        assert!(back.as_slice() == &data[..], "{io:?}");
        let mut tail = AlignedBuf::new(len + DIRECT_ALIGN as usize).unwrap();
        let got = Mutex::new(vec![0u8; tail.as_slice().len()]);
        let each = |at: usize, bytes: &[u8]| {
            got.lock()[at..at + bytes.len()].copy_from_slice(bytes);
            Ok(())
        };
        let n = file.read_at_depth_each(&mut tail, at, &each).unwrap();
        assert_eq!(n, len, "{io:?}: stops at the end");
        let got = got.into_inner();
        assert!(
            (0..len).all(|i| got[i] == data[i] ^ 0x5a),
            "{io:?}: the filled write"
        );
        // A fill that fails fails the write, after what it submitted has landed.
        let refuse = |at: usize, _: &mut [u8]| match at {
            0 => Ok(()),
            _ => Err(Error::InvalidArgument("no".into())),
        };
        let e = file.write_at_depth_filled(&mut buf, 0, 0, &refuse);
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{io:?}: {e:?}");
        let _ = std::fs::remove_file(&path);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An I/O error on the ring is the file's error, as on the threads: a write to
/// /dev/full fails with `ENOSPC` naming the path.
#[test]
fn ring_errors_name_the_path() {
    if uring::probe().is_err() {
        eprintln!("no io_uring here: skipped");
        return;
    }
    let e = OsDisk::with_io(DiskIo {
        engine: IoEngine::Uring,
        queue_depth: 4,
    })
    .unwrap()
    .append_aligned(Path::new("/dev/full"), &[b"x"])
    .unwrap_err();
    assert!(is_no_space(&e), "{e}");
    assert!(e.to_string().contains("/dev/full"), "{e}");
}

/// A file system whose `statx` claims less alignment than `O_DIRECT` honours: the in-place
/// write it refuses (`EINVAL`) is redone through the bounce buffer, its bytes taken once; the
/// read it refuses says `None` (the store reads it again bounced); the handle bounces after.
#[test]
fn a_refused_in_place_io_falls_back_to_the_bounce() {
    let mut ios = vec![Io::threads()];
    if uring::probe().is_ok() {
        ios.push(Io {
            engine: Engine::Uring,
            queue_depth: 4,
        });
    }
    for io in ios {
        let dir = tempdir(&format!("refused-{}", io.engine.name()));
        let disk = OsDisk::on(io);
        disk.create_dir_all(&dir).unwrap();
        let path = dir.join("data.seg");
        let open = || DirectFile::open_with(&path, io).unwrap();
        if !open().is_direct() {
            eprintln!("no O_DIRECT in {dir:?}: skipped");
            return;
        }
        // Memory at an odd address: no device's DMA takes it; the handle claims any is fine.
        let any = DioAlign {
            mem: 1,
            offset: 512,
        };
        let claim = |disk: &OsDisk| {
            disk.forget(&path);
            disk.direct
                .lock()
                .push((path.clone(), Arc::new(open().claiming(any))));
        };
        let len = 64 << 10;
        let mut held = vec![0u8; len + 1];
        for (i, b) in held.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let data = &held[1..];
        claim(&disk);
        let before = in_place_ios();
        let mut taken = Vec::new();
        let at = disk
            .append_aligned_taking(&path, data, &mut |b| taken.extend_from_slice(b))
            .unwrap();
        assert!(taken == data, "{io:?}: the bytes taken once, in order");
        assert_eq!(in_place_ios(), before, "{io:?}: nothing went in place");
        assert_eq!(disk.read_aligned(&path, at, len).unwrap(), data);
        claim(&disk);
        let mut out = vec![0u8; len + 1];
        let each = |_: usize, _: &[u8]| Ok(());
        let got = disk.read_aligned_into(&path, at, &mut out[1..], &each);
        assert!(matches!(got, Ok(None)), "{io:?}: {got:?}");
        // The handle bounces from now on: `None` at once, nothing read.
        let got = disk.read_aligned_into(&path, at, &mut out[1..], &each);
        assert!(matches!(got, Ok(None)), "{io:?}: {got:?}");
        assert_eq!(in_place_ios(), before, "{io:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
