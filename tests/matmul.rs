//! The native product kernels (src/matmul) from Python, inside the binary:
//! python/tests/test_matmul_native.py once per instruction set this CPU
//! runs (`CHUNKFORGE_MATMUL_ISA` caps the build the kernels choose; the
//! tests compare every build in each run), with the shared `--mode all`
//! build for the prefill padding check. The kernels' own tests against
//! float64 are the unit tests in src/matmul/tests.rs.

mod common;

use common::{built_all, run_env, stderr, stdout};

fn pytest(isa: Option<&str>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/python/tests/test_matmul_native.py"
    );
    let tools = std::env::var("CHUNKFORGE_TEST_TOOLS").unwrap_or_default();
    let build = built_all();
    let mut env = vec![
        ("PYTHONPATH", tools.as_str()),
        ("CHUNKFORGE_TEST_BUILD", build.to_str().unwrap()),
    ];
    if let Some(isa) = isa {
        env.push(("CHUNKFORGE_MATMUL_ISA", isa));
    }
    let args = ["selftest-python", "-q", "-p", "no:cacheprovider", path];
    let o = run_env(&args, &env);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "pytest ({isa:?}) failed:\n{out}\n{}",
        stderr(&o)
    );
    // The module ran, not skipped for a missing chunkforge_native or build.
    assert!(out.contains(" passed") && !out.contains("skipped"), "{out}");
}

#[test]
fn native_kernels_from_python_on_the_fastest_build() {
    pytest(None);
}

#[test]
fn native_kernels_from_python_with_the_portable_build_forced() {
    pytest(Some("portable"));
}

#[test]
fn native_kernels_from_python_with_avx2_forced() {
    pytest(Some("avx2"));
}
