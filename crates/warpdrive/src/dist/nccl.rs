//! A rank's NCCL communicator as `Comm` holds it: the device it lives on, the checks every
//! call makes (the stream's and the buffers' device), and the communicator itself.

use std::cell::RefCell;
use std::time::Duration;

use crate::device::{nccl_group, Device, NcclCall, NcclComm, Stream};
use crate::dtype::DType;
use crate::error::{Error, Result};

use super::NcclId;

pub(super) struct NcclLink {
    device: Device,
    comm: RefCell<NcclComm>,
}

impl NcclLink {
    pub(super) fn for_devices(devices: &[Device], timeout: Duration) -> Result<Vec<NcclLink>> {
        let gpus = devices
            .iter()
            .map(|d| d.gpu("Comm::nccl_group").cloned())
            .collect::<Result<Vec<_>>>()?;
        let comms = NcclComm::for_devices(&gpus, timeout)?;
        Ok(devices
            .iter()
            .zip(comms)
            .map(|(device, comm)| NcclLink {
                device: device.clone(),
                comm: RefCell::new(comm),
            })
            .collect())
    }

    pub(super) fn for_rank(
        device: &Device,
        id: &NcclId,
        world: usize,
        rank: usize,
        timeout: Duration,
    ) -> Result<NcclLink> {
        let gpu = device.gpu("Comm::nccl_rank")?;
        let comm = NcclComm::for_rank(gpu, id.as_bytes(), world, rank, timeout)?;
        Ok(NcclLink {
            device: device.clone(),
            comm: RefCell::new(comm),
        })
    }

    /// This rank's link among the ranks of the same `color`, and its rank and world there
    /// (`efficient`: as `NcclComm::split`).
    pub(super) fn split(
        &self,
        color: usize,
        key: usize,
        efficient: Option<bool>,
    ) -> Result<(NcclLink, usize, usize)> {
        let comm = self.comm_mut("Comm::split")?.split(color, key, efficient)?;
        let (rank, world) = comm.place();
        Ok((
            NcclLink {
                device: self.device.clone(),
                comm: RefCell::new(comm),
            },
            rank,
            world,
        ))
    }

    pub(super) fn device(&self) -> &Device {
        &self.device
    }

    /// Checks that the stream and every buffer are on this rank's device, then enqueues the
    /// call `make` describes (after its own argument checks).
    pub(super) fn enqueue<'c, T: DType>(
        &self,
        stream: &Stream,
        buffers: &[&Device],
        op: &'static str,
        make: impl FnOnce() -> Result<NcclCall<'c>>,
    ) -> Result<()> {
        stream.device().same_as(&self.device, op)?;
        for b in buffers {
            b.same_as(&self.device, op)?;
        }
        let call = make()?;
        let queue = stream.gpu(op)?;
        self.comm_mut(op)?.enqueue(queue.stream, T::KIND, call)
    }

    /// [`enqueue`](Self::enqueue) without the device checks, for the one buffer `device`
    /// (compared by ordinal: the one check a wrong address would need).
    pub(super) fn enqueue_direct<T: DType>(
        &self,
        stream: &Stream,
        device: &Device,
        call: NcclCall<'_>,
    ) -> Result<()> {
        if device.ordinal() != self.device.ordinal() {
            return Err(Error::DeviceMismatch {
                op: "direct_all_reduce",
                left: device.label(),
                right: self.device.label(),
            });
        }
        let queue = stream.gpu("direct_all_reduce")?;
        self.comm_mut("direct_all_reduce")?
            .enqueue(queue.stream, T::KIND, call)
    }

    /// Runs `calls` inside one NCCL group; an error at the group's end aborts the
    /// communicator (its calls' state is unknown).
    pub(super) fn group<R>(&self, calls: impl FnOnce() -> Result<R>) -> Result<R> {
        match nccl_group(calls) {
            Ok(made) => made,
            Err(e) => {
                self.comm_mut("Comm::group")?
                    .abort(&format!("its group of calls failed to launch: {e}"));
                Err(e)
            }
        }
    }

    pub(super) fn wait(&self, stream: &Stream) -> Result<()> {
        stream.device().same_as(&self.device, "Comm::wait")?;
        let queue = stream.gpu("Comm::wait")?;
        self.comm_mut("Comm::wait")?.wait(queue.stream)
    }

    fn comm_mut(&self, op: &'static str) -> Result<std::cell::RefMut<'_, NcclComm>> {
        self.comm.try_borrow_mut().map_err(|_| Error::Collective {
            op,
            detail: "the communicator is in use by another call on this thread".into(),
        })
    }
}
