//! The heap policy (src/heap.rs) in a real chunkforge process: freed memory
//! is given back to the system by default (glibc's behaviour), and reused
//! with CHUNKFORGE_HEAP=keep. python/tests/test_heap.py measures page faults
//! inside the binary's embedded interpreter, where the policy applies.

mod common;

use std::process::Command;

use common::{bin, stderr, stdout};

fn heap_test(policy: Option<&str>) -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/python/tests/test_heap.py");
    // pytest comes from the test-tools folder (scripts/test.sh).
    let tools = std::env::var("CHUNKFORGE_TEST_TOOLS").unwrap_or_default();
    let mut cmd = Command::new(bin());
    cmd.args([
        "selftest-python",
        "-q",
        "-p",
        "no:cacheprovider",
        "-s",
        path,
    ])
    .env("PYTHONPATH", &tools)
    .env_remove("CHUNKFORGE_HEAP");
    if let Some(p) = policy {
        cmd.env("CHUNKFORGE_HEAP", p);
    }
    let o = cmd.output().expect("spawn chunkforge");
    let out = stdout(&o);
    assert!(o.status.success(), "pytest failed:\n{out}\n{}", stderr(&o));
    assert!(
        out.contains("1 passed") && !out.contains("skipped"),
        "{out}"
    );
    out
}

#[test]
fn chunkforge_releases_freed_memory_by_default_and_keeps_it_when_asked() {
    // The file checks the behaviour of the policy the binary says it applied
    // (CHUNKFORGE_HEAP, which it sets) and prints which that was.
    let default = heap_test(None);
    assert!(
        default.contains("heap policy checked: release"),
        "{default}"
    );
    let kept = heap_test(Some("keep"));
    assert!(kept.contains("heap policy checked: keep"), "{kept}");
}
