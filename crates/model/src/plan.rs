//! The chunk planner: the one place chunk boundaries, KV ownership and I/O
//! contracts are decided. Torch modules, conversion, parity and manifests all
//! read this plain data; none of them re-derives a boundary.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::config::{Attention, TextConfig};
use crate::error::InputError;
use crate::layouts::{spec, FunctionSet, Purpose, SpansRule, REFERENCE};
pub use crate::layouts::{LayoutKind, Mode};

/// Layer count above which a single Core ML function has failed to compile for
/// the Neural Engine on device (seed run book: 35 layers failed on iPhone 17 Pro,
/// 15 and 20 compiled; ~15 is the historic stable ceiling).
pub const ANE_STABLE_LAYERS: usize = 15;

/// The most bytes one input or output tensor of a planned function may hold:
/// four times the largest a supported published Gemma 4 needs (E4B's
/// `merged_full` full-attention cache at `--ctx 131072`: 4 slots x 2 KV heads
/// x 131072 x 512 x fp16 = 1 GiB). Each config size has its own bound
/// ([`TextConfig::sizes`]); this one bounds what they multiply into, so a
/// plan that a build could only end in an allocation failure is refused by
/// `plan` itself.
pub const MAX_TENSOR_BYTES: u64 = 4 << 30;

/// The most layers one function has been seen to compile for the Neural
/// Engine on device (seed run book: 20 compiled on the iPhone 17 Pro, 35
/// did not). A release in which a runtime would pick a layout with a larger
/// function is refused unless asked for (`package --allow-over-ceiling`).
pub const ANE_LAYER_CEILING: usize = 20;

/// Runtime alias of the producer KV for shared sliding / full layers.
pub fn alias_of(kind: Attention) -> Alias {
    match kind {
        Attention::Sliding => Alias::Kv13,
        Attention::Full => Alias::Kv14,
    }
}

crate::named! {
    /// The runtime's names for the producer KV shared layers read.
    pub enum Alias {
        /// The last sliding producer's K/V.
        Kv13 = "kv13",
        /// The last full-attention producer's K/V.
        Kv14 = "kv14",
    }
}

crate::named! {
    /// Element type of a tensor of a contract.
    pub enum Dtype {
        Fp16 = "fp16",
        Fp32 = "fp32",
        Int32 = "int32",
    }
}

crate::named! {
    /// What a tensor of a function's contract carries. Consumers (the torch
    /// modules, the stepper, parity) wire tensors by role; only the plan
    /// knows the runtime's names.
    pub enum Role {
        /// Embedded tokens in (`hidden_states`).
        Hidden = "hidden",
        /// The next chunk's hidden states (`hidden_states_out`).
        HiddenOut = "hidden_out",
        MaskFull = "mask_full",
        MaskSliding = "mask_sliding",
        /// Prefill's one causal mask.
        MaskCausal = "mask_causal",
        /// Decode: the one-hot row of the full caches written this step.
        UpdateMask = "update_mask",
        /// Verify: one one-hot column per draft token.
        UpdateIndicator = "update_indicator",
        PerLayerRaw = "per_layer_raw",
        PerLayerCombined = "per_layer_combined",
        PerLayerCombinedOut = "per_layer_combined_out",
        CosSliding = "cos_sliding",
        SinSliding = "sin_sliding",
        CosFull = "cos_full",
        SinFull = "sin_full",
        /// The chunk's own caches (in and out).
        KSliding = "k_sliding",
        VSliding = "v_sliding",
        KFull = "k_full",
        VFull = "v_full",
        /// Producer KV under its alias (the spec's `alias`).
        SharedK = "shared_k",
        SharedV = "shared_v",
        /// Verify: the K new rows per slot.
        NewKSliding = "new_k_sliding",
        NewVSliding = "new_v_sliding",
        NewKFull = "new_k_full",
        NewVFull = "new_v_full",
        /// Prefill: one layer's N rows (the spec's `layer`).
        LayerK = "layer_k",
        LayerV = "layer_v",
        /// Prefill head: selects the last prompt position.
        LastPositionMask = "last_position_mask",
        TokenId = "token_id",
        TokenLogit = "token_logit",
        /// Verify head: one token per draft position.
        TokenIds = "token_ids",
    }
}

impl Functions {
    /// `--mode all` adds verify (K = `verify_k` or 3) and prefill (`prefill_lens`
    /// or 512); other modes add only what is asked for explicitly.
    pub fn resolve(mode: Mode, verify_k: Option<usize>, prefill_lens: Option<&[usize]>) -> Self {
        let all = mode == Mode::All;
        let mut lens: Vec<usize> = match prefill_lens {
            Some(l) => l.to_vec(),
            None if all => vec![DEFAULT_PREFILL_LEN],
            None => Vec::new(),
        };
        // Longest first: it is the package's default function.
        lens.sort_unstable_by(|a, b| b.cmp(a));
        lens.dedup();
        Functions {
            verify_k: verify_k.or(all.then_some(DEFAULT_VERIFY_K)),
            prefill_lens: lens,
        }
    }
}

/// Model dimensions every consumer of the plan needs, copied out of the config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Dims {
    pub num_hidden_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub vocab_size_per_layer_input: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads_sliding: usize,
    pub num_kv_heads_full: usize,
    pub head_dim_sliding: usize,
    pub head_dim_full: usize,
    /// Caches are padded to this so sliding and full slots share one layout.
    pub max_head_dim: usize,
    /// Window cache length W.
    pub sliding_window: usize,
    /// Full-attention cache length.
    pub ctx: usize,
    pub hidden_size_per_layer_input: usize,
    /// The runtime feeds `hidden_states = embed_tokens[id] * embed_scale`
    /// (√hidden_size), rounded to fp16.
    pub embed_scale: f64,
    /// The runtime feeds `per_layer_raw = embed_tokens_per_layer[id] *
    /// per_layer_embed_scale` (√P): already scaled, so no chunk scales it again.
    pub per_layer_embed_scale: f64,
    pub rms_norm_eps: f64,
    pub final_logit_softcapping: Option<f64>,
    pub rope_theta_sliding: f64,
    pub rope_theta_full: f64,
    pub partial_rotary_factor_full: f64,
    pub kv_start: usize,
    pub producer_sliding: Option<usize>,
    pub producer_full: Option<usize>,
    pub layer_types: Vec<Attention>,
}

/// Where a layer's K/V come from.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KvSource {
    /// Computes its own K/V into `slot` of the chunk's cache of its kind; a
    /// producer layer also carries the alias under which shared layers read it.
    Own { slot: usize, alias: Option<Alias> },
    /// Reads the producer's cache through `alias` (from an input or from a
    /// producer earlier in the same chunk).
    Shared { alias: Alias, producer: usize },
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct LayerPlan {
    pub index: usize,
    pub attention: Attention,
    pub mlp_width: usize,
    pub kv: KvSource,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct AliasUse {
    pub alias: Alias,
    pub layer: usize,
    pub attention: Attention,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(try_from = "RecordedSpec")]
pub struct TensorSpec {
    /// The runtime's name of the tensor.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub role: Role,
    /// [`Role::SharedK`]/[`Role::SharedV`]: whose producer KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<Alias>,
    /// [`Role::LayerK`]/[`Role::LayerV`]: the layer whose rows it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<usize>,
}

impl TensorSpec {
    fn fp16(name: &str, shape: &[usize], role: Role) -> Self {
        TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: Dtype::Fp16,
            role,
            alias: None,
            layer: None,
        }
    }

    fn int32(name: &str, shape: &[usize], role: Role) -> Self {
        TensorSpec {
            dtype: Dtype::Int32,
            ..TensorSpec::fp16(name, shape, role)
        }
    }

    fn shared(alias: Alias, shape: &[usize]) -> [Self; 2] {
        let of = |kv: &str, role| TensorSpec {
            alias: Some(alias),
            ..TensorSpec::fp16(&format!("{alias}_{kv}"), shape, role)
        };
        [of("k", Role::SharedK), of("v", Role::SharedV)]
    }

    fn layer_rows(i: usize, layer: usize, shape: &[usize]) -> [Self; 2] {
        let of = |kv: &str, role| TensorSpec {
            layer: Some(layer),
            ..TensorSpec::fp16(&format!("{kv}{i}"), shape, role)
        };
        [of("K", Role::LayerK), of("V", Role::LayerV)]
    }
}

/// A [`TensorSpec`] as recorded: plans written before roles existed name
/// their tensors only, and read back with the role the name has always meant.
#[derive(Deserialize, JsonSchema)]
struct RecordedSpec {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    role: Option<Role>,
    #[serde(default)]
    alias: Option<Alias>,
    #[serde(default)]
    layer: Option<usize>,
}

impl TryFrom<RecordedSpec> for TensorSpec {
    type Error = String;
    fn try_from(r: RecordedSpec) -> Result<Self, String> {
        let role = match r.role {
            Some(role) => role,
            None => Role::of_legacy_name(&r.name)
                .ok_or_else(|| format!("tensor {} has no role", r.name))?,
        };
        Ok(TensorSpec {
            name: r.name,
            shape: r.shape,
            dtype: r.dtype,
            role,
            alias: r.alias,
            layer: r.layer,
        })
    }
}

impl Role {
    /// The role of a tensor name in a plan recorded before roles existed.
    fn of_legacy_name(name: &str) -> Option<Role> {
        use Role as R;
        let role = match name {
            "hidden_states" => R::Hidden,
            "hidden_states_out" => R::HiddenOut,
            "causal_mask_full" => R::MaskFull,
            "causal_mask_sliding" => R::MaskSliding,
            "causal_mask" => R::MaskCausal,
            "update_mask" => R::UpdateMask,
            "update_indicator" => R::UpdateIndicator,
            "per_layer_raw" => R::PerLayerRaw,
            "per_layer_combined" => R::PerLayerCombined,
            "per_layer_combined_out" => R::PerLayerCombinedOut,
            "cos_s" => R::CosSliding,
            "sin_s" => R::SinSliding,
            "cos_f" => R::CosFull,
            "sin_f" => R::SinFull,
            "K_sliding_in" | "K_sliding_out" => R::KSliding,
            "V_sliding_in" | "V_sliding_out" => R::VSliding,
            "K_full_in" | "K_full_out" => R::KFull,
            "V_full_in" | "V_full_out" => R::VFull,
            "new_K_sliding" => R::NewKSliding,
            "new_V_sliding" => R::NewVSliding,
            "new_K_full" => R::NewKFull,
            "new_V_full" => R::NewVFull,
            "last_position_mask" => R::LastPositionMask,
            "token_id" => R::TokenId,
            "token_logit" => R::TokenLogit,
            "token_ids" => R::TokenIds,
            n if n.ends_with("_k") => R::SharedK,
            n if n.ends_with("_v") => R::SharedV,
            n if n.starts_with('K') => R::LayerK,
            n if n.starts_with('V') => R::LayerV,
            _ => return None,
        };
        Some(role)
    }

    /// The chunk's own KV caches, in or out.
    pub fn is_cache(self) -> bool {
        matches!(
            self,
            Role::KSliding | Role::VSliding | Role::KFull | Role::VFull
        )
    }
}

/// What one function of a package computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FunctionKind {
    /// One token against the chunk's caches; returns the updated caches.
    Decode,
    /// K draft tokens against read-only caches; returns the K new K/V rows so
    /// the runtime commits only the accepted ones.
    Verify,
    /// The first N prompt tokens from empty caches; returns every layer's K/V.
    Prefill,
}

/// One function of a package: its name in the package, what it computes for
/// how many tokens, and its input/output contract.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct FunctionPlan {
    /// `main` for single-function packages; `decode_q1`, `verify_qK` (K draft tokens),
    /// `prefill_b512` in multifunction ones.
    pub name: String,
    pub kind: FunctionKind,
    pub tokens: usize,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// Prefill: the layer whose K/V each `K{i}`/`V{i}` output holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kv_layers: Vec<usize>,
}

/// The functions a build adds beyond decode: `verify_qK` in chunk1..4 and the
/// prefill lengths of prefill_chunk1..4 (empty: no prefill packages).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Functions {
    pub verify_k: Option<usize>,
    pub prefill_lens: Vec<usize>,
}

/// The runtime's speculative-verify draft count (upstream default).
pub const DEFAULT_VERIFY_K: usize = 3;
/// Batched prefill tokens per call (the merged-runtime branch's N).
pub const DEFAULT_PREFILL_LEN: usize = 512;

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChunkPlan {
    /// Package stem, e.g. `merged_chunk1` (written as `<name>.mlpackage`).
    pub name: String,
    pub first_layer: usize,
    pub last_layer: usize,
    pub layers: Vec<LayerPlan>,
    /// Layers owning a sliding KV slot, in slot (= layer) order.
    pub sliding_slots: Vec<usize>,
    /// Layers owning a full KV slot, in slot (= layer) order.
    pub full_slots: Vec<usize>,
    /// Producer KV this chunk hands to later chunks.
    pub emits: Vec<AliasUse>,
    /// Producer KV this chunk receives from an earlier chunk.
    pub consumes: Vec<AliasUse>,
    /// First chunk: projects the raw per-layer embedding into the combined PLE.
    pub computes_per_layer_input: bool,
    /// Last chunk: final norm, tied LM head, softcap and in-model argmax.
    pub has_head: bool,
    /// The default function's contract (decode for decode packages, the
    /// longest prefill for prefill packages).
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// Every function of the package, the default first.
    pub functions: Vec<FunctionPlan>,
}

impl ChunkPlan {
    pub fn layer_count(&self) -> usize {
        self.last_layer - self.first_layer + 1
    }

    /// Own-KV layers whose K/V prefill hands out as `K{i}`/`V{i}` (producers
    /// hand theirs out as kv13/kv14 when a later chunk reads them).
    pub fn prefill_kv_layers(&self) -> Vec<usize> {
        self.layers
            .iter()
            .filter(|l| match l.kv {
                KvSource::Own { alias, .. } => {
                    alias.is_none_or(|a| !self.emits.iter().any(|e| e.alias == a))
                }
                KvSource::Shared { .. } => false,
            })
            .map(|l| l.index)
            .collect()
    }
}

/// One KV slot copy from the four-chunk prefill caches into a decode layout's caches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SlotCopy {
    pub layer: usize,
    pub attention: Attention,
    pub from_chunk: String,
    pub from_slot: usize,
    pub to_chunk: String,
    pub to_slot: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Layout {
    pub kind: LayoutKind,
    pub chunks: Vec<ChunkPlan>,
    /// How prefill KV (four-chunk caches) maps into this layout's caches.
    pub kv_slot_map: Vec<SlotCopy>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Plan {
    pub dims: Dims,
    pub layouts: Vec<Layout>,
    /// How the runtime prepares the per-step inputs every chunk is built for.
    pub contract_notes: Vec<String>,
    pub warnings: Vec<String>,
}

/// A contiguous layer range `first..=last`.
pub type Span = (usize, usize);

/// Parses `--split 0-11,12-23,24-34` and checks it covers `0..n` exactly once, in order.
pub fn parse_split(text: &str, n: usize) -> Result<Vec<Span>, InputError> {
    let bad = |message: String| InputError::Split {
        split: text.to_string(),
        message,
    };
    let mut spans = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let (a, b) = part
            .split_once('-')
            .ok_or_else(|| bad(format!("`{part}` is not a range like 0-11")))?;
        let a: usize = a
            .trim()
            .parse()
            .map_err(|_| bad(format!("`{part}`: `{a}` is not a layer number")))?;
        let b: usize = b
            .trim()
            .parse()
            .map_err(|_| bad(format!("`{part}`: `{b}` is not a layer number")))?;
        if a > b {
            return Err(bad(format!("`{part}` runs backwards")));
        }
        spans.push((a, b));
    }
    let mut next = 0;
    for &(a, b) in &spans {
        if a > next {
            return Err(bad(format!(
                "layers {next}-{} are in no chunk (gap before {a}-{b})",
                a - 1
            )));
        }
        if a < next {
            return Err(bad(format!(
                "{a}-{b} overlaps the previous chunk (which ends at layer {})",
                next - 1
            )));
        }
        next = b + 1;
    }
    if next != n {
        return Err(bad(if next > n {
            format!(
                "the model has {n} layers (0-{}), but the split reaches layer {}",
                n - 1,
                next - 1
            )
        } else {
            format!(
                "layers {next}-{} are in no chunk (the model has {n} layers)",
                n - 1
            )
        }));
    }
    Ok(spans)
}

/// `a..b` in `count` contiguous parts, the earlier ones taking the odd layers.
fn parts(a: usize, b: usize, count: usize) -> Vec<Span> {
    let (base, extra) = ((b - a) / count, (b - a) % count);
    let mut out = Vec::with_capacity(count);
    let mut first = a;
    for i in 0..count {
        let len = base + usize::from(i < extra);
        out.push((first, first + len - 1));
        first += len;
    }
    out
}

/// Chunk spans of a built-in layout, derived from the config by its row's
/// rule: the four-chunk reference splits the KV-owning layers and the
/// KV-shared layers in halves (E2B: 0-7 / 8-14 / 15-24 / 25-34), two is
/// owners / sharers, one is all, three and prefill group the reference's
/// chunks. None for a layout whose spans come from `--split`.
pub fn layout_spans(cfg: &TextConfig, kind: LayoutKind) -> Option<Vec<Span>> {
    let n = cfg.num_hidden_layers;
    let k = cfg.kv_start();
    Some(match spec(kind).spans {
        SpansRule::Whole => vec![(0, n - 1)],
        SpansRule::OwnersSharers { owners, sharers } if k >= owners && n - k >= sharers => {
            let mut spans = parts(0, k, owners);
            spans.extend(parts(k, n, sharers));
            spans
        }
        SpansRule::OwnersSharers { owners, sharers } => {
            let q = n.div_ceil(owners + sharers);
            (0..n).step_by(q).map(|s| (s, (s + q).min(n) - 1)).collect()
        }
        SpansRule::Groups(groups) => {
            let r = layout_spans(cfg, REFERENCE)?;
            groups.iter().map(|&(a, b)| (r[a].0, r[b].1)).collect()
        }
        SpansRule::Given => return None,
    })
}

/// [`layout_spans`] of a layout with fixed spans, or an error naming it.
fn fixed_spans(cfg: &TextConfig, kind: LayoutKind) -> Result<Vec<Span>, InputError> {
    layout_spans(cfg, kind).ok_or_else(|| InputError::Functions {
        message: format!("the {kind} layout takes its layer ranges from --split"),
    })
}

pub fn dims(cfg: &TextConfig, ctx: usize) -> Dims {
    Dims {
        num_hidden_layers: cfg.num_hidden_layers,
        hidden_size: cfg.hidden_size,
        vocab_size: cfg.vocab_size,
        vocab_size_per_layer_input: cfg.vocab_size_per_layer_input,
        num_attention_heads: cfg.num_attention_heads,
        num_kv_heads_sliding: cfg.kv_heads_of(Attention::Sliding),
        num_kv_heads_full: cfg.kv_heads_of(Attention::Full),
        head_dim_sliding: cfg.head_dim,
        head_dim_full: cfg.global_head_dim,
        max_head_dim: cfg.max_head_dim(),
        sliding_window: cfg.sliding_window,
        ctx,
        hidden_size_per_layer_input: cfg.hidden_size_per_layer_input,
        embed_scale: (cfg.hidden_size as f64).sqrt(),
        per_layer_embed_scale: (cfg.hidden_size_per_layer_input as f64).sqrt(),
        rms_norm_eps: cfg.rms_norm_eps,
        final_logit_softcapping: cfg.final_logit_softcapping,
        rope_theta_sliding: cfg.rope_theta_sliding,
        rope_theta_full: cfg.rope_theta_full,
        partial_rotary_factor_full: cfg.partial_rotary_factor_full,
        kv_start: cfg.kv_start(),
        producer_sliding: cfg.producer(Attention::Sliding),
        producer_full: cfg.producer(Attention::Full),
        layer_types: cfg.layer_types.clone(),
    }
}

/// Plans one layout from its spans.
pub fn plan_layout(cfg: &TextConfig, ctx: usize, kind: LayoutKind, spans: &[Span]) -> Layout {
    let n = cfg.num_hidden_layers;
    let names = spec(kind).names_for(spans, n);
    let kv_start = cfg.kv_start();
    let shared = cfg.num_kv_shared_layers > 0;
    let producer_of = |k: Attention| cfg.producer(k);
    // A producer emits its alias only when some chunk after its own reads it.
    let chunk_of = |layer: usize| {
        spans
            .iter()
            .position(|&(a, b)| a <= layer && layer <= b)
            .unwrap()
    };
    let read_by_later = |k: Attention, p: usize| {
        shared && (kv_start..n).any(|l| cfg.layer_types[l] == k && chunk_of(l) != chunk_of(p))
    };

    let last = spans.len() - 1;
    let chunks = spans
        .iter()
        .enumerate()
        .map(|(ci, &(a, b))| {
            let mut layers = Vec::new();
            let mut sliding_slots = Vec::new();
            let mut full_slots = Vec::new();
            let mut emits = Vec::new();
            let mut consumes: Vec<AliasUse> = Vec::new();
            for i in a..=b {
                let kind_i = cfg.layer_types[i];
                let kv = if !cfg.owns_kv(i) {
                    let p =
                        producer_of(kind_i).expect("validated: every shared kind has a producer");
                    let alias = alias_of(kind_i);
                    if p < a && !consumes.iter().any(|c| c.alias == alias) {
                        consumes.push(AliasUse {
                            alias,
                            layer: p,
                            attention: kind_i,
                        });
                    }
                    KvSource::Shared { alias, producer: p }
                } else {
                    let slots = match kind_i {
                        Attention::Sliding => &mut sliding_slots,
                        Attention::Full => &mut full_slots,
                    };
                    slots.push(i);
                    let is_producer = shared && producer_of(kind_i) == Some(i);
                    if is_producer && read_by_later(kind_i, i) {
                        emits.push(AliasUse {
                            alias: alias_of(kind_i),
                            layer: i,
                            attention: kind_i,
                        });
                    }
                    KvSource::Own {
                        slot: slots.len() - 1,
                        alias: is_producer.then(|| alias_of(kind_i)),
                    }
                };
                layers.push(LayerPlan {
                    index: i,
                    attention: kind_i,
                    mlp_width: cfg.mlp_width(i),
                    kv,
                });
            }
            let mut chunk = ChunkPlan {
                name: names[ci].clone(),
                first_layer: a,
                last_layer: b,
                layers,
                sliding_slots,
                full_slots,
                emits,
                consumes,
                computes_per_layer_input: ci == 0,
                has_head: ci == last,
                inputs: Vec::new(),
                outputs: Vec::new(),
                functions: Vec::new(),
            };
            let (inputs, outputs) = contract(cfg, ctx, &chunk, spans.len() > 1);
            chunk.functions.push(FunctionPlan {
                name: "main".into(),
                kind: FunctionKind::Decode,
                tokens: 1,
                inputs: inputs.clone(),
                outputs: outputs.clone(),
                kv_layers: Vec::new(),
            });
            chunk.inputs = inputs;
            chunk.outputs = outputs;
            chunk
        })
        .collect::<Vec<_>>();
    let mut layout = Layout {
        kind,
        chunks,
        kv_slot_map: Vec::new(),
    };
    // Decode layouts other than the reference take prefill's KV (written
    // into the reference's caches) through their slot map.
    if spec(kind).purpose == Purpose::Decode && kind != REFERENCE {
        if let Some(spans) = layout_spans(cfg, REFERENCE) {
            let reference = plan_layout(cfg, ctx, REFERENCE, &spans);
            layout.kv_slot_map = slot_map(&reference, &layout);
        }
    }
    layout
}

/// Gives each chunk of `layout` its functions: prefill packages get one
/// `prefill_bN` per length (longest first, the default); four-chunk decode
/// packages get `decode_q1` + `verify_qK` when verify is asked for. The
/// chunk's own `inputs`/`outputs` are its default function's.
fn attach_functions(cfg: &TextConfig, ctx: usize, layout: &mut Layout, f: &Functions) {
    for c in &mut layout.chunks {
        match spec(layout.kind).functions {
            FunctionSet::Prefill => {
                c.functions = f
                    .prefill_lens
                    .iter()
                    .map(|&n| {
                        let (inputs, outputs) = prefill_contract(cfg, c, n);
                        FunctionPlan {
                            name: format!("prefill_b{n}"),
                            kind: FunctionKind::Prefill,
                            tokens: n,
                            inputs,
                            outputs,
                            kv_layers: c.prefill_kv_layers(),
                        }
                    })
                    .collect();
            }
            FunctionSet::DecodeVerify => {
                if let Some(k) = f.verify_k {
                    c.functions[0].name = "decode_q1".into();
                    let (inputs, outputs) = verify_contract(cfg, ctx, c, k);
                    c.functions.push(FunctionPlan {
                        name: "verify_qK".into(),
                        kind: FunctionKind::Verify,
                        tokens: k,
                        inputs,
                        outputs,
                        kv_layers: Vec::new(),
                    });
                }
            }
            FunctionSet::Decode => {}
        }
        c.inputs = c.functions[0].inputs.clone();
        c.outputs = c.functions[0].outputs.clone();
    }
}

/// Per-step inputs every function takes in the same order: hidden states,
/// masks, the per-layer input, RoPE rows; `t` tokens each.
struct Rows<'a> {
    cfg: &'a TextConfig,
    c: &'a ChunkPlan,
    t: usize,
}

impl Rows<'_> {
    fn has(&self, k: Attention) -> bool {
        self.c.layers.iter().any(|l| l.attention == k)
    }

    fn per_layer(&self) -> TensorSpec {
        let ple = self.cfg.num_hidden_layers * self.cfg.hidden_size_per_layer_input;
        let (name, role) = if self.c.computes_per_layer_input {
            ("per_layer_raw", Role::PerLayerRaw)
        } else {
            ("per_layer_combined", Role::PerLayerCombined)
        };
        TensorSpec::fp16(name, &[1, self.t, ple], role)
    }

    fn rope(&self) -> Vec<TensorSpec> {
        let mut v = Vec::new();
        for (k, s, hd, cos, sin) in [
            (
                Attention::Sliding,
                "s",
                self.cfg.head_dim,
                Role::CosSliding,
                Role::SinSliding,
            ),
            (
                Attention::Full,
                "f",
                self.cfg.global_head_dim,
                Role::CosFull,
                Role::SinFull,
            ),
        ] {
            if self.has(k) {
                let shape = [1, 1, self.t, hd];
                v.push(TensorSpec::fp16(&format!("cos_{s}"), &shape, cos));
                v.push(TensorSpec::fp16(&format!("sin_{s}"), &shape, sin));
            }
        }
        v
    }

    /// kv13/kv14 of `len(attention)` positions, in or out.
    fn aliases(&self, uses: &[AliasUse], len: impl Fn(Attention) -> usize) -> Vec<TensorSpec> {
        let mut v = Vec::new();
        for u in uses {
            let shape = [
                1,
                self.cfg.kv_heads_of(u.attention),
                len(u.attention),
                self.cfg.head_dim_of(u.attention),
            ];
            v.extend(TensorSpec::shared(u.alias, &shape));
        }
        v
    }
}

/// `verify_qK`: K draft tokens at positions p..p+K-1 against the caches as
/// they stand. It serves both runtime builds' verify contracts
/// ([`crate::layouts::VerifyCommit`]): `new_K/V_*` are the K new rows per
/// slot at the layer's own head dim, for main to commit the accepted prefix;
/// `K/V_*_out` are the caches with all K rows written (window caches shifted
/// by K, full caches at p..p+K-1), which the branch copies back whole
/// (write-through) before it knows what is accepted.
fn verify_contract(
    cfg: &TextConfig,
    ctx: usize,
    c: &ChunkPlan,
    k: usize,
) -> (Vec<TensorSpec>, Vec<TensorSpec>) {
    let r = Rows { cfg, c, t: k };
    let (h, w) = (cfg.hidden_size, cfg.sliding_window);
    let decode = &c.functions[0];
    let mut inp = vec![TensorSpec::fp16("hidden_states", &[1, k, h], Role::Hidden)];
    if r.has(Attention::Full) {
        inp.push(TensorSpec::fp16(
            "causal_mask_full",
            &[1, 1, k, ctx],
            Role::MaskFull,
        ));
    }
    if r.has(Attention::Sliding) {
        inp.push(TensorSpec::fp16(
            "causal_mask_sliding",
            &[1, 1, k, w],
            Role::MaskSliding,
        ));
    }
    if !c.full_slots.is_empty() {
        inp.push(TensorSpec::fp16(
            "update_indicator",
            &[1, 1, ctx, k],
            Role::UpdateIndicator,
        ));
    }
    inp.push(r.per_layer());
    inp.extend(r.rope());
    // The caches are the decode function's; the sliding producer KV is the
    // window extended by the K - 1 newest rows, so every draft token finds
    // its own whole window in it.
    let alias_len = |a: Attention| {
        if a == Attention::Sliding {
            w + k - 1
        } else {
            ctx
        }
    };
    inp.extend(decode.inputs.iter().filter(|t| t.role.is_cache()).cloned());
    inp.extend(r.aliases(&c.consumes, alias_len));
    let mut out = Vec::new();
    if c.has_head {
        out.push(TensorSpec::int32("token_ids", &[1, k], Role::TokenIds));
    }
    out.push(TensorSpec::fp16(
        "hidden_states_out",
        &[1, k, h],
        Role::HiddenOut,
    ));
    if c.computes_per_layer_input {
        let mut p = r.per_layer();
        p.name = "per_layer_combined_out".into();
        p.role = Role::PerLayerCombinedOut;
        out.push(p);
    }
    for (kind, slots, roles) in [
        (
            Attention::Sliding,
            &c.sliding_slots,
            (Role::NewKSliding, Role::NewVSliding),
        ),
        (
            Attention::Full,
            &c.full_slots,
            (Role::NewKFull, Role::NewVFull),
        ),
    ] {
        if !slots.is_empty() {
            let shape = [slots.len(), cfg.kv_heads_of(kind), k, cfg.head_dim_of(kind)];
            out.push(TensorSpec::fp16(&format!("new_K_{kind}"), &shape, roles.0));
            out.push(TensorSpec::fp16(&format!("new_V_{kind}"), &shape, roles.1));
        }
    }
    // The branch's write-through outputs: the decode function's cache
    // outputs, by the same names and shapes.
    out.extend(decode.outputs.iter().filter(|t| t.role.is_cache()).cloned());
    out.extend(r.aliases(&c.emits, alias_len));
    (inp, out)
}

/// `prefill_bN`: the first N prompt tokens (positions 0..N-1) from empty
/// caches. One causal mask serves every layer (sliding layers add the window
/// band inside the graph); every own-KV layer hands out its N K/V rows.
fn prefill_contract(
    cfg: &TextConfig,
    c: &ChunkPlan,
    n: usize,
) -> (Vec<TensorSpec>, Vec<TensorSpec>) {
    let r = Rows { cfg, c, t: n };
    let h = cfg.hidden_size;
    let mut inp = vec![
        TensorSpec::fp16("hidden_states", &[1, n, h], Role::Hidden),
        TensorSpec::fp16("causal_mask", &[1, 1, n, n], Role::MaskCausal),
        r.per_layer(),
    ];
    inp.extend(r.rope());
    inp.extend(r.aliases(&c.consumes, |_| n));
    if c.has_head {
        inp.push(TensorSpec::fp16(
            "last_position_mask",
            &[1, n, 1],
            Role::LastPositionMask,
        ));
        return (
            inp,
            vec![
                TensorSpec::int32("token_id", &[1], Role::TokenId),
                TensorSpec::fp16("token_logit", &[1], Role::TokenLogit),
            ],
        );
    }
    let mut out = vec![TensorSpec::fp16(
        "hidden_states_out",
        &[1, n, h],
        Role::HiddenOut,
    )];
    if c.computes_per_layer_input {
        let mut p = r.per_layer();
        p.name = "per_layer_combined_out".into();
        p.role = Role::PerLayerCombinedOut;
        out.push(p);
    }
    for (i, layer) in c.prefill_kv_layers().into_iter().enumerate() {
        let a = cfg.layer_types[layer];
        let shape = [1, cfg.kv_heads_of(a), n, cfg.head_dim_of(a)];
        out.extend(TensorSpec::layer_rows(i, layer, &shape));
    }
    out.extend(r.aliases(&c.emits, |_| n));
    (inp, out)
}

/// The chunk's input and output tensors, named as the runtime names them.
fn contract(
    cfg: &TextConfig,
    ctx: usize,
    c: &ChunkPlan,
    multi: bool,
) -> (Vec<TensorSpec>, Vec<TensorSpec>) {
    let h = cfg.hidden_size;
    let w = cfg.sliding_window;
    let mhd = cfg.max_head_dim();
    let ple = cfg.num_hidden_layers * cfg.hidden_size_per_layer_input;
    let has = |k: Attention| c.layers.iter().any(|l| l.attention == k);
    let kvh = |k: Attention| cfg.kv_heads_of(k);
    let mut inp = vec![TensorSpec::fp16("hidden_states", &[1, 1, h], Role::Hidden)];
    if has(Attention::Full) {
        inp.push(TensorSpec::fp16(
            "causal_mask_full",
            &[1, 1, 1, ctx],
            Role::MaskFull,
        ));
    }
    if has(Attention::Sliding) {
        inp.push(TensorSpec::fp16(
            "causal_mask_sliding",
            &[1, 1, 1, w],
            Role::MaskSliding,
        ));
    }
    // Every decode chunk declares update_mask, KV-shared ones included, as the
    // runtime binds it to every chunk (upstream's packages all have it).
    inp.push(TensorSpec::fp16(
        "update_mask",
        &[1, 1, ctx, 1],
        Role::UpdateMask,
    ));
    if c.computes_per_layer_input {
        inp.push(TensorSpec::fp16(
            "per_layer_raw",
            &[1, 1, ple],
            Role::PerLayerRaw,
        ));
    } else {
        inp.push(TensorSpec::fp16(
            "per_layer_combined",
            &[1, 1, ple],
            Role::PerLayerCombined,
        ));
    }
    if has(Attention::Sliding) {
        inp.push(TensorSpec::fp16(
            "cos_s",
            &[1, 1, 1, cfg.head_dim],
            Role::CosSliding,
        ));
        inp.push(TensorSpec::fp16(
            "sin_s",
            &[1, 1, 1, cfg.head_dim],
            Role::SinSliding,
        ));
    }
    if has(Attention::Full) {
        inp.push(TensorSpec::fp16(
            "cos_f",
            &[1, 1, 1, cfg.global_head_dim],
            Role::CosFull,
        ));
        inp.push(TensorSpec::fp16(
            "sin_f",
            &[1, 1, 1, cfg.global_head_dim],
            Role::SinFull,
        ));
    }
    let cache = |k: Attention, n: usize| -> Vec<usize> {
        let len = if k == Attention::Sliding { w } else { ctx };
        vec![n, kvh(k), len, mhd]
    };
    let alias_shape = |u: &AliasUse| -> Vec<usize> {
        let len = if u.attention == Attention::Sliding {
            w
        } else {
            ctx
        };
        vec![1, kvh(u.attention), len, cfg.head_dim_of(u.attention)]
    };
    if !c.sliding_slots.is_empty() {
        let s = cache(Attention::Sliding, c.sliding_slots.len());
        inp.push(TensorSpec::fp16("K_sliding_in", &s, Role::KSliding));
        inp.push(TensorSpec::fp16("V_sliding_in", &s, Role::VSliding));
    }
    if !c.full_slots.is_empty() {
        let s = cache(Attention::Full, c.full_slots.len());
        inp.push(TensorSpec::fp16("K_full_in", &s, Role::KFull));
        inp.push(TensorSpec::fp16("V_full_in", &s, Role::VFull));
    }
    for u in &c.consumes {
        inp.extend(TensorSpec::shared(u.alias, &alias_shape(u)));
    }

    // The head's token first, as the runtime's packages declare it.
    let mut out = Vec::new();
    if c.has_head {
        out.push(TensorSpec::int32("token_id", &[1], Role::TokenId));
        out.push(TensorSpec::fp16("token_logit", &[1], Role::TokenLogit));
    }
    out.push(TensorSpec::fp16(
        "hidden_states_out",
        &[1, 1, h],
        Role::HiddenOut,
    ));
    if !c.sliding_slots.is_empty() {
        let s = cache(Attention::Sliding, c.sliding_slots.len());
        out.push(TensorSpec::fp16("K_sliding_out", &s, Role::KSliding));
        out.push(TensorSpec::fp16("V_sliding_out", &s, Role::VSliding));
    }
    if !c.full_slots.is_empty() {
        let s = cache(Attention::Full, c.full_slots.len());
        out.push(TensorSpec::fp16("K_full_out", &s, Role::KFull));
        out.push(TensorSpec::fp16("V_full_out", &s, Role::VFull));
    }
    for u in &c.emits {
        out.extend(TensorSpec::shared(u.alias, &alias_shape(u)));
    }
    if c.computes_per_layer_input && multi {
        out.push(TensorSpec::fp16(
            "per_layer_combined_out",
            &[1, 1, ple],
            Role::PerLayerCombinedOut,
        ));
    }
    (inp, out)
}

/// Maps every KV slot of the four-chunk reference (which prefill writes) to the
/// slot of `to` that holds the same layer, in layer order.
pub fn slot_map(four: &Layout, to: &Layout) -> Vec<SlotCopy> {
    let find = |layout: &Layout, layer: usize| -> Option<(String, Attention, usize)> {
        layout.chunks.iter().find_map(|c| {
            c.layers
                .iter()
                .find(|l| l.index == layer)
                .and_then(|l| match l.kv {
                    KvSource::Own { slot, .. } => Some((c.name.clone(), l.attention, slot)),
                    KvSource::Shared { .. } => None,
                })
        })
    };
    let mut map = Vec::new();
    for c in &four.chunks {
        for l in &c.layers {
            if let (Some((from_chunk, attention, from_slot)), Some((to_chunk, _, to_slot))) =
                (find(four, l.index), find(to, l.index))
            {
                map.push(SlotCopy {
                    layer: l.index,
                    attention,
                    from_chunk,
                    from_slot,
                    to_chunk,
                    to_slot,
                });
            }
        }
    }
    map
}

/// The layouts `mode` (or an explicit `--split`) asks for.
pub fn plan(
    cfg: &TextConfig,
    ctx: usize,
    mode: Mode,
    split: Option<&str>,
    functions: &Functions,
) -> Result<Plan, InputError> {
    let mut layouts = Vec::new();
    if let Some(text) = split {
        let spans = parse_split(text, cfg.num_hidden_layers)?;
        layouts.push(plan_layout(cfg, ctx, LayoutKind::Split, &spans));
    } else {
        for k in mode.kinds() {
            layouts.push(plan_layout(cfg, ctx, k, &fixed_spans(cfg, k)?));
        }
    }
    let bad = |message: String| InputError::Functions { message };
    let verifies = |l: &&Layout| spec(l.kind).functions == FunctionSet::DecodeVerify;
    if functions.verify_k.is_some() && !layouts.iter().any(|l| verifies(&l)) {
        let r = spec(REFERENCE);
        return Err(bad(format!(
            "verify_qK lives in {}: add the {} layout (--mode {} or all)",
            r.range(),
            r.runtime.map_or(r.kind.as_str(), |rt| rt.name),
            r.kind
        )));
    }
    if functions.verify_k == Some(0) {
        return Err(bad("--verify-k must be at least 1".into()));
    }
    if let Some(&n) = functions.prefill_lens.iter().find(|&&n| n == 0 || n > ctx) {
        return Err(bad(format!(
            "--prefill-len {n}: a prefill call takes 1 to ctx ({ctx}) tokens"
        )));
    }
    if !functions.prefill_lens.is_empty() {
        let spans = fixed_spans(cfg, LayoutKind::Prefill)?;
        layouts.push(plan_layout(cfg, ctx, LayoutKind::Prefill, &spans));
    }
    for l in &mut layouts {
        attach_functions(cfg, ctx, l, functions);
    }
    // A layout that decodes with the reference's first package holds that
    // package as the reference plans it (its functions too: one package).
    let reference_first = layouts
        .iter()
        .find(|l| l.kind == REFERENCE)
        .and_then(|l| l.chunks.first())
        .cloned();
    if let Some(first) = reference_first {
        for l in layouts.iter_mut().filter(|l| spec(l.kind).borrows_first) {
            l.chunks[0] = first.clone();
        }
    }
    check_tensor_sizes(cfg, ctx, &layouts)?;
    let mut warnings = Vec::new();
    let mut warned = std::collections::BTreeSet::new();
    for l in &layouts {
        for c in &l.chunks {
            if c.layer_count() > ANE_STABLE_LAYERS && warned.insert(c.name.clone()) {
                warnings.push(format!(
                    "{} holds {} layers (> {ANE_STABLE_LAYERS}): a 35-layer single function failed to compile \
                     for the iPhone 17 Pro Neural Engine, while 15 and 20 layers compiled; check its compute \
                     plan on device before shipping it",
                    c.name,
                    c.layer_count()
                ));
            }
        }
    }
    let dims = dims(cfg, ctx);
    Ok(Plan {
        contract_notes: contract_notes(&dims),
        dims,
        layouts,
        warnings,
    })
}

/// Refuses a plan with a tensor larger than [`MAX_TENSOR_BYTES`], naming it,
/// its shape and the config sizes it comes from.
fn check_tensor_sizes(cfg: &TextConfig, ctx: usize, layouts: &[Layout]) -> Result<(), InputError> {
    let functions = layouts
        .iter()
        .flat_map(|l| &l.chunks)
        .flat_map(|c| c.functions.iter().map(move |f| (c, f)));
    for (c, f) in functions {
        for t in f.inputs.iter().chain(&f.outputs) {
            let size = match t.dtype {
                Dtype::Fp16 => 2,
                Dtype::Fp32 | Dtype::Int32 => 4,
            };
            let bytes = t
                .shape
                .iter()
                .try_fold(size, |acc: u64, &d| acc.checked_mul(d as u64));
            if bytes.is_none_or(|b| b > MAX_TENSOR_BYTES) {
                return Err(InputError::Config {
                    path: cfg.path.clone(),
                    message: format!(
                        "{} {}: tensor {} would be {:?} {} ({}), more than the {} GiB chunkforge allows for one \
                         tensor (from hidden_size={}, sliding_window={}, head dims {}/{}, KV heads {} and --ctx {ctx})",
                        c.name,
                        f.name,
                        t.name,
                        t.shape,
                        t.dtype.as_str(),
                        bytes.map_or("more than 2^64 bytes".into(), |b| format!("{b} bytes")),
                        MAX_TENSOR_BYTES >> 30,
                        cfg.hidden_size,
                        cfg.sliding_window,
                        cfg.head_dim,
                        cfg.global_head_dim,
                        cfg.num_key_value_heads,
                    ),
                });
            }
        }
    }
    Ok(())
}

/// What the app's runtime feeds, in the plan so that nobody has to guess which
/// side applies a scale (a scale applied on both sides is 16x off on E2B).
fn contract_notes(d: &Dims) -> Vec<String> {
    vec![
        format!(
            "hidden_states = embed_tokens[id] * embed_scale ({}, sqrt(hidden_size)), rounded to fp16",
            d.embed_scale
        ),
        format!(
            "per_layer_raw = embed_tokens_per_layer[id] * per_layer_embed_scale ({}, sqrt(P)), \
             rounded to fp16; already scaled, the first chunk does not scale it again",
            d.per_layer_embed_scale
        ),
        "causal masks: 0 where visible, fp16 -inf (0xFC00) where blocked".into(),
        "update_mask: one-hot fp16 write position of the full caches, declared by every decode chunk"
            .into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    /// A config with a released model's layer structure (E2B or E4B) at tiny widths.
    fn config(n: usize, every: usize, shared: usize, kv_heads: usize) -> TextConfig {
        let types = crate::config::tests::layer_types(n, every);
        let v = json!({
            "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": n, "num_attention_heads": 2, "num_key_value_heads": kv_heads,
            "head_dim": 32, "global_head_dim": 64, "sliding_window": 512, "hidden_size_per_layer_input": 32,
            "num_kv_shared_layers": shared, "use_double_wide_mlp": true, "final_logit_softcapping": 30.0,
            "layer_types": types,
        });
        TextConfig::from_json(&v, Path::new("config.json")).unwrap()
    }

    fn e2b() -> TextConfig {
        config(35, 5, 20, 1)
    }

    fn spans(l: &Layout) -> Vec<(usize, usize)> {
        l.chunks
            .iter()
            .map(|c| (c.first_layer, c.last_layer))
            .collect()
    }

    #[test]
    fn e2b_layouts_match_the_shipped_boundaries() {
        let p = plan(
            &e2b(),
            2048,
            Mode::All,
            None,
            &Functions::resolve(Mode::All, None, None),
        )
        .unwrap();
        let kind = |k: LayoutKind| p.layouts.iter().find(|l| l.kind == k).unwrap();
        assert_eq!(
            spans(kind(LayoutKind::Four)),
            vec![(0, 7), (8, 14), (15, 24), (25, 34)]
        );
        assert_eq!(
            spans(kind(LayoutKind::Three)),
            vec![(0, 7), (8, 24), (25, 34)]
        );
        assert_eq!(spans(kind(LayoutKind::Two)), vec![(0, 14), (15, 34)]);
        assert_eq!(spans(kind(LayoutKind::One)), vec![(0, 34)]);
        assert_eq!(
            spans(kind(LayoutKind::Prefill)),
            spans(kind(LayoutKind::Four))
        );
        let names: Vec<_> = p
            .layouts
            .iter()
            .flat_map(|l| l.chunks.iter().map(|c| c.name.clone()))
            .collect();
        assert_eq!(
            names,
            [
                "chunk1",
                "chunk2",
                "chunk3",
                "chunk4",
                "chunk1",
                "chunk2_3way",
                "chunk3_3way",
                "merged_chunk1",
                "merged_chunk2",
                "merged_full",
                "prefill_chunk1",
                "prefill_chunk2",
                "prefill_chunk3",
                "prefill_chunk4"
            ]
        );
        // chunk1..4 carry decode_q1 (default) + verify_qK (the three-chunk
        // decode's chunk1 too: the same package); the others decode only.
        for l in &p.layouts {
            for c in &l.chunks {
                let f: Vec<_> = c.functions.iter().map(|f| f.name.as_str()).collect();
                let want: &[&str] = match l.kind {
                    _ if c.name == "chunk1" => &["decode_q1", "verify_qK"],
                    LayoutKind::Four => &["decode_q1", "verify_qK"],
                    LayoutKind::Prefill => &["prefill_b512"],
                    _ => &["main"],
                };
                assert_eq!(f, want, "{}", c.name);
            }
        }
    }

    #[test]
    fn without_kv_sharing_layouts_split_every_layer_evenly() {
        let cfg = config(30, 5, 0, 1);
        let spans = |k| layout_spans(&cfg, k).unwrap();
        assert_eq!(
            spans(LayoutKind::Four),
            [(0, 7), (8, 15), (16, 23), (24, 29)]
        );
        assert_eq!(spans(LayoutKind::Two), [(0, 14), (15, 29)]);
        assert_eq!(spans(LayoutKind::Three), [(0, 7), (8, 23), (24, 29)]);
        assert_eq!(layout_spans(&cfg, LayoutKind::Split), None);
    }

    #[test]
    fn the_three_chunk_decode_runs_the_reference_chunk1() {
        // Planned on its own, the three-chunk layout's first chunk is the
        // reference's first chunk: same layers, slots and decode contract,
        // so the runtime decodes with chunk1 and no copy is built.
        let cfg = e2b();
        let only = |k| {
            plan(&cfg, 512, Mode::Only(k), None, &Functions::default())
                .unwrap()
                .layouts
                .remove(0)
        };
        let (three, four) = (only(LayoutKind::Three), only(LayoutKind::Four));
        let (a, b) = (&three.chunks[0], &four.chunks[0]);
        assert_eq!(a.name, "chunk1");
        assert_eq!((a.first_layer, a.last_layer), (b.first_layer, b.last_layer));
        assert_eq!(
            (&a.sliding_slots, &a.full_slots),
            (&b.sliding_slots, &b.full_slots)
        );
        assert_eq!((&a.inputs, &a.outputs), (&b.inputs, &b.outputs));
        // Its slot map fills chunk1's caches.
        assert!(three.kv_slot_map.iter().any(|m| m.to_chunk == "chunk1"));
    }

    #[test]
    fn e2b_kv_slots_and_producers() {
        let p = plan(&e2b(), 2048, Mode::All, None, &Functions::default()).unwrap();
        let kind = |k: LayoutKind| p.layouts.iter().find(|l| l.kind == k).unwrap();
        let four = &kind(LayoutKind::Four).chunks;
        assert_eq!(
            (four[0].sliding_slots.len(), four[0].full_slots.len()),
            (7, 1)
        );
        assert_eq!(
            (four[1].sliding_slots.len(), four[1].full_slots.len()),
            (5, 2)
        );
        let merged = &kind(LayoutKind::Two).chunks[0];
        assert_eq!(
            (merged.sliding_slots.len(), merged.full_slots.len()),
            (12, 3)
        );
        assert_eq!(
            merged
                .emits
                .iter()
                .map(|e| (e.alias.as_str(), e.layer))
                .collect::<Vec<_>>(),
            [("kv13", 13), ("kv14", 14)]
        );
        assert_eq!(kind(LayoutKind::Two).chunks[1].consumes.len(), 2);
        // merged_full keeps the producers internal: nothing emitted or consumed.
        let full = &kind(LayoutKind::One).chunks[0];
        assert!(full.emits.is_empty() && full.consumes.is_empty());
        assert!(full.outputs.iter().all(|t| !t.name.starts_with("kv1")));
        assert!(full
            .outputs
            .iter()
            .all(|t| t.name != "per_layer_combined_out"));
        // The three-chunk middle chunk owns L8-14's KV and reads L13/L14 internally.
        let three = &kind(LayoutKind::Three).chunks;
        assert_eq!(
            (three[1].sliding_slots.len(), three[1].full_slots.len()),
            (5, 2)
        );
        assert!(three[1].consumes.is_empty());
        assert_eq!(three[2].consumes.len(), 2);
        assert_eq!(kind(LayoutKind::Three).kv_slot_map.len(), 15);
    }

    /// The reference's verify_qK returns every output either runtime build
    /// reads from it (main's new rows, the branch's write-through caches), of
    /// the shapes each expects.
    #[test]
    fn verify_serves_both_runtime_contracts() {
        use crate::layouts::{Runtime, VerifyCommit};
        let f = Functions::resolve(Mode::All, None, None);
        let p = plan(&e2b(), 2048, Mode::All, None, &f).unwrap();
        let four = &p
            .layouts
            .iter()
            .find(|l| l.kind == REFERENCE)
            .unwrap()
            .chunks;
        for rt in Runtime::ALL {
            for r in rt.verify().reads {
                let verify = four[r.chunk]
                    .functions
                    .iter()
                    .find(|f| f.kind == FunctionKind::Verify)
                    .unwrap();
                assert!(
                    verify.outputs.iter().any(|t| t.name == r.output),
                    "{rt}: {} of {}",
                    r.output,
                    four[r.chunk].name
                );
            }
        }
        assert_eq!(Runtime::Merged.verify().commit, VerifyCommit::WriteThrough);
        // The write-through caches are the decode function's cache outputs:
        // window caches W long, full caches ctx long, at the caches' width.
        let verify = &four[0].functions[1];
        let shape = |n: &str| {
            verify
                .outputs
                .iter()
                .find(|t| t.name == n)
                .unwrap()
                .shape
                .clone()
        };
        assert_eq!(shape("K_sliding_out"), [7, 1, 512, 64]);
        assert_eq!(shape("V_full_out"), [1, 1, 2048, 64]);
        assert_eq!(shape("new_K_sliding"), [7, 1, 3, 32]);
    }

    #[test]
    fn e4b_producers_are_l22_and_l23() {
        let cfg = config(42, 6, 18, 2);
        assert_eq!(cfg.producer(Attention::Sliding), Some(22));
        assert_eq!(cfg.producer(Attention::Full), Some(23));
        let p = plan(
            &cfg,
            1024,
            Mode::Only(LayoutKind::Two),
            None,
            &Functions::default(),
        )
        .unwrap();
        assert_eq!(spans(&p.layouts[0]), vec![(0, 23), (24, 41)]);
        let emits: Vec<_> = p.layouts[0].chunks[0]
            .emits
            .iter()
            .map(|e| e.layer)
            .collect();
        assert_eq!(emits, [22, 23]);
        let k = p.layouts[0].chunks[1]
            .inputs
            .iter()
            .find(|t| t.name == "kv13_k")
            .unwrap();
        assert_eq!(k.shape, vec![1, 2, 512, 32]);
        // 24 layers: the on-device warning must be raised.
        assert!(p
            .warnings
            .iter()
            .any(|w| w.contains("merged_chunk1") && w.contains("iPhone 17 Pro")));
    }

    #[test]
    fn slot_map_copies_every_kv_layer_to_the_same_layer() {
        let cfg = e2b();
        for kind in [LayoutKind::Two, LayoutKind::One] {
            let l = plan_layout(&cfg, 512, kind, &layout_spans(&cfg, kind).unwrap());
            assert_eq!(l.kv_slot_map.len(), 15);
            for m in &l.kv_slot_map {
                let to = l.chunks.iter().find(|c| c.name == m.to_chunk).unwrap();
                let slots = if m.attention == Attention::Sliding {
                    &to.sliding_slots
                } else {
                    &to.full_slots
                };
                assert_eq!(slots[m.to_slot], m.layer, "{m:?}");
            }
            // Layer order within each kind.
            let sliding: Vec<_> = l
                .kv_slot_map
                .iter()
                .filter(|m| m.attention == Attention::Sliding)
                .map(|m| m.to_slot)
                .collect();
            assert_eq!(sliding, (0..12).collect::<Vec<_>>());
        }
    }

    #[test]
    fn every_decode_chunk_declares_update_mask_and_the_feed_is_noted() {
        // The runtime binds update_mask to every decode chunk, KV-shared ones too.
        let p = plan(&e2b(), 512, Mode::All, None, &Functions::default()).unwrap();
        for c in p.layouts.iter().flat_map(|l| &l.chunks) {
            let m = c.inputs.iter().find(|t| t.name == "update_mask");
            assert_eq!(
                m.map(|t| t.shape.clone()),
                Some(vec![1, 1, 512, 1]),
                "{}",
                c.name
            );
        }
        let scale = (p.dims.hidden_size_per_layer_input as f64).sqrt();
        assert_eq!(p.dims.per_layer_embed_scale, scale);
        assert!(p.contract_notes.iter().any(|n| n.contains("per_layer_raw")
            && n.contains(&scale.to_string())
            && n.contains("does not scale it again")));
    }

    #[test]
    fn split_contracts_chain() {
        let p = plan(
            &e2b(),
            512,
            Mode::Both,
            Some("0-11,12-23,24-34"),
            &Functions::default(),
        )
        .unwrap();
        let chunks = &p.layouts[0].chunks;
        assert_eq!(
            chunks.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            ["layers_00-11", "layers_12-23", "layers_24-34"]
        );
        for pair in chunks.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            // Everything b takes that is not a per-step runtime input or its own cache must come from an earlier chunk.
            for t in &b.inputs {
                let runtime = [
                    "hidden_states",
                    "causal_mask_full",
                    "causal_mask_sliding",
                    "update_mask",
                    "cos_s",
                    "sin_s",
                    "cos_f",
                    "sin_f",
                ];
                if runtime.contains(&t.name.as_str()) || t.name.ends_with("_in") {
                    continue;
                }
                let want = if t.name == "per_layer_combined" {
                    "per_layer_combined_out".to_string()
                } else {
                    t.name.clone()
                };
                let from = chunks
                    .iter()
                    .take_while(|c| c.name != b.name)
                    .flat_map(|c| &c.outputs)
                    .find(|o| o.name == want);
                let from = from.unwrap_or_else(|| {
                    panic!(
                        "{}: input {} is produced by no earlier chunk",
                        b.name, t.name
                    )
                });
                assert_eq!(from.shape, t.shape, "{}", t.name);
            }
            let h_out = a
                .outputs
                .iter()
                .find(|o| o.name == "hidden_states_out")
                .unwrap();
            let h_in = b.inputs.iter().find(|i| i.name == "hidden_states").unwrap();
            assert_eq!(h_out.shape, h_in.shape);
        }
        // The middle chunk owns L13/L14 and its shared layers read them internally, while
        // the last chunk reads them through kv13/kv14.
        assert_eq!(chunks[1].emits.len(), 2);
        assert_eq!(chunks[2].consumes.len(), 2);
        assert!(chunks[1].consumes.is_empty());
    }

    #[test]
    fn bad_splits_are_refused() {
        for (s, frag) in [
            ("0-10,12-34", "in no chunk"),
            ("0-12,12-34", "overlaps"),
            ("0-14,15-35", "reaches layer 35"),
            ("0-14", "in no chunk"),
            ("5-0,1-34", "backwards"),
            ("0-14;15-34", "not a layer number"),
        ] {
            let err = parse_split(s, 35).unwrap_err().to_string();
            assert!(err.contains(frag), "{s}: {err}");
        }
    }

    #[test]
    fn config_without_a_producer_is_refused() {
        // 35 layers with 33 shared: layers 0-1 are sliding only, so full layers have no producer.
        let types = crate::config::tests::layer_types(35, 5);
        let v = json!({"model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 35, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "sliding_window": 512, "hidden_size_per_layer_input": 32, "num_kv_shared_layers": 33, "layer_types": types});
        let err = TextConfig::from_json(&v, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_kv_shared_layers=33 leaves no KV-producing full-attention layer before layer 2"), "{err}");
        let mut short = v.clone();
        short["num_kv_shared_layers"] = json!(20);
        short["layer_types"] = json!(vec!["sliding_attention"; 34]);
        let err = TextConfig::from_json(&short, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("layer_types has 34 entries but num_hidden_layers is 35"),
            "{err}"
        );
        let mut wrong = v.clone();
        wrong["model_type"] = json!("llama");
        assert!(TextConfig::from_json(&wrong, Path::new("c"))
            .unwrap_err()
            .to_string()
            .contains("`llama`"));
    }

    #[test]
    fn long_chunks_warn_with_the_device_finding() {
        let p = plan(&e2b(), 2048, Mode::Both, None, &Functions::default()).unwrap();
        assert_eq!(p.warnings.len(), 2, "{:?}", p.warnings); // merged_chunk2 (20) and merged_full (35)
        assert!(p.warnings[1].contains("merged_full holds 35 layers"));
        let four = plan(
            &e2b(),
            2048,
            Mode::Only(LayoutKind::Four),
            None,
            &Functions::default(),
        )
        .unwrap();
        assert!(four.warnings.is_empty());
    }

    #[test]
    fn a_plan_reads_back_as_written_and_old_records_get_their_roles() {
        let p = plan(
            &e2b(),
            512,
            Mode::All,
            None,
            &Functions::resolve(Mode::All, None, None),
        )
        .unwrap();
        let json = serde_json::to_value(&p).unwrap();
        let back: Plan = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(serde_json::to_value(&back).unwrap(), json);
        let old: TensorSpec =
            serde_json::from_str(r#"{"name": "kv13_k", "shape": [1], "dtype": "fp16"}"#).unwrap();
        assert_eq!(old.role, Role::SharedK);
        let old: TensorSpec =
            serde_json::from_str(r#"{"name": "K_full_in", "shape": [1], "dtype": "fp16"}"#)
                .unwrap();
        assert_eq!(old.role, Role::KFull);
    }

    /// The per-tensor bound leaves the largest supported published Gemma 4
    /// room at the longest context, and refuses sizes that multiply past it
    /// in `plan`, naming the tensor, before a build could allocate it.
    #[test]
    fn tensors_past_the_size_bound_are_refused_by_the_plan() {
        let types = crate::config::tests::layer_types(42, 6);
        let e4b = json!({
            "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 42, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 256, "global_head_dim": 512, "sliding_window": 512, "hidden_size_per_layer_input": 256,
            "num_kv_shared_layers": 18, "final_logit_softcapping": 30.0, "layer_types": types,
        });
        let e4b = TextConfig::from_json(&e4b, Path::new("config.json")).unwrap();
        let all = Functions::resolve(Mode::All, None, None);
        let ctx = crate::args::MAX_CTX;
        let p = plan(&e4b, ctx, Mode::All, None, &all).unwrap();
        let largest = p
            .layouts
            .iter()
            .flat_map(|l| &l.chunks)
            .flat_map(|c| &c.functions)
            .flat_map(|f| f.inputs.iter().chain(&f.outputs))
            .map(|t| t.shape.iter().product::<usize>() as u64 * 2)
            .max()
            .unwrap();
        assert_eq!(largest, 1 << 30, "E4B's largest tensor at --ctx {ctx}");
        assert!(largest * 4 == MAX_TENSOR_BYTES);

        // Each size within its own bound, their product far past it.
        let mut wide = e2b();
        wide.num_attention_heads = 256;
        wide.num_key_value_heads = 256;
        wide.num_global_key_value_heads = 256;
        wide.sliding_window = ctx;
        let err = plan(
            &wide,
            2048,
            Mode::Only(LayoutKind::Two),
            None,
            &Functions::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("config.json: merged_chunk1 main: tensor K_sliding_in would be [")
                && err.contains("more than the 4 GiB chunkforge allows for one tensor")
                && err.contains("sliding_window=131072"),
            "{err}"
        );
    }
}
