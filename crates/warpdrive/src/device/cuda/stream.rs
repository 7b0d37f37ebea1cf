//! Streams and events.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{result, CudaEvent, CudaStream};

use crate::error::{Error, Result};

use super::context::{no_sync_in_capture, CudaDevice};

impl CudaDevice {
    // ---- streams and events ----

    pub(crate) fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.bind()?;
        let r = self.inner.ctx.new_stream();
        self.check("cuStreamCreate", r)
    }

    pub(crate) fn synchronize_stream(&self, stream: &CudaStream) -> Result<()> {
        // This thread's captures are refused here; a capture begun on another thread makes
        // the driver return an error (not worth a cuStreamIsCapturing on every sync).
        no_sync_in_capture("cuStreamSynchronize")?;
        self.bind()?;
        self.check("cuStreamSynchronize", stream.synchronize())
    }

    /// True while `stream` is capturing a graph (begun on any thread).
    pub(crate) fn is_capturing(&self, stream: &CudaStream) -> Result<bool> {
        self.bind()?;
        // SAFETY: the stream is alive (borrowed) and its context is bound.
        let r = unsafe { result::stream::is_capturing(stream.cu_stream()) };
        let status = self.check("cuStreamIsCapturing", r)?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Binds, then refuses `call` (a synchronising one) when this thread or `stream` is
    /// capturing a graph.
    pub(crate) fn refuse_if_capturing(
        &self,
        stream: &CudaStream,
        call: &'static str,
    ) -> Result<()> {
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
    pub(crate) fn new_timing_event(&self) -> Result<CudaEvent> {
        self.bind()?;
        let r = self
            .inner
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        self.check("cuEventCreate", r)
    }

    /// An event for ordering only (timing disabled).
    pub(crate) fn new_sync_event(&self) -> Result<CudaEvent> {
        self.bind()?;
        let r = self.inner.ctx.new_event(None);
        self.check("cuEventCreate", r)
    }

    /// True when the work before `event` has finished; never waits.
    pub(crate) fn event_query(&self, event: &CudaEvent) -> Result<bool> {
        no_sync_in_capture("cuEventQuery")?;
        self.bind()?;
        self.check("cuEventQuery", event.try_is_complete())
    }

    /// Waits for all work on this device.
    pub(crate) fn synchronize(&self) -> Result<()> {
        no_sync_in_capture("cuCtxSynchronize")?;
        self.bind()?;
        self.check("cuCtxSynchronize", result::ctx::synchronize())
    }

    /// Records `event` on `stream` (both of this device) on the lean path: spans record one
    /// per boundary, where two context reads per call would show.
    pub(crate) fn record_event(&self, event: &CudaEvent, stream: &CudaStream) -> Result<()> {
        self.lean("cuEventRecord", || {
            // SAFETY: the event and the stream are alive (borrowed) and belong to this
            // device's context (the caller checked the device), which `lean` bound.
            unsafe { result::event::record(event.cu_event(), stream.cu_stream()) }
        })
    }

    pub(crate) fn event_synchronize(&self, event: &CudaEvent) -> Result<()> {
        no_sync_in_capture("cuEventSynchronize")?;
        self.bind()?;
        self.check("cuEventSynchronize", event.synchronize())
    }

    pub(crate) fn event_elapsed_ms(&self, start: &CudaEvent, end: &CudaEvent) -> Result<f32> {
        self.bind()?;
        self.check("cuEventElapsedTime", start.elapsed_ms(end))
    }

    pub(crate) fn stream_wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        self.bind()?;
        self.check("cuStreamWaitEvent", stream.wait(event))
    }
}
