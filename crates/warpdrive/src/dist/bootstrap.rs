//! Starting one process per GPU the way `torchrun` does: each process reads its rank and the
//! master's address from the environment ([`LaunchEnv`]); rank 0 makes the NCCL id and
//! serves it over TCP at `MASTER_ADDR:MASTER_PORT`; the other ranks connect (retrying until
//! the timeout, as rank 0 may start last) and fetch it. Every step is bounded by the
//! timeout: a wrong port, a rank that never comes or a peer that disagrees on the world
//! size is an [`Error::Collective`] naming what went wrong, never a hang.

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::device::{nccl_unique_id, NCCL_ID_BYTES};
use crate::error::{Error, Result};

/// The token every rank of one NCCL communicator starts from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; NCCL_ID_BYTES]);

impl NcclId {
    /// A fresh id from NCCL (`LibraryMissing` where libnccl does not load).
    pub fn new() -> Result<NcclId> {
        Ok(NcclId(nccl_unique_id()?))
    }

    /// An id received from another process.
    pub fn from_bytes(bytes: [u8; NCCL_ID_BYTES]) -> NcclId {
        NcclId(bytes)
    }

    /// The id's bytes, to hand to the other ranks.
    pub fn as_bytes(&self) -> &[u8; NCCL_ID_BYTES] {
        &self.0
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclId({:02x}{:02x}{:02x}{:02x}…)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

/// This process's place in a job started as `torchrun` starts one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`: this process's rank, `0..world`.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of processes.
    pub world: usize,
    /// `LOCAL_RANK`: the rank on this host (the GPU ordinal to use); `rank` when unset.
    pub local_rank: usize,
    /// `MASTER_ADDR`: where rank 0 serves the id.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
}

/// First bytes of every rank's hello, so a stray connection is told apart.
const HELLO: &[u8; 8] = b"wdnccl01";
const HELLO_BYTES: usize = 8 + 4 + 4;
const REPLY_BYTES: usize = 1 + NCCL_ID_BYTES;

impl LaunchEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (optional), `MASTER_ADDR`, `MASTER_PORT`.
    pub fn from_env() -> Result<LaunchEnv> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading each variable through `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let get = |name: &str| {
            lookup(name).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{name} is not set (start each process as torchrun does: RANK, \
                     WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
                ))
            })
        };
        let number = |name: &str, text: String| {
            text.trim().parse::<usize>().map_err(|_| {
                Error::InvalidArgument(format!("{name}={text:?} is not a whole number"))
            })
        };
        let rank = number("RANK", get("RANK")?)?;
        let world = number("WORLD_SIZE", get("WORLD_SIZE")?)?;
        let local_rank = match lookup("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", v)?,
            None => rank,
        };
        let master_addr = get("MASTER_ADDR")?.trim().to_string();
        let port_text = get("MASTER_PORT")?;
        let master_port = port_text.trim().parse::<u16>().map_err(|_| {
            Error::InvalidArgument(format!("MASTER_PORT={port_text:?} is not a port number"))
        })?;
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "RANK={rank} is out of range for WORLD_SIZE={world}"
            )));
        }
        if master_addr.is_empty() {
            return Err(Error::InvalidArgument("MASTER_ADDR is empty".into()));
        }
        Ok(LaunchEnv {
            rank,
            world,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// Hands rank 0's `id` to every rank: rank 0 passes `Some(id)` and serves it until every
    /// other rank has fetched it; the others pass `None` and fetch it. Fails after `timeout`.
    pub fn share_id(&self, id: Option<NcclId>, timeout: Duration) -> Result<NcclId> {
        let deadline = Instant::now() + timeout;
        match (self.rank, id) {
            (0, Some(id)) => self.serve(id, deadline).map(|()| id),
            (0, None) => Err(Error::InvalidArgument(
                "LaunchEnv::share_id: rank 0 makes the id and must pass it".into(),
            )),
            (_, None) => self.fetch(deadline),
            (_, Some(_)) => Err(Error::InvalidArgument(
                "LaunchEnv::share_id: only rank 0 passes an id".into(),
            )),
        }
    }

    fn serve(&self, id: NcclId, deadline: Instant) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let listener = TcpListener::bind(("0.0.0.0", self.master_port)).map_err(|e| {
            fail(format!(
                "rank 0 cannot listen on port {}: {e}",
                self.master_port
            ))
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(format!("rank 0's listener: {e}")))?;
        let mut served = vec![false; self.world];
        served[0] = true;
        while served.iter().any(|s| !s) {
            match listener.accept() {
                Ok((stream, _)) => {
                    // A connection that is not a rank's hello (a port scan, a stray client)
                    // is dropped; the wait for the real ranks goes on.
                    if let Some(rank) = self.answer(stream, &id, deadline)? {
                        served[rank] = true;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (0..self.world).filter(|&r| !served[r]).collect();
                        return Err(fail(format!(
                            "rank 0 waited on port {} and ranks {missing:?} never came",
                            self.master_port
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(fail(format!("rank 0's accept: {e}"))),
            }
        }
        Ok(())
    }

    /// Reads one hello and answers it; `Some(rank)` once that rank has the id.
    fn answer(
        &self,
        mut stream: TcpStream,
        id: &NcclId,
        deadline: Instant,
    ) -> Result<Option<usize>> {
        if stream.set_nonblocking(false).is_err() || set_timeouts(&stream, deadline).is_err() {
            return Ok(None);
        }
        let mut hello = [0u8; HELLO_BYTES];
        if stream.read_exact(&mut hello).is_err() || &hello[..8] != HELLO {
            return Ok(None);
        }
        let rank = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
        let world = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
        let mut reply = [0u8; REPLY_BYTES];
        let verdict = if world != self.world {
            Err(format!(
                "rank {rank} says WORLD_SIZE={world}, rank 0 has {}",
                self.world
            ))
        } else if rank == 0 || rank >= self.world {
            Err(format!("a peer claims rank {rank} of {}", self.world))
        } else {
            Ok(rank)
        };
        match &verdict {
            Ok(_) => reply[1..].copy_from_slice(id.as_bytes()),
            Err(_) => reply[0] = 1,
        }
        // The peer reads the verdict too; a write that fails means it is gone: it retries.
        let sent = stream.write_all(&reply).is_ok();
        let _ = stream.shutdown(Shutdown::Both);
        match verdict {
            Ok(rank) => Ok(sent.then_some(rank)),
            Err(why) => Err(fail(why)),
        }
    }

    /// The master's socket addresses.
    pub(crate) fn master_addrs(&self) -> Result<Vec<std::net::SocketAddr>> {
        Ok((self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| {
                fail(format!(
                    "MASTER_ADDR {}:{} does not resolve: {e}",
                    self.master_addr, self.master_port
                ))
            })?
            .collect())
    }

    fn fetch(&self, deadline: Instant) -> Result<NcclId> {
        let addrs = self.master_addrs()?;
        let mut last = String::from("no address");
        loop {
            for addr in &addrs {
                match self.ask(addr, deadline) {
                    Ok(Some(id)) => return Ok(id),
                    Ok(None) => {}
                    Err(e) => return Err(e),
                }
                last = format!("{addr}");
            }
            if Instant::now() >= deadline {
                return Err(fail(format!(
                    "rank {} could not fetch the id from rank 0 at {}:{} ({last}) before the \
                     timeout (is MASTER_PORT right, and rank 0 running?)",
                    self.rank, self.master_addr, self.master_port
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One try: `None` when rank 0 is not there (yet) or the connection broke.
    fn ask(&self, addr: &std::net::SocketAddr, deadline: Instant) -> Result<Option<NcclId>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        let Ok(mut stream) = TcpStream::connect_timeout(addr, left) else {
            return Ok(None);
        };
        if set_timeouts(&stream, deadline).is_err() {
            return Ok(None);
        }
        let mut hello = [0u8; HELLO_BYTES];
        hello[..8].copy_from_slice(HELLO);
        hello[8..12].copy_from_slice(&u32::try_from(self.rank).unwrap_or(u32::MAX).to_le_bytes());
        hello[12..16].copy_from_slice(&u32::try_from(self.world).unwrap_or(u32::MAX).to_le_bytes());
        let mut reply = [0u8; REPLY_BYTES];
        if stream.write_all(&hello).is_err() || stream.read_exact(&mut reply).is_err() {
            return Ok(None);
        }
        if reply[0] != 0 {
            return Err(fail(format!(
                "rank 0 refused rank {} (WORLD_SIZE={}): the ranks disagree on the job",
                self.rank, self.world
            )));
        }
        let mut id = [0u8; NCCL_ID_BYTES];
        id.copy_from_slice(&reply[1..]);
        Ok(Some(NcclId(id)))
    }
}

/// First bytes of a CPU process group rank's hello (a rank of another kind of job is told
/// apart from it).
const TABLE_HELLO: &[u8; 8] = b"wdcpu001";
/// The most bytes of one rank's entry in the table.
const MAX_ENTRY: usize = 1 << 12;

/// What every rank of a CPU process group learns at the rendezvous: the job's token (made
/// by rank 0) and each rank's entry, with the address rank 0 saw it connect from (rank 0's
/// own: `None`, it is at `MASTER_ADDR`).
pub(crate) struct Table {
    pub(crate) job: u64,
    pub(crate) entries: Vec<(Option<std::net::IpAddr>, Vec<u8>)>,
}

impl LaunchEnv {
    /// The rendezvous of a CPU process group: every rank sends rank 0 its `entry` (at most
    /// 4 KiB), rank 0 sends every rank the whole table once all have come, with `job`
    /// (rank 0's; the others pass anything). Connections and every read are bounded by
    /// `deadline`, as [`share_id`](Self::share_id)'s are.
    pub(crate) fn gather_table(&self, entry: &[u8], job: u64, deadline: Instant) -> Result<Table> {
        if entry.len() > MAX_ENTRY {
            return Err(fail(format!("a rank's entry of {} bytes", entry.len())));
        }
        if self.rank == 0 {
            self.serve_table(entry, job, deadline)
        } else {
            self.fetch_table(entry, deadline)
        }
    }

    fn serve_table(&self, entry: &[u8], job: u64, deadline: Instant) -> Result<Table> {
        let mut entries = vec![None; self.world];
        entries[0] = Some((None, entry.to_vec()));
        let mut streams: Vec<TcpStream> = Vec::new();
        if self.world > 1 {
            let listener = TcpListener::bind(("0.0.0.0", self.master_port)).map_err(|e| {
                fail(format!(
                    "rank 0 cannot listen on port {}: {e}",
                    self.master_port
                ))
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|e| fail(format!("rank 0's listener: {e}")))?;
            while entries.iter().any(Option::is_none) {
                match listener.accept() {
                    Ok((stream, from)) => match self.read_hello(&stream, deadline) {
                        Ok(Some((rank, bytes))) if entries[rank].is_none() => {
                            entries[rank] = Some((Some(from.ip()), bytes));
                            streams.push(stream);
                        }
                        Ok(_) => {}
                        Err(e) => {
                            refuse_all(streams, &e.to_string());
                            refuse_all(vec![stream], &e.to_string());
                            return Err(e);
                        }
                    },
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            let missing: Vec<usize> =
                                (0..self.world).filter(|&r| entries[r].is_none()).collect();
                            let why = format!(
                                "rank 0 waited on port {} and ranks {missing:?} never came",
                                self.master_port
                            );
                            refuse_all(streams, &why);
                            return Err(fail(why));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(fail(format!("rank 0's accept: {e}"))),
                }
            }
        }
        let entries: Vec<_> = entries.into_iter().flatten().collect();
        let mut reply = vec![0u8];
        reply.extend_from_slice(&job.to_le_bytes());
        for (ip, bytes) in &entries {
            let ip = match ip {
                Some(std::net::IpAddr::V4(v4)) => v4.to_ipv6_mapped(),
                Some(std::net::IpAddr::V6(v6)) => *v6,
                None => std::net::Ipv6Addr::UNSPECIFIED,
            };
            reply.extend_from_slice(&ip.octets());
            reply.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            reply.extend_from_slice(bytes);
        }
        for mut stream in streams {
            // A rank that is gone by now fails on its own side; its peers find out when they
            // connect to it.
            let _ = stream.write_all(&reply);
            let _ = stream.shutdown(Shutdown::Write);
        }
        Ok(Table { job, entries })
    }

    /// Reads a rank's hello: `Some((rank, entry))`, `None` for a stray connection, an error
    /// for a rank of another job (another world size, a rank out of range).
    fn read_hello(
        &self,
        stream: &TcpStream,
        deadline: Instant,
    ) -> Result<Option<(usize, Vec<u8>)>> {
        let mut stream = stream;
        if stream.set_nonblocking(false).is_err() || set_timeouts(stream, deadline).is_err() {
            return Ok(None);
        }
        let mut hello = [0u8; 8 + 12];
        if stream.read_exact(&mut hello).is_err() || &hello[..8] != TABLE_HELLO {
            return Ok(None);
        }
        let word = |i: usize| {
            u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]) as usize
        };
        let (rank, world, len) = (word(8), word(12), word(16));
        if world != self.world {
            return Err(fail(format!(
                "rank {rank} says WORLD_SIZE={world}, rank 0 has {}",
                self.world
            )));
        }
        if rank == 0 || rank >= self.world {
            return Err(fail(format!("a peer claims rank {rank} of {}", self.world)));
        }
        if len > MAX_ENTRY {
            return Ok(None);
        }
        let mut entry = vec![0u8; len];
        if stream.read_exact(&mut entry).is_err() {
            return Ok(None);
        }
        Ok(Some((rank, entry)))
    }

    fn fetch_table(&self, entry: &[u8], deadline: Instant) -> Result<Table> {
        let addrs = self.master_addrs()?;
        let mut hello = Vec::with_capacity(20 + entry.len());
        hello.extend_from_slice(TABLE_HELLO);
        for n in [self.rank, self.world, entry.len()] {
            hello.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
        }
        hello.extend_from_slice(entry);
        loop {
            for addr in &addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let Ok(mut stream) = TcpStream::connect_timeout(addr, left) else {
                    continue;
                };
                if set_timeouts(&stream, deadline).is_err() || stream.write_all(&hello).is_err() {
                    continue;
                }
                let mut reply = Vec::new();
                // Rank 0 answers once every rank has come: read to its end, under the deadline.
                if stream.read_to_end(&mut reply).is_err() || reply.is_empty() {
                    continue;
                }
                return self.parse_table(&reply);
            }
            if Instant::now() >= deadline {
                return Err(fail(format!(
                    "rank {} could not join rank 0 at {}:{} before the timeout (is MASTER_PORT \
                     right, and rank 0 running?)",
                    self.rank, self.master_addr, self.master_port
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn parse_table(&self, reply: &[u8]) -> Result<Table> {
        let bad = || {
            fail(format!(
                "rank {} got a malformed table from rank 0",
                self.rank
            ))
        };
        let take = |at: &mut usize, n: usize| -> Result<&[u8]> {
            let end = at.checked_add(n).ok_or_else(bad)?;
            let bytes = reply.get(*at..end).ok_or_else(bad)?;
            *at = end;
            Ok(bytes)
        };
        let mut at = 0;
        if take(&mut at, 1)?[0] != 0 {
            let why = String::from_utf8_lossy(&reply[1..]).into_owned();
            return Err(fail(format!("rank 0 refused rank {}: {why}", self.rank)));
        }
        let job = u64::from_le_bytes(take(&mut at, 8)?.try_into().map_err(|_| bad())?);
        let mut entries = Vec::new();
        for _ in 0..self.world {
            let octets: [u8; 16] = take(&mut at, 16)?.try_into().map_err(|_| bad())?;
            let ip = std::net::Ipv6Addr::from(octets);
            let ip = (!ip.is_unspecified()).then(|| {
                ip.to_ipv4_mapped()
                    .map_or(std::net::IpAddr::V6(ip), Into::into)
            });
            let len = u32::from_le_bytes(take(&mut at, 4)?.try_into().map_err(|_| bad())?);
            entries.push((ip, take(&mut at, len as usize)?.to_vec()));
        }
        Ok(Table { job, entries })
    }
}

/// Tells ranks connected to rank 0 that the rendezvous failed (`why`).
fn refuse_all(streams: Vec<TcpStream>, why: &str) {
    for mut stream in streams {
        let mut reply = vec![1u8];
        reply.extend_from_slice(why.as_bytes());
        let _ = stream.write_all(&reply);
        let _ = stream.shutdown(Shutdown::Both);
    }
}

fn set_timeouts(stream: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

fn fail(detail: String) -> Error {
    Error::Collective {
        op: "bootstrap",
        detail,
    }
}
