//! Shared by the bench crate's test binaries: each runs with a private `XDG_CACHE_HOME`
//! (the core crate's hook, set before `main`).

#[path = "../../../warpdrive/tests/common/cache_home.rs"]
#[allow(dead_code)] // private_cache_home: for a test that looks into the cache
pub mod cache_home;
