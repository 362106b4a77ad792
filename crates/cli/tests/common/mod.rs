//! Helpers shared by the `granule` command's integration tests.
#![allow(dead_code)]

use std::process::Child;

/// The `granule` binary under test.
pub const GRANULE: &str = env!("CARGO_BIN_EXE_granule");

/// Kills the child when dropped (tests must never leave processes behind).
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
