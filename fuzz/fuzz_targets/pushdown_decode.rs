//! Fuzz target: arbitrary bytes through the decoders of what a pushed operator receives
//! and returns (`granule-pushdown`): a stage, a partial, a row group and a query, as
//! postcard decodes them from a call's argument or answer.
//!
//! A data node runs whatever stage a caller ships, and a caller merges whatever partial
//! a node returns, so neither may panic on bytes that decode: a stage that decodes is
//! checked and, when the check passes, run over a real row group of every table (it may
//! fail, with an error); a partial that decodes is merged with itself and sized; a row
//! group that decodes is checked against every schema and, when one accepts it, read
//! through `Columns` the way a scan reads it.
#![no_main]

use granule_pushdown::{
    generate, schema, Columns, Partial, Query, RowGroup, Stage, TableName,
};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// One small row group of every table, generated once.
fn groups() -> &'static Vec<RowGroup> {
    static G: OnceLock<Vec<RowGroup>> = OnceLock::new();
    G.get_or_init(|| {
        TableName::ALL
            .into_iter()
            .filter_map(|t| generate(t, 0.0005, 1, 64).ok())
            .filter_map(|(_, g)| g.into_iter().next())
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(stage) = postcard::from_bytes::<Stage>(data) {
        if stage.check().is_ok() {
            for rg in groups() {
                let _ = stage.run(&Columns::of_group(rg), None);
            }
        }
    }
    if let Ok(p) = postcard::from_bytes::<Partial>(data) {
        let _ = p.bytes();
        let mut twice = p.clone();
        let _ = twice.merge(p);
    }
    if let Ok(rg) = postcard::from_bytes::<RowGroup>(data) {
        for t in TableName::ALL {
            let s = schema(t);
            if rg.check(&s).is_ok() {
                let cols: Vec<usize> = (0..s.cols.len()).collect();
                if let Ok(blobs) = rg.project(&cols) {
                    let _ = Columns::of_pulled(rg.rows, &cols, &blobs);
                }
            }
        }
    }
    if let Ok(q) = postcard::from_bytes::<Query>(data) {
        let _ = q.stage.check();
    }
});
