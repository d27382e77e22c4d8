//! Progress display: one bar over chunks, a spinner per phase. Everything goes
//! to stderr so `--json` output on stdout stays clean.

use std::sync::{Arc, Mutex};
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

/// Tells each phase of a long Python call on `sp` as `prefix: phase`, with
/// the process's resident memory now (and how much of it is pages of files
/// it has mapped, which count there as much as its own memory) and at its
/// peak so far; where stderr is not a terminal (a log
/// file), each phase is a plain line with the seconds since the start.
pub fn phases(sp: &ProgressBar, prefix: &str) -> impl Fn(&str) + Send + Sync + 'static {
    let sp = sp.clone();
    let prefix = prefix.to_string();
    let start = std::time::Instant::now();
    move |what: &str| {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let msg = format!(
            "{prefix}: {what} ({:.1} GiB resident, {:.1} of it file-backed, {:.1} GiB peak so far)",
            gib(rss_bytes()),
            gib(status_bytes("RssFile:")),
            gib(peak_rss_bytes())
        );
        if sp.is_hidden() {
            eprintln!("[{:>6.0} s] {msg}", start.elapsed().as_secs_f64());
        }
        sp.set_message(msg);
    }
}

/// Shows each phase of a conversion as it starts: `(function, phase)`.
pub type OnPhase = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Each phase shown as a spinner under `progress`, the last one cleared when
/// the returned guard is dropped.
pub fn phase_spinners(progress: &BuildProgress) -> (OnPhase, PhaseGuard) {
    let slot: Arc<Mutex<Option<ProgressBar>>> = Arc::default();
    let shown = progress.clone();
    let bars = Arc::clone(&slot);
    let on_phase: OnPhase = Arc::new(move |function: &str, what: &str| {
        let mut bar = bars.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(previous) = bar.take() {
            previous.finish_and_clear();
        }
        *bar = Some(shown.phase(format!("{function}: {what}")));
    });
    (on_phase, PhaseGuard(slot))
}

/// Clears the last phase spinner of `phase_spinners` when dropped.
pub struct PhaseGuard(Arc<Mutex<Option<ProgressBar>>>);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        if let Some(last) = self.0.lock().unwrap_or_else(|e| e.into_inner()).take() {
            last.finish_and_clear();
        }
    }
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
    status_bytes("VmHWM:")
}

/// Resident memory of this process now, in bytes.
pub fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// A `kB` field of /proc/self/status in bytes (0 where there is none).
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
