//! A deterministic TPC-H-style data generator (`lineitem`, `orders`, `part`) and a
//! `docs` table of text lines for the word count, plus CSV output for the SQL reference.
//!
//! Sizes follow TPC-H per scale factor: 1.5 M × SF orders with 1 to 7 lines each
//! (≈ 6 M × SF lineitems), 200 k × SF parts; `docs` has 1 M × SF lines. Value
//! distributions follow the TPC-H specification closely enough that the queries are as
//! selective as the real ones: order dates uniform over 1992-01-01 … 1998-08-02, ship
//! dates 1–121 days later, commit dates 30–90 days after the order, receipt dates 1–30
//! days after shipping, return flag and line status from the dates against 1995-06-17,
//! discounts 0–10 %, taxes 0–8 %, quantities 1–50, prices from the part's retail price
//! formula, and the spec's ship modes, instructions, priorities, brands and the 150 part
//! types (one in six `PROMO ...`). Order keys are sparse as in TPC-H (8 of every 32).
//!
//! Determinism: every order, part and line of text draws from its own SplitMix64 stream
//! seeded from (seed, table, index), with integer arithmetic only, so the bytes are the
//! same on every machine and a table can be generated in any chunking. Dates are days
//! since 1970-01-01; money is in cents; discounts and taxes in hundredths.

use crate::table::{i64_blob, text_blob, ColDef, ColType, RowGroup, Schema};
use granule_runtime::Blob;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;
use thiserror::Error;

/// The tables the generator makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TableName {
    /// TPC-H `lineitem`.
    Lineitem,
    /// TPC-H `orders`.
    Orders,
    /// TPC-H `part`.
    Part,
    /// Lines of text for the word count.
    Docs,
}

impl TableName {
    /// Every table.
    pub const ALL: [TableName; 4] = [
        TableName::Lineitem,
        TableName::Orders,
        TableName::Part,
        TableName::Docs,
    ];

    /// Its SQL name.
    pub fn name(self) -> &'static str {
        match self {
            TableName::Lineitem => "lineitem",
            TableName::Orders => "orders",
            TableName::Part => "part",
            TableName::Docs => "docs",
        }
    }

    fn tag(self) -> u64 {
        self as u64 + 1
    }
}

/// Why the generator refused.
#[derive(Debug, Error)]
pub enum GenError {
    /// The scale factor is not a positive finite number.
    #[error("scale factor {0} is not positive and finite")]
    ScaleFactor(f64),
    /// Zero rows per group.
    #[error("rows per group must be positive")]
    RowsPerGroup,
    /// Writing the CSV failed.
    #[error("writing {path}: {err}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        err: std::io::Error,
    },
    /// A row group does not fit the schema.
    #[error("row group {group}: {err}")]
    BadGroup {
        /// Its index.
        group: usize,
        /// What is wrong.
        err: crate::OpError,
    },
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
pub const fn days(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const START_DATE: i64 = days(1992, 1, 1);
const CURRENT_DATE: i64 = days(1995, 6, 17);
const END_DATE: i64 = days(1998, 12, 31);

const RETURN_FLAGS: [&str; 3] = ["A", "N", "R"];
const LINE_STATUS: [&str; 2] = ["F", "O"];
const ORDER_STATUS: [&str; 3] = ["F", "O", "P"];
const SHIP_INSTRUCT: [&str; 4] = [
    "COLLECT COD",
    "DELIVER IN PERSON",
    "NONE",
    "TAKE BACK RETURN",
];
const SHIP_MODES: [&str; 7] = ["AIR", "FOB", "MAIL", "RAIL", "REG AIR", "SHIP", "TRUCK"];
const PRIORITIES: [&str; 5] = ["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW"];
const TYPE_1: [&str; 6] = ["STANDARD", "SMALL", "MEDIUM", "LARGE", "ECONOMY", "PROMO"];
const TYPE_2: [&str; 5] = ["ANODIZED", "BURNISHED", "PLATED", "POLISHED", "BRUSHED"];
const TYPE_3: [&str; 5] = ["TIN", "NICKEL", "BRASS", "STEEL", "COPPER"];

/// Words in the `docs` vocabulary.
pub const VOCABULARY: usize = 5000;

fn dict(v: &[&str]) -> ColType {
    ColType::Dict(v.iter().map(|s| s.to_string()).collect())
}

fn part_types() -> Vec<String> {
    let mut v = Vec::with_capacity(150);
    for a in TYPE_1 {
        for b in TYPE_2 {
            for c in TYPE_3 {
                v.push(format!("{a} {b} {c}"));
            }
        }
    }
    v
}

fn brands() -> Vec<String> {
    (1..=5)
        .flat_map(|m| (1..=5).map(move |n| format!("Brand#{m}{n}")))
        .collect()
}

/// A table's schema (the same for every scale factor and seed: dictionaries are fixed).
pub fn schema(table: TableName) -> Schema {
    let i = |n: &str| ColDef {
        name: n.to_string(),
        ty: ColType::I64,
    };
    let d = |n: &str, ty: ColType| ColDef {
        name: n.to_string(),
        ty,
    };
    let cols = match table {
        TableName::Lineitem => vec![
            i("l_orderkey"),
            i("l_partkey"),
            i("l_suppkey"),
            i("l_linenumber"),
            i("l_quantity"),
            i("l_extendedprice"),
            i("l_discount"),
            i("l_tax"),
            d("l_returnflag", dict(&RETURN_FLAGS)),
            d("l_linestatus", dict(&LINE_STATUS)),
            i("l_shipdate"),
            i("l_commitdate"),
            i("l_receiptdate"),
            d("l_shipinstruct", dict(&SHIP_INSTRUCT)),
            d("l_shipmode", dict(&SHIP_MODES)),
        ],
        TableName::Orders => vec![
            i("o_orderkey"),
            i("o_custkey"),
            d("o_orderstatus", dict(&ORDER_STATUS)),
            i("o_totalprice"),
            i("o_orderdate"),
            d("o_orderpriority", dict(&PRIORITIES)),
            i("o_shippriority"),
        ],
        TableName::Part => vec![
            i("p_partkey"),
            d("p_brand", ColType::Dict(brands())),
            d("p_type", ColType::Dict(part_types())),
            i("p_size"),
            i("p_retailprice"),
        ],
        TableName::Docs => vec![d("d_line", ColType::Text)],
    };
    Schema {
        table: table.name().to_string(),
        cols,
    }
}

/// A SplitMix64 stream.
struct Rng(u64);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    fn new(seed: u64, table: TableName, index: u64) -> Rng {
        Rng(mix(mix(
            seed ^ table.tag().wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ) ^ index))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi` (multiply-shift: tiny bias, fully deterministic).
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let n = (hi - lo + 1) as u128;
        lo + ((self.next() as u128 * n) >> 64) as i64
    }
}

/// Entity counts at a scale factor.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    orders: u64,
    parts: i64,
    suppliers: i64,
    customers: i64,
    docs: u64,
}

impl Sizes {
    fn of(sf: f64) -> Result<Sizes, GenError> {
        if !(sf.is_finite() && sf > 0.0) {
            return Err(GenError::ScaleFactor(sf));
        }
        let n = |base: f64| ((base * sf).round() as u64).max(1);
        Ok(Sizes {
            orders: n(1_500_000.0),
            parts: n(200_000.0) as i64,
            suppliers: n(10_000.0) as i64,
            customers: n(150_000.0) as i64,
            docs: n(1_000_000.0),
        })
    }
}

/// TPC-H's retail price of a part, in cents.
fn retail_price(partkey: i64) -> i64 {
    90_000 + (partkey / 10) % 20_001 + 100 * (partkey % 1_000)
}

/// One line of an order (codes are dictionary indices).
struct Line {
    partkey: i64,
    suppkey: i64,
    quantity: i64,
    price: i64,
    discount: i64,
    tax: i64,
    returnflag: u8,
    linestatus: u8,
    shipdate: i64,
    commitdate: i64,
    receiptdate: i64,
    shipinstruct: u8,
    shipmode: u8,
}

struct Order {
    key: i64,
    custkey: i64,
    date: i64,
    priority: u8,
    lines: Vec<Line>,
}

fn order(seed: u64, s: &Sizes, i: u64) -> Order {
    let mut r = Rng::new(seed, TableName::Orders, i);
    let key = (i / 8 * 32 + i % 8 + 1) as i64;
    let custkey = r.range(1, s.customers);
    let date = r.range(START_DATE, END_DATE - 151);
    let priority = r.range(0, 4) as u8;
    let n = r.range(1, 7);
    let lines = (0..n)
        .map(|_| {
            let partkey = r.range(1, s.parts);
            let suppkey = r.range(1, s.suppliers);
            let quantity = r.range(1, 50);
            let discount = r.range(0, 10);
            let tax = r.range(0, 8);
            let shipdate = date + r.range(1, 121);
            let commitdate = date + r.range(30, 90);
            let receiptdate = shipdate + r.range(1, 30);
            let returnflag = if receiptdate <= CURRENT_DATE {
                if r.next() & 1 == 0 {
                    0 // A
                } else {
                    2 // R
                }
            } else {
                1 // N
            };
            let linestatus = if shipdate > CURRENT_DATE { 1 } else { 0 };
            Line {
                partkey,
                suppkey,
                quantity,
                price: quantity * retail_price(partkey),
                discount,
                tax,
                returnflag,
                linestatus,
                shipdate,
                commitdate,
                receiptdate,
                shipinstruct: r.range(0, 3) as u8,
                shipmode: r.range(0, 6) as u8,
            }
        })
        .collect();
    Order {
        key,
        custkey,
        date,
        priority,
        lines,
    }
}

/// The `docs` vocabulary: distinct pseudo-words spelled from syllables.
fn vocabulary() -> Vec<String> {
    const SYL: [&str; 16] = [
        "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "be", "da", "fu", "go", "hi", "jo", "pe",
        "zu",
    ];
    (0..VOCABULARY)
        .map(|k| {
            // k + 1 in base 16, most significant syllable first (no leading zeros), so
            // words are distinct.
            let mut digits = Vec::new();
            let mut n = k + 1;
            while n > 0 {
                digits.push(n % 16);
                n /= 16;
            }
            digits.iter().rev().map(|&d| SYL[d]).collect()
        })
        .collect()
}

/// Zipf(1) over the vocabulary as integer cumulative weights (⌊2⁴⁰ / rank⌋).
fn zipf_cdf() -> Vec<u64> {
    let mut acc = 0u64;
    (1..=VOCABULARY as u64)
        .map(|k| {
            acc += (1u64 << 40) / k;
            acc
        })
        .collect()
}

/// One column being filled.
enum ColBuf {
    I64(Vec<i64>),
    Dict(Vec<u8>),
    Text(Vec<String>),
}

impl ColBuf {
    fn split_off(&mut self, at: usize) -> ColBuf {
        match self {
            ColBuf::I64(v) => ColBuf::I64(v.split_off(at)),
            ColBuf::Dict(v) => ColBuf::Dict(v.split_off(at)),
            ColBuf::Text(v) => ColBuf::Text(v.split_off(at)),
        }
    }

    fn into_blob(self) -> Blob {
        match self {
            ColBuf::I64(v) => i64_blob(v),
            ColBuf::Dict(v) => Blob::from(v),
            ColBuf::Text(v) => text_blob(&v),
        }
    }

    fn i(&mut self, x: i64) {
        if let ColBuf::I64(v) = self {
            v.push(x);
        }
    }

    fn d(&mut self, x: u8) {
        if let ColBuf::Dict(v) = self {
            v.push(x);
        }
    }
}

/// The row groups of one table, generated lazily (see [`row_groups`]).
pub struct RowGroups {
    table: TableName,
    schema: Schema,
    seed: u64,
    sizes: Sizes,
    per_group: usize,
    /// The next entity (order, part, line of text) to generate.
    next: u64,
    /// Rows generated but not yet emitted.
    buf: Vec<ColBuf>,
    rows: usize,
    words: Vec<String>,
    cdf: Vec<u64>,
}

/// The row groups of `table` at scale factor `sf` from `seed`, `rows_per_group` rows
/// each (the last may be shorter), generated as the iterator is advanced.
pub fn row_groups(
    table: TableName,
    sf: f64,
    seed: u64,
    rows_per_group: u32,
) -> Result<RowGroups, GenError> {
    if rows_per_group == 0 {
        return Err(GenError::RowsPerGroup);
    }
    let sizes = Sizes::of(sf)?;
    let schema = schema(table);
    let (words, cdf) = if table == TableName::Docs {
        (vocabulary(), zipf_cdf())
    } else {
        (Vec::new(), Vec::new())
    };
    let mut g = RowGroups {
        table,
        schema,
        seed,
        sizes,
        per_group: rows_per_group as usize,
        next: 0,
        buf: Vec::new(),
        rows: 0,
        words,
        cdf,
    };
    g.buf = g.empty_buf();
    Ok(g)
}

/// All of `table` at once: its schema and row groups (see [`row_groups`]).
pub fn generate(
    table: TableName,
    sf: f64,
    seed: u64,
    rows_per_group: u32,
) -> Result<(Schema, Vec<RowGroup>), GenError> {
    let g = row_groups(table, sf, seed, rows_per_group)?;
    let schema = g.schema.clone();
    Ok((schema, g.collect()))
}

impl RowGroups {
    /// The table's schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    fn empty_buf(&self) -> Vec<ColBuf> {
        let cap = self.per_group + 8;
        self.schema
            .cols
            .iter()
            .map(|c| match c.ty {
                ColType::I64 => ColBuf::I64(Vec::with_capacity(cap)),
                ColType::Dict(_) => ColBuf::Dict(Vec::with_capacity(cap)),
                ColType::Text => ColBuf::Text(Vec::with_capacity(cap)),
            })
            .collect()
    }

    fn entities(&self) -> u64 {
        match self.table {
            TableName::Lineitem | TableName::Orders => self.sizes.orders,
            TableName::Part => self.sizes.parts as u64,
            TableName::Docs => self.sizes.docs,
        }
    }

    /// Generates entity `self.next` into the buffer.
    fn add(&mut self) {
        let i = self.next;
        self.next += 1;
        let b = &mut self.buf;
        match self.table {
            TableName::Lineitem => {
                let o = order(self.seed, &self.sizes, i);
                for (n, l) in o.lines.iter().enumerate() {
                    b[0].i(o.key);
                    b[1].i(l.partkey);
                    b[2].i(l.suppkey);
                    b[3].i(n as i64 + 1);
                    b[4].i(l.quantity);
                    b[5].i(l.price);
                    b[6].i(l.discount);
                    b[7].i(l.tax);
                    b[8].d(l.returnflag);
                    b[9].d(l.linestatus);
                    b[10].i(l.shipdate);
                    b[11].i(l.commitdate);
                    b[12].i(l.receiptdate);
                    b[13].d(l.shipinstruct);
                    b[14].d(l.shipmode);
                }
                self.rows += o.lines.len();
            }
            TableName::Orders => {
                let o = order(self.seed, &self.sizes, i);
                let shipped = o.lines.iter().filter(|l| l.linestatus == 0).count();
                let status = if shipped == o.lines.len() {
                    0 // F: every line shipped
                } else if shipped == 0 {
                    1 // O
                } else {
                    2 // P
                };
                let total: i64 = o
                    .lines
                    .iter()
                    .map(|l| l.price * (100 + l.tax) * (100 - l.discount) / 10_000)
                    .sum();
                b[0].i(o.key);
                b[1].i(o.custkey);
                b[2].d(status);
                b[3].i(total);
                b[4].i(o.date);
                b[5].d(o.priority);
                b[6].i(0);
                self.rows += 1;
            }
            TableName::Part => {
                let key = i as i64 + 1;
                let mut r = Rng::new(self.seed, TableName::Part, i);
                let brand = (r.range(0, 4) * 5 + r.range(0, 4)) as u8;
                let ty = r.range(0, 149) as u8;
                b[0].i(key);
                b[1].d(brand);
                b[2].d(ty);
                b[3].i(r.range(1, 50));
                b[4].i(retail_price(key));
                self.rows += 1;
            }
            TableName::Docs => {
                let mut r = Rng::new(self.seed, TableName::Docs, i);
                let n = r.range(4, 16);
                let total = self.cdf.last().copied().unwrap_or(1);
                let mut line = String::with_capacity(n as usize * 8);
                for k in 0..n {
                    let x = ((r.next() as u128 * total as u128) >> 64) as u64;
                    let w = self.cdf.partition_point(|&c| c <= x).min(VOCABULARY - 1);
                    if k > 0 {
                        line.push(' ');
                    }
                    line.push_str(&self.words[w]);
                }
                if let ColBuf::Text(v) = &mut b[0] {
                    v.push(line);
                }
                self.rows += 1;
            }
        }
    }
}

impl Iterator for RowGroups {
    type Item = RowGroup;

    fn next(&mut self) -> Option<RowGroup> {
        while self.rows < self.per_group && self.next < self.entities() {
            self.add();
        }
        if self.rows == 0 {
            return None;
        }
        let take = self.rows.min(self.per_group);
        // An order's lines may straddle two groups: keep the overflow for the next.
        let rest: Vec<ColBuf> = self.buf.iter_mut().map(|c| c.split_off(take)).collect();
        let full = std::mem::replace(&mut self.buf, rest);
        self.rows -= take;
        Some(RowGroup {
            rows: take as u32,
            cols: full.into_iter().map(ColBuf::into_blob).collect(),
        })
    }
}

/// Writes row groups as CSV with a header: `I64` columns as their stored integers,
/// dictionary and text columns as their strings, double-quoted.
pub fn write_csv(schema: &Schema, groups: &[RowGroup], path: &Path) -> Result<(), GenError> {
    let io = |err| GenError::Io {
        path: path.display().to_string(),
        err,
    };
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let header: Vec<&str> = schema.cols.iter().map(|c| c.name.as_str()).collect();
    writeln!(w, "{}", header.join(",")).map_err(io)?;
    for (g, rg) in groups.iter().enumerate() {
        rg.check(schema)
            .map_err(|err| GenError::BadGroup { group: g, err })?;
        let cols = crate::table::Columns::of_group(rg);
        enum Col<'a> {
            I(std::borrow::Cow<'a, [i64]>),
            D(&'a [u8], &'a [String]),
            T(crate::table::TextCol<'a>),
        }
        let mut read = Vec::with_capacity(schema.cols.len());
        for (c, def) in schema.cols.iter().enumerate() {
            let bad = |err| GenError::BadGroup { group: g, err };
            read.push(match &def.ty {
                ColType::I64 => Col::I(cols.i64s(c).map_err(bad)?),
                ColType::Dict(d) => Col::D(cols.codes(c).map_err(bad)?, d),
                ColType::Text => Col::T(cols.text(c).map_err(bad)?),
            });
        }
        for r in 0..rg.rows as usize {
            for (c, col) in read.iter().enumerate() {
                if c > 0 {
                    w.write_all(b",").map_err(io)?;
                }
                match col {
                    Col::I(v) => write!(w, "{}", v[r]).map_err(io)?,
                    Col::D(v, d) => quoted(&mut w, &d[v[r] as usize]).map_err(io)?,
                    Col::T(t) => quoted(&mut w, t.row(r)).map_err(io)?,
                }
            }
            w.write_all(b"\n").map_err(io)?;
        }
    }
    w.flush().map_err(io)
}

fn quoted(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(b"\"")?;
    w.write_all(s.replace('"', "\"\"").as_bytes())?;
    w.write_all(b"\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::Columns;

    #[test]
    fn dates_are_days_since_the_epoch() {
        assert_eq!(days(1970, 1, 1), 0);
        assert_eq!(days(1970, 3, 1), 59);
        assert_eq!(days(1992, 1, 1), 8035);
        assert_eq!(days(2000, 3, 1), 11017);
        assert_eq!(days(1998, 12, 1) - 90, days(1998, 9, 2));
    }

    #[test]
    fn the_same_seed_gives_the_same_bytes_and_another_seed_others() {
        for t in TableName::ALL {
            let (s1, a) = generate(t, 0.002, 7, 1000).unwrap();
            let (_, b) = generate(t, 0.002, 7, 1000).unwrap();
            let (_, c) = generate(t, 0.002, 8, 1000).unwrap();
            assert_eq!(a, b, "{t:?}");
            assert_ne!(a, c, "{t:?}");
            for rg in &a {
                rg.check(&s1).unwrap();
            }
        }
    }

    #[test]
    fn chunking_does_not_change_the_rows() {
        let (_, small) = generate(TableName::Lineitem, 0.001, 3, 100).unwrap();
        let (_, big) = generate(TableName::Lineitem, 0.001, 3, 1 << 20).unwrap();
        assert_eq!(big.len(), 1);
        assert!(small.iter().all(|g| g.rows <= 100));
        assert!(small[..small.len() - 1].iter().all(|g| g.rows == 100));
        let keys = |gs: &[RowGroup]| -> Vec<i64> {
            gs.iter()
                .flat_map(|g| Columns::of_group(g).i64s(0).unwrap().to_vec())
                .collect()
        };
        assert_eq!(keys(&small), keys(&big));
    }

    #[test]
    fn sizes_and_distributions_look_like_tpch() {
        let (_, li) = generate(TableName::Lineitem, 0.01, 1, 1 << 14).unwrap();
        let rows: usize = li.iter().map(|g| g.rows as usize).sum();
        assert!((55_000..65_000).contains(&rows), "{rows} lineitems");
        let (_, o) = generate(TableName::Orders, 0.01, 1, 1 << 14).unwrap();
        assert_eq!(o.iter().map(|g| g.rows).sum::<u32>(), 15_000);
        // Q6's filter keeps about 2 %.
        let mut kept = 0;
        for g in &li {
            let c = Columns::of_group(g);
            let (q, d, s) = (c.i64s(4).unwrap(), c.i64s(6).unwrap(), c.i64s(10).unwrap());
            for r in 0..g.rows as usize {
                if s[r] >= days(1994, 1, 1)
                    && s[r] < days(1995, 1, 1)
                    && (5..=7).contains(&d[r])
                    && q[r] < 24
                {
                    kept += 1;
                }
            }
        }
        let share = kept as f64 / rows as f64;
        assert!((0.012..0.025).contains(&share), "Q6 keeps {share}");
    }

    #[test]
    fn csv_has_a_header_and_one_line_per_row() {
        let (s, g) = generate(TableName::Part, 0.001, 1, 64).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("part.csv");
        write_csv(&s, &g, &p).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "p_partkey,p_brand,p_type,p_size,p_retailprice");
        assert_eq!(lines.len(), 201);
        assert!(lines[1].starts_with("1,\"Brand#"));
    }
}
