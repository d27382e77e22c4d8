//! `DEVICE_RUNBOOK.md`: the bench a person runs on the iPhone for this
//! release, generated from its manifest: the decode layouts it holds, what
//! to move aside to force each one, the environment, the lines to record,
//! the runs, the targets (`targets`) and the `chunkforge
//! device-report` command that turns the logs into a verdict. The same
//! manifest gives the same bytes.

use std::fmt::Write;

use chunkforge_model::layouts::{spec, LoadLine, NameRule, LAYOUTS, REFERENCE};
use chunkforge_model::plan::{LayoutKind, ANE_STABLE_LAYERS};
use chunkforge_model::records::Verdict;

use super::device_log::{
    show_template, ANE_COMPILE_FAILED, AUDIT_ALL, AUDIT_SOME, AUDIT_SUMMARY, KV_CONTEXT_LINE,
    LAYOUT_LINE, PROFILE_LINES,
};
use super::device_report::bench_order;
use super::runtime_layout::{move_aside, runtime_layout, Runtime, RuntimeLayout, RUNTIME_LAYOUTS};
use super::targets::{
    fmt_number, fmt_percent, tok_target, BENCH_CONTEXT, COLD_RUNS, CONTROL, MAX_OFF_NEURAL_ENGINE,
};
use crate::downloader::{self, Client, CORE_FILES, FOLDER_NAME};
use crate::manifest::{self, Manifest};

/// What the run book needs from a manifest.
#[derive(Clone, Debug)]
pub struct RunbookFacts {
    pub model_id: String,
    pub version: String,
    /// `release.layout`: four, three, two, one or all.
    pub release_layout: String,
    /// `settings.ctx`.
    pub context: usize,
    /// `compiled.mlmodelc`: `.mlmodelc` folders beside the packages.
    pub compiled: bool,
    /// `parity.ok`, when a parity report is embedded.
    pub parity_ok: Option<bool>,
    /// `parity.verdict` (`inconclusive`: signed with `--accept-inconclusive-parity`).
    pub parity_verdict: Option<Verdict>,
    /// Every package: name, first and last layer (manifest order).
    pub packages: Vec<(String, usize, usize)>,
    /// Every package's folder in the release (`swa/chunk1.mlpackage`,
    /// `prefill/chunk1.mlmodelc`, `merged_full.mlpackage`), by name.
    pub package_files: Vec<(String, String)>,
    /// `decode_layouts[].kind`, with their packages.
    pub decode_layouts: Vec<(LayoutKind, Vec<String>)>,
    /// The first step for compiled models no device has loaded ([`super::load_step`]).
    pub load_step: Option<String>,
}

impl RunbookFacts {
    /// The facts of a manifest.
    pub fn from_manifest(m: &Manifest) -> Self {
        RunbookFacts {
            model_id: m.model.id.clone(),
            version: m.release.version.clone(),
            release_layout: m.release.layout.to_string(),
            context: m.settings.ctx,
            compiled: m.compiled.mlmodelc,
            parity_ok: m.parity.as_ref().map(|p| p.ok()),
            parity_verdict: m.parity.as_ref().map(|p| p.summary.verdict()),
            packages: m
                .chunks
                .iter()
                .map(|c| (c.name.clone(), c.first_layer, c.last_layer))
                .collect(),
            package_files: m
                .chunks
                .iter()
                .map(|c| (c.name.clone(), c.file.clone()))
                .collect(),
            decode_layouts: m
                .decode_layouts
                .iter()
                .map(|l| (l.kind, l.chunks.clone()))
                .collect(),
            load_step: super::load_step::render(m),
        }
    }

    fn has(&self, package: &str) -> bool {
        self.packages.iter().any(|p| p.0 == package)
    }

    /// Package `name`'s folder in the release.
    fn file(&self, name: &str) -> String {
        self.package_files
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(
                || manifest::package_file(name, self.compiled),
                |(_, f)| f.clone(),
            )
    }

    /// Package `name`'s folder in the model folder: its local name, compiled
    /// or not as the release holds it.
    fn local(&self, name: &str) -> String {
        let file = self.file(name);
        let ext = file.rsplit_once('.').map_or("mlpackage", |(_, e)| e);
        format!("{name}.{ext}")
    }

    fn layers(&self, package: &str) -> Option<usize> {
        self.packages
            .iter()
            .find(|p| p.0 == package)
            .map(|p| p.2 + 1 - p.1)
    }

    /// The runtime builds the bench needs: those that load the layouts
    /// other than the control (the control runs on each).
    pub fn runtimes(&self) -> Vec<Runtime> {
        let mut out: Vec<Runtime> = Vec::new();
        for l in self.layouts().iter().filter(|l| l.kind != CONTROL) {
            for r in &l.runtimes {
                if !out.contains(r) {
                    out.push(*r);
                }
            }
        }
        out.sort();
        out
    }

    /// The runtime's layouts whose decode packages are all in the release,
    /// in bench order.
    pub fn layouts(&self) -> Vec<&'static RuntimeLayout> {
        bench_order()
            .into_iter()
            .filter(|l| l.decode.iter().all(|p| self.has(p)))
            .collect()
    }
}

fn code_list<S: AsRef<str>>(names: &[S]) -> String {
    names
        .iter()
        .map(|n| format!("`{}`", n.as_ref()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A runtime build's line for a layout it loads (`name`: the layout's runtime name).
fn load_line(line: LoadLine, name: &str) -> String {
    match line {
        LoadLine::Merged => LAYOUT_LINE.replace("{}-chunk", name),
        LoadLine::Main(t) => show_template(t),
    }
}

/// How the runtime's layout line reads for `kind` (each runtime build's form).
fn layout_lines(kind: LayoutKind) -> String {
    let Some(rt) = spec(kind).runtime else {
        return "?".into();
    };
    let mut lines = rt.load_lines.iter();
    let mut out = lines
        .next()
        .map(|l| format!("`{}`", load_line(*l, rt.name)))
        .unwrap_or_default();
    for l in lines {
        out.push_str(&format!(
            " ({} runtime: `{}`)",
            l.runtime(),
            load_line(*l, rt.name)
        ));
    }
    out
}

/// `two- and one-chunk`: runtime names joined, a shared `-suffix` said once.
fn join_names(names: &[&str]) -> String {
    let suffix = names
        .last()
        .and_then(|n| n.rfind('-').map(|i| &n[i..]))
        .filter(|s| names.iter().all(|n| n.ends_with(s)))
        .unwrap_or("");
    let mut parts: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let last = parts.pop().unwrap_or_default();
    if parts.is_empty() {
        return last;
    }
    let parts: Vec<String> = parts
        .iter()
        .map(|p| format!("{}-", &p[..p.len() - suffix.len()]))
        .collect();
    format!("{} and {last}", parts.join(", "))
}

/// The run book's note on runtime build `runtime`: which layouts need it,
/// and the layout line it prints.
fn runtime_note(runtime: Runtime) -> String {
    let needs: Vec<_> = LAYOUTS
        .iter()
        .filter(|l| l.kind != CONTROL)
        .filter_map(|l| {
            Some((
                l.runtime?,
                l.runtime?
                    .load_lines
                    .iter()
                    .find(|x| x.runtime() == runtime)?,
            ))
        })
        .collect();
    let names: Vec<&str> = needs.iter().map(|(rt, _)| rt.name).collect();
    let mut prints: Vec<String> = Vec::new();
    for (_, line) in &needs {
        let text = match line {
            LoadLine::Merged => show_template(LAYOUT_LINE),
            LoadLine::Main(t) => show_template(t),
        };
        if !prints.contains(&text) {
            prints.push(text);
        }
    }
    let control = spec(CONTROL).runtime.and_then(|rt| {
        let line = rt.load_lines.iter().find(|x| x.runtime() == runtime)?;
        match line {
            LoadLine::Main(t) => Some(format!(" (and `{}` for {})", show_template(t), rt.name)),
            LoadLine::Merged => None,
        }
    });
    format!(
        "- The {} layout{} {} {}; it prints {}{}.",
        join_names(&names),
        if names.len() > 1 { "s" } else { "" },
        if names.len() > 1 { "need" } else { "needs" },
        runtime.describe(),
        code_list(&prints),
        control.unwrap_or_default()
    )
}

/// The names of the layouts (other than the control) `runtime` loads.
fn layouts_on(layouts: &[&RuntimeLayout], runtime: Runtime) -> String {
    layouts
        .iter()
        .filter(|l| l.kind != CONTROL && l.runtimes.contains(&runtime))
        .map(|l| l.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The bench's command lines for moving `packages` out of the model folder
/// (under their local names) and back.
fn moves(f: &RunbookFacts, packages: &[&str]) -> (String, String) {
    let out: Vec<String> = packages
        .iter()
        .map(|p| format!("\"$MODEL_DIR/{}\"", f.local(p)))
        .collect();
    let back: Vec<String> = packages
        .iter()
        .map(|p| format!("\"$STASH/{}\"", f.local(p)))
        .collect();
    (
        format!("mkdir -p \"$STASH\"\nmv {} \"$STASH/\"", out.join(" ")),
        format!("mv {} \"$MODEL_DIR/\"", back.join(" ")),
    )
}

/// The shell lines that make the model folder from the release: every
/// package under its local name (`swa/chunk1.mlpackage` ->
/// `chunk1.mlpackage`, `prefill/chunk1.mlpackage` -> `prefill_chunk1.mlpackage`),
/// the blobs the app's download shares into packages stored without one
/// (only where the package has none, as `finishDownload` does), the side
/// files and `hf_model/` at their local paths and the encoders the release
/// carries: the folder the app's runtime reads, as `client-check
/// --materialize` writes an entry's download of it.
fn model_folder_lines(f: &RunbookFacts) -> String {
    let mut lines = vec!["mkdir \"$MODEL_DIR\"".to_string()];
    for (name, file) in &f.package_files {
        lines.push(format!(
            "cp -R \"$RELEASE/{file}\" \"$MODEL_DIR/{}\"",
            f.local(name)
        ));
    }
    for &(package, from) in downloader::entry(Client::Main).shares {
        if !f.has(package) || !f.has(from) {
            continue;
        }
        let to = format!("$MODEL_DIR/{}", f.local(package));
        let to = format!("{to}/{}", downloader::blob_in(&to));
        let src = format!("$MODEL_DIR/{}", f.local(from));
        let src = format!("{src}/{}", downloader::blob_in(&src));
        let dir = to.rsplit_once('/').map_or(to.as_str(), |(d, _)| d);
        lines.push(format!(
            "[ -e \"{to}\" ] || {{ mkdir -p \"{dir}\" && cp \"{src}\" \"{to}\"; }}"
        ));
    }
    let hf = format!("{}/", crate::paths::HF_MODEL_DIR);
    for (remote, local, _) in CORE_FILES.iter().filter(|(r, _, _)| !r.starts_with(&hf)) {
        lines.push(format!("cp \"$RELEASE/{remote}\" \"$MODEL_DIR/{local}\""));
    }
    lines.push(format!(
        "cp -R \"$RELEASE/{0}\" \"$MODEL_DIR/{0}\"",
        crate::paths::HF_MODEL_DIR
    ));
    // Not read by the app; `chunkforge run "$MODEL_DIR"` reads the contracts in it.
    lines.push(format!(
        "cp \"$RELEASE/{0}\" \"$MODEL_DIR/{0}\"",
        crate::manifest::MANIFEST_FILE
    ));
    let encoders: Vec<&str> = downloader::all_encoder_files()
        .iter()
        .map(|e| e.path)
        .collect();
    lines.push(format!(
        "for f in {}; do [ ! -e \"$RELEASE/$f\" ] || cp -R \"$RELEASE/$f\" \"$MODEL_DIR/$f\"; done",
        encoders.join(" ")
    ));
    lines.join("\n")
}

/// The shell line that copies the model folder into the app's container on
/// the device, where its `ModelDownloader` keeps the entry's folder.
fn device_copy_line() -> String {
    format!(
        "xcrun devicectl device copy to --device \"$DEVICE\" --domain-type appDataContainer --domain-identifier \"$APP_ID\" --source \"$MODEL_DIR\" --destination Documents/Models/{FOLDER_NAME} --remove-existing-content true"
    )
}

/// The run book's text.
pub fn render(f: &RunbookFacts) -> String {
    let mut s = String::new();
    let layouts = f.layouts();
    let runtimes = f.runtimes();
    intro(&mut s, f);
    s.push_str(f.load_step.as_deref().unwrap_or_default());
    layouts_in_release(&mut s, f, &layouts);
    before_the_bench(&mut s, f);
    environment(&mut s);
    forcing_each_layout(&mut s, f, &layouts, &runtimes);
    runs(&mut s, f);
    lines_the_verdict_reads(&mut s, &layouts);
    targets(&mut s, &layouts);
    verdict(&mut s, &layouts, &runtimes);
    free_running_gate(&mut s, &layouts);
    s
}

/// `writeln!` to the run book (a String: it cannot fail).
macro_rules! line {
    ($s:ident) => { writeln!($s).expect("writing to a String") };
    ($s:ident, $($t:tt)*) => { writeln!($s, $($t)*).expect("writing to a String") };
}

/// The title and what the run book is for.
fn intro(s: &mut String, f: &RunbookFacts) {
    line!(s, "# Device run book: {} {}", f.model_id, f.version);
    line!(s);
    line!(s,
        "Generated by `chunkforge package` from this release's `manifest.json` ({} release, context length {}). It is signed with the release: `chunkforge verify` checks it like every other file.",
        f.release_layout, f.context
    );
    line!(s);
    line!(s,
        "It measures each decode layout of this release on the device: whether the Neural Engine loads it, how much of it the compute plan keeps on the Neural Engine, and its decode tok/s against the targets below. `chunkforge device-report` turns the logs into the verdict."
    );
    line!(s);
}

/// The layouts the release holds, their packages and what else stays in the folder.
fn layouts_in_release(s: &mut String, f: &RunbookFacts, layouts: &[&RuntimeLayout]) {
    line!(s, "## Layouts in this release");
    line!(s);
    line!(s, "| Layout | Decode packages | Layers per package | The runtime picks it when the folder holds |");
    line!(s, "|---|---|---|---|");
    for l in layouts {
        let layers: Vec<String> = l
            .decode
            .iter()
            .map(|p| f.layers(p).map_or("?".into(), |n| n.to_string()))
            .collect();
        let when = if l.selected_by.is_empty() {
            "none of the packages that select another layout".to_string()
        } else {
            l.selected_by
                .iter()
                .map(|p| format!("`{p}`"))
                .collect::<Vec<_>>()
                .join(" and ")
        };
        line!(
            s,
            "| {}{} | {} | {} | {when} |",
            l.name,
            if l.kind == CONTROL { " (control)" } else { "" },
            code_list(&l.decode),
            layers.join(", ")
        );
    }
    line!(s);
    let big: Vec<String> = layouts
        .iter()
        .flat_map(|l| l.decode.iter())
        .filter_map(|p| Some((p, f.layers(p).filter(|n| *n > ANE_STABLE_LAYERS)?)))
        .map(|(p, n)| format!("`{p}` ({n})"))
        .fold(Vec::new(), |mut v, x| {
            if !v.contains(&x) {
                v.push(x);
            }
            v
        });
    if !big.is_empty() {
        line!(s,
            "- Above {ANE_STABLE_LAYERS} layers, the historic stable ceiling of one Neural Engine function: {}. A 35-layer function failed to compile for the iPhone 17 Pro Neural Engine while 15 and 20 layers compiled: watch these for the Neural Engine load failure and their compute plan.",
            big.join(", ")
        );
    }
    let span = |kind: LayoutKind| {
        let names = spec(kind).package_names();
        match (names.first(), names.last()) {
            (Some(a), Some(z)) => format!("`{a}`..`{z}`"),
            _ => String::new(),
        }
    };
    let mut keep = vec![span(REFERENCE)];
    if spec(LayoutKind::Prefill)
        .package_names()
        .first()
        .is_some_and(|p| f.has(p))
    {
        keep.push(span(LayoutKind::Prefill));
    }
    line!(s,
        "- {} stay in the folder for every layout: the runtime prefills and verifies speculative drafts with them, and falls back to {} for decode.",
        keep.join(" and "),
        spec(REFERENCE).range()
    );
    for l in layouts {
        let row = spec(l.kind);
        if !row.borrows_first {
            continue;
        }
        // The layout's first chunk is the reference's own package: no copy
        // of it is built, and one left from an older release is never loaded.
        let first = l.decode.first().cloned().unwrap_or_default();
        let copy = match row.names {
            NameRule::Numbered { prefix, suffix } => format!("{prefix}1{suffix}"),
            _ => String::new(),
        };
        line!(
            s,
            "- The {} decode runs {}: its first package is the reference's `{first}` itself{}.",
            l.name,
            l.decode
                .iter()
                .map(|p| format!("`{p}`"))
                .collect::<Vec<_>>()
                .join(" + "),
            if !copy.is_empty() && f.has(&copy) {
                format!("; `{copy}` ships too (an older build's copy of it), and the runtime never loads it")
            } else {
                String::new()
            }
        );
    }
    for runtime in Runtime::ALL {
        let needed = layouts
            .iter()
            .any(|l| l.kind != CONTROL && l.runtimes.contains(runtime));
        if needed {
            line!(s, "{}", runtime_note(*runtime));
        }
    }
    for (kind, chunks) in &f.decode_layouts {
        if runtime_layout(*kind).is_none() {
            line!(
                s,
                "- Decode layout `{kind}` ({}) is not one the runtime loads; this bench skips it.",
                code_list(chunks)
            );
        }
    }
    line!(s);
}

/// Verify, the parity the manifest embeds, the model folder, the copy to the device.
fn before_the_bench(s: &mut String, f: &RunbookFacts) {
    line!(s, "## Before the bench (on the Mac)");
    line!(s);
    line!(s,
        "The shell lines below read `RELEASE` (this release folder), `PUBLIC_KEY` (its public key), `MODEL_DIR` (a new folder: the model folder they make) and `STASH` (any folder outside it), and for the copy to the device `DEVICE` (the iPhone's identifier, from `xcrun devicectl list devices`) and `APP_ID` (the app's bundle identifier)."
    );
    line!(s);
    line!(
        s,
        "1. The folder that goes to the device comes from this signed release:"
    );
    line!(s);
    line!(s, "```sh");
    line!(
        s,
        "chunkforge verify \"$RELEASE\" --public-key \"$PUBLIC_KEY\""
    );
    line!(s, "```");
    line!(s);
    line!(s,
        "2. Parity: {}",
        match (f.parity_ok, f.parity_verdict) {
            (Some(true), _) => "`manifest.json` embeds a passed parity report.",
            (Some(false), Some(Verdict::Inconclusive)) => "`manifest.json` embeds an INCONCLUSIVE parity report: the checkpoint is ill-conditioned at some steps (transformers disagrees with itself there), so the conversion was not checked at those steps; device numbers are only as trustworthy as the checks that held.",
            (Some(false), _) => "`manifest.json` embeds a FAILED parity report: do not bench this release.",
            (None, _) => "`manifest.json` embeds no parity report: run `chunkforge parity` on the build's checkpoint before trusting device numbers.",
        }
    );
    line!(s);
    line!(s,
        "3. The model folder. The release is laid out as the app's repository (`swa/chunk1…`, `prefill/chunk1…`, the RoPE tables under `swa/`); the runtime reads the local names the app's download saves (`chunk1…`, `prefill_chunk1…`, the RoPE tables at the root), and without a `chunk1` at the folder's root it takes the single-model path and fails. These lines make `$MODEL_DIR` with every package of the release under its local name, the weight blobs the download shares into prefill packages stored without one, the side files, `hf_model/` and the encoders the release carries (`chunkforge client-check \"$RELEASE\" --client main --materialize DIR` writes one entry's download the same way):"
    );
    line!(s);
    line!(s, "```sh");
    line!(s, "{}", model_folder_lines(f));
    line!(s, "```");
    line!(s);
    line!(s,
        "4. Copy it into the app's container, where its downloader keeps the model (`Documents/Models/{FOLDER_NAME}`); `--remove-existing-content true` clears what an earlier copy or download left there. Force-quit the app first so that devicectl can write."
    );
    line!(s);
    line!(s, "```sh");
    line!(s, "{}", device_copy_line());
    line!(s, "```");
    line!(s);
    if f.compiled {
        line!(s, "Its packages are compiled `.mlmodelc` folders, the kind the app's model picker looks for.");
    } else {
        line!(s,
            "Its packages are `.mlpackage` folders, not compiled: the app's model picker finds a model only by `chunk1.mlmodelc/weights/weight.bin`, so for the iPhone run `chunkforge compile RELEASE --key KEY.pem` first and make the folder from the compiled release (its run book is made again with it). The Mac's command-line bench (below) loads `.mlpackage` folders as they are."
        );
    }
    line!(s);
}

/// `COMPUTE_PLAN_AUDIT=1`, in Xcode and on the command line.
fn environment(s: &mut String) {
    line!(s, "## Environment");
    line!(s);
    line!(s, "Set `COMPUTE_PLAN_AUDIT=1` for every launch: the runtime then prints the compute-plan audit (`[ComputePlan]` lines) the verdict needs. Without it a layout's verdict stays INCOMPLETE.");
    line!(s);
    line!(s, "- Xcode: Product > Scheme > Edit Scheme > Run > Arguments > Environment Variables: `COMPUTE_PLAN_AUDIT` = `1`.");
    line!(s, "- The command-line bench on the Mac (upstream's `coreml-llm-smoke MODEL_DIR [PROMPT] [MAX_TOKENS]`), from the upstream clone: `COMPUTE_PLAN_AUDIT=1 swift run -c release coreml-llm-smoke \"$MODEL_DIR\" \"Explain attention.\" 100 > two-1.log 2>&1`.");
    line!(s);
}

/// What to move aside (and back) to make the runtime pick each layout.
fn forcing_each_layout(
    s: &mut String,
    f: &RunbookFacts,
    layouts: &[&RuntimeLayout],
    runtimes: &[Runtime],
) {
    line!(s, "## Forcing each layout");
    line!(s);
    let order: Vec<&str> = RUNTIME_LAYOUTS.iter().map(|l| l.name).collect();
    line!(s,
        "The runtime picks the decode layout by the packages in the model folder, trying {} in that order. Before a layout's runs, move aside the packages of the layouts tried before it and copy the folder to the device again (the copy replaces what is there); put them back after its runs.",
        order.join(", ")
    );
    for l in layouts {
        line!(s);
        line!(
            s,
            "### {}{}",
            l.name,
            if l.kind == CONTROL { " (control)" } else { "" }
        );
        line!(s);
        let aside = move_aside(l.kind, |p| f.has(p));
        if aside.is_empty() {
            line!(
                s,
                "Nothing to move aside: with every package in place the runtime picks it."
            );
            line!(s);
            line!(s, "```sh");
            line!(s, "{}", device_copy_line());
            line!(s, "```");
        } else {
            let (out, back) = moves(f, &aside);
            line!(s, "```sh");
            line!(s, "{out}");
            line!(s, "{}", device_copy_line());
            line!(s, "```");
            line!(s);
            line!(s, "After its runs:");
            line!(s);
            line!(s, "```sh");
            line!(s, "{back}");
            line!(s, "```");
        }
        line!(s);
        line!(s, "The runtime must print {}.", layout_lines(l.kind));
        if l.kind == CONTROL && runtimes.len() > 1 {
            line!(s);
            line!(s,
                "The control runs on each runtime build the other layouts need ({}): each layout is compared with the control on its own build, whose speeds differ. Name its logs `four-RUNTIME-N.log`.",
                runtimes
                    .iter()
                    .map(|r| format!("{r}: {}", layouts_on(layouts, *r)))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
    }
    line!(s);
}

/// The cold runs and how their logs are named.
fn runs(s: &mut String, f: &RunbookFacts) {
    line!(s, "## Runs");
    line!(s);
    line!(
        s,
        "{COLD_RUNS} cold runs per layout at context {BENCH_CONTEXT}; for each run:"
    );
    line!(s);
    line!(s, "1. Reboot the device: it clears the Neural Engine compiler's caches, so the load compiles as a user's first launch does.");
    line!(s, "2. Launch with `COMPUTE_PLAN_AUDIT=1` and run one prompt with `--max-tokens 100` (the chat prompt `chat-define-transformer` is the primary signal).");
    line!(s, "3. Save the whole console output of that launch, from the launch on, as its own file `LAYOUT-N.log` (`two-1.log`, `two-2.log`, ...). One file is one run: `device-report` refuses a file with two layout lines.");
    line!(s);
    line!(s, "If the app fails to load a layout, keep that log too: a Neural Engine load failure is the layout's verdict.");
    if f.context != BENCH_CONTEXT {
        line!(s);
        line!(s,
            "This release's context length is {}, the targets' is {BENCH_CONTEXT}: `device-report` does not count runs whose `[KV]` line reports another context. Package a {BENCH_CONTEXT}-context build for the verdict.",
            f.context
        );
    }
    line!(s);
}

/// The runtime's lines `device-report` reads.
fn lines_the_verdict_reads(s: &mut String, layouts: &[&RuntimeLayout]) {
    line!(s, "## Lines the verdict reads");
    line!(s);
    line!(s, "`device-report` reads these from the logs, so nothing needs copying by hand; check them while the bench runs.");
    line!(s);
    line!(
        s,
        "- {}: the layout the runtime loaded; it must be the one you meant.",
        layouts
            .iter()
            .map(|l| layout_lines(l.kind))
            .collect::<Vec<_>>()
            .join("; ")
    );
    line!(
        s,
        "- `{}`: the context length.",
        show_template(KV_CONTEXT_LINE)
    );
    line!(
        s,
        "- `{}` or `{}`, one per package: its compute plan.",
        show_template(AUDIT_ALL).replace("[ComputePlan] …:", "[ComputePlan] NAME:"),
        show_template(AUDIT_SOME).replace("[ComputePlan] …:", "[ComputePlan] NAME:")
    );
    line!(
        s,
        "- `{}`: the audit's total; the package lines before it must add up to it.",
        show_template(AUDIT_SUMMARY)
    );
    line!(s, "- The decode timings, printed every 10 steps; the last line's tok/s (the running average) is the run's, and its tag must be its layout's:");
    for (tag, template) in PROFILE_LINES.iter() {
        let users: Vec<&str> = layouts
            .iter()
            .filter(|l| l.profile_tag == *tag)
            .map(|l| l.name)
            .collect();
        if !users.is_empty() {
            line!(
                s,
                "  - `{}` ({})",
                show_template(template),
                users.join(", ")
            );
        }
    }
    line!(s,
        "- `{ANE_COMPILE_FAILED}. Must re-compile the E5 bundle.` (from the OS): the Neural Engine could not load a package: DEAD ON ARRIVAL."
    );
    line!(s);
}

/// Each layout's tok/s targets and the compute-plan and load rules.
fn targets(s: &mut String, layouts: &[&RuntimeLayout]) {
    line!(s, "## Targets");
    line!(s);
    line!(s,
        "Decode tok/s at context {BENCH_CONTEXT}, the median of the {COLD_RUNS} cold runs. \"Pass\": the consolidation did not hurt. \"Ship\": the gain justifies the extra download."
    );
    line!(s);
    line!(s, "| Layout | Pass if >= | Ship if >= |");
    line!(s, "|---|---|---|");
    for l in layouts {
        match tok_target(l.kind) {
            Some(t) => line!(
                s,
                "| {} | {} | {} |",
                l.name,
                fmt_number(t.pass),
                fmt_number(t.ship)
            ),
            None if l.kind == CONTROL => line!(
                s,
                "| {} | control: the baseline of the others' change | |",
                l.name
            ),
            None => line!(
                s,
                "| {} | no target: measured against the control | |",
                l.name
            ),
        }
    }
    line!(s);
    line!(s,
        "- Compute plan: at most {} of a layout's decode ops (its packages' `[ComputePlan]` counts together) off the Neural Engine, for every layout but the control. More is ANE REGRESSION: do not ship that layout (deleting its packages makes the runtime fall back to the next layout it tries).",
        fmt_percent(MAX_OFF_NEURAL_ENGINE)
    );
    line!(
        s,
        "- A Neural Engine load failure in any run: DEAD ON ARRIVAL."
    );
    line!(s,
        "- Fewer than {COLD_RUNS} counted runs, or no compute-plan audit: INCOMPLETE, with the verdict so far."
    );
    line!(s);
}

/// The `chunkforge device-report` command over every run's log.
fn verdict(s: &mut String, layouts: &[&RuntimeLayout], runtimes: &[Runtime]) {
    line!(s, "## Verdict");
    line!(s);
    line!(s, "```sh");
    // `--require` only where a layout has a target (a four-chunk release has none).
    let require = layouts.iter().any(|l| tok_target(l.kind).is_some());
    line!(
        s,
        "chunkforge device-report{} \\",
        if require { " --require ship" } else { "" }
    );
    let mut groups: Vec<Vec<String>> = Vec::new();
    for l in layouts {
        let tags: Vec<String> = if l.kind == CONTROL && runtimes.len() > 1 {
            runtimes.iter().map(|r| format!("{}-{r}", l.kind)).collect()
        } else {
            vec![l.kind.to_string()]
        };
        for t in tags {
            groups.push(
                (1..=COLD_RUNS)
                    .map(|r| format!("{k}={t}-{r}.log", k = l.kind))
                    .collect(),
            );
        }
    }
    let n = groups.len();
    for (i, files) in groups.iter().enumerate() {
        line!(
            s,
            "    {}{}",
            files.join(" "),
            if i + 1 < n { " \\" } else { "" }
        );
    }
    line!(s, "```");
    line!(s);
    line!(s, "A `LAYOUT=FILE` label names the layout the run was meant to be: a run whose layout line names another is an error (a package was not moved aside, or is missing), and a launch that died while loading counts against its label. The report prints a verdict per layout (DEAD ON ARRIVAL, ANE REGRESSION, INCOMPLETE, BELOW PASS, PASS, SHIP; CONTROL for the control), its runs, its change against the control and every problem found with its file and line, runtime lines it could not read included. `--json` prints it as JSON; `--require pass` or `--require ship` exits 1 unless every layout with a target reaches it.");
}

/// The free-running gate on the device: the transcript made on the CPU
/// (`run --against-source --transcript`), one greedy run per layout that
/// replays its prompt ids, and `device-report --transcript` over their logs.
fn free_running_gate(s: &mut String, layouts: &[&RuntimeLayout]) {
    line!(s);
    line!(s, "## The free-running gate");
    line!(s);
    line!(s, "The device's own greedy tokens against transformers' on the source checkpoint (docs/eval.md). First the transcript, where the source checkpoint is (`SOURCE`: its folder; a release of the built-in checkpoint needs none): this release's emulation and transformers, 64 tokens each, with the source's top-2 margin at every token:");
    line!(s);
    line!(s, "```sh");
    line!(s, "chunkforge run \"$RELEASE\" ${{SOURCE:+--hf-dir \"$SOURCE\"}} --prompt \"${{GATE_PROMPT:-The quick brown fox}}\" \\");
    line!(
        s,
        "    --max-tokens 64 --against-source --transcript gate.json"
    );
    line!(s, "```");
    line!(s);
    line!(s, "Then, after the cold runs, one more launch per layout (forced as above): greedy decoding with every drafter off, the transcript's `prompt_ids` as the prompt's token ids and `--max-tokens 64`. The bench logs the ids the app emitted (upstream's `CoreMLLLM.lastEmittedTokenIDs`) on one line, `[Gate] tokens: ID ID ...`; save each launch's console as `LAYOUT-gate.log`. A divergence from transformers passes only where its top-2 margin is under the transcript's near-tie:");
    line!(s);
    line!(s, "```sh");
    let logs: Vec<String> = layouts
        .iter()
        .map(|l| format!("{k}={k}-gate.log", k = l.kind))
        .collect();
    line!(
        s,
        "chunkforge device-report --transcript gate.json {}",
        logs.join(" ")
    );
    line!(s, "```");
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../manifests/example.manifest.json"
    );

    fn example() -> Manifest {
        Manifest::load(std::path::Path::new(EXAMPLE)).unwrap()
    }

    #[test]
    fn the_example_release_gets_its_layouts_moves_and_targets() {
        let m = example();
        let f = RunbookFacts::from_manifest(&m);
        let text = render(&f);
        assert_eq!(text, render(&f), "the same manifest gives the same bytes");
        // The example is a two-chunk release: four-chunk control and two-chunk.
        let names: Vec<&str> = f.layouts().iter().map(|l| l.name).collect();
        assert_eq!(names, ["four-chunk", "two-chunk"]);
        assert!(text.contains("| two-chunk | `merged_chunk1`, `merged_chunk2` | 15, 20 |"));
        assert!(!text.contains("### one-chunk"));
        // The three-chunk decode is not in a two-chunk release.
        assert!(!text.contains("its first package is the reference's"));
        // The model folder takes local names; forcing the control moves the
        // merged pair aside there, and back.
        assert!(text.contains("\" \"$MODEL_DIR/prefill_chunk1.mlpackage\"\n"));
        assert!(text.contains("--source \"$MODEL_DIR\" --destination Documents/Models/gemma4-e2b"));
        assert!(text.contains("mv \"$MODEL_DIR/merged_chunk1.mlpackage\" \"$MODEL_DIR/merged_chunk2.mlpackage\" \"$STASH/\""));
        assert!(text.contains("mv \"$STASH/merged_chunk1.mlpackage\" \"$STASH/merged_chunk2.mlpackage\" \"$MODEL_DIR/\""));
        let t = tok_target(LayoutKind::Two).unwrap();
        assert!(text.contains(&format!(
            "| two-chunk | {} | {} |",
            fmt_number(t.pass),
            fmt_number(t.ship)
        )));
        assert!(text.contains("COMPUTE_PLAN_AUDIT=1"));
        assert!(text.contains("[Load] Decode layout: two-chunk"));
        assert!(text.contains("two=two-1.log two=two-2.log two=two-3.log"));
        // merged_chunk2's 20 layers are above the stable ceiling.
        assert!(text.contains("`merged_chunk2` (20)"));
        assert!(text.contains("two=two-1.log two=two-2.log two=two-3.log"));
        assert!(!text.contains("four-main"));
    }

    /// The example with every layout's packages, compiled, at context 8192.
    fn every_layout_manifest() -> Manifest {
        let mut m = example();
        for (name, a, b) in [
            ("chunk1_3way", 0, 7),
            ("chunk2_3way", 8, 24),
            ("chunk3_3way", 25, 34),
            ("merged_full", 0, 34),
        ] {
            let mut c = m.chunks[0].clone();
            (c.name, c.first_layer, c.last_layer) = (name.into(), a, b);
            m.chunks.push(c);
        }
        m.compiled.mlmodelc = true;
        for c in &mut m.chunks {
            c.file = manifest::package_file(&c.name, true);
        }
        m.settings.ctx = 8192;
        m
    }

    #[test]
    fn every_layout_and_compiled_packages() {
        let m = every_layout_manifest();
        let f = RunbookFacts::from_manifest(&m);
        let names: Vec<&str> = f.layouts().iter().map(|l| l.name).collect();
        assert_eq!(
            names,
            ["four-chunk", "three-chunk", "two-chunk", "one-chunk"]
        );
        let text = render(&f);
        // Two-chunk: the three-way pair and merged_full go aside, with their .mlmodelc.
        let two = &text[text.find("### two-chunk").unwrap()..text.find("### one-chunk").unwrap()];
        for p in ["chunk2_3way", "chunk3_3way", "merged_full"] {
            assert!(
                two.contains(&format!("\"$MODEL_DIR/{p}.mlmodelc\"")),
                "{two}"
            );
        }
        assert!(!two.contains("merged_chunk1.mlmodelc"), "{two}");
        assert!(!two.contains(".mlpackage"), "{two}");
        assert!(text.contains("### three-chunk\n\nNothing to move aside"));
        // The model folder takes every package under its local name, and
        // the three-chunk decode runs chunk1 itself (an old chunk1_3way is
        // never loaded).
        assert!(text.contains(
            "cp -R \"$RELEASE/swa/chunk2_3way.mlmodelc\" \"$MODEL_DIR/chunk2_3way.mlmodelc\""
        ));
        assert!(text.contains(
            "cp -R \"$RELEASE/prefill/chunk1.mlmodelc\" \"$MODEL_DIR/prefill_chunk1.mlmodelc\""
        ));
        assert!(text.contains("cp \"$RELEASE/swa/cos_full.npy\" \"$MODEL_DIR/cos_full.npy\""));
        assert!(text.contains(
            "its first package is the reference's `chunk1` itself; `chunk1_3way` ships too"
        ));
        assert!(!text.contains("`chunk2_3way` ships too"), "{text}");
        assert!(text.contains("context length is 8192"));
        assert!(text.contains("no target: measured against the control"));
        // Three-chunk needs the main runtime, the merged layouts the other
        // build: the control runs on both.
        assert_eq!(f.runtimes(), [Runtime::Merged, Runtime::Main]);
        assert!(text.contains("four=four-merged-layout-1.log"), "{text}");
        assert!(text.contains("four=four-main-3.log"));
        assert!(text.contains("`merged_full` (35)"));
    }

    #[test]
    fn a_missing_field_is_named() {
        let mut m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(EXAMPLE).unwrap()).unwrap();
        m["settings"].as_object_mut().unwrap().remove("quantize");
        let path = std::env::temp_dir().join(format!("cf-runbook-{}.json", std::process::id()));
        std::fs::write(&path, m.to_string()).unwrap();
        let e = Manifest::load(&path).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.contains("missing field `quantize`"), "{e}");
    }

    /// The run books of the example release and of one with every layout,
    /// compiled, at another context, byte for byte as checked in under
    /// manifests/runbooks/ (`scripts/generate-all.sh` writes them after an
    /// intended change).
    #[test]
    fn run_books_are_the_checked_in_ones() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../manifests/runbooks");
        let every = every_layout_manifest();
        for (name, m) in [("example.md", example()), ("every-layout.md", every)] {
            let text = render(&RunbookFacts::from_manifest(&m));
            let path = dir.join(name);
            if chunkforge_model::generated::bless() {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap();
            }
            let want = std::fs::read_to_string(&path).unwrap();
            assert!(
                text == want,
                "{}: the run book changed ({} if intended)",
                path.display(),
                chunkforge_model::generated::REGENERATE
            );
        }
    }
}
