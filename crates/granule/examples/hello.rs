//! The README's ten lines, as a runnable example:
//! `cargo run --release -p granule --example hello`.
use granule::{Cluster, Kind, Proclet};

#[derive(serde::Serialize, serde::Deserialize)]
struct Counter {
    n: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let _cluster = Cluster::start()?; // controller + node processes of this binary
    let c = Proclet::create(Kind::Memory, 10u64, |start: u64| Counter { n: start })?; // placed by the controller
    let n = c.run(5u64, |c: &mut Counter, x: u64| {
        c.n += x;
        c.n
    })?; // runs where c lives
    println!("{n} (on node {})", c.location()?);
    Ok(())
}
