//! An upstream bundle: a model folder as the app downloads it from an
//! upstream repository (john-rocky/CoreML-LLM's Hugging Face repos), with
//! compiled `.mlmodelc` packages and no `manifest.json`, in the repository
//! layout (`swa/chunk1.mlmodelc`, `prefill/chunk1.mlmodelc`,
//! `swa/cos_sliding.npy`) or the local one the app saves it in
//! (`chunk1.mlmodelc`, `prefill_chunk1.mlmodelc`, `cos_sliding.npy`).
//!
//! Nothing in it is signed or recorded, so everything `package --onto`
//! carries from it is read from the files themselves: the dimensions from
//! `hf_model/config.json` and `model_config.json`, the side files' sizes
//! from those dimensions, and each package's contract from its text MIL
//! (`model.mil`, as coremltools' `get_compiled_model_path()` writes it:
//! `func NAME<ios18>(tensor<fp16, [1, 1, 1536]> hidden_states, ...) { ... }
//! -> (out, ...);`, each output declared by the statement that makes it).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use chunkforge_model::config::TextConfig;
use chunkforge_model::plan::Dtype;

use crate::folder::{self, FolderError, FolderKind};
use crate::manifest::{self, ContractTensor};
use crate::paths::HF_MODEL_DIR;
use crate::sidefiles;

type Result<T, E = FolderError> = std::result::Result<T, E>;

fn err(path: &Path, message: impl Into<String>) -> FolderError {
    FolderError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The package every model folder has, by which a bundle is recognised.
const FIRST_PACKAGE: &str = "chunk1";

/// One function of a compiled model, as its text MIL declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct MilFunction {
    pub name: String,
    pub inputs: Vec<ContractTensor>,
    pub outputs: Vec<ContractTensor>,
}

/// An upstream bundle, opened: its dimensions read and checked against
/// each other.
pub struct Bundle {
    pub dir: PathBuf,
    pub kind: FolderKind,
    /// `hf_model/config.json`.
    pub cfg: TextConfig,
    /// `model_config.json`'s `context_length`.
    pub context_length: usize,
    /// `model_config.json`'s `model_name`.
    pub model_name: String,
}

impl Bundle {
    /// The layout of `dir` when it holds a compiled `chunk1` the way an
    /// upstream bundle does (None: not a bundle).
    pub fn detect(dir: &Path) -> Option<FolderKind> {
        if dir
            .join(manifest::package_file(FIRST_PACKAGE, true))
            .is_dir()
        {
            Some(FolderKind::Repository)
        } else if dir.join(format!("{FIRST_PACKAGE}.mlmodelc")).is_dir() {
            Some(FolderKind::Local)
        } else {
            None
        }
    }

    /// Opens the bundle `dir` of layout `kind`: `hf_model/config.json` and
    /// `model_config.json`, which must describe one model.
    pub fn open(dir: &Path, kind: FolderKind) -> Result<Bundle> {
        // Nothing is read through a symlink, a FIFO or a name that is not
        // plain (a link could carry a file from outside into the release).
        folder::refuse_links(dir)?;
        let hf = dir.join(HF_MODEL_DIR);
        if !hf.join("config.json").is_file() {
            return Err(err(
                &hf.join("config.json"),
                "missing: an upstream bundle is checked against the build through its model's config.json",
            ));
        }
        let cfg = TextConfig::load(&hf).map_err(|e| err(&hf, e.to_string()))?;
        let config_path = dir.join(sidefiles::MODEL_CONFIG);
        let config = folder::read_model_config(&config_path)?;
        folder::check_model_config(&config, &config_path, &cfg)?;
        Ok(Bundle {
            dir: dir.to_path_buf(),
            kind,
            cfg,
            context_length: config.context_length,
            model_name: config.model_name,
        })
    }

    /// Package `name`'s folder: at its remote path in the repository
    /// layout, under its own name in the local one.
    pub fn package_dir(&self, name: &str) -> PathBuf {
        match self.kind {
            FolderKind::Repository => self.dir.join(manifest::package_file(name, true)),
            FolderKind::Local => self.dir.join(format!("{name}.mlmodelc")),
        }
    }

    /// Package `name`'s functions, read from its `model.mil`.
    pub fn functions(&self, name: &str) -> Result<Vec<MilFunction>> {
        let path = self.package_dir(name).join("model.mil");
        let bytes = fs::read(&path).map_err(|e| {
            err(
                &path,
                if e.kind() == std::io::ErrorKind::NotFound {
                    "missing: the package's program, which states its contract".to_string()
                } else {
                    format!("cannot read: {e}")
                },
            )
        })?;
        let text = std::str::from_utf8(&bytes).map_err(|_| {
            err(
                &path,
                "not text MIL (a binary model.mil, as `xcrun coremlcompiler` writes, which the iPhone rejects)",
            )
        })?;
        mil_functions(text).map_err(|m| err(&path, m))
    }
}

/// The functions of a text MIL program: each one's inputs from its
/// signature, its outputs from its `-> (...)` list, typed by the
/// statements that declare them.
pub fn mil_functions(text: &str) -> std::result::Result<Vec<MilFunction>, String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = find_func(rest) {
        let after = &rest[at + "func ".len()..];
        let name_end = after
            .find(['<', '('])
            .ok_or("a `func` without a signature")?;
        let name = after[..name_end].trim().to_string();
        let open = after.find('(').ok_or("a `func` without a signature")?;
        let close = matching(after, open).ok_or_else(|| format!("{name}: unclosed signature"))?;
        let inputs = split_top(&after[open + 1..close])
            .into_iter()
            .filter(|a| !a.trim().is_empty())
            .map(|a| typed(a.trim()).map_err(|m| format!("function {name}: {m}")))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let body_and_rest = &after[close + 1..];
        let end = body_and_rest
            .find("} -> (")
            .ok_or_else(|| format!("function {name}: no `}} -> (...)` output list"))?;
        let body = &body_and_rest[..end];
        let list_start = end + "} -> (".len();
        let list_end = body_and_rest[list_start..]
            .find(')')
            .ok_or_else(|| format!("function {name}: unclosed output list"))?;
        let declared: BTreeMap<&str, &str> = body
            .lines()
            .filter_map(|l| l.trim().split_once(" = "))
            .filter_map(|(lhs, _)| {
                let (ty, var) = lhs.rsplit_once(' ')?;
                Some((var.trim(), ty.trim()))
            })
            .collect();
        let outputs = body_and_rest[list_start..list_start + list_end]
            .split(',')
            .map(str::trim)
            .filter(|o| !o.is_empty())
            .map(|o| {
                let ty = declared.get(o).ok_or_else(|| {
                    format!("function {name}: output {o} is declared by no statement")
                })?;
                typed(&format!("{ty} {o}")).map_err(|m| format!("function {name}: {m}"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        out.push(MilFunction {
            name,
            inputs,
            outputs,
        });
        rest = &body_and_rest[list_start + list_end..];
    }
    if out.is_empty() {
        return Err("declares no function (`func NAME<...>(...)`)".into());
    }
    Ok(out)
}

/// Where the next `func ` declaration starts (at a line's first word).
fn find_func(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = text[from..].find("func ") {
        let pos = from + at;
        let line_start = text[..pos].rfind('\n').map_or(0, |n| n + 1);
        if text[line_start..pos].trim().is_empty() {
            return Some(pos);
        }
        from = pos + 1;
    }
    None
}

/// The `)` closing the `(` at `open`.
fn matching(text: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// `text` split at the commas outside `<...>` and `[...]`.
fn split_top(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '<' | '[' => depth += 1,
            '>' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// `tensor<fp16, [1, 1, 1536]> name` as a contract tensor.
fn typed(decl: &str) -> std::result::Result<ContractTensor, String> {
    let (ty, name) = decl
        .rsplit_once(|c: char| c.is_whitespace())
        .ok_or_else(|| format!("`{decl}` is not `TYPE NAME`"))?;
    let inner = ty
        .trim()
        .strip_prefix("tensor<")
        .and_then(|t| t.strip_suffix('>'))
        .ok_or_else(|| {
            format!(
                "{name}: `{ty}` is not a tensor type (states are not in the runtime's contract)"
            )
        })?;
    let (dtype, shape) = inner
        .split_once(',')
        .ok_or_else(|| format!("{name}: `{ty}` has no shape"))?;
    let dtype = Dtype::from_str(dtype.trim()).map_err(|e| format!("{name}: {e}"))?;
    let shape = shape
        .trim()
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .ok_or_else(|| format!("{name}: `{ty}` has no [dims]"))?
        .split(',')
        .map(|d| {
            d.trim().parse::<usize>().map_err(|_| {
                format!(
                    "{name}: dimension `{}` is not fixed (the runtime binds fixed shapes)",
                    d.trim()
                )
            })
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(ContractTensor {
        name: name.to_string(),
        shape,
        dtype,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"program(1.3)
[buildInfo = dict<string, string>({{"coremlc-component-MIL", "3500.14.1"}, {"coremltools-version", "9.0"}})]
{
    func decode_q1<ios18>(tensor<fp16, [1, 1, 64]> hidden_states, tensor<fp16, [1, 1, 1, 512]> causal_mask_full) {
            tensor<int32, [1]> var_10 = const()[name = string("op_10"), val = tensor<int32, [1]>([-1])];
            tensor<fp16, [1, 1, 64]> hidden_states_out = add(x = hidden_states, y = hidden_states)[name = string("hidden_states_out")];
            tensor<int32, [1]> token_id = const()[name = string("token_id"), val = tensor<int32, [1]>([0])];
    } -> (hidden_states_out, token_id);
    func verify_qK<ios18>(tensor<fp16, [1, 3, 64]> hidden_states) {
            tensor<fp16, [1, 3, 64]> hidden_states_out = mul(x = hidden_states, y = hidden_states)[name = string("hidden_states_out")];
    } -> (hidden_states_out);
}
"#;

    fn t(name: &str, shape: &[usize], dtype: Dtype) -> ContractTensor {
        ContractTensor {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
        }
    }

    #[test]
    fn reads_every_function_contract() {
        let f = mil_functions(TEXT).unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].name, "decode_q1");
        assert_eq!(
            f[0].inputs,
            vec![
                t("hidden_states", &[1, 1, 64], Dtype::Fp16),
                t("causal_mask_full", &[1, 1, 1, 512], Dtype::Fp16)
            ]
        );
        assert_eq!(
            f[0].outputs,
            vec![
                t("hidden_states_out", &[1, 1, 64], Dtype::Fp16),
                t("token_id", &[1], Dtype::Int32)
            ]
        );
        assert_eq!(f[1].name, "verify_qK");
        assert_eq!(
            f[1].outputs,
            vec![t("hidden_states_out", &[1, 3, 64], Dtype::Fp16)]
        );
        // The downloader's own reading of the same text agrees.
        assert_eq!(crate::client_check::mil_context(TEXT), Some(512));
    }

    #[test]
    fn refuses_what_it_cannot_type() {
        let undeclared = TEXT.replace(
            "-> (hidden_states_out, token_id)",
            "-> (hidden_states_out, nowhere)",
        );
        assert!(mil_functions(&undeclared)
            .unwrap_err()
            .contains("output nowhere is declared by no statement"));
        let flexible = TEXT.replace("[1, 3, 64]> hidden_states)", "[1, is0, 64]> hidden_states)");
        assert!(mil_functions(&flexible)
            .unwrap_err()
            .contains("is not fixed"));
        assert!(mil_functions("program(1.3)\n{\n}\n")
            .unwrap_err()
            .contains("declares no function"));
    }
}
