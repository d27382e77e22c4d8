//! Progress display: one bar over chunks, a spinner per phase. Everything goes
//! to stderr so `--json` output on stdout stays clean.

use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A spinner that ticks on its own thread (Python holds the GIL meanwhile).
pub fn spinner(msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{spinner:.cyan} [{elapsed:>4}] {msg}")
            .expect("static template"),
    );
    pb.set_message(msg.into());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// The bar over all chunks of a build, with room for one phase spinner below it.
#[derive(Clone)]
pub struct BuildProgress {
    multi: MultiProgress,
    pub bar: ProgressBar,
}

impl BuildProgress {
    pub fn new(total: u64) -> Self {
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
        let bar = multi.add(ProgressBar::new(total));
        bar.set_style(
            ProgressStyle::with_template(
                "[{elapsed_precise}] {bar:30.green/dim} {pos}/{len} packages {msg}",
            )
            .expect("static template"),
        );
        BuildProgress { multi, bar }
    }

    /// A spinner for one phase; when stderr is not a terminal (CI logs), the
    /// phase's start is logged as a plain line instead.
    pub fn phase(&self, msg: String) -> ProgressBar {
        if self.multi.is_hidden() {
            eprintln!("{msg} ...");
        }
        let pb = self.multi.add(ProgressBar::new_spinner());
        pb.set_style(
            ProgressStyle::with_template("  {spinner:.cyan} [{elapsed:>4}] {msg}")
                .expect("static template"),
        );
        pb.set_message(msg);
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    }

    /// A log line above the bars (plain stderr when stderr is not a terminal).
    pub fn println(&self, line: impl AsRef<str>) {
        if self.multi.is_hidden() {
            eprintln!("{}", line.as_ref());
        } else {
            let _ = self.multi.println(line.as_ref());
        }
    }
}

/// Peak resident memory of this process (which embeds Python) in bytes.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
