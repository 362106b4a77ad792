//! The `harvest` benchmark: harvesting a real redis-server (being written).

use crate::BenchOpts;
use std::path::PathBuf;

pub fn run(_opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    anyhow::bail!("this benchmark is being written")
}
