//! What the unit tests share with the integration tests: a private `XDG_CACHE_HOME` for the
//! test process (the same file as theirs), and the macro that runs one body on both backends.

#[path = "../tests/common/cache_home.rs"]
mod cache_home;

pub use cache_home::private_cache_home;

/// `device_test!(cpu_name, gpu_name, body)`: the test `cpu_name` runs `body(&Device::cpu())`,
/// and `gpu_name`, ignored without a GPU, runs it on CUDA device 0. `body` is a `fn(&Device)`.
/// The integration tests' `common` has the same macro.
macro_rules! device_test {
    ($(#[$attr:meta])* $cpu:ident, $gpu:ident, $body:expr $(,)?) => {
        $(#[$attr])*
        #[test]
        fn $cpu() {
            let body: fn(&$crate::Device) = $body;
            body(&$crate::Device::cpu());
        }

        $(#[$attr])*
        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn $gpu() {
            let body: fn(&$crate::Device) = $body;
            match $crate::Device::cuda(0) {
                Ok(dev) => body(&dev),
                Err(e) => panic!("GPU test run without a usable CUDA device: {e}"),
            }
        }
    };
}
pub(crate) use device_test;

#[test]
fn tests_keep_their_cache_out_of_the_users_home() {
    let home = private_cache_home();
    assert_eq!(
        std::env::var_os("XDG_CACHE_HOME"),
        Some(home.clone().into())
    );
    let tune_file = crate::exec::tune::default_path().unwrap();
    assert!(tune_file.starts_with(&home), "{}", tune_file.display());
}
