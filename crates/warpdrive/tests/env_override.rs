//! `WARPDRIVE_DEVICE` read from the environment (its own test binary: it sets the variable).

mod common;

use warpdrive::{Device, Error};

#[test]
fn warpdrive_device_env_overrides_best() {
    std::env::set_var(warpdrive::device::DEVICE_ENV, "garbage");
    let err = Device::best().unwrap_err();
    assert!(
        matches!(err, Error::BadDeviceSpec { ref value } if value == "garbage"),
        "{err}"
    );
    std::env::set_var(warpdrive::device::DEVICE_ENV, "cpu");
    assert_eq!(Device::best().unwrap(), Device::Cpu);
    std::env::remove_var(warpdrive::device::DEVICE_ENV);
}
