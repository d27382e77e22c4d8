//! Conversion work on more than one core: a build's conversions, bundles and
//! compositions are independent tasks, and a task is run either by the
//! build's own embedded interpreter or by a conversion worker, a second
//! `chunkforge` process (`chunkforge convert-worker`, hidden) with an
//! interpreter of its own. coremltools' passes are Python and hold the GIL,
//! so threads of one process would take turns; processes run side by side.
//!
//! The worker reads one JSON request per line on stdin and answers on stdout
//! with a line per phase as it starts and one with the task's reply (or its
//! error) and the worker's peak RSS. Anything Python itself prints goes to
//! stderr: the protocol has its own copy of stdout. The worker dies with the
//! build (`PR_SET_PDEATHSIG` on Linux) and exits at the end of its input.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::calls::{self, WeightCache};
use super::contract::{
    Bundle, BundleArgs, ChunkJob, ComposeJob, Composed, ConvertJobsArgs, ConvertedChunk,
};
use super::env as pyenv;
use crate::progress::{self, BuildProgress, OnPhase};
use crate::records::PackageWriter;
use crate::staging;

/// A bundle of single-function parts into multifunction packages (`convert.combine`).
#[derive(Clone, Serialize, Deserialize)]
pub struct BundleRequest {
    /// Shown as `label: bundle N functions`.
    pub label: String,
    pub parts: Vec<(String, String)>,
    pub targets: Vec<(String, Vec<String>)>,
    pub writer: PackageWriter,
}

/// One task, which the worker runs as well as the build (sent as a JSON line).
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// The jobs converted, together with `joint` (`joint.convert_jobs`),
    /// then the bundle.
    Convert {
        jobs: Vec<ChunkJob>,
        bundle: Option<BundleRequest>,
        #[serde(default)]
        joint: bool,
        /// torch threads for loading and tracing (`Pool::threads`).
        #[serde(default = "one")]
        threads: usize,
    },
    /// `compose.compose_job`, shown as `label: what`.
    Compose {
        job: Box<ComposeJob>,
        label: String,
        what: String,
    },
}

/// What a task gives back.
#[derive(Serialize, Deserialize)]
pub struct TaskReply {
    /// Each job's `convert_chunk` reply, in order.
    #[serde(default)]
    pub converted: Vec<ConvertedChunk>,
    pub bundle: Option<Bundle>,
    #[serde(default)]
    pub bundle_seconds: f64,
    pub composed: Option<Composed>,
}

/// Where a task failed, and Python's error as the user reads it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TaskError {
    pub stage: Stage,
    pub message: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Converting: the function (`chunk` or `chunk/function`) if one had started.
    Convert(Option<String>),
    Bundle,
    Compose,
    /// The worker process itself failed.
    Worker,
}

fn one() -> usize {
    1
}

/// Runs `task` in this process's interpreter.
pub fn execute(
    task: &Task,
    cache: &WeightCache,
    on_phase: &OnPhase,
    verbose: bool,
) -> Result<TaskReply, TaskError> {
    match task {
        Task::Convert {
            jobs,
            bundle,
            joint,
            threads,
        } => {
            let args = ConvertJobsArgs {
                jobs,
                joint: *joint,
                threads: *threads,
            };
            let converted =
                calls::convert_jobs(&args, cache, Arc::clone(on_phase)).map_err(|e| TaskError {
                    stage: Stage::Convert(e.function),
                    message: pyenv::render_error(e.error, verbose),
                })?;
            let (mut done, mut seconds) = (None, 0.0);
            if let Some(b) = bundle {
                on_phase(&b.label, &format!("bundle {} functions", b.parts.len()));
                let t = Instant::now();
                let args = BundleArgs {
                    parts: &b.parts,
                    targets: &b.targets,
                    writer: b.writer,
                };
                done = Some(calls::combine(&args).map_err(|e| TaskError {
                    stage: Stage::Bundle,
                    message: pyenv::render_error(e, verbose),
                })?);
                seconds = t.elapsed().as_secs_f64();
            }
            Ok(TaskReply {
                converted,
                bundle: done,
                bundle_seconds: seconds,
                composed: None,
            })
        }
        Task::Compose { job, label, what } => {
            on_phase(label, what);
            let composed = calls::compose(job).map_err(|e| TaskError {
                stage: Stage::Compose,
                message: pyenv::render_error(e, verbose),
            })?;
            Ok(TaskReply {
                converted: Vec::new(),
                bundle: None,
                bundle_seconds: 0.0,
                composed: Some(composed),
            })
        }
    }
}

/// The worker's side of the line protocol.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Message {
    Phase {
        function: String,
        what: String,
    },
    Done {
        reply: TaskReply,
        peak_rss_bytes: u64,
    },
    Failed {
        error: TaskError,
        peak_rss_bytes: u64,
    },
}

/// The first line a worker reads: the build's palettization cache size.
#[derive(Serialize, Deserialize)]
struct Init {
    uses: usize,
}

/// `chunkforge convert-worker`: serves tasks from stdin until it closes.
pub fn serve(verbose: bool) -> Result<()> {
    // The protocol writes to a copy of stdout; fd 1 becomes stderr, so
    // whatever Python or coremltools print cannot garble it.
    let protocol = protocol_stdout()?;
    // Ctrl-C reaches the whole process group: the build handles it (it
    // kills this worker before removing its staging folder).
    #[cfg(unix)]
    // SAFETY: changing this process's own signal disposition.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
    let out = Arc::new(Mutex::new(protocol));
    pyenv::activate(verbose)?;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let init: Init = match lines.next() {
        Some(line) => serde_json::from_str(&line?).context("convert-worker: bad first line")?,
        None => return Ok(()),
    };
    let cache = WeightCache::new(init.uses)
        .map_err(|e| anyhow!("palettization cache: {}", pyenv::render_error(e, verbose)))?;
    let send = |out: &Mutex<std::fs::File>, m: &Message| {
        let mut line = serde_json::to_string(m).expect("messages serialize");
        line.push('\n');
        let mut f = out.lock().unwrap_or_else(|e| e.into_inner());
        // The build reads every line; if it is gone, so is this worker's purpose.
        if f.write_all(line.as_bytes())
            .and_then(|()| f.flush())
            .is_err()
        {
            std::process::exit(1);
        }
    };
    for line in lines {
        let task: Task = serde_json::from_str(&line?).context("convert-worker: bad task")?;
        let phases = Arc::clone(&out);
        let on_phase: OnPhase = Arc::new(move |function: &str, what: &str| {
            let m = Message::Phase {
                function: function.to_string(),
                what: what.to_string(),
            };
            send(&phases, &m);
        });
        let m = match execute(&task, &cache, &on_phase, verbose) {
            Ok(reply) => Message::Done {
                reply,
                peak_rss_bytes: progress::peak_rss_bytes(),
            },
            Err(error) => Message::Failed {
                error,
                peak_rss_bytes: progress::peak_rss_bytes(),
            },
        };
        send(&out, &m);
    }
    Ok(())
}

#[cfg(unix)]
fn protocol_stdout() -> Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: plain descriptor calls on this process's own fds 1 and 2; the
    // duplicate is owned by the returned File alone.
    unsafe {
        let copy = libc::dup(1);
        if copy < 0 || libc::dup2(2, 1) < 0 {
            bail!("convert-worker: cannot set up its output");
        }
        Ok(std::fs::File::from_raw_fd(copy))
    }
}

#[cfg(not(unix))]
fn protocol_stdout() -> Result<std::fs::File> {
    bail!("convert-worker needs a Unix platform")
}

/// A running conversion worker, as the build sees it.
pub struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// The worker's peak RSS, as of its last reply.
    pub peak_rss_bytes: u64,
}

impl Worker {
    /// Starts `chunkforge convert-worker` (this executable) with the build's cache size.
    pub fn spawn(uses: usize, verbose: bool) -> Result<Worker> {
        let exe = std::env::current_exe().context("locating the chunkforge executable")?;
        let mut cmd = Command::new(exe);
        if verbose {
            cmd.arg("--verbose");
        }
        cmd.arg("convert-worker")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().context("starting a conversion worker")?;
        staging::register_child(child.id());
        let mut stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let init = serde_json::to_string(&Init { uses })? + "\n";
        stdin
            .write_all(init.as_bytes())
            .context("starting a conversion worker")?;
        Ok(Worker {
            child,
            stdin: Some(stdin),
            stdout,
            peak_rss_bytes: 0,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Runs `task` in the worker, telling `on_phase` each phase it starts.
    pub fn run(&mut self, task: &Task, on_phase: &OnPhase) -> Result<TaskReply, TaskError> {
        self.exchange(task, on_phase).unwrap_or_else(|e| {
            Err(TaskError {
                stage: Stage::Worker,
                message: format!("{e:#}"),
            })
        })
    }

    fn exchange(
        &mut self,
        task: &Task,
        on_phase: &OnPhase,
    ) -> Result<Result<TaskReply, TaskError>> {
        let line = serde_json::to_string(task)? + "\n";
        let stdin = self.stdin.as_mut().expect("open until finish");
        if stdin.write_all(line.as_bytes()).is_err() {
            bail!(
                "the conversion worker ({}) {}",
                self.child.id(),
                self.status()
            );
        }
        let mut buf = String::new();
        loop {
            buf.clear();
            if self.stdout.read_line(&mut buf)? == 0 {
                bail!(
                    "the conversion worker ({}) {}",
                    self.child.id(),
                    self.status()
                );
            }
            match serde_json::from_str::<Message>(&buf)
                .with_context(|| format!("bad line from the conversion worker: {}", buf.trim()))?
            {
                Message::Phase { function, what } => on_phase(&function, &what),
                Message::Done {
                    reply,
                    peak_rss_bytes,
                } => {
                    self.peak_rss_bytes = peak_rss_bytes;
                    return Ok(Ok(reply));
                }
                Message::Failed {
                    error,
                    peak_rss_bytes,
                } => {
                    self.peak_rss_bytes = peak_rss_bytes;
                    return Ok(Err(error));
                }
            }
        }
    }

    /// How the worker ended (it is waited for).
    fn status(&mut self) -> String {
        staging::forget_child(self.child.id());
        match self.child.wait() {
            Ok(s) => format!("exited ({s})"),
            Err(e) => format!("could not be waited for: {e}"),
        }
    }

    /// Ends the worker: its input closes and it exits.
    pub fn finish(mut self) -> Result<()> {
        drop(self.stdin.take());
        staging::forget_child(self.child.id());
        let status = self
            .child
            .wait()
            .context("waiting for the conversion worker")?;
        if !status.success() {
            bail!("the conversion worker exited ({status})");
        }
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.stdin.is_some() {
            staging::forget_child(self.child.id());
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `tasks` on this process and on `workers` at once, each taking the
/// next task when it is free, the largest `cost` first (so the last task to
/// end is a short one); results in task order. After the first failure no
/// task starts, and the workers still busy are stopped.
pub fn run_all(
    tasks: &[Task],
    cost: &[u64],
    workers: &mut [Worker],
    cache: &WeightCache,
    progress: &BuildProgress,
    verbose: bool,
) -> Vec<Option<Result<TaskReply, TaskError>>> {
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    // Stable: equal costs keep plan order.
    order.sort_by_key(|&i| std::cmp::Reverse(cost.get(i).copied().unwrap_or(0)));
    let queue = Mutex::new(order.into_iter().collect::<VecDeque<_>>());
    let results: Mutex<Vec<Option<Result<TaskReply, TaskError>>>> =
        Mutex::new((0..tasks.len()).map(|_| None).collect());
    let failed = AtomicBool::new(false);
    let next = || {
        if failed.load(Ordering::SeqCst) {
            return None;
        }
        queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
    };
    let store = |i: usize, r: Result<TaskReply, TaskError>| {
        if r.is_err() {
            failed.store(true, Ordering::SeqCst);
        }
        results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
    };
    let pids: Vec<u32> = workers.iter().map(Worker::pid).collect();
    std::thread::scope(|s| {
        for w in workers.iter_mut() {
            let (next, store) = (&next, &store);
            s.spawn(move || {
                let (on_phase, _spinners) = progress::phase_spinners(progress);
                while let Some(i) = next() {
                    store(i, w.run(&tasks[i], &on_phase));
                }
            });
        }
        let (on_phase, spinners) = progress::phase_spinners(progress);
        while let Some(i) = next() {
            store(i, execute(&tasks[i], cache, &on_phase, verbose));
        }
        drop(spinners);
        if failed.load(Ordering::SeqCst) {
            // A worker's task could take minutes more: the build has failed.
            for pid in &pids {
                // SAFETY: signalling our own child; a pid already reaped is
                // still ours until `Worker::drop` waits for it.
                unsafe {
                    libc::kill(*pid as libc::pid_t, libc::SIGKILL);
                }
            }
        }
    });
    results.into_inner().unwrap_or_else(|e| e.into_inner())
}
