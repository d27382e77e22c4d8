//! Random-weight Gemma 4 checkpoints: `chunkforge fixture`, and the built-in
//! default checkpoint used when no `--hf-dir` is given.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::progress;
use crate::py::calls;
use crate::staging;

/// Bumped whenever the fixture generator changes, so cached defaults are regenerated.
/// (v3: tokenizer files and generation_config.json added; weights unchanged.)
const DEFAULT_FIXTURE_VERSION: u32 = 3;

chunkforge_model::named! {
    /// The fixture's layer structure.
    pub enum Shape {
        /// 35 layers, full attention every 5th, 20 KV-shared layers, 1 KV head.
        E2b = "e2b",
        /// 42 layers, full attention every 6th, 18 KV-shared layers, 2 KV heads.
        E4b = "e4b",
    }
}

/// What the fixture generator was asked for (sent to `fixture.write_fixture_json`).
#[derive(Clone, Debug, Serialize)]
pub struct FixtureArgs {
    pub shape: Shape,
    pub seed: u64,
    pub multimodal: bool,
    pub shards: usize,
    pub sliding_window: usize,
    pub vocab_size: usize,
    pub full_width: bool,
}

/// What the generator wrote.
#[derive(Clone, Debug, Deserialize)]
pub struct FixtureInfo {
    pub tensors: u64,
    pub parameters: u64,
}

/// Writes a checkpoint into `out` (which must not exist yet, or be empty) via a
/// temporary sibling folder renamed into place when complete.
pub fn write(out: &Path, args: &FixtureArgs, verbose: bool) -> Result<FixtureInfo> {
    if out.exists() {
        let empty = out.is_dir()
            && fs::read_dir(out)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
        if !empty {
            bail!(
                "{}: already exists and is not an empty folder; choose a new --out",
                out.display()
            );
        }
        fs::remove_dir(out)
            .with_context(|| format!("{}: cannot replace the empty folder", out.display()))?;
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).with_context(|| format!("{}: cannot create", parent.display()))?;
    let staging = staging::Staging::new(parent)?;
    let tmp = staging.dir.join("checkpoint");
    fs::create_dir(&tmp)?;
    let sp = progress::spinner(format!(
        "writing {} fixture checkpoint to {}",
        args.shape.as_str(),
        out.display()
    ));
    #[derive(Serialize)]
    struct Request<'a> {
        out_dir: &'a str,
        #[serde(flatten)]
        args: &'a FixtureArgs,
    }
    let out_dir = tmp.to_string_lossy();
    let info = calls::call(
        "fixture",
        "write_fixture_json",
        &Request {
            out_dir: &out_dir,
            args,
        },
        verbose,
    );
    sp.finish_and_clear();
    let info = info?;
    staging
        .publish(&[(tmp, out.to_path_buf())])
        .with_context(|| format!("moving the checkpoint into {}", out.display()))?;
    staging.finish()?;
    Ok(info)
}

/// The built-in default: a deterministic tiny E2B-shaped checkpoint, generated
/// once into the cache folder.
pub fn default_checkpoint(verbose: bool) -> Result<PathBuf> {
    let dir = crate::cache_dir::cache_dir()?
        .join("fixtures")
        .join(format!("default-e2b-v{DEFAULT_FIXTURE_VERSION}"));
    if dir.join("config.json").exists() {
        return Ok(dir);
    }
    eprintln!("no --hf-dir or GEMMA4_HF_DIR given: generating the built-in default checkpoint (once) at {}", dir.display());
    let args = FixtureArgs {
        shape: Shape::E2b,
        seed: 0,
        multimodal: false,
        shards: 1,
        sliding_window: 512,
        vocab_size: 512,
        full_width: false,
    };
    match write(&dir, &args, verbose) {
        Ok(_) => Ok(dir),
        // Another chunkforge process generated it at the same time.
        Err(_) if dir.join("config.json").exists() => Ok(dir),
        Err(e) => Err(e),
    }
}
