//! The Gemma 4 text-decoder configuration, read from a checkpoint's `config.json`.
//!
//! Every structural number chunkforge uses (layer count, layer types, KV sharing,
//! head dims, window) comes from here; nothing else hard-codes E2B values.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::InputError;

/// Attention kind of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    Sliding,
    Full,
}

impl Attention {
    pub fn label(self) -> &'static str {
        match self {
            Attention::Sliding => "sliding",
            Attention::Full => "full",
        }
    }
}

/// The fields of the text config that shape the decode graph.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TextConfig {
    #[serde(skip)]
    pub path: PathBuf,
    /// `Gemma4ForCausalLM` or `Gemma4ForConditionalGeneration`.
    pub architecture: String,
    /// Whether the text config sat under `text_config` (multimodal checkpoint).
    pub multimodal: bool,
    pub vocab_size: usize,
    pub vocab_size_per_layer_input: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub num_global_key_value_heads: usize,
    pub head_dim: usize,
    pub global_head_dim: usize,
    pub sliding_window: usize,
    pub hidden_size_per_layer_input: usize,
    pub num_kv_shared_layers: usize,
    pub use_double_wide_mlp: bool,
    pub final_logit_softcapping: Option<f64>,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub layer_types: Vec<Attention>,
    pub rope_theta_sliding: f64,
    pub rope_theta_full: f64,
    pub partial_rotary_factor_full: f64,
}

fn field<'a>(obj: &'a Value, key: &str, path: &Path) -> Result<&'a Value, InputError> {
    obj.get(key).ok_or_else(|| InputError::Config {
        path: path.to_path_buf(),
        message: format!("missing field `{key}`"),
    })
}

fn usize_field(obj: &Value, key: &str, path: &Path) -> Result<usize, InputError> {
    field(obj, key, path)?
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| InputError::Config {
            path: path.to_path_buf(),
            message: format!("field `{key}` must be a non-negative integer"),
        })
}

fn opt_usize(obj: &Value, key: &str, path: &Path) -> Result<Option<usize>, InputError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => usize_field(obj, key, path).map(Some),
    }
}

fn f64_or(obj: &Value, key: &str, default: f64, path: &Path) -> Result<f64, InputError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| InputError::Config {
            path: path.to_path_buf(),
            message: format!("field `{key}` must be a number"),
        }),
    }
}

impl TextConfig {
    /// Reads `dir/config.json` and checks it describes a Gemma 4 text decoder
    /// chunkforge can plan.
    pub fn load(dir: &Path) -> Result<Self, InputError> {
        let path = dir.join("config.json");
        let bytes = std::fs::read(&path).map_err(|e| InputError::Io {
            path: path.clone(),
            action: "read the model config",
            source: e,
        })?;
        let root: Value = serde_json::from_slice(&bytes).map_err(|e| InputError::Config {
            path: path.clone(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(&root, &path)
    }

    pub fn from_json(root: &Value, path: &Path) -> Result<Self, InputError> {
        let bad = |message: String| InputError::Config {
            path: path.to_path_buf(),
            message,
        };
        let architecture = root
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let (text, multimodal) = match root.get("text_config") {
            Some(t) if t.is_object() => (t, true),
            _ => (root, false),
        };
        let model_type = text.get("model_type").and_then(Value::as_str).unwrap_or("");
        let top_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        if model_type != "gemma4_text" && !(model_type.is_empty() && top_type == "gemma4") {
            let found = if model_type.is_empty() {
                top_type
            } else {
                model_type
            };
            return Err(bad(format!(
                "model_type is `{found}`, expected `gemma4_text` (or `gemma4` with a `text_config`); \
                 chunkforge only converts Gemma 4 text decoders"
            )));
        }
        for (flag, what) in [
            ("enable_moe_block", "mixture-of-experts layers"),
            (
                "attention_k_eq_v",
                "shared K/V projections (attention_k_eq_v)",
            ),
        ] {
            if text.get(flag).and_then(Value::as_bool).unwrap_or(false) {
                return Err(bad(format!(
                    "`{flag}` is true: {what} are not supported by chunkforge's decode chunks"
                )));
            }
        }

        let n = usize_field(text, "num_hidden_layers", path)?;
        if n == 0 {
            return Err(bad("num_hidden_layers is 0".into()));
        }
        let layer_types = match text.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(Attention::Sliding),
                    Some("full_attention") => Ok(Attention::Full),
                    other => Err(bad(format!(
                        "layer_types[{i}] is {other:?}, expected \"sliding_attention\" or \"full_attention\""
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err(bad("missing field `layer_types` (a list, one entry per layer)".into())),
        };
        if layer_types.len() != n {
            return Err(bad(format!(
                "layer_types has {} entries but num_hidden_layers is {n}",
                layer_types.len()
            )));
        }

        let rope = text.get("rope_parameters");
        let rope_of = |kind: &str| rope.and_then(|r| r.get(kind));
        let theta_s = rope_of("sliding_attention")
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        let full = rope_of("full_attention");
        let theta_f = full
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(1_000_000.0);
        let full_type = full
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
            .unwrap_or("proportional");
        let partial = if full_type == "proportional" {
            full.and_then(|r| r.get("partial_rotary_factor"))
                .and_then(Value::as_f64)
                .unwrap_or(1.0)
        } else if full_type == "default" {
            1.0
        } else {
            return Err(bad(format!(
                "rope_parameters.full_attention.rope_type is `{full_type}`; only `proportional` and `default` are supported"
            )));
        };

        let kv_heads = usize_field(text, "num_key_value_heads", path)?;
        let cfg = TextConfig {
            path: path.to_path_buf(),
            architecture,
            multimodal,
            vocab_size: usize_field(text, "vocab_size", path)?,
            vocab_size_per_layer_input: opt_usize(text, "vocab_size_per_layer_input", path)?
                .unwrap_or(usize_field(text, "vocab_size", path)?),
            hidden_size: usize_field(text, "hidden_size", path)?,
            intermediate_size: usize_field(text, "intermediate_size", path)?,
            num_hidden_layers: n,
            num_attention_heads: usize_field(text, "num_attention_heads", path)?,
            num_key_value_heads: kv_heads,
            num_global_key_value_heads: kv_heads,
            head_dim: usize_field(text, "head_dim", path)?,
            global_head_dim: opt_usize(text, "global_head_dim", path)?
                .unwrap_or(usize_field(text, "head_dim", path)?),
            sliding_window: usize_field(text, "sliding_window", path)?,
            hidden_size_per_layer_input: usize_field(text, "hidden_size_per_layer_input", path)?,
            num_kv_shared_layers: opt_usize(text, "num_kv_shared_layers", path)?.unwrap_or(0),
            use_double_wide_mlp: text
                .get("use_double_wide_mlp")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            final_logit_softcapping: text.get("final_logit_softcapping").and_then(Value::as_f64),
            rms_norm_eps: f64_or(text, "rms_norm_eps", 1e-6, path)?,
            tie_word_embeddings: text
                .get("tie_word_embeddings")
                .or_else(|| root.get("tie_word_embeddings"))
                .and_then(Value::as_bool)
                .unwrap_or(true),
            layer_types,
            rope_theta_sliding: theta_s,
            rope_theta_full: theta_f,
            partial_rotary_factor_full: partial,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), InputError> {
        let bad = |message: String| InputError::Config {
            path: self.path.clone(),
            message,
        };
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("sliding_window", self.sliding_window),
            (
                "hidden_size_per_layer_input",
                self.hidden_size_per_layer_input,
            ),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(bad(format!("{name} is 0")));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(bad(format!(
                "num_attention_heads={} is not a multiple of num_key_value_heads={}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if !self.tie_word_embeddings {
            return Err(bad(
                "tie_word_embeddings is false; chunkforge expects Gemma 4's tied LM head".into(),
            ));
        }
        let n = self.num_hidden_layers;
        if self.num_kv_shared_layers >= n {
            return Err(bad(format!(
                "num_kv_shared_layers={} leaves no layer that computes its own K/V (num_hidden_layers={n})",
                self.num_kv_shared_layers
            )));
        }
        let kv_start = self.kv_start();
        if self.num_kv_shared_layers > 0 {
            for kind in [Attention::Sliding, Attention::Full] {
                let shared_use = self.layer_types[kv_start..].contains(&kind);
                if shared_use && self.producer(kind).is_none() {
                    return Err(bad(format!(
                        "num_kv_shared_layers={} leaves no KV-producing {}-attention layer before layer {kv_start}",
                        self.num_kv_shared_layers,
                        kind.label()
                    )));
                }
            }
        }
        Ok(())
    }

    /// First layer that reads shared KV instead of computing its own.
    pub fn kv_start(&self) -> usize {
        self.num_hidden_layers - self.num_kv_shared_layers
    }

    /// The last KV-owning layer of `kind`, whose cache the shared layers of that kind read.
    pub fn producer(&self, kind: Attention) -> Option<usize> {
        (0..self.kv_start())
            .rev()
            .find(|&i| self.layer_types[i] == kind)
    }

    /// Feed-forward width of layer `i` (KV-shared layers are double-wide when configured).
    pub fn mlp_width(&self, i: usize) -> usize {
        let shared = self.num_kv_shared_layers > 0 && i >= self.kv_start();
        if self.use_double_wide_mlp && shared {
            2 * self.intermediate_size
        } else {
            self.intermediate_size
        }
    }

    pub fn head_dim_of(&self, kind: Attention) -> usize {
        match kind {
            Attention::Sliding => self.head_dim,
            Attention::Full => self.global_head_dim,
        }
    }

    pub fn kv_heads_of(&self, kind: Attention) -> usize {
        match kind {
            Attention::Sliding => self.num_key_value_heads,
            Attention::Full => self.num_global_key_value_heads,
        }
    }

    pub fn max_head_dim(&self) -> usize {
        self.head_dim.max(self.global_head_dim)
    }
}
