//! All-reduce across nodes in three steps on sub-communicators, as NCCL's and Horovod's
//! hierarchical modes do: reduce-scatter among a node's ranks, all-reduce of each shard
//! across the nodes, all-gather in the node, so each element crosses between nodes once per
//! node rather than once per rank. Nodes can be declared (consecutive ranks), which tests
//! the path on one host, or found from the ranks' host names
//! ([`Comm::hierarchy_by_host`]): the hierarchy is chosen when the ranks span several hosts
//! with as many ranks each, and the flat all-reduce otherwise.

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops;
use twox_hash::XxHash3_64;

use super::{Comm, ReduceOp};

/// A rank's two sub-communicators: its node's ranks, and the ranks of its place in every
/// node. From [`Comm::hierarchy`].
pub struct Hierarchy {
    node: Comm,
    across: Comm,
}

impl Comm {
    /// Splits this group into nodes of `ranks_per_node` consecutive ranks (every rank calls
    /// it; the world must be a multiple of `ranks_per_node`).
    pub fn hierarchy(&self, ranks_per_node: usize) -> Result<Hierarchy> {
        if ranks_per_node == 0 || self.world() % ranks_per_node != 0 {
            return Err(Error::InvalidArgument(format!(
                "Comm::hierarchy: {} ranks do not make nodes of {ranks_per_node}",
                self.world()
            )));
        }
        let node = self.split(self.rank() / ranks_per_node, self.rank())?;
        let across = self.split(self.rank() % ranks_per_node, self.rank())?;
        Ok(Hierarchy { node, across })
    }

    /// The hierarchy of this group's hosts, found from each rank's host name (every rank
    /// calls it, with a stream of its device): `Some` when the ranks span two hosts or more
    /// with as many ranks on each (nodes need not be consecutive ranks), `None` when they
    /// share one host or the hosts hold different counts (then the flat all-reduce is the
    /// one to use).
    pub fn hierarchy_by_host(&self, stream: &Stream) -> Result<Option<Hierarchy>> {
        self.hierarchy_for_host(stream, &super::procs::host_name())
    }

    /// [`hierarchy_by_host`](Self::hierarchy_by_host) with this rank's host named by the
    /// caller (tests declare hosts this way on one machine).
    pub fn hierarchy_for_host(&self, stream: &Stream, host: &str) -> Result<Option<Hierarchy>> {
        let mine = Buffer::from_host(stream, &[XxHash3_64::oneshot(host.as_bytes())])?;
        let mut all = Buffer::<u64>::zeros(stream, self.world())?;
        self.all_gather(stream, &mine, &mut all)?;
        self.wait(stream)?;
        let Some((node, place)) = nodes_of(&all.to_host(stream)?, self.rank()) else {
            return Ok(None);
        };
        let node = self.split(node, self.rank())?;
        let across = self.split(place, self.rank())?;
        Ok(Some(Hierarchy { node, across }))
    }
}

/// Rank `me`'s (node, place in the node) from every rank's host id: nodes numbered in order
/// of their first rank, places in rank order. `None` for one host or unequal hosts.
fn nodes_of(hosts: &[u64], me: usize) -> Option<(usize, usize)> {
    let mut order: Vec<u64> = Vec::new();
    for h in hosts {
        if !order.contains(h) {
            order.push(*h);
        }
    }
    let per_host = hosts.len() / order.len().max(1);
    let even = order
        .iter()
        .all(|h| hosts.iter().filter(|x| *x == h).count() == per_host);
    if order.len() < 2 || !even {
        return None;
    }
    let host = *hosts.get(me)?;
    let node = order.iter().position(|h| *h == host)?;
    let place = hosts[..me].iter().filter(|h| **h == host).count();
    Some((node, place))
}

impl Hierarchy {
    /// This rank's node.
    pub fn node(&self) -> &Comm {
        &self.node
    }

    /// The ranks holding this rank's place in every node.
    pub fn across(&self) -> &Comm {
        &self.across
    }

    /// Reduces `buf` over every rank with `op` in the three steps (see the module docs);
    /// lengths must agree across ranks. A length the node's ranks do not divide is padded
    /// (with zeros, which only padded places see).
    pub fn all_reduce<T: Float>(
        &self,
        stream: &Stream,
        buf: &mut Buffer<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let per_node = self.node.world();
        let len = buf.len();
        let shard = len.div_ceil(per_node);
        let padded = shard.checked_mul(per_node).ok_or_else(|| {
            Error::InvalidArgument(format!("Hierarchy::all_reduce: {len} elements"))
        })?;
        let mut part = Buffer::<T>::uninit(stream, shard)?;
        if padded == len {
            self.node.reduce_scatter(stream, buf, &mut part, op)?;
            self.across.all_reduce(stream, &mut part, op)?;
            return self.node.all_gather(stream, &part, buf);
        }
        let mut work = Buffer::<T>::uninit(stream, padded)?;
        ops::fill(stream, &mut work, T::from_f64(0.0))?;
        work.copy_rows_from(stream, (0, 0), (buf, 0, 0), len, 1)?;
        self.node.reduce_scatter(stream, &work, &mut part, op)?;
        self.across.all_reduce(stream, &mut part, op)?;
        self.node.all_gather(stream, &part, &mut work)?;
        buf.copy_rows_from(stream, (0, 0), (&work, 0, 0), len, 1)
    }

    /// Waits for this rank's calls on both sub-communicators enqueued on `stream`.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        self.node.wait(stream)?;
        self.across.wait(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::nodes_of;

    #[test]
    fn nodes_come_from_host_ids_in_order_of_first_rank() {
        let hosts = [7, 7, 9, 9];
        let got: Vec<_> = (0..4).map(|r| nodes_of(&hosts, r)).collect();
        assert_eq!(
            got,
            [Some((0, 0)), Some((0, 1)), Some((1, 0)), Some((1, 1))]
        );
        // Interleaved hosts: nodes need not be consecutive ranks.
        let hosts = [9, 7, 9, 7];
        let got: Vec<_> = (0..4).map(|r| nodes_of(&hosts, r)).collect();
        assert_eq!(
            got,
            [Some((0, 0)), Some((1, 0)), Some((0, 1)), Some((1, 1))]
        );
        // One host, unequal hosts, nothing: the flat all-reduce.
        assert_eq!(nodes_of(&[3, 3, 3], 0), None);
        assert_eq!(nodes_of(&[3, 3, 4], 2), None);
        assert_eq!(nodes_of(&[], 0), None);
    }
}
