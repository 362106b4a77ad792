//! Writes two sample reports (a log-log line chart and a grouped bar chart) so the
//! output can be eyeballed: `cargo run -p granule-report --example demo -- /tmp/demo`.

use std::path::PathBuf;

use granule_report::{Cell, Meta, Plot, Report, Table};

fn main() -> Result<(), granule_report::ReportError> {
    let out = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("granule-report-demo"));

    let works = [0.1, 1.0, 10.0, 50.0];
    let modes = [("function call", 0.0), ("local", 0.3), ("remote", 60.0)];
    let mut table = Table::new(&["mode", "work_us", "calls_per_s", "efficiency"]);
    let mut plot = Plot::line("Proclet call efficiency vs work per call")
        .x_label("work per call (µs)")
        .y_label("efficiency (ops/s ÷ function-call ops/s)")
        .log_x(true)
        .hline(1.0, "ideal");
    for (mode, overhead_us) in modes {
        let mut pts = Vec::new();
        for w in works {
            let eff = w / (w + overhead_us);
            let eff = if overhead_us == 0.0 { 1.0 } else { eff };
            table.row(vec![
                Cell::from(mode),
                w.into(),
                (1e6 / (w + overhead_us)).into(),
                eff.into(),
            ]);
            pts.push((w, eff));
        }
        if overhead_us > 0.0 {
            plot.push_series(mode, pts);
        }
    }
    let meta = Meta::collect(
        "client and proclet on core 0 (current-thread runtime)",
        true,
    );
    let mut rep = Report::new("demo-invoke", meta);
    rep.table(table)
        .plot(plot)
        .summary("local_efficiency_1us", 1.0 / 1.3)
        .summary_str("baseline", "plain function call, same run")
        .note("synthetic numbers, for eyeballing the output format");
    println!("{}", rep.write(&out)?.display());

    let mut rep = Report::new(
        "demo-kv",
        Meta::collect("redis and granule share both cores", true),
    );
    let mut t = Table::new(&["workload", "redis_ops", "granule_ops"]);
    let cats = ["GET 100 B", "SET 100 B", "GET 4 KiB", "SET 4 KiB"];
    let redis = [95e3, 92e3, 80e3, 70e3];
    let granule = [61e3, 58.5e3, 45e3, 40e3];
    for i in 0..4 {
        t.row(vec![cats[i].into(), redis[i].into(), granule[i].into()]);
    }
    rep.table(t).plot(
        Plot::bars("KV throughput, no pipelining")
            .x_label("workload")
            .y_label("ops/s")
            .categories(cats)
            .bar_series("redis-server", redis)
            .bar_series("granule kv", granule)
            .hline(1e5, "target"),
    );
    rep.extra_plot(
        "bars_log",
        Plot::bars("KV throughput (log y)")
            .y_label("ops/s")
            .log_y(true)
            .categories(cats)
            .bar_series("redis-server", redis)
            .bar_series("granule kv", granule)
            .bar_series("granule kv -P16", [600e3, 580e3, 300e3, 250e3]),
    );
    let mut lat = Plot::line("p99 latency vs offered load (log-log)")
        .x_label("offered load (ops/s)")
        .y_label("p99 latency (µs)")
        .log_x(true)
        .log_y(true)
        .hline(6.4, "64 B TCP RTT, same core");
    for (k, name) in ["redis", "granule", "granule -P16", "ray"]
        .iter()
        .enumerate()
    {
        let base = 10.0 * (k as f64 + 1.0);
        let cap = 2e5 / (k as f64 + 1.0);
        let pts = (0..12).map(|i| {
            let load = 1e3 * 1.6f64.powi(i);
            (load, base / (1.0 - (load / cap).min(0.98)))
        });
        lat.push_series(*name, pts.collect::<Vec<_>>());
    }
    rep.extra_plot("latency", lat);
    println!("{}", rep.write(&out)?.display());
    Ok(())
}
