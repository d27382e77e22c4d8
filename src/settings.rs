//! The resolve step (ripgrep's low args → `HiArgs`, uv's `Settings::resolve`):
//! a command's options, the environment and a recorded build are lowered
//! once, here, into the settings a build or a parity run takes. Everything
//! downstream reads those values; nothing re-reads the environment, replays a
//! record through a copy of its own, or re-derives a default.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use crate::cli::values::{parse_prompt, Jobs, DEFAULT_STEPS};
use crate::cli::{BenchBuildCmd, BenchParityCmd, BuildCmd, LayoutArgs, ParityCmd, ReleaseCmd};
use crate::names::Named;
use crate::parity_checks::Thresholds;
use crate::plan::{self, Mode};
use crate::records::{
    BuildRecord, BuildRequest, ConversionSettings, PackageWriter, Palettizer, Switch,
};
use crate::staging::OnLocked;
#[cfg(feature = "test-hooks")]
use crate::test_hooks::Sabotage;

/// Whether a unit's functions are converted together (`joint.convert_jobs`):
/// `on` (the default) or `off` (one conversion per function, the reference:
/// `bench build --compare joint`).
pub const JOINT_ENV: &str = "CHUNKFORGE_JOINT";
/// Who writes bundled and composed packages ([`PackageWriter`]; `bench build
/// --compare writer`).
pub const WRITER_ENV: &str = "CHUNKFORGE_WRITER";
/// Whether conversions take chunkforge's shortcuts through coremltools' own
/// code (python/chunkforge_py/convert/passes.py `shortcuts`): `on` (the default) or
/// `off` (coremltools' code for every step: `bench build --compare shortcuts`).
pub const SHORTCUTS_ENV: &str = "CHUNKFORGE_MIL_SHORTCUTS";

/// The environment's switches that change a conversion, read once
/// ([`Env::process`]); a build reads them from here only.
#[derive(Clone, Debug, Default)]
pub struct Env {
    joint: Option<String>,
    writer: Option<String>,
    shortcuts: Option<String>,
}

impl Env {
    /// This process's environment.
    pub fn process() -> Env {
        let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        Env {
            joint: var(JOINT_ENV),
            writer: var(WRITER_ENV),
            shortcuts: var(SHORTCUTS_ENV),
        }
    }

    /// An environment of these variables only (tests).
    pub fn of(vars: &[(&str, &str)]) -> Env {
        let get = |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        };
        Env {
            joint: get(JOINT_ENV),
            writer: get(WRITER_ENV),
            shortcuts: get(SHORTCUTS_ENV),
        }
    }

    /// The conversion settings `conversion` with this environment's switches.
    fn apply(&self, mut conversion: ConversionSettings) -> Result<ConversionSettings> {
        conversion.joint = choice::<Switch>(JOINT_ENV, &self.joint)? == Switch::On;
        conversion.writer = choice::<PackageWriter>(WRITER_ENV, &self.writer)?;
        conversion.mil_shortcuts = choice::<Switch>(SHORTCUTS_ENV, &self.shortcuts)? == Switch::On;
        Ok(conversion)
    }
}

/// The value of the switch `name`: one of `T`'s names, the first when unset
/// or empty; any other value is an error naming them, before anything is written.
fn choice<T: Named>(name: &str, value: &Option<String>) -> Result<T> {
    let value = value.as_deref().unwrap_or("");
    let value = if value.is_empty() { T::NAMES[0] } else { value };
    value
        .parse::<T>()
        .map_err(|_| anyhow!("{name}={value:?}: expected {}", T::NAMES.join(" or ")))
}

/// What a build is resolved from.
pub enum BuildCommand<'a> {
    /// `build --output`.
    Build(&'a BuildCmd),
    /// `build --check DIR`: the build recorded in DIR/build.json, on this
    /// command's processes (`--jobs`, `--kmeans-workers`) and, with
    /// `--hf-dir`, the checkpoint's folder now.
    Check(&'a BuildCmd, &'a Path),
    /// `release`'s build of the checkpoint in this folder.
    Release(&'a ReleaseCmd, &'a Path),
    /// `bench build`, into a temporary folder of its own.
    Bench(&'a BenchBuildCmd),
}

/// One build, resolved: the checkpoint, the layout request, the conversion
/// settings handed to Python (and recorded in build.json), and the run's own options.
#[derive(Clone, Debug)]
pub struct BuildSettings {
    /// The checkpoint's folder (None: the built-in one).
    pub hf_dir: Option<PathBuf>,
    pub layout: Layout,
    pub conversion: ConversionSettings,
    /// Time every coremltools graph pass into each function's record.
    pub profile: bool,
    /// Processes converting at once (`--jobs`).
    pub jobs: Jobs,
    /// When another run holds the output folder's lock; None: the output is
    /// a fresh temporary folder of this run (`--check`, `bench build`), unlocked.
    pub lock: Option<OnLocked>,
}

impl BuildSettings {
    /// The only way to make build settings.
    pub fn resolve(cmd: BuildCommand, env: &Env) -> Result<BuildSettings> {
        let (hf_dir, layout, conversion, profile, jobs, lock) = match cmd {
            BuildCommand::Build(a) => {
                let layout = Layout::of(&a.layout);
                let lock = Some(OnLocked::from_no_wait(a.no_wait));
                (
                    a.model.hf_dir.clone(),
                    layout,
                    &a.conversion,
                    false,
                    a.jobs,
                    lock,
                )
            }
            BuildCommand::Check(a, dir) => {
                let mut recorded = recorded(&dir.join("build.json"), &a.model.hf_dir)?;
                if let Some(p) = recorded.conversion.palettization.as_mut() {
                    p.kmeans_workers = a.conversion.kmeans_workers;
                }
                recorded.jobs = a.jobs;
                return Ok(recorded);
            }
            BuildCommand::Release(a, hf_dir) => {
                let layout = Layout {
                    mode: Mode::All,
                    split: None,
                    ctx: a.ctx,
                    verify_k: a.functions.verify_k,
                    prefill_len: a.functions.prefill_len.clone(),
                };
                let lock = Some(OnLocked::from_no_wait(a.release.no_wait));
                let hf_dir = Some(hf_dir.to_path_buf());
                (hf_dir, layout, &a.conversion, false, Jobs::Auto, lock)
            }
            BuildCommand::Bench(a) => {
                let layout = Layout::of(&a.layout);
                (
                    a.model.hf_dir.clone(),
                    layout,
                    &a.conversion,
                    a.profile,
                    a.jobs,
                    None,
                )
            }
        };
        Ok(BuildSettings {
            hf_dir,
            conversion: env.apply(conversion.settings(layout.ctx))?,
            layout,
            profile,
            jobs,
            lock,
        })
    }

    /// The verify and prefill functions the layout asks for.
    pub fn functions(&self) -> plan::Functions {
        let l = &self.layout;
        plan::Functions::resolve(l.mode, l.verify_k, l.prefill_len.as_deref())
    }
}

/// A layout request with its mode and context known (a recorded one is
/// checked to have both).
#[derive(Clone, Debug)]
pub struct Layout {
    pub mode: Mode,
    pub split: Option<String>,
    pub ctx: usize,
    pub verify_k: Option<usize>,
    pub prefill_len: Option<Vec<usize>>,
}

impl Layout {
    /// The CLI's layout options.
    pub fn of(args: &LayoutArgs) -> Self {
        Layout {
            mode: args.mode,
            split: args.split.clone(),
            ctx: args.ctx,
            verify_k: args.functions.verify_k,
            prefill_len: args.functions.prefill_len.clone(),
        }
    }

    /// As build.json records it.
    pub fn record(&self) -> BuildRequest {
        BuildRequest {
            mode: Some(self.mode),
            split: self.split.clone(),
            ctx: Some(self.ctx as u64),
            verify_k: self.verify_k,
            prefill_len: self.prefill_len.clone(),
        }
    }
}

/// The parts of build.json a rebuild reads: what was asked for, the
/// conversion settings as they were recorded, and the checkpoint's folder.
#[derive(Deserialize)]
struct Recorded {
    request: BuildRequest,
    settings: ConversionSettings,
    checkpoint: RecordedCheckpoint,
}

#[derive(Deserialize)]
struct RecordedCheckpoint {
    dir: PathBuf,
}

/// The build whose record is `build_json`, as `build --check` makes it again
/// (`hf_override`: the checkpoint's folder now, instead of the recorded one).
/// Records from before a settings field read as the builds of their day
/// (records.rs: every later field has the default that build had).
pub fn recorded(build_json: &Path, hf_override: &Option<PathBuf>) -> Result<BuildSettings> {
    let text = std::fs::read(build_json)
        .with_context(|| format!("{}: cannot read", build_json.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not valid JSON", build_json.display()))?;
    let r: Recorded = serde_json::from_value(v).map_err(|e| {
        anyhow!(
            "{}: {e}: missing or invalid (not a chunkforge build.json?)",
            build_json.display()
        )
    })?;
    let (Some(mode), Some(ctx)) = (r.request.mode, r.request.ctx) else {
        bail!(
            "{}: request.mode and request.ctx missing or invalid (not a chunkforge build.json?)",
            build_json.display()
        );
    };
    let ctx = usize::try_from(ctx)
        .map_err(|_| format!("{ctx} is out of range"))
        .and_then(crate::args::check_ctx)
        .map_err(|e| anyhow!("{}: request.ctx {e}", build_json.display()))?;
    let hf_dir = match hf_override {
        Some(p) => p.clone(),
        None => {
            let recorded = &r.checkpoint.dir;
            // Builds record an absolute path; a relative one (hand-written, or
            // from an older chunkforge) is taken relative to build.json, never
            // to the folder `--check` happens to run in.
            let base = build_json.parent().unwrap_or(Path::new(""));
            let dir = base.join(recorded);
            if !dir.is_dir() {
                bail!(
                    "{}: checkpoint.dir `{}` ({}) is not a folder; pass --hf-dir to say where the checkpoint is now",
                    build_json.display(),
                    recorded.display(),
                    dir.display()
                );
            }
            dir
        }
    };
    let mut conversion = r.settings;
    conversion.ctx = ctx;
    // A record that palettized but predates the palettization record: the
    // Rust kernel's, as shipped; one without the mode: its palettizer's.
    if conversion.quantize {
        let palettizer = conversion.palettizer().unwrap_or(Palettizer::Chunkforge);
        let shipped = ConversionSettings::shipped(ctx, true, palettizer, 1).palettization;
        match (&mut conversion.palettization, shipped) {
            (None, shipped) => conversion.palettization = shipped,
            (Some(p), Some(s)) if p.mode.is_empty() => p.mode = s.mode,
            _ => {}
        }
    }
    Ok(BuildSettings {
        hf_dir: Some(hf_dir),
        layout: Layout {
            mode,
            split: r.request.split,
            ctx,
            verify_k: r.request.verify_k,
            prefill_len: r.request.prefill_len,
        },
        conversion,
        profile: false,
        jobs: Jobs::Auto,
        lock: None,
    })
}

/// `parity --ctx` without artifacts: short caches keep the torch steps fast.
pub const DEFAULT_PARITY_CTX: usize = 512;
/// Prompt tokens the release gate prefills before decoding the rest.
const RELEASE_PREFILL: usize = 8;

/// What a parity run is resolved from.
pub enum ParityCommand<'a> {
    /// `parity`; its build is `--artifacts`' (read for its context length).
    Parity(&'a ParityCmd),
    /// `release`'s gate on the build in this folder.
    Release(&'a ReleaseCmd, &'a Path),
    /// `bench parity`: every option but its own at `parity`'s defaults.
    Bench(&'a BenchParityCmd),
}

/// One parity run, resolved.
#[derive(Clone, Debug)]
pub struct ParitySettings {
    pub mode: Mode,
    /// verify_qK and prefill functions to check (`--mode all` asks for both).
    pub functions: plan::Functions,
    pub split: Option<String>,
    pub steps: usize,
    /// What the checks are held to.
    pub thresholds: Thresholds,
    pub ctx: usize,
    pub prompt_ids: Option<Vec<i64>>,
    pub prefill: usize,
    pub artifacts: Option<PathBuf>,
    pub report: Option<PathBuf>,
    pub oracle: bool,
    /// Sign on an INCONCLUSIVE verdict (`release --accept-inconclusive-parity`):
    /// the reference disagrees with transformers only at ill-conditioned steps.
    pub accept_inconclusive: bool,
    /// What a test build breaks on purpose (`--corrupt-layer`,
    /// `--skip-prefill-copy`; test builds only).
    #[cfg(feature = "test-hooks")]
    pub sabotage: Option<Sabotage>,
}

impl ParitySettings {
    /// The only way to make parity settings. `build`: the build whose
    /// packages are checked, if any (its context length is the default).
    pub fn resolve(cmd: ParityCommand, build: Option<&BuildRecord>) -> Result<ParitySettings> {
        let defaults = ParitySettings {
            mode: Mode::Both,
            functions: plan::Functions::resolve(Mode::Both, None, None),
            split: None,
            steps: DEFAULT_STEPS,
            thresholds: Thresholds::default(),
            ctx: build.map_or(DEFAULT_PARITY_CTX, |b| b.settings.ctx),
            prompt_ids: None,
            prefill: 0,
            artifacts: None,
            report: None,
            oracle: true,
            accept_inconclusive: false,
            #[cfg(feature = "test-hooks")]
            sabotage: None,
        };
        if let (ParityCommand::Parity(a), Some(b)) = (&cmd, build) {
            if let Some(ctx) = a.ctx.filter(|&c| c != b.settings.ctx) {
                bail!(
                    "{}: the build's packages take context length {}, but --ctx {ctx} was given; parity --artifacts checks the packages as built (drop --ctx)",
                    a.artifacts
                        .as_deref()
                        .map(|d| d.join("build.json").display().to_string())
                        .unwrap_or_default(),
                    b.settings.ctx
                );
            }
        }
        Ok(match cmd {
            ParityCommand::Parity(a) => ParitySettings {
                mode: a.mode,
                functions: parity_functions(
                    a.mode,
                    a.functions.verify_k,
                    a.functions.prefill_len.as_deref(),
                    a.artifacts.as_deref(),
                    build,
                )?,
                split: a.split.clone(),
                steps: a.steps,
                thresholds: a.thresholds,
                ctx: a.ctx.unwrap_or(defaults.ctx),
                prompt_ids: a.prompt_ids.as_deref().map(parse_prompt).transpose()?,
                prefill: a.prefill,
                artifacts: a.artifacts.clone(),
                report: a.report.clone(),
                oracle: !a.no_oracle,
                accept_inconclusive: false,
                #[cfg(feature = "test-hooks")]
                sabotage: a.sabotage.sabotage(),
            },
            ParityCommand::Release(a, build_dir) => ParitySettings {
                mode: Mode::All,
                functions: plan::Functions::resolve(
                    Mode::All,
                    a.functions.verify_k,
                    a.functions.prefill_len.as_deref(),
                ),
                steps: a.steps,
                ctx: a.ctx,
                // The prefill hand-off, and the prefill programs through the interpreter.
                prefill: if a.steps > RELEASE_PREFILL {
                    RELEASE_PREFILL
                } else {
                    0
                },
                // The packages' weights read back (INT4, or FP16 with --no-quantize)
                // and their own programs run by the MIL interpreter.
                artifacts: Some(build_dir.to_path_buf()),
                report: Some(build_dir.join("parity.json")),
                accept_inconclusive: a.inconclusive.accept_inconclusive_parity,
                #[cfg(feature = "test-hooks")]
                sabotage: a.sabotage.sabotage(),
                ..defaults
            },
            ParityCommand::Bench(a) => ParitySettings {
                mode: a.mode,
                functions: parity_functions(a.mode, None, None, a.artifacts.as_deref(), build)?,
                steps: a.steps,
                prefill: a.prefill,
                artifacts: a.artifacts.clone(),
                report: a.report.clone(),
                ..defaults
            },
        })
    }
}

/// The functions `parity` checks: as asked, except that with `--artifacts`
/// the packages' own verify K and prefill lengths stand where none were
/// asked for (the reference's packages are checked as built), and a
/// request the packages cannot answer is refused before anything runs.
/// (`bench parity --artifacts` too: it asks for nothing.)
fn parity_functions(
    mode: Mode,
    verify_k: Option<usize>,
    prefill_len: Option<&[usize]>,
    artifacts: Option<&Path>,
    build: Option<&BuildRecord>,
) -> Result<plan::Functions> {
    let asked = plan::Functions::resolve(mode, verify_k, prefill_len);
    let Some(b) = build else {
        return Ok(asked);
    };
    let function_tokens = |kind: plan::LayoutKind, f: plan::FunctionKind| -> Option<Vec<usize>> {
        let layout = b.plan.layouts.iter().find(|l| l.kind == kind)?;
        Some(
            layout
                .chunks
                .first()?
                .functions
                .iter()
                .filter(|g| g.kind == f)
                .map(|g| g.tokens)
                .collect(),
        )
    };
    let json = artifacts
        .map(|d| d.join("build.json").display().to_string())
        .unwrap_or_else(|| "build.json".into());
    let mut out = asked.clone();
    if let Some(built) = function_tokens(crate::layouts::REFERENCE, plan::FunctionKind::Verify) {
        let built = built.first().copied();
        match (verify_k, built) {
            // Only where the mode checks chunk1..4, whose functions they are.
            (None, _) if mode.kinds().contains(&crate::layouts::REFERENCE) => {
                out.verify_k = built
            }
            (Some(k), Some(b)) if k != b => bail!(
                "{json}: the build's chunk1..4 carry verify_qK with K = {b}, but --verify-k {k} was given; parity --artifacts checks the packages as built (drop --verify-k)"
            ),
            (Some(k), None) => bail!(
                "{json}: the build's chunk1..4 carry no verify_qK, but --verify-k {k} was given (drop --verify-k, or rebuild with it)"
            ),
            _ => {}
        }
    }
    if let Some(built) = function_tokens(plan::LayoutKind::Prefill, plan::FunctionKind::Prefill) {
        let mut built = built;
        built.sort_unstable_by(|x, y| y.cmp(x));
        match prefill_len {
            None if !asked.prefill_lens.is_empty() => out.prefill_lens = built,
            Some(_) if asked.prefill_lens != built => bail!(
                "{json}: the build's prefill packages carry prefill lengths {built:?}, but --prefill-len asks for {:?}; parity --artifacts checks the packages as built (drop --prefill-len)",
                asked.prefill_lens
            ),
            _ => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::LayoutKind;
    use crate::records::PassPipeline;
    use serde_json::json;

    #[test]
    fn the_environment_switches_default_on_and_refuse_other_values() {
        let conv = |vars: &[(&str, &str)]| {
            Env::of(vars).apply(ConversionSettings::shipped(
                64,
                true,
                Palettizer::Chunkforge,
                1,
            ))
        };
        let c = conv(&[]).unwrap();
        assert!(c.joint && c.mil_shortcuts);
        assert_eq!(c.writer, PackageWriter::Chunkforge);
        let c = conv(&[(WRITER_ENV, "")]).unwrap();
        assert_eq!(c.writer, PackageWriter::Chunkforge);
        let c = conv(&[
            (WRITER_ENV, "coremltools"),
            (SHORTCUTS_ENV, "off"),
            (JOINT_ENV, "off"),
        ])
        .unwrap();
        assert_eq!(c.writer, PackageWriter::Coremltools);
        assert!(!c.mil_shortcuts && !c.joint);
        let e = conv(&[(WRITER_ENV, "protobuf")]).unwrap_err().to_string();
        assert_eq!(
            e,
            "CHUNKFORGE_WRITER=\"protobuf\": expected chunkforge or coremltools"
        );
        let e = conv(&[(SHORTCUTS_ENV, "fast")]).unwrap_err().to_string();
        assert_eq!(e, "CHUNKFORGE_MIL_SHORTCUTS=\"fast\": expected on or off");
    }

    #[test]
    fn default_switches_are_not_recorded_and_others_are() {
        let record =
            |c: &ConversionSettings| ConversionSettings::recorded(c, serde_json::value::Serializer);
        let shipped = ConversionSettings::shipped(64, true, Palettizer::Chunkforge, 1);
        let v = record(&shipped).unwrap();
        assert!(
            v.get("writer").is_none() && v.get("mil_shortcuts").is_none(),
            "{v}"
        );
        // The seam sends every field: Python keeps no default of its own.
        let sent = serde_json::to_value(&shipped).unwrap();
        assert_eq!(
            (&sent["writer"], &sent["mil_shortcuts"]),
            (&json!("chunkforge"), &json!(true))
        );
        let other = Env::of(&[(WRITER_ENV, "coremltools"), (SHORTCUTS_ENV, "off")])
            .apply(shipped)
            .unwrap();
        let v = record(&other).unwrap();
        assert_eq!(
            (&v["writer"], &v["mil_shortcuts"]),
            (&json!("coremltools"), &json!(false))
        );
        let back: ConversionSettings = serde_json::from_value(v).unwrap();
        assert_eq!(back, other);
    }

    #[test]
    fn a_relative_checkpoint_dir_is_taken_relative_to_build_json() {
        let root = std::env::temp_dir().join(format!("cf-request-of-{}", std::process::id()));
        let out = root.join("out");
        std::fs::create_dir_all(root.join("ck")).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        let write_ctx = |dir: &str, ctx: u64| {
            let v = json!({
                "request": {"mode": "one", "split": null, "ctx": ctx},
                "settings": {"quantize": false},
                "checkpoint": {"dir": dir},
            });
            std::fs::write(out.join("build.json"), v.to_string()).unwrap();
        };
        let write = |dir: &str| write_ctx(dir, 64);
        write("../ck");
        let old = recorded(&out.join("build.json"), &None).unwrap();
        assert_eq!(old.hf_dir.unwrap(), out.join("../ck"));
        // A record from before joint conversions: each function was converted alone.
        assert!(!old.conversion.joint);
        let v = json!({
            "request": {"mode": "all", "split": null, "ctx": 64},
            "settings": {"quantize": true, "joint": true},
            "checkpoint": {"dir": "../ck"},
        });
        std::fs::write(out.join("build.json"), v.to_string()).unwrap();
        assert!(
            recorded(&out.join("build.json"), &None)
                .unwrap()
                .conversion
                .joint
        );
        write("../gone");
        let e = recorded(&out.join("build.json"), &None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("checkpoint.dir `../gone`") && e.contains("pass --hf-dir"),
            "{e}"
        );
        // A context no build could have had (--ctx refuses it) is refused here too.
        write_ctx("../ck", 1 << 40);
        let e = recorded(&out.join("build.json"), &None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("request.ctx 1099511627776 is out of range"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_recorded_build_reads_back_as_the_settings_it_was_made_with() {
        let root = std::env::temp_dir().join(format!("cf-recorded-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let mut settings = ConversionSettings::shipped(256, true, Palettizer::Coremltools, 3);
        settings.pass_pipeline = PassPipeline::Coremltools;
        settings.compose = false;
        settings.writer = PackageWriter::Coremltools;
        let v = json!({
            "request": {"mode": "two", "split": null, "ctx": 256, "verify_k": 2},
            "settings": settings,
            "checkpoint": {"dir": root},
        });
        std::fs::write(root.join("build.json"), v.to_string()).unwrap();
        let old = recorded(&root.join("build.json"), &None).unwrap();
        assert_eq!(old.conversion, settings);
        assert_eq!(
            (old.layout.mode, old.layout.verify_k),
            (Mode::Only(LayoutKind::Two), Some(2))
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
