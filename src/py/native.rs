//! `chunkforge_native`: the Rust kernels the embedded Python imports.
//!
//! Registered with `pyo3::append_to_inittab!` in `main()` before the
//! interpreter starts, so `import chunkforge_native` works inside this binary
//! (and only there: it is not an installable extension module).

use pyo3::prelude::*;

#[pymodule]
pub mod chunkforge_native {
    use half::f16;
    use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    use crate::palette;

    /// The array's elements in memory order, or an error naming `label`.
    fn contiguous<'a>(
        a: &'a PyReadonlyArray2<'_, f16>,
        label: &str,
        func: &str,
    ) -> PyResult<&'a [f16]> {
        a.as_slice().map_err(|_| {
            PyValueError::new_err(format!(
                "{label}: {func} needs C-contiguous float16 arrays (use numpy.ascontiguousarray)"
            ))
        })
    }

    /// `(lut [groups, 2**nbits] float16, indices [rows, cols] uint8)`.
    type Palettized<'py> = (Bound<'py, PyArray2<f16>>, Bound<'py, PyArray2<u8>>);

    /// palettize_int4(weight, group_size=32, nbits=4, name=None) -> (lut, indices)
    ///
    /// `weight`: C-contiguous float16 array `[rows, cols]` (rows = output
    /// channels). Returns `lut` float16 `[rows // group_size, 2**nbits]` (one
    /// sorted table per group of consecutive rows, unused entries 0) and
    /// `indices` uint8 `[rows, cols]`. Optimal (least squares) and bit-for-bit
    /// deterministic; the GIL is released while the groups run on all cores.
    /// `name` only labels error messages.
    #[pyfunction]
    #[pyo3(signature = (weight, group_size = 32, nbits = 4, name = None))]
    fn palettize_int4<'py>(
        py: Python<'py>,
        weight: PyReadonlyArray2<'py, f16>,
        group_size: usize,
        nbits: u32,
        name: Option<&str>,
    ) -> PyResult<Palettized<'py>> {
        let (rows, cols) = (weight.shape()[0], weight.shape()[1]);
        let label = name.unwrap_or("weight");
        let data = contiguous(&weight, label, "palettize_int4")?;
        let p = py
            .detach(|| palette::palettize(data, rows, cols, group_size, nbits))
            .map_err(|e| PyValueError::new_err(format!("{label} [{rows}, {cols}]: {e}")))?;
        let lut = PyArray1::from_vec(py, p.lut).reshape([p.groups, p.entries])?;
        let indices = PyArray1::from_vec(py, p.indices).reshape([rows, cols])?;
        Ok((lut, indices))
    }

    /// indices_int4(weight, lut, group_size=32, nbits=4, name=None) -> indices
    ///
    /// The `indices` `palettize_int4` returns for `weight` when it returned
    /// `lut`, byte for byte, in one cheap pass (no LUT search): a build keeps
    /// only the LUTs of weights later layouts will ask for again.
    #[pyfunction]
    #[pyo3(signature = (weight, lut, group_size = 32, nbits = 4, name = None))]
    fn indices_int4<'py>(
        py: Python<'py>,
        weight: PyReadonlyArray2<'py, f16>,
        lut: PyReadonlyArray2<'py, f16>,
        group_size: usize,
        nbits: u32,
        name: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray2<u8>>> {
        let (rows, cols) = (weight.shape()[0], weight.shape()[1]);
        let label = name.unwrap_or("weight");
        let data = contiguous(&weight, label, "indices_int4")?;
        let table = contiguous(&lut, &format!("{label} LUT"), "indices_int4")?;
        let entries = lut.shape()[1];
        if (1..=8).contains(&nbits) && entries != 1 << nbits {
            return Err(PyValueError::new_err(format!(
                "{label}: a LUT of {entries} entries per group; nbits {nbits} needs {}",
                1 << nbits
            )));
        }
        let indices = py
            .detach(|| palette::indices_for(data, rows, cols, group_size, nbits, table))
            .map_err(|e| PyValueError::new_err(format!("{label} [{rows}, {cols}]: {e}")))?;
        PyArray1::from_vec(py, indices).reshape([rows, cols])
    }
}

/// Runs pytest inside this binary's interpreter, where `chunkforge_native` is
/// importable (the hidden `selftest-python` command; plain `python -m pytest`
/// skips the tests that need the kernel). Returns pytest's exit code.
pub fn run_pytest(args: &[String], verbose: bool) -> anyhow::Result<i32> {
    crate::py::env::activate(verbose)?;
    Python::attach(|py| -> PyResult<i32> {
        py.import("pytest")?
            .call_method1("main", (args.to_vec(),))?
            .extract()
    })
    .map_err(|e| anyhow::anyhow!(crate::py::env::render_error(e, verbose)))
}
