//! Fuzz target: arbitrary bytes through the producer stores' RESP request decoder.
//!
//! A store's decoder faces bytes from anyone who can reach its port (before AUTH too), so
//! it must never panic, never claim more bytes than it was given, never hand back an
//! argument outside the buffer, and keep its bounds whatever a header claims. This target
//! feeds the input as a connection's byte stream: split into commands the way a store's
//! connection does it (parse, run, advance; stop at the first protocol error), once whole
//! and once delivered in two pieces at a point the input chooses (the connection's
//! parser resuming a partial command where it stopped), under the default limits and
//! under small ones, and checks that both deliveries give the same commands.
#![no_main]

use granule_market::store::resp::{Limits, Parser};
use libfuzzer_sys::fuzz_target;

type Outcome = (Vec<Vec<Vec<u8>>>, bool);

/// Commands decoded from `data` delivered up to `avail` bytes at a time, and whether a
/// protocol error stopped it.
fn stream(data: &[u8], cut: usize, limits: &Limits) -> Outcome {
    let mut out = Vec::new();
    let mut parser = Parser::default();
    let mut args = Vec::new();
    let mut pos = 0;
    let mut avail = cut.min(data.len());
    loop {
        match parser.parse(&data[pos..avail], limits, &mut args) {
            Ok(Some(n)) => {
                assert!(n > 0 && pos + n <= avail, "consumed {n} of {}", avail - pos);
                assert!(args.len() <= limits.max_args);
                let buf = &data[pos..pos + n];
                let mut cmd = Vec::new();
                for &(s, e) in &args {
                    assert!(s <= e && e <= n, "argument {s}..{e} outside {n}");
                    assert!(e - s <= limits.max_bulk.max(limits.max_inline));
                    cmd.push(buf[s..e].to_vec());
                }
                if !cmd.is_empty() {
                    out.push(cmd);
                }
                pos += n;
            }
            Ok(None) if avail < data.len() => avail = data.len(),
            Ok(None) => return (out, false),
            Err(e) => {
                // Every error has a message for the `-ERR Protocol error: ...` line.
                assert!(!e.to_string().is_empty());
                return (out, true);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let cut = data.first().map_or(0, |&b| b as usize * data.len() / 256);
    for limits in [
        Limits::default(),
        Limits {
            max_bulk: 16,
            max_args: 4,
            max_inline: 32,
        },
    ] {
        let whole = stream(data, data.len(), &limits);
        let split = stream(data, cut, &limits);
        assert_eq!(whole, split, "delivery in two pieces changed the commands");
    }
});
