//! `chunkforge_native`: the Rust kernels the embedded Python imports.
//!
//! Registered with `pyo3::append_to_inittab!` in `main()` before the
//! interpreter starts, so `import chunkforge_native` works inside this binary
//! (and only there: it is not an installable extension module).

use pyo3::prelude::*;

#[pymodule]
pub mod chunkforge_native {
    use half::f16;
    use numpy::{
        PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadonlyArrayDyn,
        PyReadwriteArray2, PyUntypedArrayMethods,
    };
    use pyo3::exceptions::PyValueError;
    use pyo3::prelude::*;

    use crate::matmul as kernels;
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

    /// A weight's stored values as Python hands them: 4-bit indices (uint8),
    /// bf16 / fp16 bits (uint16) or float32.
    enum Held<'py> {
        U8(PyReadonlyArrayDyn<'py, u8>),
        U16(PyReadonlyArrayDyn<'py, u16>),
        F32(PyReadonlyArrayDyn<'py, f32>),
    }

    /// The weight `(kind, data, lut, group_rows)` as the kernels read it,
    /// or an error naming `label`.
    struct Spec<'py> {
        kind: String,
        data: Held<'py>,
        lut: Option<PyReadonlyArray2<'py, f32>>,
        group_rows: usize,
    }

    /// `(kind, data, lut, group_rows)`: kind `lut4` (data uint8: two indices
    /// a byte, low nibble first; lut float32 [groups, 16]), `bf16` or `fp16`
    /// (data uint16 bits), `fp32` (data float32).
    type SpecArgs<'py> = (
        String,
        Bound<'py, PyAny>,
        Option<PyReadonlyArray2<'py, f32>>,
        usize,
    );

    fn spec<'py>(args: SpecArgs<'py>, label: &str) -> PyResult<Spec<'py>> {
        let (kind, data, lut, group_rows) = args;
        let bad =
            |what: &str| PyValueError::new_err(format!("{label}: a {kind} weight needs {what}"));
        let held = match kind.as_str() {
            "lut4" => Held::U8(data.extract().map_err(|_| bad("uint8 indices"))?),
            "bf16" | "fp16" => Held::U16(data.extract().map_err(|_| bad("uint16 bits"))?),
            "fp32" => Held::F32(data.extract().map_err(|_| bad("float32 values"))?),
            other => {
                return Err(PyValueError::new_err(format!(
                    "{label}: unknown stored form {other} (lut4, bf16, fp16, fp32)"
                )))
            }
        };
        if kind == "lut4" && lut.is_none() {
            return Err(bad("a LUT [groups, 16]"));
        }
        Ok(Spec {
            kind,
            data: held,
            lut,
            group_rows,
        })
    }

    fn slice<'a, T: numpy::Element>(
        a: &'a PyReadonlyArrayDyn<'_, T>,
        label: &str,
    ) -> PyResult<&'a [T]> {
        a.as_slice().map_err(|_| {
            PyValueError::new_err(format!(
                "{label}: the weight's values must be C-contiguous and aligned"
            ))
        })
    }

    impl Spec<'_> {
        fn weights(&self, label: &str) -> PyResult<kernels::Weights<'_>> {
            Ok(match &self.data {
                Held::U8(a) => kernels::Weights::Lut4 {
                    packed: slice(a, label)?,
                    lut: match &self.lut {
                        Some(l) => l.as_slice().map_err(|_| {
                            PyValueError::new_err(format!(
                                "{label}: the LUT must be C-contiguous and aligned"
                            ))
                        })?,
                        None => &[],
                    },
                    group_rows: self.group_rows,
                },
                Held::U16(a) if self.kind == "bf16" => kernels::Weights::Bf16(slice(a, label)?),
                Held::U16(a) => kernels::Weights::F16(slice(a, label)?),
                Held::F32(a) => kernels::Weights::F32(slice(a, label)?),
            })
        }
    }

    fn isa_of(isa: Option<&str>) -> PyResult<kernels::Isa> {
        let Some(name) = isa else {
            return Ok(kernels::best_isa());
        };
        let wanted = kernels::Isa::parse(name).ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown instruction set {name} (portable, avx2, avx512)"
            ))
        })?;
        if !kernels::available_isas().contains(&wanted) {
            return Err(PyValueError::new_err(format!(
                "this CPU cannot run the {name} build"
            )));
        }
        Ok(wanted)
    }

    /// matmul(x, weight, rows, cols, live=None, channels_first=False, name=None, isa=None) -> y
    ///
    /// `x · Wᵀ` for float32 `x [tokens, cols]` (any strides) and `weight`
    /// `(kind, data, lut, group_rows)` of shape `[rows, cols]` in its stored
    /// form (src/matmul: `lut4`, `bf16`, `fp16`, `fp32`), without a dense
    /// copy of it. Returns float32 `[tokens, rows]`, or `[rows, tokens]`
    /// with `channels_first`; only the first `live` tokens are computed (the
    /// others are 0). The GIL is released while the rows run on all cores.
    /// `name` labels errors; `isa` picks a build (default: the fastest).
    #[pyfunction]
    #[pyo3(signature = (x, weight, rows, cols, live = None, channels_first = false, name = None, isa = None))]
    #[allow(clippy::too_many_arguments)]
    fn matmul<'py>(
        py: Python<'py>,
        x: PyReadonlyArray2<'py, f32>,
        weight: SpecArgs<'py>,
        rows: usize,
        cols: usize,
        live: Option<usize>,
        channels_first: bool,
        name: Option<&str>,
        isa: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let label = name.unwrap_or("weight");
        let spec = spec(weight, label)?;
        let w = spec.weights(label)?;
        let isa = isa_of(isa)?;
        let view = x.as_array();
        let (tokens, given) = view.dim();
        if given != cols {
            return Err(PyValueError::new_err(format!(
                "{label} [{rows}, {cols}]: an input of {given} columns (x is [{tokens}, {given}])"
            )));
        }
        let live = live.unwrap_or(tokens);
        if live > tokens {
            return Err(PyValueError::new_err(format!(
                "{label}: {live} live tokens of {tokens}"
            )));
        }
        let layout = if channels_first {
            kernels::Layout::ChannelMajor
        } else {
            kernels::Layout::TokenMajor
        };
        let out = py
            .detach(|| {
                // The live tokens' rows, contiguous (x may be a transposed view).
                let mut xs = Vec::with_capacity(live * cols);
                for row in view.outer_iter().take(live) {
                    xs.extend(row.iter().copied());
                }
                let input = kernels::Input {
                    x: &xs,
                    tokens,
                    live,
                };
                kernels::matmul(&w, rows, cols, input, layout, isa)
            })
            .map_err(|e| PyValueError::new_err(format!("{label}: {e}")))?;
        let shape = if channels_first {
            [rows, tokens]
        } else {
            [tokens, rows]
        };
        PyArray1::from_vec(py, out).reshape(shape)
    }

    /// dense_rows(weight, rows, cols, start, stop, name=None) -> float32 [stop - start, cols]
    ///
    /// Rows `start..stop` of a stored weight as float32 (the values its
    /// products use): the general path, for an op the kernels do not serve.
    #[pyfunction]
    #[pyo3(signature = (weight, rows, cols, start, stop, name = None))]
    fn dense_rows<'py>(
        py: Python<'py>,
        weight: SpecArgs<'py>,
        rows: usize,
        cols: usize,
        start: usize,
        stop: usize,
        name: Option<&str>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let label = name.unwrap_or("weight");
        let spec = spec(weight, label)?;
        let w = spec.weights(label)?;
        let out = py
            .detach(|| kernels::dense_rows(&w, rows, cols, start, stop))
            .map_err(|e| PyValueError::new_err(format!("{label}: {e}")))?;
        PyArray1::from_vec(py, out).reshape([stop - start, cols])
    }

    /// dense_rows_into(weight, rows, cols, start, out, name=None)
    ///
    /// `dense_rows` into ``out`` (float32 [n, cols], C-contiguous): rows
    /// `start..start + n`, written into memory the caller reuses.
    #[pyfunction]
    #[pyo3(signature = (weight, rows, cols, start, out, name = None))]
    fn dense_rows_into<'py>(
        py: Python<'py>,
        weight: SpecArgs<'py>,
        rows: usize,
        cols: usize,
        start: usize,
        mut out: PyReadwriteArray2<'py, f32>,
        name: Option<&str>,
    ) -> PyResult<()> {
        let label = name.unwrap_or("weight");
        let spec = spec(weight, label)?;
        let w = spec.weights(label)?;
        let dst = out.as_slice_mut().map_err(|_| {
            PyValueError::new_err(format!("{label}: the output must be C-contiguous"))
        })?;
        py.detach(|| kernels::dense_rows_into(&w, rows, cols, start, dst))
            .map_err(|e| PyValueError::new_err(format!("{label}: {e}")))
    }

    /// squared_error(a, b, rows, cols, name=None) -> (float, float)
    ///
    /// `(Σ (a − b)², Σ b²)` in float64 over two stored weights of one shape
    /// (a read-back weight against the checkpoint's), the same whatever the
    /// thread count.
    #[pyfunction]
    #[pyo3(signature = (a, b, rows, cols, name = None))]
    fn squared_error<'py>(
        py: Python<'py>,
        a: SpecArgs<'py>,
        b: SpecArgs<'py>,
        rows: usize,
        cols: usize,
        name: Option<&str>,
    ) -> PyResult<(f64, f64)> {
        let label = name.unwrap_or("weight");
        let (sa, sb) = (spec(a, label)?, spec(b, label)?);
        let (wa, wb) = (sa.weights(label)?, sb.weights(label)?);
        py.detach(|| kernels::squared_error(&wa, &wb, rows, cols))
            .map_err(|e| PyValueError::new_err(format!("{label}: {e}")))
    }

    /// matmul_isas() -> (chosen, available): the build the kernels run here
    /// (capped by CHUNKFORGE_MATMUL_ISA) and every build this CPU runs.
    #[pyfunction]
    fn matmul_isas() -> (String, Vec<String>) {
        (
            kernels::best_isa().name().to_string(),
            kernels::available_isas()
                .iter()
                .map(|i| i.name().to_string())
                .collect(),
        )
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
