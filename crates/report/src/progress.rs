//! [`Progress`]: where a long-running command (a benchmark, the demo) is in its phases,
//! as a bar on a terminal and as plain lines in a log. It lives here, beside the tables
//! of [`usage`](crate::usage), so that the `granule` command and the benchmarks share it
//! without the command depending on the benchmarks.

/// Progress through the phases of a long-running command (a benchmark, the demo).
///
/// On a terminal (stderr) it is an `indicatif` bar that redraws in place; otherwise (CI
/// logs, pipes) every step is one plain line, `label [k/n] message`, so logs stay
/// readable and greppable. It writes to stderr only: stdout carries the results.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    label: String,
    total: u64,
    done: std::sync::atomic::AtomicU64,
}

impl Progress {
    /// A progress of `total` steps, named `label` (e.g. the benchmark's name).
    pub fn new(total: u64, label: &str) -> Progress {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            let style = indicatif::ProgressStyle::with_template(
                "{prefix:>12} [{bar:30}] {pos}/{len} {elapsed:>4} {wide_msg}",
            )
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_prefix(label.to_string());
            // No steady tick: a redraw thread would compete with what is being measured;
            // the bar redraws at each step.
            bar
        });
        Progress {
            bar,
            label: label.to_string(),
            total,
            done: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether this draws a bar (stderr is a terminal) rather than plain lines.
    pub fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    /// One step done; `msg` says what comes next (or what just finished).
    pub fn step(&self, msg: impl AsRef<str>) {
        let k = self.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let k = k.min(self.total);
        match &self.bar {
            Some(bar) => {
                bar.set_position(k);
                bar.set_message(msg.as_ref().to_string());
            }
            None => eprintln!("{} [{k}/{}] {}", self.label, self.total, msg.as_ref()),
        }
    }

    /// A line of its own above the bar (plain line when there is none).
    pub fn note(&self, msg: impl AsRef<str>) {
        match &self.bar {
            Some(bar) => bar.println(msg.as_ref()),
            None => eprintln!("{}: {}", self.label, msg.as_ref()),
        }
    }

    /// Done: the bar is cleared from the terminal (plain output prints nothing more).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // A benchmark that fails half-way must not leave a half-drawn bar behind its
        // error message.
        if let Some(bar) = &self.bar {
            if !bar.is_finished() {
                bar.finish_and_clear();
            }
        }
    }
}
