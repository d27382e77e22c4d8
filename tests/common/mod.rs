//! Shared helpers for the integration tests: run the binary, make fixtures.
#![allow(dead_code)]

pub mod synthetic;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

use serde_json::Value;

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_chunkforge"))
}

/// Runs chunkforge with `args`; returns the output (never panics on failure).
pub fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env_remove("GEMMA4_HF_DIR")
        .output()
        .expect("spawn chunkforge")
}

/// Runs chunkforge with `args` and extra environment variables (the test
/// hooks, e.g. `CHUNKFORGE_TEST_KILL_AT_STEP`).
pub fn run_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(bin())
        .args(args)
        .env_remove("GEMMA4_HF_DIR")
        .envs(env.iter().copied())
        .output()
        .expect("spawn chunkforge")
}

/// Runs chunkforge with `args` where only the folders `writable` (and
/// `/dev`, `/proc`) can be written: a private mount namespace (`unshare
/// -rm`) in which each of them is bound over itself and the root then
/// remounted read-only, so a write anywhere else fails with EROFS instead
/// of happening. TMPDIR is the first of them. Panics, naming the reason,
/// when the namespace cannot be made (a kernel without user namespaces).
pub fn run_confined(args: &[&str], writable: &[&Path]) -> Output {
    const SCRIPT: &str = r#"set -e
while [ "$1" != "--" ]; do mount --bind "$1" "$1"; shift; done
shift
mount -o remount,bind,ro /
exec "$@""#;
    let mut cmd = Command::new("unshare");
    cmd.args(["-rm", "--propagation", "private", "sh", "-c", SCRIPT, "sh"]);
    cmd.args(writable);
    cmd.arg("--")
        .arg(bin())
        .args(args)
        .env_remove("GEMMA4_HF_DIR");
    if let Some(t) = writable.first() {
        cmd.env("TMPDIR", t);
    }
    let o = cmd.output().expect("spawn unshare");
    let err = stderr(&o);
    assert!(
        !(err.starts_with("unshare:") || err.starts_with("mount:")),
        "cannot confine chunkforge to {writable:?} (unshare -rm, mount --bind): {err}"
    );
    o
}

/// Whether `o` is a run that SIGKILLed itself (the kill-at-step hook).
pub fn killed(o: &Output) -> bool {
    use std::os::unix::process::ExitStatusExt;
    o.status.signal() == Some(9)
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts success and returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "chunkforge {args:?} failed:\n{}\n{}",
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

/// Runs chunkforge expecting failure; returns stderr.
pub fn fails(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        !o.status.success(),
        "chunkforge {args:?} unexpectedly succeeded:\n{}",
        stderr(&o)
    );
    stderr(&o)
}

static FIXTURE_LOCK: Mutex<()> = Mutex::new(());

/// Bumped with the fixture generator (python/chunkforge_py/fixture.py), or
/// with what build.json must hold, so cached test fixtures and builds are
/// made again (gen5: build.json records the checkpoint's weights, which
/// `release --reuse-build` and `package --parity-report` require; gen6: chunk1_3way is no
/// longer built; gen7: tiny E4B fixtures have 2 query heads per KV head;
/// gen8: `verify_qK` also returns the branch's write-through caches; gen9: the
/// built-in checkpoint is trained, checkpoints/default).
const FIXTURE_GENERATION: &str = "gen9";

/// A cached fixture checkpoint under target/test-fixtures/<name>, made once
/// with `chunkforge fixture --out <dir> <extra...>` and shared by tests.
pub fn fixture(name: &str, extra: &[&str]) -> PathBuf {
    let _guard = FIXTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fixtures")
        .join(FIXTURE_GENERATION);
    std::fs::create_dir_all(&root).unwrap();
    let dir = root.join(name);
    if !dir.join("config.json").exists() {
        let _ = std::fs::remove_dir_all(&dir);
        let mut args = vec!["fixture", "--out", dir.to_str().unwrap()];
        args.extend_from_slice(extra);
        ok(&args);
    }
    dir
}

/// The cached fixture `base` with every `layer_scalar` tensor set to 1.0,
/// cached beside it as `name` (transformers' own default, and what bf16
/// rounds a scalar within 0.4 % of 1 to).
pub fn unit_scalar_fixture(name: &str, base: &Path) -> PathBuf {
    edited_fixture(name, base, &["layer_scalar"], |_| 1.0)
}

/// The cached fixture `base` with every F32 value of the tensors whose
/// names end with one of `suffixes` replaced by `edit(value)`, cached
/// beside it as `name`.
pub fn edited_fixture(
    name: &str,
    base: &Path,
    suffixes: &[&str],
    edit: impl Fn(f32) -> f32,
) -> PathBuf {
    let _guard = FIXTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = base.with_file_name(name);
    if dir.join("config.json").exists() {
        return dir;
    }
    let staging = base.with_file_name(format!("{name}.partial"));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).unwrap();
    for e in std::fs::read_dir(base).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), staging.join(e.file_name())).unwrap();
    }
    let file = staging.join("model.safetensors");
    let (header, mut data) = read_safetensors(&file);
    let mut set = 0;
    for (key, t) in header.as_object().unwrap() {
        if suffixes.iter().any(|s| key.ends_with(s)) {
            assert_eq!(t["dtype"], "F32", "{key}");
            let (from, to) = (
                t["data_offsets"][0].as_u64().unwrap() as usize,
                t["data_offsets"][1].as_u64().unwrap() as usize,
            );
            for v in data[from..to].chunks_exact_mut(4) {
                let x = f32::from_le_bytes(v.try_into().unwrap());
                v.copy_from_slice(&edit(x).to_le_bytes());
            }
            set += 1;
        }
    }
    assert!(
        set > 0,
        "{}: no tensor ends with {suffixes:?}",
        file.display()
    );
    write_safetensors(&file, &header, &data);
    std::fs::rename(&staging, &dir).unwrap();
    dir
}

/// A fresh empty temporary folder under the target dir.
pub fn tempdir(tag: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("work");
    std::fs::create_dir_all(&base).unwrap();
    let d = base.join(format!(
        "{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Where the shared builds of this fixture generation live.
pub fn builds_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("builds")
        .join(FIXTURE_GENERATION)
}

static BUILD_LOCK: Mutex<()> = Mutex::new(());

/// `build --mode all` of the built-in default checkpoint, made once and shared
/// (under the target dir) by every test that needs real packages.
pub fn built_all() -> PathBuf {
    let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("builds")
        .join(FIXTURE_GENERATION)
        .join("default-all");
    if !dir.join("build.json").exists() {
        ok(&["build", "--mode", "all", "--output", dir.to_str().unwrap()]);
    }
    dir
}

/// The FP16 builds of the built-in checkpoint `package --onto` is tested
/// with: (four-chunk with verify_q3 and prefill_b512, `--mode both`).
pub fn onto_builds() -> (PathBuf, PathBuf) {
    let build = built_all();
    let hf = PathBuf::from(
        json_file(&build.join("build.json"))["checkpoint"]["dir"]
            .as_str()
            .unwrap(),
    );
    let four = shared_build(
        "default-four-fp16",
        &hf,
        &[
            "--mode",
            "four",
            "--verify-k",
            "3",
            "--prefill-len",
            "512",
            "--no-quantize",
        ],
    );
    let both = shared_build(
        "default-both-fp16",
        &hf,
        &["--mode", "both", "--no-quantize"],
    );
    (four, both)
}

/// A build of `hf` with `args` shared by tests under
/// target/tmp/builds/<generation>/<name>, made once.
pub fn shared_build(name: &str, hf: &Path, args: &[&str]) -> PathBuf {
    let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("builds")
        .join(FIXTURE_GENERATION)
        .join(name);
    if !dir.join("build.json").exists() {
        let mut all = vec!["build", "--hf-dir", hf.to_str().unwrap()];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--output", dir.to_str().unwrap()]);
        ok(&all);
    }
    dir
}

pub fn json_file(path: &Path) -> serde_json::Value {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A safetensors file as (header, data section).
pub fn read_safetensors(path: &Path) -> (serde_json::Value, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

pub fn write_safetensors(path: &Path, header: &serde_json::Value, data: &[u8]) {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// Copies a checkpoint folder (files only) to a new temporary folder.
pub fn copy_checkpoint(src: &Path, tag: &str) -> PathBuf {
    let dst = tempdir(tag);
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// The pinned environment's python (`chunkforge doctor --venv-python`).
pub fn venv_python() -> PathBuf {
    PathBuf::from(ok(&["doctor", "--venv-python"]).trim())
}

/// A tiny ML program (iOS18) built to break every static audit rule once,
/// each on an op of its own name: `l0_linear` (op type `linear`), `l0_rank5`
/// (rank 5), input `x` and `l0_fp32` (fp32), `l0_wide` (a dimension of
/// 20000), `l0_column` (8192 elements, last axis 1), `l0_dynamic` (input
/// `n` has a symbolic dimension). Saved to `path`, made once per path.
pub fn non_ane_package(path: &Path) -> PathBuf {
    const SCRIPT: &str = r#"
import sys
import numpy as np
import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

@mb.program(input_specs=[mb.TensorSpec(shape=(1, 64), dtype=types.fp32),
                         mb.TensorSpec(shape=(1, get_new_symbol()), dtype=types.fp16)],
            opset_version=ct.target.iOS18)
def prog(x, n):
    w = mb.const(val=np.ones((64, 64), dtype=np.float16), name="layers_0_q_proj_weight")
    h = mb.cast(x=x, dtype="fp16", name="pre_cast")
    h = mb.linear(x=h, weight=w, name="l0_linear")
    r = mb.reshape(x=h, shape=[1, 2, 2, 2, 8], name="l0_rank5")
    f = mb.cast(x=mb.reshape(x=r, shape=[1, 64], name="l0_flat"), dtype="fp32", name="l0_fp32")
    wide = mb.tile(x=h, reps=[1, 313], name="l0_wide")
    col = mb.reshape(x=mb.slice_by_size(x=wide, begin=[0, 0], size=[1, 8192], name="l0_cut"), shape=[1, 8192, 1], name="l0_column")
    d = mb.mul(x=n, y=mb.const(val=np.ones((1, 1), dtype=np.float16), name="layers_0_scale"), name="l0_dynamic")
    return f, col, d

ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
           compute_precision=ct.precision.FLOAT32, pass_pipeline=ct.PassPipeline.EMPTY).save(sys.argv[1])
"#;
    if !path.join("Manifest.json").exists() {
        let o = Command::new(venv_python())
            .args(["-c", SCRIPT])
            .arg(path)
            .output()
            .expect("spawn python");
        assert!(
            o.status.success(),
            "making {}: {}",
            path.display(),
            stderr(&o)
        );
    }
    path.to_path_buf()
}

/// `from` copied file by file into `to` (created).
pub fn copy_tree(from: &Path, to: &Path) {
    for e in walkdir::WalkDir::new(from) {
        let e = e.unwrap();
        let dst = to.join(e.path().strip_prefix(from).unwrap());
        if e.file_type().is_dir() {
            std::fs::create_dir_all(&dst).unwrap();
        } else {
            std::fs::copy(e.path(), &dst).unwrap();
        }
    }
}

/// An upstream bundle's multimodal encoder files for the built-in
/// checkpoint (text hidden size 64, no vision or audio config), made once:
/// the three compiled encoders' `model.mil` signatures as upstream converts
/// them (vision: fp32 `pixel_values` [1, 2520 | 630, 768] and int32
/// `pixel_position_ids` in, fp16 `image_features` rows of the hidden size
/// out; audio: fp16 `input_features` [1, 200, 128] in, the legacy
/// `hidden_states` [1, 50, 1024] out, projected in Swift), stand-ins for the
/// compiler's binary files, a mel filter bank, `audio_config.json` and the
/// projection `.npy` files (1024 -> 1536 -> 64).
pub fn encoder_bundle() -> PathBuf {
    let _guard = FIXTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fixtures/encoder-bundle-2");
    if dir.join("done").exists() {
        return dir;
    }
    let write = |rel: &str, bytes: &[u8]| {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    };
    let mil = |inputs: &str, out: &str| {
        let name = out.rsplit(' ').next().unwrap();
        format!(
            "program(1.3)\n{{\n    func main<ios18>({inputs}) {{\n            {out} = const()[name = string(\"{name}\"), val = {}(0)];\n    }} -> ({name});\n}}\n",
            out.rsplit_once(' ').unwrap().0
        )
    };
    for (m, n) in [("vision.mlmodelc", 2520), ("vision_video.mlmodelc", 630)] {
        let text = mil(
            &format!("tensor<fp32, [1, {n}, 768]> pixel_values, tensor<int32, [1, {n}, 2]> pixel_position_ids"),
            &format!("tensor<fp16, [1, {}, 64]> image_features", n / 9),
        );
        write(&format!("{m}/model.mil"), text.as_bytes());
    }
    let text = mil(
        "tensor<fp16, [1, 200, 128]> input_features",
        "tensor<fp16, [1, 50, 1024]> hidden_states",
    );
    write("audio.mlmodelc/model.mil", text.as_bytes());
    for (i, m) in ["vision.mlmodelc", "vision_video.mlmodelc", "audio.mlmodelc"]
        .iter()
        .enumerate()
    {
        for (j, f) in [
            "weights/weight.bin",
            "coremldata.bin",
            "metadata.json",
            "analytics/coremldata.bin",
        ]
        .iter()
        .enumerate()
        {
            let bytes: Vec<u8> = (0..64 + i * 4 + j)
                .map(|b| (b * 31 + i + j) as u8)
                .collect();
            write(&format!("{m}/{f}"), &bytes);
        }
    }
    // Triangular-ish weights in [0, 1], 257 FFT bins x 128 mel bins, float32.
    let bank: Vec<u8> = (0..257 * 128)
        .flat_map(|i: usize| ((i % 11) as f32 / 10.0).to_le_bytes())
        .collect();
    write("mel_filterbank.bin", &bank);
    write(
        "audio_config.json",
        br#"{"mel_frames": 200, "num_tokens": 50, "log_offset": 0.001}"#,
    );
    // .npy 1.0 files of fp16 values, as numpy.save writes them.
    let npy = |dims: &[usize]| {
        let t: Vec<String> = dims.iter().map(usize::to_string).collect();
        let tuple = if t.len() == 1 {
            format!("({},)", t[0])
        } else {
            format!("({})", t.join(", "))
        };
        let mut dict = format!("{{'descr': '<f2', 'fortran_order': False, 'shape': {tuple}, }}");
        while (10 + dict.len() + 1) % 64 != 0 {
            dict.push(' ');
        }
        dict.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((dict.len() as u16).to_le_bytes());
        out.extend(dict.as_bytes());
        let n: usize = dims.iter().product();
        out.extend((0..n).flat_map(|i| half::f16::from_f32((i % 13) as f32 / 64.0).to_le_bytes()));
        out
    };
    write("output_proj_weight.npy", &npy(&[1536, 1024]));
    write("output_proj_bias.npy", &npy(&[1536]));
    write("embed_proj_weight.npy", &npy(&[64, 1536]));
    write("done", b"");
    dir
}

/// `model.mil` text as coremltools' `get_compiled_model_path()` writes it,
/// stating `chunk`'s functions (a manifest entry): each signature, and each
/// output declared by a statement. The test's stand-in for a compiled
/// package, for the synthetic releases whose packages are not programs.
pub fn text_mil(chunk: &Value) -> String {
    let tensor = |t: &Value| {
        let dims: Vec<String> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.to_string())
            .collect();
        format!(
            "tensor<{}, [{}]>",
            t["dtype"].as_str().unwrap(),
            dims.join(", ")
        )
    };
    let mut text = String::from(
        "program(1.3)\n[buildInfo = dict<string, string>({{\"coremlc-component-MIL\", \"3500.14.1\"}})]\n{\n",
    );
    for f in chunk["functions"].as_array().unwrap() {
        let inputs: Vec<String> = f["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| format!("{} {}", tensor(t), t["name"].as_str().unwrap()))
            .collect();
        text += &format!(
            "    func {}<ios18>({}) {{\n",
            f["name"].as_str().unwrap(),
            inputs.join(", ")
        );
        let mut outs = Vec::new();
        for t in f["outputs"].as_array().unwrap() {
            let n = t["name"].as_str().unwrap();
            text += &format!(
                "            {} {n} = identity(x = var_0)[name = string(\"{n}\")];\n",
                tensor(t)
            );
            outs.push(n.to_string());
        }
        text += &format!("    }} -> ({});\n", outs.join(", "));
    }
    text + "}\n"
}

/// A stand-in upstream bundle made from the chunkforge release `rel`: the app's
/// repository with each package compiled (`text_mil`, the package's weight
/// blob, stand-ins for the compiler's binary files) and no manifest or
/// signature.
pub fn stand_in_bundle(rel: &Path, out: &Path) {
    let m = json_file(&rel.join("manifest.json"));
    let packages: Vec<&Value> = m["chunks"].as_array().unwrap().iter().collect();
    for f in m["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap();
        if path.contains(".mlpackage/")
            || ["manifest.json", "model.sig", "DEVICE_RUNBOOK.md"].contains(&path)
        {
            continue;
        }
        let dst = out.join(path);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(rel.join(path), dst).unwrap();
    }
    for c in packages {
        let file = c["file"].as_str().unwrap();
        let compiled = out.join(file.replace(".mlpackage", ".mlmodelc"));
        std::fs::create_dir_all(compiled.join("analytics")).unwrap();
        std::fs::write(compiled.join("model.mil"), text_mil(c)).unwrap();
        std::fs::write(compiled.join("coremldata.bin"), b"stand-in").unwrap();
        std::fs::write(compiled.join("analytics/coremldata.bin"), b"stand-in").unwrap();
        std::fs::write(compiled.join("metadata.json"), b"[]").unwrap();
        // A package the release holds without its blob (shared in) is
        // fetched without one from upstream too.
        let blob = rel
            .join(file)
            .join("Data/com.apple.CoreML/weights/weight.bin");
        if blob.is_file() {
            std::fs::create_dir_all(compiled.join("weights")).unwrap();
            std::fs::copy(blob, compiled.join("weights/weight.bin")).unwrap();
        }
    }
}

/// `n` (0..=999) in words, as the built-in checkpoint learned to count
/// (python/chunkforge_py/train.py `number_words`): `three hundred forty-two`.
pub fn number_words(n: usize) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 10] = [
        "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    ];
    assert!(n <= 999, "{n}: counting words cover 0..999");
    match n {
        0..=19 => ONES[n].to_string(),
        20..=99 if n.is_multiple_of(10) => TENS[n / 10].to_string(),
        20..=99 => format!("{}-{}", TENS[n / 10], ONES[n % 10]),
        _ if n.is_multiple_of(100) => format!("{} hundred", ONES[n / 100]),
        _ => format!("{} hundred {}", ONES[n / 100], number_words(n % 100)),
    }
}

/// `count` numbers in words from `start`, each followed by a comma, joined
/// by spaces (train.py `counting`): the synthetic task's text.
pub fn counting(start: usize, count: usize) -> String {
    (start..start + count)
        .map(|i| format!("{},", number_words(i)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The synthetic task the built-in checkpoint was trained on
/// (python/chunkforge_py/train.py): counting in words. Its right
/// continuation is known without transformers (`counting(NEXT, ..)`), and
/// changes token at every step with a wide margin, so the KV hand-off from
/// prefill and the decode caches both show in the tokens.
pub const SENTENCE: &str = "forty-seven, forty-eight, forty-nine,";
/// The number the continuation of [`SENTENCE`] starts with.
pub const NEXT: usize = 50;

/// The built-in checkpoint's folder in this repository (checkpoints/default).
pub fn builtin_checkpoint() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("checkpoints/default")
}

/// `text`'s token ids by the built-in checkpoint's tokenizer, `<bos>` first,
/// as a comma-separated `--prompt-ids` value.
pub fn builtin_prompt_ids(text: &str) -> String {
    let python = ok(&["doctor", "--venv-python"]).trim().to_string();
    let script = r#"
import sys
from tokenizers import Tokenizer
ids = Tokenizer.from_file(sys.argv[1]).encode(sys.argv[2]).ids
print(",".join(map(str, ids)))
"#;
    let o = Command::new(python)
        .args(["-c", script])
        .arg(builtin_checkpoint().join("tokenizer.json"))
        .arg(text)
        .output()
        .expect("run the venv python");
    assert!(o.status.success(), "tokenizers: {}", stderr(&o));
    let ids = stdout(&o).trim().to_string();
    assert!(ids.starts_with("2,"), "<bos> first: {ids}");
    ids
}
pub const TOKENS: usize = 16;

pub fn ids(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// transformers' own tokenizer and greedy `generate` on the source
/// checkpoint: (prompt ids, generated ids).
pub fn transformers_greedy(checkpoint: &Path, text: &str, n: usize) -> (Vec<i64>, Vec<i64>) {
    let python = ok(&["doctor", "--venv-python"]).trim().to_string();
    let script = r#"
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, text, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
print(json.dumps({"prompt": ids, "generated": out[0, len(ids):].tolist()}))
"#;
    let o = Command::new(python)
        .args([
            "-c",
            script,
            checkpoint.to_str().unwrap(),
            text,
            &n.to_string(),
        ])
        .output()
        .expect("run the venv python");
    assert!(o.status.success(), "transformers: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).lines().last().unwrap()).unwrap();
    (ids(&v["prompt"]), ids(&v["generated"]))
}
