//! The Gemma 4 text-decoder configuration, read from a checkpoint's `config.json`.
//!
//! Every structural number chunkforge uses (layer count, layer types, KV sharing,
//! head dims, window) comes from here; nothing else hard-codes E2B values.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::InputError;

crate::named! {
    /// Attention kind of one decoder layer.
    pub enum Attention {
        Sliding = "sliding",
        Full = "full",
    }
}

/// The smallest normal and the largest finite fp16 values: a factor the
/// packages compute with in fp16 must lie between them.
const F16_MIN_NORMAL: f64 = 6.103515625e-5;
const F16_MAX: f64 = 65504.0;

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

/// transformers' `Gemma4TextConfig` defaults for fields a config.json may leave
/// out (`save_pretrained` writes them all, hand-written configs may not):
/// chunkforge must compute what transformers computes for the same file.
const DEFAULT_GLOBAL_HEAD_DIM: usize = 512;
const DEFAULT_ROPE: (f64, f64, f64) = (10_000.0, 1_000_000.0, 0.25);
/// The only MLP activation chunkforge's modules compute (tanh-approximated GELU).
const ACTIVATION: &str = "gelu_pytorch_tanh";

/// Reads the fields of one object of config.json, naming each by its dotted
/// path (`rope_parameters.full_attention.rope_theta`) and its value in errors.
struct Fields<'a> {
    obj: &'a Value,
    prefix: &'a str,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    fn err(&self, message: String) -> InputError {
        InputError::Config {
            path: self.path.to_path_buf(),
            message,
        }
    }

    fn bad(&self, key: &str, v: &Value, expected: &str) -> InputError {
        self.err(format!(
            "`{}{key}` is {v}, expected {expected}",
            self.prefix
        ))
    }

    /// The value of `key`; `None` when absent or null (transformers' default applies).
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn required(&self, key: &str) -> Result<&'a Value, InputError> {
        self.get(key)
            .ok_or_else(|| self.err(format!("missing field `{}{key}`", self.prefix)))
    }

    fn usize(&self, key: &str) -> Result<usize, InputError> {
        let v = self.required(key)?;
        v.as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| self.bad(key, v, "a non-negative integer"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, InputError> {
        self.get(key).map(|_| self.usize(key)).transpose()
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, InputError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, v, "true or false")),
        }
    }

    /// A finite number accepted by `ok` (described by `expected`); `default`
    /// when absent, an error when absent without one.
    fn num(
        &self,
        key: &str,
        default: Option<f64>,
        ok: impl Fn(f64) -> bool,
        expected: &str,
    ) -> Result<f64, InputError> {
        let v = match (self.get(key), default) {
            (None, Some(d)) => return Ok(d),
            (None, None) => self.required(key)?,
            (Some(v), _) => v,
        };
        v.as_f64()
            .filter(|x| x.is_finite() && ok(*x))
            .ok_or_else(|| self.bad(key, v, expected))
    }

    /// A string out of `supported`; `default` when absent.
    fn one_of(
        &self,
        key: &str,
        default: Option<&'static str>,
        supported: &[&'static str],
    ) -> Result<&'static str, InputError> {
        let v = match (self.get(key), default) {
            (None, Some(d)) => return Ok(d),
            (None, None) => self.required(key)?,
            (Some(v), _) => v,
        };
        let list = supported
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(" or ");
        v.as_str()
            .and_then(|s| supported.iter().find(|&&x| x == s).copied())
            .ok_or_else(|| {
                self.err(format!(
                    "`{}{key}` is {v}; chunkforge implements only {list}",
                    self.prefix
                ))
            })
    }
}

/// RoPE of both layer kinds from `rope_parameters`: (sliding theta, full
/// theta, full partial_rotary_factor). Only what the stepper computes is
/// accepted: plain RoPE on sliding layers, proportional (or plain, when the
/// head dims agree) on full layers, no frequency scaling.
fn rope(
    text: &Value,
    layer_types: &[Attention],
    head_dim: usize,
    global_head_dim: usize,
    path: &Path,
) -> Result<(f64, f64, f64), InputError> {
    let top = Fields {
        obj: text,
        prefix: "",
        path,
    };
    let Some(params) = top.get("rope_parameters") else {
        return Ok(DEFAULT_ROPE);
    };
    if !params.is_object() {
        return Err(top.bad(
            "rope_parameters",
            params,
            "an object with `sliding_attention` and `full_attention` entries",
        ));
    }
    let (mut theta_s, mut theta_f, mut partial) = (0.0, 0.0, 1.0);
    for kind in [Attention::Sliding, Attention::Full] {
        if !layer_types.contains(&kind) {
            continue;
        }
        let key = format!("{}_attention", kind.as_str());
        let prefix = format!("rope_parameters.{key}.");
        let entry = params.get(&key).unwrap_or(&Value::Null);
        if !entry.is_object() {
            return Err(top.err(format!(
                "`rope_parameters.{key}` is {entry}, expected an object with `rope_type` and `rope_theta` ({} layers use it)",
                kind.as_str()
            )));
        }
        let f = Fields {
            obj: entry,
            prefix: &prefix,
            path,
        };
        let supported: &[&str] = match kind {
            Attention::Sliding => &["default"],
            Attention::Full => &["proportional", "default"],
        };
        let rope_type = f.one_of("rope_type", None, supported)?;
        // Frequencies theta^(-2i/d) above 1 would overflow position * frequency.
        let theta = f.num(
            "rope_theta",
            None,
            |x| x > 1.0,
            "a number > 1 (the rotation frequencies theta^(-2i/d) must not exceed 1)",
        )?;
        match kind {
            Attention::Sliding => theta_s = theta,
            Attention::Full => theta_f = theta,
        }
        if kind == Attention::Full && rope_type == "proportional" {
            partial = f.num(
                "partial_rotary_factor",
                Some(1.0),
                |x| x > 0.0 && x <= 1.0,
                "a number in (0, 1]",
            )?;
            f.num(
                "factor",
                Some(1.0),
                |x| x == 1.0,
                "1.0 (chunkforge does not scale RoPE frequencies)",
            )?;
        } else if kind == Attention::Full && global_head_dim != head_dim {
            return Err(f.err(format!(
                "`{prefix}rope_type` is \"default\", which transformers computes over head_dim={head_dim}, \
                 not the full layers' global_head_dim={global_head_dim}; chunkforge supports it only when the two \
                 are equal (use \"proportional\")"
            )));
        }
    }
    Ok((theta_s, theta_f, partial))
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
        // A key given twice would let chunkforge and transformers (or two
        // versions of either) read different models from one file.
        let root: Value =
            crate::strict_json::from_slice(&bytes).map_err(|e| InputError::Config {
                path: path.clone(),
                message: match e.classify() {
                    // The duplicate key, named with where it is.
                    serde_json::error::Category::Data => e.to_string(),
                    _ => format!("not valid JSON: {e}"),
                },
            })?;
        Self::from_json(&root, &path)
    }

    /// Reads the text config and checks every field that changes what the
    /// decoder computes: its type, its range, and that chunkforge implements
    /// the value (an unimplemented one is an error naming field, value and
    /// what is supported, never silently replaced). `plan`, `build` and
    /// `parity` all load the config through here.
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
        let f = Fields {
            obj: text,
            prefix: "",
            path,
        };
        for (flag, what) in [
            ("enable_moe_block", "mixture-of-experts layers"),
            (
                "attention_k_eq_v",
                "shared K/V projections (attention_k_eq_v)",
            ),
            ("attention_bias", "bias terms in the attention projections"),
        ] {
            if f.bool_or(flag, false)? {
                return Err(bad(format!(
                    "`{flag}` is true: {what} are not supported by chunkforge's decode chunks"
                )));
            }
        }
        f.one_of("hidden_activation", Some(ACTIVATION), &[ACTIVATION])?;
        if let Some(v) = f.get("use_bidirectional_attention") {
            // "vision" only changes how image tokens attend; text decoding stays causal.
            if v.as_str() != Some("vision") {
                return Err(bad(format!(
                    "`use_bidirectional_attention` is {v}; chunkforge's decode is causal, so only null or \"vision\" is supported"
                )));
            }
        }

        let n = f.usize("num_hidden_layers")?;
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
        if layer_types[n - 1] != Attention::Full {
            return Err(bad(format!(
                "layer_types[{}] (the last layer) is \"sliding_attention\"; transformers runs Gemma 4's last layer \
                 with full attention whatever the config says, so chunkforge supports only \"full_attention\" there",
                n - 1
            )));
        }

        let head_dim = f.usize("head_dim")?;
        // transformers uses head_dim for full layers when global_head_dim is null.
        let global_head_dim = match text.get("global_head_dim") {
            None => DEFAULT_GLOBAL_HEAD_DIM,
            Some(Value::Null) => head_dim,
            Some(_) => f.usize("global_head_dim")?,
        };
        let (theta_s, theta_f, partial) =
            rope(text, &layer_types, head_dim, global_head_dim, path)?;
        let final_logit_softcapping = f
            .get("final_logit_softcapping")
            .map(|_| {
                // The packages compute tanh(x / cap) * cap in fp16.
                f.num(
                    "final_logit_softcapping",
                    None,
                    |x| (F16_MIN_NORMAL..=F16_MAX).contains(&x),
                    "a number fp16 holds (6.1e-5 to 65504), or null for no capping",
                )
            })
            .transpose()?;
        // The norms compute in fp16 on the device, whose smallest subnormal is ~6e-8.
        let rms_norm_eps = f.num(
            "rms_norm_eps",
            Some(1e-6),
            |x| (6e-8..=1e-2).contains(&x),
            "a small positive number (6e-8 <= eps <= 0.01)",
        )?;
        // A multimodal checkpoint may record the tie at the top level instead.
        let tie_word_embeddings = if f.get("tie_word_embeddings").is_some() || !multimodal {
            f.bool_or("tie_word_embeddings", true)?
        } else {
            Fields {
                obj: root,
                prefix: "",
                path,
            }
            .bool_or("tie_word_embeddings", true)?
        };

        let kv_heads = f.usize("num_key_value_heads")?;
        let vocab_size = f.usize("vocab_size")?;
        let cfg = TextConfig {
            path: path.to_path_buf(),
            architecture,
            multimodal,
            vocab_size,
            vocab_size_per_layer_input: f
                .opt_usize("vocab_size_per_layer_input")?
                .unwrap_or(vocab_size),
            hidden_size: f.usize("hidden_size")?,
            intermediate_size: f.usize("intermediate_size")?,
            num_hidden_layers: n,
            num_attention_heads: f.usize("num_attention_heads")?,
            num_key_value_heads: kv_heads,
            num_global_key_value_heads: kv_heads,
            head_dim,
            global_head_dim,
            sliding_window: f.usize("sliding_window")?,
            hidden_size_per_layer_input: f.usize("hidden_size_per_layer_input")?,
            num_kv_shared_layers: f.opt_usize("num_kv_shared_layers")?.unwrap_or(0),
            use_double_wide_mlp: f.bool_or("use_double_wide_mlp", false)?,
            final_logit_softcapping,
            rms_norm_eps,
            tie_word_embeddings,
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
        for (name, v, max, published) in self.sizes() {
            if v == 0 {
                return Err(bad(format!("{name} is 0")));
            }
            if v > max {
                return Err(bad(format!(
                    "{name}={v} is out of range: chunkforge accepts 1..={max} ({published}); \
                     a larger value is a typo or not a Gemma 4 model"
                )));
            }
        }
        // RoPE rotates the two halves of each head against each other.
        for (name, v) in [
            ("head_dim", self.head_dim),
            ("global_head_dim", self.global_head_dim),
        ] {
            if !v.is_multiple_of(2) {
                return Err(bad(format!(
                    "{name}={v} is odd; RoPE needs an even head dimension"
                )));
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
                        kind.as_str()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every size that becomes a tensor dimension, with its upper bound and
    /// why: `(field, value, max, reason)`, checked before anything is
    /// planned, allocated or created. Each bound is a generous multiple of
    /// the largest value a published Gemma 4 uses (transformers 5.5's
    /// `convert_gemma4_weights.py`: E2B, E4B, 26B-A4B, 31B), so real
    /// checkpoints and their fine-tunes fit while a typo or a hostile file is
    /// refused by `plan` and `build` alike instead of by an allocator (a
    /// `sliding_window` of 10^12 asked torch for 4 TB). How large the tensors
    /// they multiply into may grow is the plan's check
    /// ([`crate::plan::MAX_TENSOR_BYTES`]).
    pub fn sizes(&self) -> [(&'static str, usize, usize, &'static str); 11] {
        [
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                512,
                "Gemma 4 31B has 60",
            ),
            (
                "hidden_size",
                self.hidden_size,
                65_536,
                "Gemma 4 31B has 5376",
            ),
            (
                "intermediate_size",
                self.intermediate_size,
                262_144,
                "Gemma 4 31B has 21504",
            ),
            (
                "num_attention_heads",
                self.num_attention_heads,
                256,
                "Gemma 4 31B has 32",
            ),
            (
                "num_key_value_heads",
                self.num_key_value_heads,
                256,
                "Gemma 4 31B has 16",
            ),
            ("head_dim", self.head_dim, 4096, "Gemma 4 has 256"),
            (
                "global_head_dim",
                self.global_head_dim,
                4096,
                "Gemma 4 has 512",
            ),
            ("vocab_size", self.vocab_size, 1 << 21, "Gemma 4 has 262144"),
            (
                "vocab_size_per_layer_input",
                self.vocab_size_per_layer_input,
                1 << 21,
                "Gemma 4 has 262144",
            ),
            (
                "hidden_size_per_layer_input",
                self.hidden_size_per_layer_input,
                4096,
                "Gemma 4 E2B and E4B have 256",
            ),
            (
                "sliding_window",
                self.sliding_window,
                crate::args::MAX_CTX,
                "a window longer than the longest context (--ctx <= 131072) never fills; \
                 Gemma 4 uses 512 and 1024",
            ),
        ]
    }

    /// First layer that reads shared KV instead of computing its own.
    pub fn kv_start(&self) -> usize {
        self.num_hidden_layers - self.num_kv_shared_layers
    }

    /// Whether layer `i` computes its own K/V (the rest read a producer's).
    pub fn owns_kv(&self, i: usize) -> bool {
        i < self.kv_start()
    }

    /// The last KV-owning layer of `kind`, whose cache the shared layers of that kind read.
    pub fn producer(&self, kind: Attention) -> Option<usize> {
        (0..self.kv_start())
            .rev()
            .find(|&i| self.layer_types[i] == kind)
    }

    /// Feed-forward width of layer `i` (KV-shared layers are double-wide when configured).
    pub fn mlp_width(&self, i: usize) -> usize {
        if self.use_double_wide_mlp && !self.owns_kv(i) {
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// `layer_types` of `n` layers with full attention every `every`th (E2B: 35, 5).
    pub(crate) fn layer_types(n: usize, every: usize) -> Vec<&'static str> {
        (0..n)
            .map(|i| {
                if (i + 1) % every == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect()
    }

    /// The built-in fixture's config as transformers writes it (E2B structure).
    fn e2b() -> Value {
        let types = layer_types(35, 5);
        json!({
            "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
            "vocab_size": 512, "vocab_size_per_layer_input": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 35, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_global_key_value_heads": null, "head_dim": 32,
            "global_head_dim": 64, "sliding_window": 512, "hidden_size_per_layer_input": 32,
            "num_kv_shared_layers": 20, "use_double_wide_mlp": true, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "attention_bias": false, "attention_k_eq_v": false,
            "enable_moe_block": false, "use_bidirectional_attention": null, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "layer_types": types,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}
            }
        })
    }

    fn load(v: &Value) -> Result<TextConfig, String> {
        TextConfig::from_json(v, Path::new("config.json")).map_err(|e| e.to_string())
    }

    /// `edit` applied to the E2B config must be refused with every fragment in the message.
    fn refused(edit: impl FnOnce(&mut Value), fragments: &[&str]) {
        let mut v = e2b();
        edit(&mut v);
        let err = match load(&v) {
            Ok(_) => panic!("accepted {fragments:?}"),
            Err(e) => e,
        };
        for f in fragments {
            assert!(err.contains(f), "expected `{f}` in: {err}");
        }
    }

    #[test]
    fn real_configs_load_with_their_rope() {
        let c = load(&e2b()).unwrap();
        assert_eq!(c.final_logit_softcapping, Some(30.0));
        assert_eq!(
            (
                c.rope_theta_sliding,
                c.rope_theta_full,
                c.partial_rotary_factor_full
            ),
            (10_000.0, 1_000_000.0, 0.25)
        );
        // A multimodal checkpoint: the same text config under text_config.
        let mm = json!({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                        "text_config": e2b(), "tie_word_embeddings": true});
        assert!(load(&mm).unwrap().multimodal);
        // Fields left out take transformers' defaults, not made-up ones.
        let mut bare = e2b();
        for k in [
            "rope_parameters",
            "global_head_dim",
            "rms_norm_eps",
            "hidden_activation",
            "final_logit_softcapping",
        ] {
            bare.as_object_mut().unwrap().remove(k);
        }
        let c = load(&bare).unwrap();
        assert_eq!(c.partial_rotary_factor_full, 0.25);
        assert_eq!(c.global_head_dim, 512);
        assert_eq!(c.final_logit_softcapping, None);
        let mut null_global = e2b();
        null_global["global_head_dim"] = Value::Null;
        assert_eq!(load(&null_global).unwrap().global_head_dim, 32);
    }

    #[test]
    fn unimplemented_values_are_refused_naming_field_value_and_support() {
        refused(
            |v| v["hidden_activation"] = json!("relu"),
            &["`hidden_activation` is \"relu\"", "\"gelu_pytorch_tanh\""],
        );
        refused(
            |v| v["rope_parameters"]["sliding_attention"]["rope_type"] = json!("linear"),
            &[
                "`rope_parameters.sliding_attention.rope_type` is \"linear\"",
                "only \"default\"",
            ],
        );
        refused(
            |v| v["rope_parameters"]["full_attention"]["rope_type"] = json!("yarn"),
            &["\"yarn\"", "\"proportional\" or \"default\""],
        );
        refused(
            |v| v["final_logit_softcapping"] = json!("30.0"),
            &[
                "`final_logit_softcapping` is \"30.0\"",
                "a number fp16 holds",
            ],
        );
        refused(
            |v| v["final_logit_softcapping"] = json!(0.0),
            &["`final_logit_softcapping` is 0.0"],
        );
        // Tiny caps and thetas: positive, but what the packages compute
        // with them overflows (parity would see NaN and Infinity).
        refused(
            |v| v["final_logit_softcapping"] = json!(1e-300),
            &["`final_logit_softcapping` is 1e-300", "fp16 holds"],
        );
        refused(
            |v| v["rope_parameters"]["full_attention"]["rope_theta"] = json!(1e-300),
            &[
                "`rope_parameters.full_attention.rope_theta` is 1e-300",
                "a number > 1",
            ],
        );
        refused(
            |v| v["rope_parameters"]["sliding_attention"]["rope_theta"] = json!("10000"),
            &[
                "`rope_parameters.sliding_attention.rope_theta` is \"10000\"",
                "a number > 1",
            ],
        );
        refused(
            |v| v["rope_parameters"]["full_attention"]["rope_theta"] = json!(-1.0),
            &["`rope_parameters.full_attention.rope_theta` is -1.0"],
        );
        refused(
            |v| {
                v["rope_parameters"]["full_attention"]
                    .as_object_mut()
                    .unwrap()
                    .remove("rope_theta");
            },
            &["missing field `rope_parameters.full_attention.rope_theta`"],
        );
        refused(
            |v| {
                v["rope_parameters"]
                    .as_object_mut()
                    .unwrap()
                    .remove("full_attention");
            },
            &["`rope_parameters.full_attention` is null"],
        );
        refused(
            |v| v["rms_norm_eps"] = json!(-1),
            &["`rms_norm_eps` is -1", "small positive"],
        );
        refused(
            |v| v["rms_norm_eps"] = json!(0.5),
            &["`rms_norm_eps` is 0.5"],
        );
        refused(
            |v| v["rope_parameters"]["full_attention"]["partial_rotary_factor"] = json!(5),
            &[
                "`rope_parameters.full_attention.partial_rotary_factor` is 5",
                "(0, 1]",
            ],
        );
        refused(
            |v| v["rope_parameters"]["full_attention"]["factor"] = json!(8.0),
            &["`rope_parameters.full_attention.factor` is 8.0"],
        );
        refused(
            |v| v["rope_parameters"]["full_attention"]["rope_type"] = json!("default"),
            &["head_dim=32", "global_head_dim=64"],
        );
        refused(
            |v| v["attention_bias"] = json!(true),
            &["`attention_bias` is true"],
        );
        refused(
            |v| v["enable_moe_block"] = json!("true"),
            &["`enable_moe_block` is \"true\", expected true or false"],
        );
        refused(
            |v| v["use_double_wide_mlp"] = json!(1),
            &["`use_double_wide_mlp` is 1"],
        );
        refused(
            |v| v["tie_word_embeddings"] = json!("false"),
            &["`tie_word_embeddings` is \"false\""],
        );
        refused(
            |v| v["use_bidirectional_attention"] = json!("all"),
            &["`use_bidirectional_attention` is \"all\""],
        );
        refused(|v| v["head_dim"] = json!(33), &["head_dim=33 is odd"]);
        refused(
            |v| v["hidden_size"] = json!(64.5),
            &["`hidden_size` is 64.5, expected a non-negative integer"],
        );
        refused(
            |v| v["layer_types"][34] = json!("sliding_attention"),
            &["layer_types[34] (the last layer)"],
        );
    }

    /// Every size that becomes a tensor dimension has an upper bound,
    /// checked with the config (so `plan` refuses what `build` would), and
    /// the error names the field, the value and the bound.
    #[test]
    fn sizes_past_their_bound_are_refused_naming_field_and_bound() {
        refused(
            |v| v["sliding_window"] = json!(1_000_000_000_000u64),
            &["sliding_window=1000000000000 is out of range", "1..=131072"],
        );
        refused(
            |v| v["hidden_size"] = json!(u64::MAX),
            &[
                "hidden_size=18446744073709551615 is out of range",
                "1..=65536",
            ],
        );
        let c = load(&e2b()).unwrap();
        for (name, _, max, _) in c.sizes() {
            let too_big = max as u64 + 1;
            refused(
                |v| {
                    v[name] = json!(too_big);
                    if name == "num_hidden_layers" {
                        v["layer_types"] = json!(layer_types(too_big as usize, 1));
                    }
                },
                &[&format!(
                    "{name}={too_big} is out of range: chunkforge accepts 1..={max} ("
                )],
            );
        }
        // At the bound: accepted by this check (the plan bounds the products).
        let mut v = e2b();
        v["sliding_window"] = json!(crate::args::MAX_CTX);
        assert_eq!(load(&v).unwrap().sliding_window, 131_072);
    }

    /// A key given twice in config.json is refused naming it and its object,
    /// as the manifest reader does: transformers and chunkforge could
    /// otherwise read different models from one file.
    #[test]
    fn duplicate_keys_in_config_json_are_refused_naming_the_key() {
        let dir = std::env::temp_dir().join(format!("cf-config-dup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = serde_json::to_string(&e2b()).unwrap();
        for (from, to, want) in [
            (
                "\"sliding_window\":512",
                "\"sliding_window\":512,\"sliding_window\":4096",
                "duplicate key `sliding_window` in the top-level object",
            ),
            (
                "\"rope_theta\":10000.0",
                "\"rope_theta\":10000.0,\"rope_theta\":1.0",
                "duplicate key `rope_theta` in `rope_parameters.sliding_attention`",
            ),
        ] {
            assert!(text.contains(from), "{from}");
            std::fs::write(dir.join("config.json"), text.replacen(from, to, 1)).unwrap();
            let err = TextConfig::load(&dir).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("{}: {want}", dir.join("config.json").display())),
                "{err}"
            );
        }
        std::fs::write(dir.join("config.json"), &text).unwrap();
        assert!(TextConfig::load(&dir).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
