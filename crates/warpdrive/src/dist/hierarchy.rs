//! All-reduce across nodes in three steps on sub-communicators, as NCCL's and Horovod's
//! hierarchical modes do: reduce-scatter among a node's ranks, all-reduce of each shard
//! across the nodes, all-gather in the node, so each element crosses between nodes once per
//! node rather than once per rank. Nodes can be declared (consecutive ranks), which tests
//! the path on one host.

use crate::device::Stream;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::memory::Buffer;
use crate::ops;

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
