//! The `consumer` benchmark: a YCSB-like application with leased memory (being written).

use crate::BenchOpts;
use std::path::PathBuf;

pub fn run(_opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    anyhow::bail!("this benchmark is being written")
}
