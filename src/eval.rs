//! `chunkforge eval`: what a release (or a build) costs against its source
//! checkpoint, layout by layout, over a text: perplexity of the packages'
//! own programs and of transformers, KL, top-1 agreement and the positions
//! of disagreement (python/chunkforge_py/quality/text.py), and with `--fp16`
//! the programs' fp16 range (mil/fp16range.py). The folder is opened and
//! checked here, the source checkpoint found and checked to be the one the
//! packages were made from; the report is [`EvalReport`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::folder::{PackageFiles, ReleaseFolder};
use crate::hashing;
use crate::layouts::{spec, Purpose, RunLayout};
use crate::manifest::{Build, MANIFEST_FILE};
use crate::plan;
use crate::py::calls;
use crate::py::contract::RunFiles;
use crate::py::contract::{CheckpointFiles, EvalLayout, EvalRequest};
use crate::quality::{EvalReport, EvalResult, EvalText, EVAL_FORMAT};
use crate::records::{ParityCheckpoint, ToolVersions};
use crate::sidefiles::{self, SideFilesRequest};
use crate::staging::Staging;

/// The project's own text, scored when no `--text` is given.
pub const DEFAULT_TEXT: &str = include_str!("../eval/default.txt");

/// What to evaluate.
pub struct EvalOptions<'a> {
    /// A release folder or a build folder.
    pub target: &'a Path,
    /// The text file (None: [`DEFAULT_TEXT`]).
    pub text: Option<&'a Path>,
    /// The source checkpoint (None: the build's, or the built-in one when
    /// it is the release's).
    pub hf_dir: Option<&'a Path>,
    /// Tokens of the text scored at most (None: the context length).
    pub max_tokens: Option<usize>,
    /// Round every fp16 op output to fp16, and record the fp16 range.
    pub fp16: bool,
    pub verbose: bool,
}

/// The checkpoint packages were made from, whose `config.json` is `config`
/// (the release's `hf_model/config.json`): `hf_dir` if given, else the
/// built-in checkpoint when it is that one. Refused when its config.json is
/// another.
pub fn source_of(config: &Path, hf_dir: Option<&Path>) -> Result<PathBuf> {
    let want = hashing::sha256_file(config)?;
    let dir = match hf_dir {
        Some(d) => {
            crate::checkpoint::check_folder(d)?;
            d.to_path_buf()
        }
        None => {
            let builtin = crate::builtin::dir();
            if hashing::sha256_file(&builtin.join("config.json"))
                .ok()
                .as_ref()
                != Some(&want)
            {
                bail!(
                    "{}: not the built-in checkpoint's config: pass the checkpoint the release was made from with --hf-dir (or GEMMA4_HF_DIR)",
                    config.display()
                );
            }
            crate::builtin::checkpoint()?
        }
    };
    let got = hashing::sha256_file(&dir.join("config.json"))?;
    if got != want {
        bail!(
            "{}: not the config.json of {} (sha256 {got}, the packages' is {want}): the source must be the checkpoint the packages were made from",
            dir.join("config.json").display(),
            config.display()
        );
    }
    Ok(dir)
}

/// The text to read: its contents and how the report names it.
pub fn text_of(path: Option<&Path>) -> Result<(String, EvalText)> {
    let (text, name) = match path {
        None => (DEFAULT_TEXT.to_string(), "default".to_string()),
        Some(p) => {
            let bytes = std::fs::read(p)
                .with_context(|| format!("{}: cannot read the text", p.display()))?;
            let text = String::from_utf8(bytes)
                .map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", p.display()))?;
            if text.trim().is_empty() {
                bail!("{}: the text is empty", p.display());
            }
            (text, p.display().to_string())
        }
    };
    let sha256 = hashing::hex(&<sha2::Sha256 as sha2::Digest>::digest(text.as_bytes()));
    Ok((text, EvalText { name, sha256 }))
}

/// The side files by the names `run` reads, `side` giving each one's path.
fn run_files(side: impl Fn(&str) -> PathBuf, tokenizer: Option<PathBuf>) -> RunFiles {
    RunFiles::new(
        &|name| side(name).to_string_lossy().into_owned(),
        tokenizer.map_or_else(String::new, |p| p.to_string_lossy().into_owned()),
    )
}

/// What the evaluation of one folder needs: the request's parts, and the
/// folder the side files of a build are made in (removed when done).
struct Target {
    kind: &'static str,
    precision: &'static str,
    dims: plan::Dims,
    layouts: Vec<EvalLayout>,
    files: RunFiles,
    source: PathBuf,
    _staging: Option<Staging>,
}

fn release_target(folder: &ReleaseFolder, hf_dir: Option<&Path>) -> Result<Target> {
    folder.check_files()?;
    let source = source_of(&folder.dir.join("hf_model/config.json"), hf_dir)?;
    let mut layouts = Vec::new();
    for d in &folder.manifest.decode_layouts {
        let plan = folder.plan(RunLayout::Only(d.kind), None)?;
        let packages = plan
            .decode
            .chunks
            .iter()
            .map(|c| (c.name.clone(), plan.packages[&c.name].clone()))
            .collect();
        layouts.push(EvalLayout {
            layout: plan.decode,
            packages,
        });
    }
    let tokenizer = folder.tokenizer();
    Ok(Target {
        kind: "release",
        precision: if folder.manifest.settings.quantize {
            "INT4"
        } else {
            "FP16"
        },
        dims: plan::Dims {
            embed_scale: folder.embed_scale,
            per_layer_embed_scale: folder.per_layer_embed_scale,
            ..plan::dims(&folder.cfg, folder.context_length)
        },
        layouts,
        files: run_files(|n| folder.side_file(n), tokenizer),
        source,
        _staging: None,
    })
}

/// A build: its packages as they are, the side files made from its
/// checkpoint into a staging folder inside it, as `package` makes them.
fn build_target(dir: &Path, hf_dir: Option<&Path>) -> Result<Target> {
    let build = Build::load(dir)?;
    let source = match hf_dir {
        Some(d) => {
            crate::checkpoint::check_folder(d)?;
            d.to_path_buf()
        }
        None => PathBuf::from(&build.record.checkpoint.dir),
    };
    let config = source.join("config.json");
    let sha = hashing::sha256_file(&config).with_context(|| {
        format!(
            "{}: the build's checkpoint; pass --hf-dir if it moved",
            config.display()
        )
    })?;
    if sha != build.record.checkpoint.config_sha256 {
        bail!(
            "{}: not the checkpoint {} was built from (config.json sha256 {sha}, build.json has {})",
            config.display(),
            dir.join("build.json").display(),
            build.record.checkpoint.config_sha256
        );
    }
    let cfg = TextConfig::load(&source)?;
    let ckpt = Checkpoint::open(&source, &cfg)?;
    let ctx = build.record.settings.ctx;
    let staging = Staging::new(dir)?;
    sidefiles::write_side_files(&SideFilesRequest {
        hf_dir: &source,
        cfg: &cfg,
        checkpoint: &ckpt,
        context_length: ctx,
        rope_positions: ctx,
        model_name: "eval",
        dest: &staging.dir,
        repository: false,
    })?;
    let mut layouts = Vec::new();
    for l in &build.record.plan.layouts {
        if spec(l.kind).purpose != Purpose::Decode {
            continue;
        }
        let mut packages = BTreeMap::new();
        for c in &l.chunks {
            let path = dir.join(format!("{}.mlpackage", c.name));
            let blob = path.join(crate::downloader::PACKAGE_BLOB);
            if !blob.is_file() {
                bail!(
                    "{}: missing: the build's {} layout needs it",
                    blob.display(),
                    l.kind
                );
            }
            let weights = blob.parent().map(Path::to_path_buf).unwrap_or_default();
            packages.insert(c.name.clone(), PackageFiles { path, weights });
        }
        layouts.push(EvalLayout {
            layout: l.clone(),
            packages,
        });
    }
    let tokenizer = Some(source.join("tokenizer.json")).filter(|p| p.is_file());
    let side = staging.dir.clone();
    Ok(Target {
        kind: "build",
        precision: if build.record.settings.quantize {
            "INT4"
        } else {
            "FP16"
        },
        dims: plan::dims(&cfg, ctx),
        layouts,
        files: run_files(|n| side.join(n), tokenizer),
        source,
        _staging: Some(staging),
    })
}

/// Evaluates `o.target` (module docstring).
pub fn eval(o: &EvalOptions) -> Result<EvalReport> {
    let (text, named) = text_of(o.text)?;
    let target = if o.target.join(MANIFEST_FILE).is_file() {
        release_target(&ReleaseFolder::open(o.target)?, o.hf_dir)?
    } else if o.target.join("build.json").is_file() {
        build_target(o.target, o.hf_dir)?
    } else {
        bail!(
            "{}: neither a release folder (manifest.json) nor a build folder (build.json)",
            o.target.display()
        );
    };
    if target.layouts.is_empty() {
        bail!("{}: no decode layout to evaluate", o.target.display());
    }
    let cfg = TextConfig::load(&target.source)?;
    let ckpt = Checkpoint::open(&target.source, &cfg)?;
    let ctx = target.dims.ctx;
    let max_tokens = o.max_tokens.unwrap_or(ctx);
    if max_tokens < 2 || max_tokens > ctx {
        bail!("--max-tokens {max_tokens}: between 2 and the context length ({ctx})");
    }
    let req = EvalRequest {
        target: o.target.display().to_string(),
        dims: target.dims.clone(),
        layouts: target.layouts,
        files: target.files,
        text: &text,
        max_tokens,
        checkpoint: CheckpointFiles::of(&ckpt),
        config_path: target
            .source
            .join("config.json")
            .to_string_lossy()
            .into_owned(),
        fp16: o.fp16,
    };
    crate::py::env::activate(o.verbose)?;
    let sp = crate::progress::spinner(format!(
        "eval: {} layouts of {} against transformers",
        req.layouts.len(),
        o.target.display()
    ));
    let result = calls::with_progress::<calls::Evaluate>(
        &req,
        o.verbose,
        crate::progress::phases(&sp, "eval"),
    );
    sp.finish_and_clear();
    let result: EvalResult = result?;
    let dir = std::path::absolute(&target.source)
        .with_context(|| format!("{}: cannot make the path absolute", target.source.display()))?;
    Ok(EvalReport {
        format: EVAL_FORMAT.into(),
        target: o.target.display().to_string(),
        kind: target.kind.into(),
        precision: target.precision.into(),
        fp16: o.fp16,
        text: named,
        checkpoint: ParityCheckpoint {
            dir: dir.to_string_lossy().into_owned(),
            config_sha256: hashing::sha256_file(&target.source.join("config.json"))?,
            weights: Some(hashing::weights_digest(&ckpt)?),
        },
        tool: ToolVersions {
            chunkforge: env!("CARGO_PKG_VERSION").into(),
            python: crate::py::env::versions(o.verbose)?,
        },
        result,
    })
}

/// The report as a table.
pub fn render(r: &EvalReport) -> String {
    let res = &r.result;
    let mut out = format!(
        "eval: {} ({}, {} packages, {} arithmetic), text {} ({} tokens, {} positions scored)\n",
        r.target,
        r.kind,
        r.precision,
        if r.fp16 { "fp16" } else { "fp32" },
        r.text.name,
        res.tokens,
        res.positions
    );
    out += &format!(
        "source (transformers, fp32): perplexity {:.4}\n\n",
        res.source.perplexity
    );
    out += &format!(
        "{:<7} {:>10} {:>9} {:>9} {:>15} {:>7}  disagreements (position: source margin)\n",
        "layout", "perplexity", "vs source", "KL mean", "KL max (pos)", "top-1"
    );
    for l in &res.layouts {
        let change = (l.perplexity / res.source.perplexity - 1.0) * 100.0;
        let shown: Vec<String> = l
            .disagreements
            .iter()
            .take(6)
            .map(|d| format!("{}: {:.2}", d.position, d.source_margin))
            .collect();
        let more = l.disagreements.len().saturating_sub(shown.len());
        out += &format!(
            "{:<7} {:>10.4} {:>+8.2}% {:>9.5} {:>8.4} ({:>4}) {:>6.1}%  {}{}{}\n",
            l.layout.as_str(),
            l.perplexity,
            change,
            l.kl_mean,
            l.kl_max,
            l.kl_max_position,
            l.top1 * 100.0,
            l.disagreements.len(),
            if shown.is_empty() {
                String::new()
            } else {
                format!(" ({})", shown.join(", "))
            },
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    if let Some(range) = &res.fp16_range {
        out += &format!("\n{}\n", range.line());
    }
    out
}
