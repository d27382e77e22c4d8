//! `chunkforge plan`: the chunk plan, as text or as the JSON every other step reads.

use anyhow::Result;

use super::{plan_for, resolve_checkpoint, ExitStatus, Layout};
use crate::cli::{LayoutArgs, ModelArgs};
use crate::plan::render;

pub fn run(
    model: &ModelArgs,
    layout: &LayoutArgs,
    json: bool,
    verbose: bool,
) -> Result<ExitStatus> {
    let dir = resolve_checkpoint(model.hf_dir.as_deref(), verbose)?;
    let (_, plan) = plan_for(&dir, &Layout::of(layout))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", render(&plan));
    }
    Ok(ExitStatus::Success)
}
