//! The Rust palettizer end to end: the kernel's Python tests inside the binary
//! (where `chunkforge_native` exists) and the benchmark's accuracy claims on
//! small matrices. Package-level checks (read-back, byte-identical rebuilds,
//! merged_full = merged_chunk1 + merged_chunk2, cache counts) are in
//! python/tests/test_palettize.py.

mod common;

use common::{ok, run_env, stderr, stdout};

#[test]
fn native_kernel_python_tests_pass_inside_the_binary() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/python/tests/test_palettize_native.py"
    );
    // pytest comes from the test-tools folder (scripts/test.sh), put on the
    // path of this one run only: the other runs see the pinned environment alone.
    let tools = std::env::var("CHUNKFORGE_TEST_TOOLS").unwrap_or_default();
    let args = ["selftest-python", "-q", "-p", "no:cacheprovider", path];
    let o = run_env(&args, &[("PYTHONPATH", &tools)]);
    let out = stdout(&o);
    assert!(o.status.success(), "pytest failed:\n{out}\n{}", stderr(&o));
    // The module must have run, not been skipped for a missing chunkforge_native.
    assert!(out.contains(" passed") && !out.contains("skipped"), "{out}");
}

#[test]
fn bench_palettize_quick_kernel_at_least_as_accurate_as_coremltools() {
    let out = ok(&["bench", "palettize", "--quick", "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).expect("bench --json prints JSON");
    let results = report["results"].as_array().expect("results");
    let mut shapes: Vec<&serde_json::Value> = results.iter().map(|r| &r["shape"]).collect();
    shapes.dedup();
    assert!(shapes.len() >= 2, "{out}");
    for shape in shapes {
        let of = |imp: &str| {
            results
                .iter()
                .find(|r| &r["shape"] == shape && r["impl"] == imp)
                .unwrap_or_else(|| panic!("{imp} missing for {shape}"))
        };
        let ours = of("chunkforge")["mse"].as_f64().unwrap();
        for imp in [
            "coremltools-kmeans1d-w1",
            "coremltools-kmeans1d-w2",
            "coremltools-sklearn-w1",
            "coremltools-sklearn-w2",
        ] {
            let r = of(imp);
            assert!(r["seconds"].as_f64().unwrap() > 0.0);
            let theirs = r["mse"].as_f64().unwrap();
            assert!(
                ours <= theirs * (1.0 + 1e-9),
                "{shape}: chunkforge mse {ours} > {imp} {theirs}"
            );
        }
        // scikit-learn's k-means is a local optimum: strictly worse here.
        assert!(ours < of("coremltools-sklearn-w1")["mse"].as_f64().unwrap());
    }
}
