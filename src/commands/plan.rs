//! `chunkforge plan`: the chunk plan, as text or as the JSON every other step reads.

use std::fmt::Write as _;

use anyhow::Result;

use super::{plan_for, resolve_checkpoint, ExitStatus, Layout};
use crate::cli::{LayoutArgs, ModelArgs};
use crate::plan::{Plan, TensorSpec};

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

/// Human-readable rendering for `chunkforge plan`.
fn render(plan: &Plan) -> String {
    let d = &plan.dims;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model: {} layers, hidden {}, heads {}/{} kv, head dim {} sliding / {} full, window {}, ctx {}",
        d.num_hidden_layers,
        d.hidden_size,
        d.num_attention_heads,
        d.num_kv_heads_sliding,
        d.head_dim_sliding,
        d.head_dim_full,
        d.sliding_window,
        d.ctx
    );
    let p = |x: Option<usize>| x.map_or("none".to_string(), |v| format!("L{v}"));
    let _ = writeln!(
        s,
        "KV sharing: layers {}..{} read shared KV; producers: sliding {} (kv13), full {} (kv14)",
        d.kv_start,
        d.num_hidden_layers - 1,
        p(d.producer_sliding),
        p(d.producer_full)
    );
    for l in &plan.layouts {
        let n = l.chunks.len();
        let _ = writeln!(
            s,
            "\nlayout {} ({n} chunk{})",
            l.kind,
            if n == 1 { "" } else { "s" }
        );
        for c in &l.chunks {
            let mut roles = Vec::new();
            if c.computes_per_layer_input {
                roles.push("PLE projection".to_string());
            }
            for e in &c.emits {
                roles.push(format!("emits {} (L{})", e.alias, e.layer));
            }
            for e in &c.consumes {
                roles.push(format!("reads {} (L{})", e.alias, e.layer));
            }
            if c.has_head {
                roles.push("norm + head".to_string());
            }
            let _ = writeln!(
                s,
                "  {:<16} layers {:>2}-{:<2} ({:>2}) KV slots: {} sliding {:?}, {} full {:?}; {}",
                c.name,
                c.first_layer,
                c.last_layer,
                c.layer_count(),
                c.sliding_slots.len(),
                c.sliding_slots,
                c.full_slots.len(),
                c.full_slots,
                roles.join(", ")
            );
            let io = |ts: &[TensorSpec]| {
                ts.iter()
                    .map(|t| format!("{}{:?}", t.name, t.shape))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let _ = writeln!(s, "      in:  {}", io(&c.inputs));
            let _ = writeln!(s, "      out: {}", io(&c.outputs));
        }
        if !l.kv_slot_map.is_empty() {
            let _ = writeln!(
                s,
                "  prefill KV copy (four-chunk -> {}): {} slots",
                l.kind,
                l.kv_slot_map.len()
            );
            for m in &l.kv_slot_map {
                let _ = writeln!(
                    s,
                    "      L{:<2} {:<7} {}[{}] -> {}[{}]",
                    m.layer, m.attention, m.from_chunk, m.from_slot, m.to_chunk, m.to_slot
                );
            }
        }
    }
    let _ = writeln!(s, "\nruntime feed:");
    for n in &plan.contract_notes {
        let _ = writeln!(s, "  {n}");
    }
    for w in &plan.warnings {
        let _ = writeln!(s, "\nwarning: {w}");
    }
    s
}
