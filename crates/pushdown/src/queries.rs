//! The benchmark's queries as data (TPC-H Q6, Q1, Q14, Q12 and a word count), their
//! final step at the caller, and [`run_local`], the in-process reference executor.
//!
//! A [`Query`] is an optional build side (a scan stage projecting (key, payload) from
//! one table, made into a [`JoinTable`]), a scan [`Stage`] over the probe table, and a
//! [`Finalize`] that turns the merged [`Partial`] into a [`QueryResult`]. Pull, push and
//! [`run_local`] differ only in where `Stage::run` executes; all three then merge and
//! finalize the same way, so they agree by construction.
//!
//! Every number is an exact integer in the stored units (cents, hundredths, days):
//!
//! - Q6 `revenue` = Σ price × discount (cents × hundredths).
//! - Q1 `sum_disc_price` = Σ price × (100 − discount); `sum_charge` = Σ price ×
//!   (100 − discount) × (100 + tax); `avg_x` = ⌊Σx × 100 / count⌋.
//! - Q14 reports Σ promo price × (100 − discount), Σ price × (100 − discount), and
//!   `promo_revenue_e4` = ⌊1 000 000 × promo / total⌋ (the percentage × 10⁴; 0 when the
//!   total is 0).
//! - Q12 counts high (`1-URGENT`, `2-HIGH`) and low priority lines per ship mode.
//! - The word count reports every word with its number of occurrences.
//!
//! [`QueryResult::to_json`] is the canonical form compared with DuckDB: rows sorted,
//! compact JSON as Python's `json.dumps(..., separators=(",", ":"))` writes it.

use crate::expr::{CmpOp, Expr, Pred};
use crate::gen::{days, schema, TableName};
use crate::ops::{Acc, Agg, JoinTable, Output, Partial, Stage};
use crate::table::{Columns, Table};
use crate::OpError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Display;

/// The build side of a hash join: a stage over `table` projecting (key, payload).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildSide {
    /// The table scanned.
    pub table: TableName,
    /// A stage whose output is `Project([key, payload])`.
    pub stage: Stage,
}

/// How the merged partial becomes the result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finalize {
    /// An aggregate (one row) or group-by (one row per group): the group key's parts,
    /// dictionary codes shown as their strings (`key_dicts[i]`, when a dictionary
    /// key), then each aggregate's value.
    Table {
        /// Per key part, the dictionary its codes index, if any.
        key_dicts: Vec<Option<Vec<String>>>,
    },
    /// Two sums `a`, `b`: the row `a, b, ⌊a × scale / b⌋` (0 when `b` is 0).
    Ratio {
        /// The multiplier.
        scale: i128,
    },
    /// A word count's buckets: one row (word, count) per word.
    Words,
}

/// A query: see the module doc.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query {
    /// Its short name (`q6`, `q1`, `q14`, `q12`, `wordcount`).
    pub name: String,
    /// The result's column names.
    pub columns: Vec<String>,
    /// The join's build side, if the query joins.
    pub build: Option<BuildSide>,
    /// The table the scan stage runs over.
    pub table: TableName,
    /// The per-row-group scan stage.
    pub stage: Stage,
    /// The final step at the caller.
    pub finalize: Finalize,
}

/// One value of a result.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Value {
    /// SQL `NULL` (the min, max or average of no rows).
    Null,
    /// An integer.
    Int(i128),
    /// A string.
    Str(String),
}

/// A query's rows.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryResult {
    /// Column names.
    pub columns: Vec<String>,
    /// Rows, sorted ascending.
    pub rows: Vec<Vec<Value>>,
}

impl QueryResult {
    /// The canonical JSON form: `{"columns":[...],"rows":[[...],...]}`, rows sorted,
    /// no spaces, strings escaped as Python's `json.dumps` does (ASCII only).
    pub fn to_json(&self) -> String {
        let mut rows = self.rows.clone();
        rows.sort();
        let mut s = String::from("{\"columns\":[");
        for (i, c) in self.columns.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            json_str(&mut s, c);
        }
        s.push_str("],\"rows\":[");
        for (i, row) in rows.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push('[');
            for (j, v) in row.iter().enumerate() {
                if j > 0 {
                    s.push(',');
                }
                match v {
                    Value::Null => s.push_str("null"),
                    Value::Int(n) => s.push_str(&n.to_string()),
                    Value::Str(t) => json_str(&mut s, t),
                }
            }
            s.push(']');
        }
        s.push_str("]}");
        s
    }
}

/// `t` as a JSON string the way Python's `json.dumps` (with `ensure_ascii`) writes it.
fn json_str(s: &mut String, t: &str) {
    s.push('"');
    for c in t.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '\r' => s.push_str("\\r"),
            '\t' => s.push_str("\\t"),
            '\u{8}' => s.push_str("\\b"),
            '\u{c}' => s.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7f => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    s.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => s.push(c),
        }
    }
    s.push('"');
}

/// Builds the join table from a build side's merged partial (`Rows` of key, payload),
/// asking `reserve` for its memory first.
pub fn build_join<E: Display>(
    partial: &Partial,
    reserve: &mut dyn FnMut(u64) -> Result<(), E>,
) -> Result<JoinTable, OpError> {
    match partial {
        Partial::Rows { cols } if cols.len() == 2 => JoinTable::build(&cols[0], &cols[1], reserve)
            .map_err(|e| OpError::JoinBuild(e.to_string())),
        _ => Err(OpError::JoinBuild(
            "the build side must project exactly (key, payload)".into(),
        )),
    }
}

/// Turns the merged partial of `q`'s stage into its result.
pub fn finalize(q: &Query, p: Partial) -> Result<QueryResult, OpError> {
    let int = |a: &Acc| a.value().map_or(Value::Null, Value::Int);
    let rows = match (&q.finalize, p) {
        (Finalize::Table { .. }, Partial::Agg(accs)) => vec![accs.iter().map(int).collect()],
        (Finalize::Table { key_dicts }, Partial::Groups(groups)) => groups
            .into_iter()
            .map(|(key, accs)| {
                let mut row: Vec<Value> = key
                    .iter()
                    .enumerate()
                    .map(|(i, &k)| match key_dicts.get(i).and_then(|d| d.as_ref()) {
                        Some(d) => usize::try_from(k)
                            .ok()
                            .and_then(|k| d.get(k))
                            .map_or(Value::Null, |s| Value::Str(s.clone())),
                        None => Value::Int(k as i128),
                    })
                    .collect();
                row.extend(accs.iter().map(int));
                row
            })
            .collect(),
        (Finalize::Ratio { scale }, Partial::Agg(accs)) => match accs.as_slice() {
            [a, b] => {
                let (a, b) = (a.value().unwrap_or(0), b.value().unwrap_or(0));
                let r = if b == 0 {
                    0
                } else {
                    a.checked_mul(*scale)
                        .ok_or_else(|| OpError::Mismatch("the ratio overflows".into()))?
                        .div_euclid(b)
                };
                vec![vec![Value::Int(a), Value::Int(b), Value::Int(r)]]
            }
            _ => return Err(OpError::Mismatch("a ratio needs exactly two sums".into())),
        },
        (Finalize::Words, Partial::Buckets(buckets)) => buckets
            .into_iter()
            .flatten()
            .map(|(w, c)| vec![Value::Str(w), Value::Int(c as i128)])
            .collect(),
        (f, p) => {
            return Err(OpError::Mismatch(format!(
                "finalize {f:?} cannot take this partial ({} bytes)",
                p.bytes()
            )))
        }
    };
    let mut rows: Vec<Vec<Value>> = rows;
    rows.sort();
    Ok(QueryResult {
        columns: q.columns.clone(),
        rows,
    })
}

/// Runs `stage` over every row group of `table` and merges the partials.
pub fn scan_local(
    stage: &Stage,
    table: &Table,
    join: Option<&JoinTable>,
) -> Result<Partial, OpError> {
    stage.check_columns(&table.schema)?;
    let mut acc = stage.empty();
    for rg in &table.groups {
        acc.merge(stage.run(&Columns::of_group(rg), join)?)?;
    }
    Ok(acc)
}

/// Runs `q` entirely in this process: the reference executor.
pub fn run_local(q: &Query, tables: &BTreeMap<TableName, Table>) -> Result<QueryResult, OpError> {
    let get = |t: TableName| {
        tables
            .get(&t)
            .ok_or_else(|| OpError::NoTable(t.name().into()))
    };
    if let Some(b) = &q.build {
        b.stage.check_columns(&get(b.table)?.schema)?;
    }
    q.stage.check_columns(&get(q.table)?.schema)?;
    let join = match &q.build {
        Some(b) => {
            let rows = scan_local(&b.stage, get(b.table)?, None)?;
            Some(build_join(&rows, &mut |_| Ok::<(), OpError>(()))?)
        }
        None => None,
    };
    let partial = scan_local(&q.stage, get(q.table)?, join.as_ref())?;
    finalize(q, partial)
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// TPC-H Q6: revenue from discounts on 1994's lines with discount 0.06 ± 0.01 and
/// quantity < 24.
pub fn q6() -> Result<Query, OpError> {
    let li = schema(TableName::Lineitem);
    let c = |n| li.col(n);
    Ok(Query {
        name: "q6".into(),
        columns: names(&["revenue"]),
        build: None,
        table: TableName::Lineitem,
        stage: Stage {
            // The most selective conjunct first: the others run on its survivors.
            filter: Pred::and([
                Pred::Between(c("l_shipdate")?, days(1994, 1, 1), days(1995, 1, 1) - 1),
                Pred::Between(c("l_discount")?, 5, 7),
                Pred::Cmp(c("l_quantity")?, CmpOp::Lt, 24),
            ]),
            probe: None,
            output: Output::Aggregate(vec![Agg::Sum(Expr::times(
                Expr::Col(c("l_extendedprice")?),
                Expr::Col(c("l_discount")?),
            ))]),
        },
        finalize: Finalize::Table { key_dicts: vec![] },
    })
}

/// TPC-H Q1: the pricing summary per return flag and line status of lines shipped by
/// 1998-12-01 minus 90 days.
pub fn q1() -> Result<Query, OpError> {
    let li = schema(TableName::Lineitem);
    let c = |n| li.col(n);
    let price = || c("l_extendedprice").map(Expr::Col);
    let disc_price = || -> Result<Expr, OpError> {
        Ok(Expr::times(
            price()?,
            Expr::minus(Expr::Const(100), Expr::Col(c("l_discount")?)),
        ))
    };
    let (flag, status) = (c("l_returnflag")?, c("l_linestatus")?);
    Ok(Query {
        name: "q1".into(),
        columns: names(&[
            "l_returnflag",
            "l_linestatus",
            "sum_qty",
            "sum_base_price",
            "sum_disc_price",
            "sum_charge",
            "avg_qty",
            "avg_price",
            "avg_disc",
            "count_order",
        ]),
        build: None,
        table: TableName::Lineitem,
        stage: Stage {
            filter: Pred::Cmp(c("l_shipdate")?, CmpOp::Le, days(1998, 12, 1) - 90),
            probe: None,
            output: Output::GroupBy {
                keys: vec![Expr::Code(flag), Expr::Code(status)],
                aggs: vec![
                    Agg::Sum(Expr::Col(c("l_quantity")?)),
                    Agg::Sum(price()?),
                    Agg::Sum(disc_price()?),
                    Agg::Sum(Expr::times(
                        disc_price()?,
                        Expr::plus(Expr::Const(100), Expr::Col(c("l_tax")?)),
                    )),
                    Agg::Avg(Expr::Col(c("l_quantity")?)),
                    Agg::Avg(price()?),
                    Agg::Avg(Expr::Col(c("l_discount")?)),
                    Agg::Count,
                ],
            },
        },
        finalize: Finalize::Table {
            key_dicts: vec![
                Some(li.dict(flag)?.to_vec()),
                Some(li.dict(status)?.to_vec()),
            ],
        },
    })
}

/// TPC-H Q14: the share of September 1995's revenue from promotional parts.
pub fn q14() -> Result<Query, OpError> {
    let li = schema(TableName::Lineitem);
    let part = schema(TableName::Part);
    let c = |n| li.col(n);
    let p_type = part.col("p_type")?;
    let promo = part.codes_where(p_type, |s| s.starts_with("PROMO"))?;
    let revenue = || -> Result<Expr, OpError> {
        Ok(Expr::times(
            Expr::Col(c("l_extendedprice")?),
            Expr::minus(Expr::Const(100), Expr::Col(c("l_discount")?)),
        ))
    };
    Ok(Query {
        name: "q14".into(),
        columns: names(&["promo_sum", "total_sum", "promo_revenue_e4"]),
        build: Some(BuildSide {
            table: TableName::Part,
            stage: Stage {
                filter: Pred::True,
                probe: None,
                output: Output::Project(vec![
                    Expr::Col(part.col("p_partkey")?),
                    Expr::case(Pred::InSet(p_type, promo), Expr::Const(1), Expr::Const(0)),
                ]),
            },
        }),
        table: TableName::Lineitem,
        stage: Stage {
            filter: Pred::Between(c("l_shipdate")?, days(1995, 9, 1), days(1995, 10, 1) - 1),
            probe: Some(Expr::Col(c("l_partkey")?)),
            output: Output::Aggregate(vec![
                Agg::Sum(Expr::times(Expr::Joined, revenue()?)),
                Agg::Sum(revenue()?),
            ]),
        },
        finalize: Finalize::Ratio { scale: 1_000_000 },
    })
}

/// TPC-H Q12: high and low priority order lines per ship mode (MAIL, SHIP) received in
/// 1994 late but shipped in time.
pub fn q12() -> Result<Query, OpError> {
    let li = schema(TableName::Lineitem);
    let orders = schema(TableName::Orders);
    let c = |n| li.col(n);
    let mode = c("l_shipmode")?;
    let prio = orders.col("o_orderpriority")?;
    let high = orders.codes_where(prio, |s| s == "1-URGENT" || s == "2-HIGH")?;
    let modes = li.codes_where(mode, |s| s == "MAIL" || s == "SHIP")?;
    Ok(Query {
        name: "q12".into(),
        columns: names(&["l_shipmode", "high_line_count", "low_line_count"]),
        build: Some(BuildSide {
            table: TableName::Orders,
            stage: Stage {
                filter: Pred::True,
                probe: None,
                output: Output::Project(vec![
                    Expr::Col(orders.col("o_orderkey")?),
                    Expr::case(Pred::InSet(prio, high), Expr::Const(1), Expr::Const(0)),
                ]),
            },
        }),
        table: TableName::Lineitem,
        stage: Stage {
            filter: Pred::and([
                Pred::Between(c("l_receiptdate")?, days(1994, 1, 1), days(1995, 1, 1) - 1),
                Pred::InSet(mode, modes),
                Pred::CmpCols(c("l_commitdate")?, CmpOp::Lt, c("l_receiptdate")?),
                Pred::CmpCols(c("l_shipdate")?, CmpOp::Lt, c("l_commitdate")?),
            ]),
            probe: Some(Expr::Col(c("l_orderkey")?)),
            output: Output::GroupBy {
                keys: vec![Expr::Code(mode)],
                aggs: vec![
                    Agg::Sum(Expr::Joined),
                    Agg::Sum(Expr::minus(Expr::Const(1), Expr::Joined)),
                ],
            },
        },
        finalize: Finalize::Table {
            key_dicts: vec![Some(li.dict(mode)?.to_vec())],
        },
    })
}

/// The word count over `docs`, its map side shuffling into `buckets` buckets.
pub fn word_count(buckets: u32) -> Result<Query, OpError> {
    let docs = schema(TableName::Docs);
    Ok(Query {
        name: "wordcount".into(),
        columns: names(&["word", "count"]),
        build: None,
        table: TableName::Docs,
        stage: Stage {
            filter: Pred::True,
            probe: None,
            output: Output::WordCount {
                col: docs.col("d_line")?,
                buckets,
            },
        },
        finalize: Finalize::Words,
    })
}

/// The five queries (the word count with 8 buckets).
pub fn all() -> Result<Vec<Query>, OpError> {
    Ok(vec![q6()?, q1()?, q14()?, q12()?, word_count(8)?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen::generate;
    use crate::table::RowGroup;
    use granule_runtime::Blob;

    /// A small deterministic PRNG for shuffles (xorshift64*).
    struct Prng(u64);

    impl Prng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n as u64) as usize
        }

        fn shuffle<T>(&mut self, v: &mut [T]) {
            for i in (1..v.len()).rev() {
                v.swap(i, self.below(i + 1));
            }
        }
    }

    fn tables(sf: f64, seed: u64, rows: u32) -> BTreeMap<TableName, Table> {
        TableName::ALL
            .iter()
            .map(|&t| {
                let (schema, groups) = generate(t, sf, seed, rows).unwrap();
                (t, Table { schema, groups })
            })
            .collect()
    }

    fn join_of(q: &Query, t: &BTreeMap<TableName, Table>) -> Option<JoinTable> {
        q.build.as_ref().map(|b| {
            let rows = scan_local(&b.stage, &t[&b.table], None).unwrap();
            build_join(&rows, &mut |_| Ok::<(), OpError>(())).unwrap()
        })
    }

    /// A copy of `b` whose bytes start at an odd address, as a view into a frame may.
    fn unaligned(b: &Blob) -> Blob {
        let mut v = vec![0u8; b.len() + 1];
        v[1..].copy_from_slice(b);
        Blob(bytes::Bytes::from(v).slice(1..))
    }

    #[test]
    fn partials_merge_the_same_in_any_grouping_and_order() {
        let t = tables(0.002, 5, 100);
        let mut rng = Prng(0x1234_5678);
        for q in all().unwrap() {
            let join = join_of(&q, &t);
            let parts: Vec<Partial> = t[&q.table]
                .groups
                .iter()
                .map(|rg| q.stage.run(&Columns::of_group(rg), join.as_ref()).unwrap())
                .collect();
            assert!(parts.len() >= 10, "{}: {} groups", q.name, parts.len());
            let mut want = q.stage.empty();
            for p in parts.clone() {
                want.merge(p).unwrap();
            }
            for _ in 0..5 {
                let mut ps = parts.clone();
                rng.shuffle(&mut ps);
                // Random runs merged from the identity, then the runs in random order.
                let mut runs = Vec::new();
                while !ps.is_empty() {
                    let n = 1 + rng.below(ps.len().min(7));
                    let mut run = q.stage.empty();
                    for p in ps.drain(..n) {
                        run.merge(p).unwrap();
                    }
                    runs.push(run);
                }
                rng.shuffle(&mut runs);
                let mut got = runs.pop().unwrap();
                for r in runs {
                    got.merge(r).unwrap();
                }
                assert_eq!(got, want, "{}", q.name);
            }
            assert_eq!(
                finalize(&q, want).unwrap(),
                run_local(&q, &t).unwrap(),
                "{}",
                q.name
            );
        }
    }

    #[test]
    fn pulled_unaligned_columns_give_what_the_stored_group_gives() {
        let t = tables(0.002, 9, 333);
        for q in all().unwrap() {
            let join = join_of(&q, &t);
            let need = q.stage.columns();
            for rg in &t[&q.table].groups {
                let pushed = q.stage.run(&Columns::of_group(rg), join.as_ref()).unwrap();
                let pulled: Vec<Blob> = rg.project(&need).unwrap().iter().map(unaligned).collect();
                let cols = Columns::of_pulled(rg.rows, &need, &pulled).unwrap();
                assert_eq!(
                    q.stage.run(&cols, join.as_ref()).unwrap(),
                    pushed,
                    "{}",
                    q.name
                );
                assert_eq!(
                    q.stage.bytes_in(rg),
                    pulled.iter().map(|b| b.len() as u64).sum::<u64>()
                );
            }
        }
    }

    #[test]
    fn stages_name_the_columns_they_read() {
        let li = schema(TableName::Lineitem);
        let c = |n| li.col(n).unwrap();
        assert_eq!(
            q6().unwrap().stage.columns(),
            vec![
                c("l_quantity"),
                c("l_extendedprice"),
                c("l_discount"),
                c("l_shipdate")
            ]
        );
        // A pulled set missing one of them is an error, not a wrong answer.
        let (_, groups) = generate(TableName::Lineitem, 0.001, 1, 1000).unwrap();
        let need = [c("l_quantity"), c("l_discount"), c("l_shipdate")];
        let blobs = groups[0].project(&need).unwrap();
        let cols = Columns::of_pulled(groups[0].rows, &need, &blobs).unwrap();
        assert_eq!(
            q6().unwrap().stage.run(&cols, None),
            Err(OpError::ColumnMissing(c("l_extendedprice")))
        );
    }

    #[test]
    fn a_probing_stage_needs_its_join_table() {
        let t = tables(0.001, 1, 1000);
        let q = q14().unwrap();
        let rg = &t[&TableName::Lineitem].groups[0];
        assert!(matches!(
            q.stage.run(&Columns::of_group(rg), None),
            Err(OpError::Join(_))
        ));
        // The budget's refusal surfaces as an error, and nothing is built.
        let b = q.build.as_ref().unwrap();
        let rows = scan_local(&b.stage, &t[&b.table], None).unwrap();
        let err = build_join(&rows, &mut |bytes| {
            if bytes > 1000 {
                Err(format!("{bytes} bytes over budget"))
            } else {
                Ok(())
            }
        });
        assert!(matches!(err, Err(OpError::JoinBuild(m)) if m.contains("over budget")));
    }

    #[test]
    fn partial_bytes_are_their_encoded_length() {
        let t = tables(0.001, 3, 500);
        for q in all().unwrap() {
            let p = run_partial(&q, &t);
            assert_eq!(p.bytes(), postcard::to_allocvec(&p).unwrap().len() as u64);
        }
    }

    fn run_partial(q: &Query, t: &BTreeMap<TableName, Table>) -> Partial {
        let join = join_of(q, t);
        scan_local(&q.stage, &t[&q.table], join.as_ref()).unwrap()
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics_and_neither_does_running_what_decodes() {
        let t = tables(0.0005, 2, 200);
        let rg: &RowGroup = &t[&TableName::Lineitem].groups[0];
        let join = join_of(&q12().unwrap(), &t);
        let mut rng = Prng(77);
        // Valid encodings with bytes flipped, and plain noise.
        let seeds: Vec<Vec<u8>> = all()
            .unwrap()
            .iter()
            .map(|q| postcard::to_allocvec(&q.stage).unwrap())
            .collect();
        let mut ran = 0;
        for i in 0..20_000 {
            let bytes: Vec<u8> = if i % 2 == 0 {
                let mut b = seeds[rng.below(seeds.len())].clone();
                for _ in 0..1 + rng.below(4) {
                    let at = rng.below(b.len());
                    b[at] = rng.below(256) as u8;
                }
                b
            } else {
                (0..rng.below(64)).map(|_| rng.below(256) as u8).collect()
            };
            let _ = postcard::from_bytes::<RowGroup>(&bytes);
            let _ = postcard::from_bytes::<Partial>(&bytes);
            let _ = postcard::from_bytes::<Query>(&bytes);
            if let Ok(stage) = postcard::from_bytes::<Stage>(&bytes) {
                ran += 1;
                let _ = stage.run(&Columns::of_group(rg), join.as_ref());
                let _ = stage.empty().merge(stage.empty());
            }
        }
        assert!(ran > 1000, "only {ran} decoded stages ran");
    }

    #[test]
    fn json_escapes_as_python_does() {
        let r = QueryResult {
            columns: vec!["a\"b".into()],
            rows: vec![
                vec![Value::Str("é\n\u{1}\u{1F600}".into())],
                vec![Value::Null],
                vec![Value::Int(-3)],
            ],
        };
        assert_eq!(
            r.to_json(),
            r#"{"columns":["a\"b"],"rows":[[null],[-3],["\u00e9\n\u0001\ud83d\ude00"]]}"#
        );
    }
}
