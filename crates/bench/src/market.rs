//! The `market` benchmark: the broker simulated over 48 hours (being written).

use crate::BenchOpts;
use std::path::PathBuf;

pub fn run(_opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    anyhow::bail!("this benchmark is being written")
}
