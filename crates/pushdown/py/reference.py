"""The reference results of granule-pushdown's queries, computed by DuckDB.

Usage (the venv is made by `bash scripts/deps.sh`):

    target/ray-venv/bin/python crates/pushdown/py/reference.py DIR [--time N]

DIR holds lineitem.csv, orders.csv, part.csv and docs.csv as granule_pushdown::write_csv
writes them (dates as days since 1970-01-01, money in cents, discounts and taxes in
hundredths). Prints one line per query, `name<TAB>json`, where json is the canonical form
QueryResult::to_json gives on the Rust side: {"columns":[...],"rows":[[...],...]}, rows
sorted, no spaces. The SQL uses the same exact integer arithmetic as the Rust stages
(HUGEINT sums, averages as floor(sum * 100 / count)).

With `--time N` the CSVs are loaded as without it (not timed), then each query runs N
times and the line is `name<TAB>json<TAB>median_seconds`, the median over the N runs of
executing the SQL and fetching its result (not loading, sorting or printing).
"""

import datetime
import json
import os
import statistics
import sys
import time

import duckdb

I = "BIGINT"
S = "VARCHAR"

TABLES = {
    "lineitem": [
        ("l_orderkey", I), ("l_partkey", I), ("l_suppkey", I), ("l_linenumber", I),
        ("l_quantity", I), ("l_extendedprice", I), ("l_discount", I), ("l_tax", I),
        ("l_returnflag", S), ("l_linestatus", S), ("l_shipdate", I), ("l_commitdate", I),
        ("l_receiptdate", I), ("l_shipinstruct", S), ("l_shipmode", S),
    ],
    "orders": [
        ("o_orderkey", I), ("o_custkey", I), ("o_orderstatus", S), ("o_totalprice", I),
        ("o_orderdate", I), ("o_orderpriority", S), ("o_shippriority", I),
    ],
    "part": [
        ("p_partkey", I), ("p_brand", S), ("p_type", S), ("p_size", I), ("p_retailprice", I),
    ],
    "docs": [("d_line", S)],
}


def day(y, m, d):
    """Days since 1970-01-01, as the generator stores dates."""
    return (datetime.date(y, m, d) - datetime.date(1970, 1, 1)).days


def queries():
    q6 = f"""
        SELECT COALESCE(SUM(CAST(l_extendedprice AS HUGEINT) * l_discount), 0) AS revenue
        FROM lineitem
        WHERE l_shipdate >= {day(1994, 1, 1)} AND l_shipdate < {day(1995, 1, 1)}
          AND l_discount BETWEEN 5 AND 7 AND l_quantity < 24
    """
    q1 = f"""
        SELECT l_returnflag, l_linestatus,
               SUM(CAST(l_quantity AS HUGEINT)) AS sum_qty,
               SUM(CAST(l_extendedprice AS HUGEINT)) AS sum_base_price,
               SUM(CAST(l_extendedprice AS HUGEINT) * (100 - l_discount)) AS sum_disc_price,
               SUM(CAST(l_extendedprice AS HUGEINT) * (100 - l_discount) * (100 + l_tax))
                   AS sum_charge,
               FLOOR_DIV(SUM(CAST(l_quantity AS HUGEINT)) * 100, COUNT(*)) AS avg_qty,
               FLOOR_DIV(SUM(CAST(l_extendedprice AS HUGEINT)) * 100, COUNT(*)) AS avg_price,
               FLOOR_DIV(SUM(CAST(l_discount AS HUGEINT)) * 100, COUNT(*)) AS avg_disc,
               COUNT(*) AS count_order
        FROM lineitem
        WHERE l_shipdate <= {day(1998, 12, 1) - 90}
        GROUP BY l_returnflag, l_linestatus
    """
    q14 = f"""
        SELECT promo, total,
               CASE WHEN total = 0 THEN 0 ELSE FLOOR_DIV(promo * 1000000, total) END
        FROM (
            SELECT COALESCE(SUM(CASE WHEN p_type LIKE 'PROMO%'
                                     THEN CAST(l_extendedprice AS HUGEINT) * (100 - l_discount)
                                     ELSE 0 END), 0) AS promo,
                   COALESCE(SUM(CAST(l_extendedprice AS HUGEINT) * (100 - l_discount)), 0)
                       AS total
            FROM lineitem, part
            WHERE l_partkey = p_partkey
              AND l_shipdate >= {day(1995, 9, 1)} AND l_shipdate < {day(1995, 10, 1)}
        )
    """
    q12 = f"""
        SELECT l_shipmode,
               SUM(CASE WHEN o_orderpriority = '1-URGENT' OR o_orderpriority = '2-HIGH'
                        THEN 1 ELSE 0 END) AS high_line_count,
               SUM(CASE WHEN o_orderpriority <> '1-URGENT' AND o_orderpriority <> '2-HIGH'
                        THEN 1 ELSE 0 END) AS low_line_count
        FROM orders, lineitem
        WHERE o_orderkey = l_orderkey
          AND l_shipmode IN ('MAIL', 'SHIP')
          AND l_commitdate < l_receiptdate
          AND l_shipdate < l_commitdate
          AND l_receiptdate >= {day(1994, 1, 1)} AND l_receiptdate < {day(1995, 1, 1)}
        GROUP BY l_shipmode
    """
    # Words are maximal runs of bytes other than the space, as the Rust stage splits.
    wordcount = """
        SELECT word, COUNT(*) AS count
        FROM (SELECT UNNEST(STRING_SPLIT(d_line, ' ')) AS word FROM docs)
        WHERE word <> ''
        GROUP BY word
    """
    return [
        ("q6", ["revenue"], q6),
        ("q1", ["l_returnflag", "l_linestatus", "sum_qty", "sum_base_price",
                "sum_disc_price", "sum_charge", "avg_qty", "avg_price", "avg_disc",
                "count_order"], q1),
        ("q14", ["promo_sum", "total_sum", "promo_revenue_e4"], q14),
        ("q12", ["l_shipmode", "high_line_count", "low_line_count"], q12),
        ("wordcount", ["word", "count"], wordcount),
    ]


def parse_args(argv):
    """(folder, runs): runs is None without `--time N`; None, None when malformed."""
    args = argv[1:]
    runs = None
    if "--time" in args:
        at = args.index("--time")
        try:
            runs = int(args[at + 1])
        except (IndexError, ValueError):
            return None, None
        if runs < 1:
            return None, None
        del args[at:at + 2]
    if len(args) != 1:
        return None, None
    return args[0], runs


def main():
    folder, runs = parse_args(sys.argv)
    if folder is None:
        print("usage: reference.py DIR [--time N]", file=sys.stderr)
        return 2
    con = duckdb.connect()
    # DuckDB's `//` truncates toward zero; the Rust side floors (the same for the
    # non-negative values here, but say exactly what is meant). For b > 0:
    con.execute("CREATE MACRO floor_div(a, b) AS (a - ((a % b) + b) % b) // b")
    for table, cols in TABLES.items():
        path = os.path.join(folder, table + ".csv")
        if not os.path.exists(path):
            continue
        types = ", ".join(f"'{name}': '{ty}'" for name, ty in cols)
        con.execute(
            f"CREATE TABLE {table} AS SELECT * FROM read_csv(?, header = true, "
            f"quote = '\"', escape = '\"', columns = {{{types}}})",
            [path],
        )
    for name, columns, sql in queries():
        secs = []
        for _ in range(runs or 1):
            start = time.perf_counter()
            fetched = con.execute(sql).fetchall()
            secs.append(time.perf_counter() - start)
        rows = [[int(v) if isinstance(v, int) else v for v in row] for row in fetched]
        rows.sort()
        line = name + "\t" + json.dumps({"columns": columns, "rows": rows},
                                         separators=(",", ":"))
        if runs is not None:
            line += "\t" + repr(statistics.median(secs))
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
