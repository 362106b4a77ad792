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

/// Start `granule controller` with `args` (after `controller`), its stdout read until it
/// says where it listens (then drained, so later output never meets a closed pipe).
/// Returns the process and its address.
pub fn start_controller(args: &[&str]) -> (Reaped, String) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut ctl = Reaped(
        Command::new(GRANULE)
            .arg("controller")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start granule controller"),
    );
    let mut lines = BufReader::new(ctl.0.stdout.take().expect("stdout")).lines();
    let addr = loop {
        let l = lines.next().expect("controller output").expect("a line");
        if let Some(a) = l.strip_prefix("granule controller listening on ") {
            break a.trim().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    (ctl, addr)
}
