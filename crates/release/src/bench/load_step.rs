//! The run book's first step for a release whose `.mlmodelc` no device has
//! loaded yet (`manifest.json` `compiled.device_verified: false`, as every
//! release `chunkforge compile` writes): load every function of every
//! package on the phone before the bench, and say what to report.

use std::fmt::Write;

use crate::manifest::Manifest;

/// The section's text, or None when the release is not compiled or a device
/// has loaded it.
pub fn render(m: &Manifest) -> Option<String> {
    if !m.compiled.mlmodelc || m.compiled.device_verified {
        return None;
    }
    let mut s = String::new();
    let by = m
        .compiled
        .by
        .as_deref()
        .unwrap_or("a compiler the manifest does not name");
    let mut line = |t: &str| writeln!(s, "{t}").expect("writing to a String");
    line("## First: load every function on the phone");
    line("");
    line(&format!(
        "These `.mlmodelc` were written by {by}, and no device has loaded them yet (`manifest.json` `compiled.device_verified: false`). Before anything below, load each function of each package once on the phone, with the compute units the runtime uses (`.cpuAndNeuralEngine`), from the model folder the app's download leaves (`chunkforge client-check RELEASE --client CLIENT --materialize DIR` writes it with these names):"
    ));
    line("");
    line("| Package | Folder in the model folder | Functions |");
    line("|---|---|---|");
    for c in &m.chunks {
        let functions: Vec<String> = if c.functions.is_empty() {
            vec!["main".into()]
        } else {
            c.functions
                .iter()
                .map(|f| format!("`{}`", f.name))
                .collect()
        };
        line(&format!(
            "| {} | `{}.mlmodelc` | {} |",
            c.name,
            c.name,
            functions.join(", ")
        ));
    }
    line("");
    line("For each row and function, in Swift on the device:");
    line("");
    line("```swift");
    line("let config = MLModelConfiguration()");
    line("config.computeUnits = .cpuAndNeuralEngine");
    line("config.functionName = \"FUNCTION\"");
    line("let model = try MLModel(contentsOf: modelDir.appendingPathComponent(\"FOLDER\"), configuration: config)");
    line("```");
    line("");
    line("Report, for every package and function: loaded or not, the error Core ML gives when not (the whole `error.localizedDescription`), and the load time. Stop at the first failure and report it: the bench below would measure nothing. When every function loads, say so with the release's version; chunkforge never sets `device_verified` itself.");
    line("");
    Some(s)
}
