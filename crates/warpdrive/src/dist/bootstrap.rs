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

    fn fetch(&self, deadline: Instant) -> Result<NcclId> {
        let addrs: Vec<_> = (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| {
                fail(format!(
                    "MASTER_ADDR {}:{} does not resolve: {e}",
                    self.master_addr, self.master_port
                ))
            })?
            .collect();
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
