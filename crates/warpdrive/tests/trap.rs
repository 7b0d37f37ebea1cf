//! Device loss: a kernel that traps breaks the context for this whole process, so this test
//! has a binary of its own. Its name starts with `gpu_trap` so the GPU bundle's sanitizer
//! phase skips it (compute-sanitizer reports the trap itself as an error).

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::cuda;
use warpdrive::exec::{self, run_with_fallback, Fallback, Graph, Kernel, LaunchConfig};
use warpdrive::{kernels, ops, Buffer, Device, Error};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_trap_marks_the_device_lost_and_nothing_hangs() {
    let dev = cuda();
    let s = dev.new_stream().unwrap();
    let mut buf = Buffer::from_host(&s, &[1.0f32; 256]).unwrap();
    let trap = Kernel::new(&dev, &kernels::EXEC, "trap_kernel").unwrap();
    let fill = Kernel::new(&dev, &kernels::BASIC, "fill_u32").unwrap();
    // SAFETY: trap_kernel takes no parameters.
    unsafe { exec::launch(&s, &trap, LaunchConfig::linear(1, 32), &mut []) }.unwrap();

    // Waiting for it reports the fault, within a minute (a hang fails the test).
    let (tx, rx) = mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        let _ = tx.send(s2.synchronize());
    });
    let waited = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("synchronize after a trap hung");
    assert!(
        matches!(waited, Err(Error::DeviceLost { .. })),
        "{waited:?}"
    );
    assert!(dev.is_lost());

    // From now on every call is DeviceLost at once, without the driver.
    let lost = |what: &str, r: Result<(), Error>| {
        assert!(matches!(r, Err(Error::DeviceLost { .. })), "{what}: {r:?}");
    };
    lost("synchronize", s.synchronize());
    lost("device synchronize", dev.synchronize());
    lost("new stream", dev.new_stream().map(drop));
    lost("new event", dev.new_event().map(drop));
    lost("alloc", Buffer::<f32>::uninit(&s, 16).map(drop));
    lost("fill", ops::fill(&s, &mut buf, 2.0));
    lost("to_host", buf.to_host(&s).map(drop));
    lost("copy_from_host", buf.copy_from_host(&s, &[3.0; 256]));
    lost("reopen", Device::cuda(0).map(drop));
    lost(
        "kernel",
        Kernel::new(&dev, &kernels::BASIC, "fill_u32").map(drop),
    );
    lost("graph", Graph::capture(&s, |_| Ok(())).map(drop));
    let mut params: [*mut std::ffi::c_void; 0] = [];
    // SAFETY: the device is lost: refused before any launch.
    lost("launch", unsafe {
        exec::launch(&s, &fill, LaunchConfig::linear(1, 32), &mut params)
    });
    // Device loss is not recoverable on the CPU: the policy returns the error.
    lost(
        "fallback",
        run_with_fallback(&dev, Fallback::Cpu, |_| Ok(())).map(drop),
    );
    drop(buf);
}
