//! Streams and events.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{result, CudaEvent, CudaStream};

use crate::error::{Error, Result};

use super::context::{no_sync_in_capture, CudaDevice};

/// A CUDA stream as the floors above hold it: opaque to them, the driver's stream to this
/// backend. Cheap to clone (the same stream).
#[derive(Clone)]
pub(crate) struct GpuStream(Arc<CudaStream>);

impl std::ops::Deref for GpuStream {
    type Target = CudaStream;
    fn deref(&self) -> &CudaStream {
        &self.0
    }
}

impl GpuStream {
    /// The shared driver stream (graph capture ends on it).
    pub(super) fn shared(&self) -> &Arc<CudaStream> {
        &self.0
    }
}

/// A CUDA event as the floors above hold it.
pub(crate) struct GpuEvent(CudaEvent);

impl std::ops::Deref for GpuEvent {
    type Target = CudaEvent;
    fn deref(&self) -> &CudaEvent {
        &self.0
    }
}

impl CudaDevice {
    // ---- streams and events ----

    pub(crate) fn new_stream(&self) -> Result<GpuStream> {
        self.bind()?;
        let r = self.inner.ctx.new_stream();
        self.check("cuStreamCreate", r).map(GpuStream)
    }

    pub(crate) fn synchronize_stream(&self, stream: &GpuStream) -> Result<()> {
        // This thread's captures are refused here; a capture begun on another thread makes
        // the driver return an error (not worth a cuStreamIsCapturing on every sync).
        no_sync_in_capture("cuStreamSynchronize")?;
        self.bind()?;
        self.check("cuStreamSynchronize", stream.synchronize())
    }

    /// True while `stream` is capturing a graph (begun on any thread).
    pub(crate) fn is_capturing(&self, stream: &GpuStream) -> Result<bool> {
        self.bind()?;
        // SAFETY: the stream is alive (borrowed) and its context is bound.
        let r = unsafe { result::stream::is_capturing(stream.cu_stream()) };
        let status = self.check("cuStreamIsCapturing", r)?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Binds, then refuses `call` (a synchronising one) when this thread or `stream` is
    /// capturing a graph.
    pub(crate) fn refuse_if_capturing(&self, stream: &GpuStream, call: &'static str) -> Result<()> {
        no_sync_in_capture(call)?;
        if self.is_capturing(stream)? {
            return Err(Error::Capture {
                call,
                hint: "the stream is capturing a graph (begun on another thread)".into(),
            });
        }
        Ok(())
    }

    /// A timing-enabled event (`CU_EVENT_DEFAULT`).
    pub(crate) fn new_timing_event(&self) -> Result<GpuEvent> {
        self.bind()?;
        let r = self
            .inner
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        self.check("cuEventCreate", r).map(GpuEvent)
    }

    /// An event for ordering only (timing disabled).
    pub(crate) fn new_sync_event(&self) -> Result<GpuEvent> {
        self.bind()?;
        let r = self.inner.ctx.new_event(None);
        self.check("cuEventCreate", r).map(GpuEvent)
    }

    /// True when the work before `event` has finished; never waits.
    pub(crate) fn event_query(&self, event: &GpuEvent) -> Result<bool> {
        no_sync_in_capture("cuEventQuery")?;
        self.bind()?;
        self.check("cuEventQuery", event.try_is_complete())
    }

    /// Waits for all work on this device.
    pub(crate) fn synchronize(&self) -> Result<()> {
        no_sync_in_capture("cuCtxSynchronize")?;
        self.refuse_while_resident("cuCtxSynchronize")?;
        self.bind()?;
        self.check("cuCtxSynchronize", result::ctx::synchronize())
    }

    /// Records `event` on `stream` (both of this device) on the lean path: spans record one
    /// per boundary, where two context reads per call would show.
    pub(crate) fn record_event(&self, event: &GpuEvent, stream: &GpuStream) -> Result<()> {
        self.lean("cuEventRecord", || {
            // SAFETY: the event and the stream are alive (borrowed) and belong to this
            // device's context (the caller checked the device), which `lean` bound.
            unsafe { result::event::record(event.cu_event(), stream.cu_stream()) }
        })
    }

    pub(crate) fn event_synchronize(&self, event: &GpuEvent) -> Result<()> {
        no_sync_in_capture("cuEventSynchronize")?;
        self.bind()?;
        self.check("cuEventSynchronize", event.synchronize())
    }

    pub(crate) fn event_elapsed_ms(&self, start: &GpuEvent, end: &GpuEvent) -> Result<f32> {
        self.bind()?;
        self.check("cuEventElapsedTime", start.elapsed_ms(end))
    }

    pub(crate) fn stream_wait_event(&self, stream: &GpuStream, event: &GpuEvent) -> Result<()> {
        self.bind()?;
        self.check("cuStreamWaitEvent", stream.wait(event))
    }
}
