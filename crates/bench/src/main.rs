//! The `granule-bench` command: run a benchmark (or all of them) and write
//! `DIR/NAME/{results.csv,results.md,plot.png,summary.json}`; with no name, list them.
//!
//! Argument parsing and printing only; the benchmarks live in the library. Like the
//! `granule` command, this binary is also a node: Granule's pre-`main` hook turns it into
//! one when a benchmark's driver starts it in node mode, so every benchmark that starts a
//! cluster spawns copies of this executable. Subcommands of `granule` that benchmarks start
//! (`fs mount`, `store`, `antagonist memory`, ...) come from the `granule` binary beside
//! it: build both (`cargo build --release -p granule-cli -p granule-bench`).

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "granule-bench",
    version,
    about = "Granule's benchmarks: run one (or `all`) and write DIR/NAME/{results.csv,results.md,plot.png,summary.json}"
)]
struct Args {
    /// Benchmark name, or `all`; omit to list them.
    name: Option<String>,
    /// A seconds-long smoke run of the same code.
    #[arg(long)]
    quick: bool,
    /// Where reports go.
    #[arg(long, default_value = "docs/results")]
    out: PathBuf,
    /// Repetitions instead of the benchmark's default (pressure).
    #[arg(long)]
    reps: Option<usize>,
    /// Write every request and the cluster's events of each run to this directory,
    /// to line a tail up with a scheduler trace (pressure).
    #[arg(long)]
    dump: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("granule-bench: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let Some(name) = args.name else {
        println!("benchmarks (granule-bench NAME [--quick] [--out DIR]):");
        for (n, d) in granule_bench::BENCHMARKS {
            println!("  {n:<12} {d}");
        }
        println!("  {:<12} every benchmark above", "all");
        return Ok(());
    };
    let opts = granule_bench::BenchOpts {
        quick: args.quick,
        out: args.out,
        reps: args.reps,
        dump: args.dump,
    };
    let names: Vec<&str> = if name == "all" {
        granule_bench::BENCHMARKS.iter().map(|(n, _)| *n).collect()
    } else {
        vec![name.as_str()]
    };
    // Before minutes of other benchmarks, not when one of these reaches its first child.
    if names
        .iter()
        .any(|n| granule_bench::NEEDS_GRANULE.contains(n))
    {
        granule_bench::granule_exe()?;
    }
    for n in names {
        let dir = granule_bench::run(n, &opts)?;
        let summary = std::fs::read_to_string(dir.join("summary.json")).unwrap_or_default();
        println!("{n}: wrote {}", dir.display());
        println!("{summary}");
    }
    Ok(())
}
