//! `chunkforge exec` end to end on chunk1 of the shared `build --mode all`
//! (tests/common `built_all`, made once and reused by the other tests): the
//! interpreter runs the package's decode function from an .npz and writes
//! its outputs by name; bad inputs are refused with the input named, exit 2,
//! and no output written. (The interpreter's numerics are checked op by op
//! and against the torch modules by python/tests/test_mil_interp.py.)

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::path::Path;

use common::*;
use serde_json::Value;

/// One array of an .npz: numpy dtype string, shape, little-endian bytes.
struct Array {
    descr: String,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn npy(a: &Array) -> Vec<u8> {
    let shape = match a.shape.len() {
        1 => format!("({},)", a.shape[0]),
        _ => format!(
            "({})",
            a.shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        a.descr
    );
    // Magic (6) + version (2) + length (2) + header, padded to 64 bytes with '\n' last.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&a.data);
    out
}

fn write_npz(path: &Path, arrays: &BTreeMap<String, Array>) {
    let mut w = zip::ZipWriter::new(fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(true);
    for (name, a) in arrays {
        w.start_file(format!("{name}.npy"), opts).unwrap();
        w.write_all(&npy(a)).unwrap();
    }
    w.finish().unwrap();
}

fn read_npz(path: &Path) -> BTreeMap<String, Array> {
    let mut ar = zip::ZipArchive::new(fs::File::open(path).unwrap()).unwrap();
    let mut out = BTreeMap::new();
    for i in 0..ar.len() {
        let mut f = ar.by_index(i).unwrap();
        let name = f.name().trim_end_matches(".npy").to_string();
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY", "{name}");
        let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        let header = String::from_utf8_lossy(&bytes[10..10 + len]).into_owned();
        let field = |key: &str, open: char, close: char| {
            let at = header.find(key).unwrap() + key.len();
            let from = at + header[at..].find(open).unwrap() + 1;
            header[from..from + header[from..].find(close).unwrap()].to_string()
        };
        let shape = field("'shape':", '(', ')')
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect();
        out.insert(
            name,
            Array {
                descr: field("'descr':", '\'', '\''),
                shape,
                data: bytes[10 + len..].to_vec(),
            },
        );
    }
    out
}

fn f16_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values
        .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
        .collect()
}

fn f32_values(a: &Array) -> Vec<f32> {
    match a.descr.as_str() {
        "<f4" => a
            .data
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "<f2" => a
            .data
            .chunks(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect(),
        d => panic!("unexpected dtype {d}"),
    }
}

/// chunk1 of the shared build and its decode function as the build's plan
/// (build.json) describes it: name, inputs and outputs with shapes and dtypes.
fn chunk1() -> (std::path::PathBuf, Value) {
    let build = built_all();
    let info = json_file(&build.join("build.json"));
    let four = info["plan"]["layouts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "four")
        .unwrap();
    let chunk = &four["chunks"][0];
    let f = chunk["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "decode")
        .unwrap()
        .clone();
    let pkg = build.join(format!("{}.mlpackage", chunk["name"].as_str().unwrap()));
    (pkg, f)
}

/// Every fp16 input zero, except the sliding K/V caches: row r of every slot
/// holds r mod 64 (exact in fp16), so the window shift is visible.
fn inputs(function: &Value) -> BTreeMap<String, Array> {
    let mut out = BTreeMap::new();
    for t in function["inputs"].as_array().unwrap() {
        assert_eq!(t["dtype"], "fp16", "{t}");
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let n: usize = shape.iter().product();
        let name = t["name"].as_str().unwrap().to_string();
        let data = if name.ends_with("_sliding_in") {
            let (rows, width) = (shape[2], shape[3]);
            f16_bytes((0..n).map(|i| ((i / width % rows) % 64) as f32))
        } else {
            f16_bytes((0..n).map(|_| 0.0))
        };
        out.insert(
            name,
            Array {
                descr: "<f2".into(),
                shape,
                data,
            },
        );
    }
    out
}

#[test]
fn exec_runs_chunk1_decode_and_writes_outputs_by_name() {
    let (pkg, function) = chunk1();
    let dir = tempdir("exec");
    let input = dir.join("in.npz");
    write_npz(&input, &inputs(&function));
    let mut results = BTreeMap::new();
    for (mode, extra) in [("fp32", None), ("fp16", Some("--fp16"))] {
        let out = dir.join(format!("{mode}.npz"));
        let mut args = vec![
            "exec",
            pkg.to_str().unwrap(),
            "--inputs",
            input.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--json",
        ];
        args.extend(extra);
        let report: Value = serde_json::from_str(&ok(&args)).unwrap();
        assert_eq!(report["function"], function["name"]);
        assert_eq!(report["fp16"], mode == "fp16");
        assert!(report["ops"].as_u64().unwrap() > 100, "{report}");
        let got = read_npz(&out);
        let want: Vec<&str> = function["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        let mut names: Vec<&str> = got.keys().map(String::as_str).collect();
        names.sort();
        let mut sorted = want.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        for t in function["outputs"].as_array().unwrap() {
            let a = &got[t["name"].as_str().unwrap()];
            let shape: Vec<usize> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(a.shape, shape, "{}", t["name"]);
            assert_eq!(a.descr, if mode == "fp16" { "<f2" } else { "<f4" });
        }
        // A decode step drops each window's oldest row and appends the new
        // one: rows 1.. of the input are rows ..-1 of the output.
        let (k_in, k_out) = (&inputs(&function)["K_sliding_in"], &got["K_sliding_out"]);
        let (rows, width) = (k_in.shape[2], k_in.shape[3]);
        let (a, b) = (f32_values(k_in), f32_values(k_out));
        for slot in 0..k_in.shape[0] {
            let base = slot * rows * width;
            assert_eq!(
                b[base..base + (rows - 1) * width],
                a[base + width..base + rows * width],
                "slot {slot}"
            );
        }
        results.insert(mode, got);
    }
    // fp16 arithmetic rounds, fp32 does not: the hidden states differ a little.
    let (h32, h16) = (
        f32_values(&results["fp32"]["hidden_states_out"]),
        f32_values(&results["fp16"]["hidden_states_out"]),
    );
    let worst = h32
        .iter()
        .zip(&h16)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst > 0.0 && worst < 0.1, "fp32 vs fp16: {worst}");
    let leftovers: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Runs exec expecting exit 2, every fragment in stderr and no output file.
fn refused(pkg: &Path, input: &Path, extra: &[&str], fragments: &[&str]) {
    let out = input.with_extension("out.npz");
    let mut args = vec![
        "exec",
        pkg.to_str().unwrap(),
        "--inputs",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = run(&args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for f in fragments {
        assert!(err.contains(f), "missing {f:?} in: {err}");
    }
    assert!(!out.exists(), "{} written on error", out.display());
}

#[test]
fn exec_refuses_bad_inputs_and_unknown_functions() {
    let (pkg, function) = chunk1();
    let dir = tempdir("exec-bad");
    let good = inputs(&function);
    let write = |name: &str, arrays: BTreeMap<String, Array>| {
        let p = dir.join(format!("{name}.npz"));
        write_npz(&p, &arrays);
        p
    };

    // One call, every problem named: a missing input, a mis-shaped one, a
    // mis-typed one and one the function does not take.
    let mut bad = inputs(&function);
    bad.remove("per_layer_raw");
    bad.get_mut("hidden_states").unwrap().shape.insert(0, 1);
    bad.get_mut("update_mask").unwrap().descr = "<i2".into();
    bad.insert(
        "kv13_k".into(),
        Array {
            descr: "<f2".into(),
            shape: vec![1],
            data: f16_bytes([0.0].into_iter()),
        },
    );
    refused(
        &pkg,
        &write("bad", bad),
        &[],
        &[
            "missing per_layer_raw [1, 1, ",
            "input hidden_states has shape [1, 1, 1, ",
            "input update_mask is int16, expected fp16 (a float16 or float32 array)",
            "unexpected kv13_k",
        ],
    );

    let ok_input = write("good", good);
    refused(
        &pkg,
        &ok_input,
        &["--function", "decode_q9"],
        &["no function decode_q9 (it has ", "decode_q1", "verify_q"],
    );
    refused(
        &dir.join("nope.mlpackage"),
        &ok_input,
        &[],
        &["nope.mlpackage: not an .mlpackage folder"],
    );
}
