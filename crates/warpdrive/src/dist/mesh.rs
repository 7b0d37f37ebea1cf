//! The TCP links of a CPU process group: one connection per pair of ranks, made after the
//! rendezvous. Each connection has a thread that writes the frames this rank queues (so a
//! send returns once its data is copied, as the in-process group's does) and one that reads
//! the peer's frames into this rank's inbox, where calls wait for them under their deadline.
//!
//! A connection that closes is how a rank learns that a peer left (its process ended, or it
//! dropped its `Comm`): frames the peer sent before are still delivered, and a wait for more
//! from it fails at once. An abort frame carries one rank's reason to the others, so a rank
//! that fails mid-step does not leave the others waiting for their timeout.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A round of a collective step.
    Round = 0,
    /// A point-to-point message.
    Message = 1,
    /// The sender aborted the group; the payload is its reason.
    Abort = 2,
}

/// A frame's bytes, stored in u64 words so that any element type can be viewed in place.
#[derive(Default)]
pub(super) struct Payload {
    words: Vec<u64>,
    bytes: usize,
}

impl Payload {
    /// A copy of `bytes`.
    pub(super) fn copy_of(bytes: &[u8]) -> Result<Payload> {
        let mut p = Payload::zeroed(bytes.len())?;
        p.bytes_mut().copy_from_slice(bytes);
        Ok(p)
    }

    /// `bytes` zero bytes (an error when the host cannot hold them).
    pub(super) fn zeroed(bytes: usize) -> Result<Payload> {
        let n = bytes.div_ceil(8);
        let mut words = Vec::new();
        words.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
            requested: bytes,
            detail: "host memory for a dist message".into(),
        })?;
        words.resize(n, 0);
        Ok(Payload { words, bytes })
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.bytes]
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.bytes]
    }
}

/// A received frame: its tag (a message's element type and count) and payload.
pub(super) struct Frame {
    pub(super) tag: (u64, u64),
    pub(super) payload: Payload,
}

/// A frame queued for a peer's writing thread: kind, tag, payload.
type Outgoing = (Kind, (u64, u64), Payload);

/// Frame header: kind, then the two tag words, then the payload's length in bytes.
const HEADER: usize = 32;
/// First bytes of a mesh connection's hello.
const MESH_HELLO: &[u8; 8] = b"wdmesh01";

struct Inbox {
    rounds: Vec<VecDeque<Frame>>,
    messages: Vec<VecDeque<Frame>>,
    /// Why each peer is gone (its connection closed or broke), in the order seen.
    gone: Vec<Option<(usize, String)>>,
    departures: usize,
    abort: Option<String>,
}

struct Shared {
    inbox: Mutex<Inbox>,
    changed: Condvar,
    /// Set with any `gone` or `abort`: the shared-memory waits look at it between spins.
    troubled: AtomicBool,
    /// Set while this rank closes its links: a closing connection is no news then.
    closing: AtomicBool,
}

/// How long a failed write waits for the peer's reader to record the departure itself.
const READER_GRACE: Duration = Duration::from_secs(1);

impl Shared {
    /// Records that `peer` is gone after its reader has read what the peer sent before it
    /// left (bounded by [`READER_GRACE`]): a write can fail on the peer's reset before the
    /// reader runs, and an abort frame still queued there says which rank left first.
    fn gone_after_reading(&self, peer: usize, why: String) {
        let deadline = Instant::now() + READER_GRACE;
        let mut inbox = self.inbox.lock();
        while inbox.gone[peer].is_none() && !self.closing.load(Ordering::Acquire) {
            if self.changed.wait_until(&mut inbox, deadline).timed_out() {
                break;
            }
        }
        drop(inbox);
        self.gone(peer, why);
    }

    fn gone(&self, peer: usize, why: String) {
        let mut inbox = self.inbox.lock();
        if inbox.gone[peer].is_none() {
            inbox.gone[peer] = Some((inbox.departures, why));
            inbox.departures += 1;
        }
        self.troubled.store(true, Ordering::Release);
        self.changed.notify_all();
    }
}

/// One rank's links to every other rank.
pub(super) struct Mesh {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    /// Frames to write, per peer (none for this rank).
    outboxes: Vec<Option<mpsc::Sender<Outgoing>>>,
    streams: Vec<Option<TcpStream>>,
    threads: Vec<JoinHandle<()>>,
}

impl Mesh {
    /// Connects rank `rank` to every other: it dials the ranks below it (at `addrs`) and
    /// takes the calls of the ranks above it on `listener`, each hello naming the `job`.
    pub(super) fn connect(
        rank: usize,
        addrs: &[SocketAddr],
        listener: TcpListener,
        job: u64,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Mesh> {
        let world = addrs.len();
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (q, addr) in addrs.iter().enumerate().take(rank) {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut stream = TcpStream::connect_timeout(addr, left.max(Duration::from_millis(1)))
                .map_err(|e| {
                fail(format!("rank {rank} cannot reach rank {q} at {addr}: {e}"))
            })?;
            let mut hello = [0u8; 20];
            hello[..8].copy_from_slice(MESH_HELLO);
            hello[8..16].copy_from_slice(&job.to_le_bytes());
            hello[16..].copy_from_slice(&(rank as u32).to_le_bytes());
            stream
                .write_all(&hello)
                .map_err(|e| fail(format!("rank {rank} cannot greet rank {q}: {e}")))?;
            streams[q] = Some(stream);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(format!("rank {rank}'s listener: {e}")))?;
        while streams[rank + 1..].iter().any(Option::is_none) {
            match listener.accept() {
                Ok((stream, _)) => {
                    if let Some(q) = read_hello(&stream, job, rank, world, deadline) {
                        streams[q] = Some(stream);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (rank + 1..world)
                            .filter(|&q| streams[q].is_none())
                            .collect();
                        return Err(fail(format!(
                            "rank {rank} waited for ranks {missing:?} to connect and they did not"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(fail(format!("rank {rank}'s accept: {e}"))),
            }
        }
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                rounds: (0..world).map(|_| VecDeque::new()).collect(),
                messages: (0..world).map(|_| VecDeque::new()).collect(),
                gone: vec![None; world],
                departures: 0,
                abort: None,
            }),
            changed: Condvar::new(),
            troubled: AtomicBool::new(false),
            closing: AtomicBool::new(false),
        });
        let mut mesh = Mesh {
            rank,
            world,
            shared,
            outboxes: (0..world).map(|_| None).collect(),
            streams: (0..world).map(|_| None).collect(),
            threads: Vec::new(),
        };
        for (q, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else { continue };
            mesh.start(q, stream, timeout)?;
        }
        Ok(mesh)
    }

    /// Starts the writing and reading threads of the connection to `peer`.
    fn start(&mut self, peer: usize, stream: TcpStream, timeout: Duration) -> Result<()> {
        let io = |e: std::io::Error| fail(format!("the connection to rank {peer}: {e}"));
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        // Writes give up after the timeout (a peer that stopped reading); reads block until
        // the peer writes or the connection closes (the waits on the inbox are timed).
        stream.set_write_timeout(Some(timeout)).map_err(io)?;
        let (reader, writer) = (
            stream.try_clone().map_err(io)?,
            stream.try_clone().map_err(io)?,
        );
        self.streams[peer] = Some(stream);
        let (tx, rx) = mpsc::channel();
        self.outboxes[peer] = Some(tx);
        let shared = self.shared.clone();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| fail(format!("cannot start a link thread: {e}")))
        };
        let me = self.rank;
        self.threads.push(spawn(
            format!("wd-dist-tx{peer}"),
            Box::new(move || write_frames(writer, rx, peer, &shared)),
        )?);
        let shared = self.shared.clone();
        self.threads.push(spawn(
            format!("wd-dist-rx{peer}"),
            Box::new(move || read_frames(reader, peer, me, &shared)),
        )?);
        Ok(())
    }

    /// Queues a frame for `peer`; returns at once.
    pub(super) fn send(
        &self,
        peer: usize,
        kind: Kind,
        tag: (u64, u64),
        payload: Payload,
    ) -> Result<()> {
        if let Some(e) = self.trouble(kind_op(kind), Some(peer)) {
            return Err(e);
        }
        let sent = self.outboxes[peer]
            .as_ref()
            .map(|tx| tx.send((kind, tag, payload)).is_ok());
        if sent == Some(true) {
            Ok(())
        } else {
            Err(fail(format!("rank {}: no link to rank {peer}", self.rank)))
        }
    }

    /// The next frame of `kind` from `peer`, waiting until `deadline`. Frames that arrived
    /// before the peer left or the group was aborted are still handed out.
    pub(super) fn take(
        &self,
        op: &'static str,
        peer: usize,
        kind: Kind,
        deadline: Option<Instant>,
    ) -> Result<Frame> {
        let mut inbox = self.shared.inbox.lock();
        loop {
            let queue = match kind {
                Kind::Message => &mut inbox.messages[peer],
                _ => &mut inbox.rounds[peer],
            };
            if let Some(frame) = queue.pop_front() {
                return Ok(frame);
            }
            if let Some(e) = trouble_in(&inbox, op, Some(peer)) {
                return Err(e);
            }
            let timed_out = match deadline {
                Some(d) => self.shared.changed.wait_until(&mut inbox, d).timed_out(),
                None => {
                    self.shared.changed.wait(&mut inbox);
                    false
                }
            };
            if timed_out {
                return Err(Error::Collective {
                    op,
                    detail: format!(
                        "rank {} waited past its timeout for rank {peer}, which did not send",
                        self.rank
                    ),
                });
            }
        }
    }

    /// Why a call of `op` cannot go on: the group was aborted, or `peer` (any peer: `None`)
    /// is gone (named: the first rank seen to leave). Cheap when nothing went wrong.
    pub(super) fn trouble(&self, op: &'static str, peer: Option<usize>) -> Option<Error> {
        if !self.shared.troubled.load(Ordering::Acquire) {
            return None;
        }
        trouble_in(&self.shared.inbox.lock(), op, peer)
    }

    /// Aborts the group: this rank's later calls fail with `reason`, and so do the others'
    /// once the abort frame reaches them.
    pub(super) fn abort(&self, reason: &str) {
        {
            let mut inbox = self.shared.inbox.lock();
            if inbox.abort.is_some() {
                return;
            }
            inbox.abort = Some(reason.to_string());
            self.shared.troubled.store(true, Ordering::Release);
            self.shared.changed.notify_all();
        }
        for q in (0..self.world).filter(|&q| q != self.rank) {
            if let (Some(tx), Ok(p)) = (&self.outboxes[q], Payload::copy_of(reason.as_bytes())) {
                let _ = tx.send((Kind::Abort, (0, 0), p));
            }
        }
    }
}

impl Drop for Mesh {
    /// Flushes what this rank queued (each write bounded by the timeout), then closes every
    /// connection: the peers learn that this rank left.
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.outboxes.iter_mut().for_each(|tx| drop(tx.take()));
        let (writers, readers): (Vec<_>, Vec<_>) = self
            .threads
            .drain(..)
            .partition(|t| t.thread().name().is_some_and(|n| n.contains("tx")));
        for t in writers {
            let _ = t.join();
        }
        for stream in self.streams.iter().flatten() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for t in readers {
            let _ = t.join();
        }
    }
}

fn kind_op(kind: Kind) -> &'static str {
    match kind {
        Kind::Message => "send",
        _ => "step",
    }
}

fn trouble_in(inbox: &Inbox, op: &'static str, peer: Option<usize>) -> Option<Error> {
    if let Some(reason) = &inbox.abort {
        return Some(Error::Collective {
            op,
            detail: format!("the group is aborted: {reason}"),
        });
    }
    if peer.is_some_and(|q| inbox.gone[q].is_none()) {
        return None;
    }
    // The first rank to leave: the others may have left because of it.
    let first = inbox.gone.iter().flatten().min_by_key(|(order, _)| *order);
    first.map(|(_, why)| Error::Collective {
        op,
        detail: why.clone(),
    })
}

/// Reads a peer's hello on an accepted connection: its rank, when it is one of this job's
/// ranks above this one.
fn read_hello(
    stream: &TcpStream,
    job: u64,
    rank: usize,
    world: usize,
    deadline: Instant,
) -> Option<usize> {
    let mut stream = stream;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(left)).ok()?;
    let mut hello = [0u8; 20];
    stream.read_exact(&mut hello).ok()?;
    let q = u32::from_le_bytes([hello[16], hello[17], hello[18], hello[19]]) as usize;
    let ok =
        &hello[..8] == MESH_HELLO && hello[8..16] == job.to_le_bytes() && q > rank && q < world;
    stream.set_read_timeout(None).ok()?;
    ok.then_some(q)
}

fn write_frames(mut stream: TcpStream, rx: mpsc::Receiver<Outgoing>, peer: usize, shared: &Shared) {
    for (kind, tag, payload) in rx {
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&(kind as u64).to_le_bytes());
        header[8..16].copy_from_slice(&tag.0.to_le_bytes());
        header[16..24].copy_from_slice(&tag.1.to_le_bytes());
        header[24..].copy_from_slice(&(payload.bytes as u64).to_le_bytes());
        let written = stream
            .write_all(&header)
            .and_then(|()| stream.write_all(payload.bytes()));
        if let Err(e) = written {
            shared.gone_after_reading(
                peer,
                format!("rank {peer} left the group (a write to it failed: {e})"),
            );
            return;
        }
    }
}

fn read_frames(mut stream: TcpStream, peer: usize, me: usize, shared: &Shared) {
    let why = loop {
        let mut header = [0u8; HEADER];
        if let Err(e) = stream.read_exact(&mut header) {
            break e;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&header[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        let Ok(bytes) = usize::try_from(word(3)) else {
            break std::io::Error::other("a frame longer than this host's address space");
        };
        let mut payload = match Payload::zeroed(bytes) {
            Ok(p) => p,
            Err(e) => break std::io::Error::other(e.to_string()),
        };
        if let Err(e) = stream.read_exact(payload.bytes_mut()) {
            break e;
        }
        let frame = Frame {
            tag: (word(1), word(2)),
            payload,
        };
        let mut inbox = shared.inbox.lock();
        match word(0) {
            0 => inbox.rounds[peer].push_back(frame),
            1 => inbox.messages[peer].push_back(frame),
            _ => {
                let reason = String::from_utf8_lossy(frame.payload.bytes()).into_owned();
                if inbox.abort.is_none() {
                    inbox.abort = Some(reason);
                }
                shared.troubled.store(true, Ordering::Release);
            }
        }
        shared.changed.notify_all();
    };
    if !shared.closing.load(Ordering::Acquire) {
        let how = if why.kind() == ErrorKind::UnexpectedEof {
            "its connection closed: its process ended or it dropped its Comm".to_string()
        } else {
            format!("its connection broke: {why}")
        };
        shared.gone(
            peer,
            format!("rank {peer} left the group ({how}); seen by rank {me}"),
        );
    }
}

/// The address to dial a rank at: the address rank 0 saw it connect from, or the master's
/// for rank 0 itself.
pub(super) fn dial_addr(seen: Option<IpAddr>, master: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(seen.unwrap_or(master), port)
}

fn fail(detail: String) -> Error {
    Error::Collective {
        op: "bootstrap",
        detail,
    }
}
