//! Embeds the Python interpreter pyo3 was configured with: an rpath to its
//! libpython makes the binary load that same interpreter at run time instead
//! of whichever libpython3.x the system loader finds first.

fn main() {
    let cfg = pyo3_build_config::get();
    if let Some(dir) = cfg.lib_dir() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
}
