//! The command line: clap structs only (their value types and parsers are
//! `values`). Each command's options become a request in `commands/`, which
//! does the work and renders the result.

pub mod values;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::args;
use crate::bench::device_report::Level;
use crate::downloader::{Client, RuntimeBuild};
use crate::layouts::{Mode, ReleaseLayout, RunLayout};
use crate::parity_checks::Thresholds;
use crate::py::contract::{AttentionSharpness, Shape};
use crate::records::ConversionArgs;
use values::DEFAULT_STEPS;
pub use values::{choice, named, BuildComparison, Jobs, ParityComparison};

#[derive(Parser)]
#[command(
    name = "chunkforge",
    version,
    about = "Gemma 4 checkpoint -> Core ML decode chunk packages for the Apple Neural Engine"
)]
pub struct Cli {
    /// Show Python tracebacks and coremltools' own progress output.
    #[arg(long, global = true)]
    pub verbose: bool,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Hugging Face Gemma 4 checkpoint folder (config.json + safetensors). Without
    /// it (and without GEMMA4_HF_DIR) the small built-in trained checkpoint is used
    /// (checkpoints/default).
    #[arg(long, env = "GEMMA4_HF_DIR")]
    pub hf_dir: Option<PathBuf>,
}

/// `build`'s context length, which `side-files` must agree with.
pub const DEFAULT_CTX: usize = 2048;

#[derive(Args, Clone)]
pub struct LayoutArgs {
    /// Layouts to build.
    #[arg(long, default_value = "both", value_parser = choice::<Mode>())]
    pub mode: Mode,
    /// Custom split instead of --mode: contiguous layer ranges covering every layer, e.g. 0-11,12-23,24-34.
    #[arg(long)]
    pub split: Option<String>,
    /// Full-attention context length (KV cache entries), at most 131072.
    #[arg(long, default_value_t = DEFAULT_CTX, value_parser = args::ctx)]
    pub ctx: usize,
    #[command(flatten)]
    pub functions: FunctionArgs,
}

#[derive(Args, Clone)]
pub struct FunctionArgs {
    /// Draft tokens of chunk1..4's verify_qK function (default with --mode all: 3).
    #[arg(long)]
    pub verify_k: Option<usize>,
    /// Tokens per batched prefill call of prefill_chunk1..4, one function per value,
    /// e.g. 64,128,512 (default with --mode all: 512).
    #[arg(long, value_delimiter = ',')]
    pub prefill_len: Option<Vec<usize>>,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Print the Python interpreter, package versions, cache paths and what this platform cannot do.
    Doctor {
        /// Only print the path of the cached environment's python executable (for scripts).
        #[arg(long)]
        venv_python: bool,
    },
    /// Create (or update) the pinned Python environment in the cache folder.
    Setup,
    /// Print the chunk plan for a checkpoint: layer ranges, KV slots, producer KV, I/O contracts.
    Plan {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Print the plan as JSON (the same data every other step consumes).
        #[arg(long)]
        json: bool,
    },
    /// Convert a checkpoint into Core ML decode packages (.mlpackage) plus build.json.
    Build(BuildCmd),
    /// Check merged layouts against the four-chunk reference and the reference against transformers (torch, fp32, CPU).
    Parity(ParityCmd),
    /// Write a random-weight Gemma 4 checkpoint in the Hugging Face layout.
    Fixture(FixtureCmd),
    /// Run one function of a package's ML program on the CPU (the MIL interpreter): inputs from an
    /// .npz by name, outputs to an .npz by name (works on Linux; reads the package only).
    Exec(ExecCmd),
    /// Describe a built .mlpackage: spec version, inputs/outputs, palettized weights, layers (no model load; works on Linux).
    Inspect {
        /// One .mlpackage folder (e.g. out/default/merged_chunk1.mlpackage), or a compiled
        /// .mlmodelc with text MIL, not the build or release folder that holds it.
        package: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Static ANE audit of a build's packages (BUILD_DIR with build.json) or of one .mlpackage:
    /// op types, ranks, fp32, large and singleton-last dimensions, dynamic shapes; on macOS also
    /// the compute plan. Exit 1 with errors (a padded last axis is a warning: exit 0).
    Audit {
        /// A build folder (its build.json lists the packages) or one .mlpackage folder.
        path: PathBuf,
        /// Print the full report (every finding) as JSON.
        #[arg(long)]
        json: bool,
        /// Print the op types per layer kind found in the packages, in
        /// python/chunkforge_py/mil/ane_op_types.json's shape (to regenerate and diff that table).
        #[arg(long, conflicts_with = "json")]
        print_op_types: bool,
    },
    /// Write an ECDSA P-256 signing key pair: PREFIX.pem (PKCS#8, mode 0600) and PREFIX.pub.
    Keygen {
        /// File prefix, e.g. keys/release; its folder is created if missing (mode 0700).
        /// Refuses to overwrite existing PREFIX.pem / PREFIX.pub.
        #[arg(long)]
        out: PathBuf,
    },
    /// Write the files the runtime reads beside the packages: INT8 embedding tables, per-layer
    /// projection, RoPE tables, model_config.json.
    SideFiles(SideFilesCmd),
    /// Make a signed release folder from a build: the packages, the runtime's side files,
    /// hf_model/, manifest.json and model.sig (OpenSSF model signing format).
    Package(PackageCmd),
    /// Build, check parity, then package and sign: one command from checkpoint to release
    /// (refuses to sign when parity fails).
    Release(ReleaseCmd),
    /// Generate text from a release folder alone: the app's runtime emulated on the CPU.
    Run(RunCmd),
    /// What a release (or build) costs against its source checkpoint, per decode layout, over a
    /// text: perplexity of the packages' own programs and of transformers, KL, top-1 agreement,
    /// the positions of disagreement; with --fp16, the fp16 range of the programs.
    Eval(EvalCmd),
    /// Check a release folder's signature, files and manifest (and optionally its zip).
    Verify(VerifyCmd),
    /// Replay the app's download of a release folder (ModelDownloader.swift's lists): every
    /// request, the shared weight blobs, the context check, the hard-coded widths, the layout
    /// the runtime picks, the multimodal files. Exit 1 when the download would abort or the
    /// load fail.
    ClientCheck(ClientCheckCmd),
    /// Turn an uncompiled release into the repository the app downloads: each package compiled
    /// to the files the app requests (text MIL model.mil, coremldata.bin, metadata.json,
    /// analytics, the weights linked), chunk1's context checked, the run book and
    /// distribution.json made again, re-signed. chunkforge's own writer on Linux; Core ML's
    /// compiler (coremltools get_compiled_model_path()) on macOS, where --check compares both.
    Compile(CompileCmd),
    /// Turn device bench logs (the runtime's [Load], [ComputePlan], [Profile] lines) into a
    /// verdict per decode layout, by the release's DEVICE_RUNBOOK.md.
    DeviceReport(DeviceReportCmd),
    /// Serve a build's conversion tasks on stdin (started by `build --jobs`).
    #[command(hide = true)]
    ConvertWorker,
    /// Run pytest inside the embedded interpreter (where chunkforge_native is importable).
    #[command(hide = true)]
    SelftestPython {
        /// Arguments for pytest.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Time `parity` (wall time, peak RSS); options not given here at `parity`'s defaults.
    Parity(BenchParityCmd),
    /// Time `build` (wall time per phase, peak RSS) into a temporary folder.
    Build(BenchBuildCmd),
    /// Time `side-files` (seconds, MiB/s, peak RSS of its own process) next to a plain write of
    /// as many bytes and a plain copy (the same tensor bytes read, as many written) in the same folder.
    SideFiles(BenchSideFilesCmd),
    /// Time hashing + signing a release (1 big file, 8 smaller ones) against openssl and model_signing.
    Hash(HashBenchArgs),
    /// `run` side by side with `run` before the native kernels (CHUNKFORGE_MATMUL=dense) and
    /// transformers' own generate on the source checkpoint (bf16, sdpa), each a child process:
    /// prefill and decode tokens per second, peak RSS.
    Run(BenchRunCmd),
    /// The product kernels on E2B's decode step: GB/s of stored weight read (4-bit LUT and
    /// bf16) beside the machine's copy bandwidth in the same run, and few-token GFLOP/s.
    Matmul {
        /// Print the figures as JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// A tenth of the layers and of the head (seconds; for tests).
        #[arg(long)]
        quick: bool,
        /// The build to run (portable, avx2, avx512) [default: the fastest this CPU runs].
        #[arg(long)]
        isa: Option<String>,
    },
    /// INT4 g=32 palettization: the Rust kernel vs coremltools 9.0 (kmeans1d and scikit-learn,
    /// 1 and 2 workers) on E2B-width matrices; seconds and MSE side by side.
    Palettize {
        /// Print {"results": [{"shape", "impl", "seconds", "mse"}, ...]} instead of a table.
        #[arg(long)]
        json: bool,
        /// Small matrices only (seconds instead of many minutes; for tests).
        #[arg(long)]
        quick: bool,
        /// Seed of the random weight matrices.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(Args, Clone)]
pub struct BuildCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Output folder; packages appear there only when every one of them is complete.
    #[arg(long, required_unless_present = "check")]
    pub output: Option<PathBuf>,
    /// Rebuild the build in this folder (same checkpoint and settings, from its
    /// build.json) into a temporary folder and report whether every package is
    /// byte-identical.
    #[arg(long, conflicts_with = "output")]
    pub check: Option<PathBuf>,
    #[command(flatten)]
    pub conversion: ConversionArgs,
    /// If another run is writing the same --output, fail at once instead of waiting for it.
    #[arg(long)]
    pub no_wait: bool,
    /// Processes converting at once: this one plus conversion workers. auto: one per
    /// core, as many as the estimated peak memory of that many conversions at once
    /// keeps within 6.5 GiB and the memory available.
    #[arg(long, default_value = "auto")]
    pub jobs: Jobs,
}

#[derive(Args, Clone)]
pub struct ParityCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Layouts to check against the reference (the reference alone: only against transformers;
    /// all also checks verify_qK and the prefill functions).
    #[arg(long, default_value = "both", value_parser = choice::<Mode>())]
    pub mode: Mode,
    #[command(flatten)]
    pub functions: FunctionArgs,
    /// A custom split to check instead of --mode, e.g. 0-11,12-23,24-34.
    #[arg(long)]
    pub split: Option<String>,
    /// Decode steps (step t feeds prompt token t).
    #[arg(long, default_value_t = DEFAULT_STEPS)]
    pub steps: usize,
    /// Full-attention context length used for the caches, at most 131072
    /// [default: 512; with --artifacts, the build's (build.json)].
    #[arg(long, value_parser = args::ctx)]
    pub ctx: Option<usize>,
    /// Prompt token ids (comma-separated); default: parity/builtin_prompt.json for the
    /// built-in checkpoint, parity/default_prompt.json for any other.
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// Run the first N prompt tokens through the four-chunk reference, copy its KV
    /// slots into each layout (plan's slot map), then decode the rest with the layout.
    #[arg(long, default_value_t = 0)]
    pub prefill: usize,
    /// Read the INT4 weights back out of the packages in this build folder and
    /// report their agreement with the fp32 reference.
    #[arg(long)]
    pub artifacts: Option<PathBuf>,
    /// What the checks are held to.
    #[command(flatten)]
    pub thresholds: Thresholds,
    /// Write the JSON report (schema: parity/report.schema.json) here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Skip the transformers oracle.
    #[arg(long)]
    pub no_oracle: bool,
    #[cfg(feature = "test-hooks")]
    #[command(flatten)]
    pub sabotage: crate::test_hooks::SabotageArgs,
}

#[derive(Args, Clone)]
pub struct FixtureCmd {
    /// Folder to create.
    #[arg(long)]
    pub out: PathBuf,
    /// Layer structure (layer count, attention pattern, KV sharing) of the released model it mimics.
    #[arg(long, default_value = "e2b", value_parser = named::<Shape>())]
    pub shape: Shape,
    /// Seed of the random weights (the tokenizer files do not depend on it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Gemma4ForConditionalGeneration layout: text_config, model.language_model.* names, extra vision tensors.
    #[arg(long)]
    pub multimodal: bool,
    /// Number of safetensors shards (>1 writes model.safetensors.index.json)
    /// [default: 1; with --full-size, shards of at most 4 GiB].
    #[arg(long)]
    pub shards: Option<usize>,
    /// config.json's sliding_window: tokens a sliding-attention layer sees (small values
    /// make short tests decode past the window).
    #[arg(long, default_value_t = 512)]
    pub sliding_window: usize,
    /// Vocabulary size: the LM head's rows and the tokenizer's tokens (at least 260).
    #[arg(long, default_value_t = 512)]
    pub vocab_size: usize,
    /// The released model's widths (E2B: hidden 1536, 8x256/512 heads, MLP 6144)
    /// instead of tiny ones, stored in bfloat16: for benchmarks (E2B ~2B parameters
    /// with --vocab-size 16384).
    #[arg(long)]
    pub full_width: bool,
    /// The published checkpoint's whole size: its widths, the 262144-token vocabulary
    /// (per-layer table included) and 131072 positions (E2B 4.65 G parameters, 8.7 GiB;
    /// E4B 7.5 G, 14 GiB), streamed tensor by tensor into bf16 shards in flat memory.
    #[arg(long, conflicts_with_all = ["full_width", "vocab_size"])]
    pub full_size: bool,
    /// How peaked random attention is, by the q/k norm weights [default: soft with
    /// --full-size; otherwise transformers' initialisation, near 1].
    #[arg(long, value_parser = named::<AttentionSharpness>())]
    pub attention: Option<AttentionSharpness>,
}

/// `chunkforge side-files`.
#[derive(Args, Clone)]
pub struct SideFilesCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub options: SideFilesArgs,
    /// Output folder (e.g. the build folder); the side files appear there together, once all are complete.
    #[arg(long)]
    pub output: PathBuf,
    /// Print the report (files, bytes, seconds, peak RSS) as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// If another run is writing the same --output, fail at once instead of waiting for it.
    #[arg(long)]
    pub no_wait: bool,
}

/// What the side files are written for (shared by `side-files` and `bench side-files`).
#[derive(Args, Clone)]
pub struct SideFilesArgs {
    /// The packages' full-attention context length: model_config.json's context_length, which
    /// the runtime checks against the packages (use the build's --ctx).
    #[arg(long, default_value_t = DEFAULT_CTX, value_parser = args::ctx)]
    pub ctx: usize,
    /// Rows of each RoPE table, at least --ctx (the runtime feeds zero rows past the end) [default: --ctx].
    #[arg(long, value_parser = args::ctx)]
    pub rope_positions: Option<usize>,
    /// model_config.json's model_name [default: the checkpoint folder's name].
    #[arg(long)]
    pub model_name: Option<String>,
}

/// `chunkforge bench parity`.
#[derive(Args, Clone)]
pub struct BenchParityCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Layouts to check, as `parity --mode`.
    #[arg(long, default_value = "all", value_parser = choice::<Mode>())]
    pub mode: Mode,
    /// Decode steps, as `parity --steps`.
    #[arg(long, default_value_t = DEFAULT_STEPS)]
    pub steps: usize,
    /// Prompt tokens prefilled, as `parity --prefill`.
    #[arg(long, default_value_t = 0)]
    pub prefill: usize,
    /// The build whose packages are checked too, as `parity --artifacts`.
    #[arg(long)]
    pub artifacts: Option<PathBuf>,
    /// Run it twice, each in a child process of its own, differing only in what is
    /// compared, side by side; fails unless the two reports agree.
    #[arg(long, value_parser = named::<ParityComparison>())]
    pub compare: Option<ParityComparison>,
    /// Write the parity report here (the children of --compare).
    #[arg(long, hide = true)]
    pub report: Option<PathBuf>,
    /// Print the wall time, peak RSS and verdict as JSON on the last line
    /// (the children of --compare).
    #[arg(long, hide = true)]
    pub json: bool,
}

/// `chunkforge bench run`.
#[derive(Args, Clone)]
pub struct BenchRunCmd {
    /// Release folder (from `package` or `release`).
    pub release_dir: PathBuf,
    /// The checkpoint the release was built from, for transformers' side (without it,
    /// and without GEMMA4_HF_DIR, transformers is not run).
    #[arg(long, env = "GEMMA4_HF_DIR")]
    pub hf_dir: Option<PathBuf>,
    /// Prompt text, tokenized with the release's tokenizer and its ids repeated to
    /// --prompt-tokens.
    #[arg(long, default_value = "The quick brown fox")]
    pub prompt: String,
    /// Tokens of the prompt every side prefills.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: usize,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Leave out `run` before the kernels (at real size it takes seconds a token).
    #[arg(long)]
    pub no_baseline: bool,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `chunkforge bench side-files`.
#[derive(Args, Clone)]
pub struct BenchSideFilesCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub options: SideFilesArgs,
    /// Folder to write into (removed afterwards) [default: the system temp folder].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Rounds (side-files, plain write, plain copy, in turn); the best of each is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

#[derive(Args, Clone)]
pub struct BenchBuildCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[command(flatten)]
    pub conversion: ConversionArgs,
    /// As `build --jobs`.
    #[arg(long, default_value = "auto")]
    pub jobs: Jobs,
    /// Also time every coremltools graph pass of every conversion and count the
    /// runs that changed the program; prints seconds per pass, per package.
    #[arg(long)]
    pub profile: bool,
    /// Run the build three times, each in a child process of its own: as before
    /// chunkforge's optimisations (coremltools' default pass pipeline, every layout
    /// converted from torch, one process), as shipped in one process (--jobs 1), and
    /// as shipped (--jobs auto); prints them side by side.
    #[arg(long, conflicts_with_all = ["json", "pass_pipeline", "no_compose", "profile", "jobs"])]
    pub baseline: bool,
    /// Run the build twice, each in a child process of its own, as given but for what
    /// is compared; prints them side by side and, but for `joint`, requires
    /// byte-identical packages.
    #[arg(long, value_parser = named::<BuildComparison>(), conflicts_with_all = ["json", "baseline", "profile"])]
    pub compare: Option<BuildComparison>,
    /// Print the build report JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// `chunkforge package`.
#[derive(Args, Clone, Debug)]
pub struct PackageCmd {
    /// Build output folder (build.json + <name>.mlpackage folders).
    pub build_dir: PathBuf,
    #[command(flatten)]
    pub release: ReleaseArgs,
    /// The checkpoint the side files and hf_model/ come from [default: build.json's
    /// checkpoint folder]; its config.json and weights must be the ones the build was made
    /// from. Not with --onto a release (they come from it).
    #[arg(long)]
    pub hf_dir: Option<PathBuf>,
    /// An existing chunkforge release of the same checkpoint, or an upstream bundle of it
    /// (compiled .mlmodelc, swa/ or local layout): the build's packages go into a new
    /// release beside every file the build lacks (chunk1..4, prefill_chunk1..4, the side
    /// files, hf_model/), carried from it after each is checked against the build. A
    /// release must verify first (--onto-public-key); a bundle gives only its packages.
    #[arg(long, value_name = "DIR")]
    pub onto: Option<PathBuf>,
    /// The public key --onto's release is verified with (its signature, and every file
    /// against its signed digest) [default: the public key of --key].
    #[arg(long, value_name = "PUB", requires = "onto")]
    pub onto_public_key: Option<PathBuf>,
    /// Carry --onto's release without verifying its signature: each file is checked
    /// against its manifest.json only, and the new manifest records it as unverified.
    #[arg(long, requires = "onto", conflicts_with = "onto_public_key")]
    pub allow_unverified_onto: bool,
    /// Parity report JSON (`chunkforge parity --report`) of the build's checkpoint; its
    /// top-level `summary` object is embedded in the manifest. A failed report is refused.
    #[arg(long)]
    pub parity_report: Option<PathBuf>,
    /// Embed a failed parity report anyway, recorded as failed (`ok: false`).
    #[arg(long, requires = "parity_report")]
    pub allow_failed_parity: bool,
    /// Eval report JSON (`chunkforge eval BUILD --report`) of the build: its figures
    /// (perplexity, KL, top-1 per layout against the source) are recorded in the manifest.
    #[arg(long)]
    pub eval_report: Option<PathBuf>,
    #[command(flatten)]
    pub inconclusive: InconclusiveArgs,
}

/// Signing on an inconclusive parity (`package`, `release`).
#[derive(Args, Clone, Debug)]
pub struct InconclusiveArgs {
    /// Sign although parity is INCONCLUSIVE: the reference disagrees with transformers
    /// only at steps where transformers disagrees with itself (an ill-conditioned
    /// checkpoint), so a conversion error at those steps would go unseen. Recorded in
    /// the manifest as inconclusive (`ok: false`).
    #[arg(long)]
    pub accept_inconclusive_parity: bool,
}

/// What goes into a release folder and where (`package` and `release`).
#[derive(Args, Clone, Debug)]
pub struct ReleaseArgs {
    /// Decode layout(s) to ship; the reference's packages (decode, verify) and the prefill packages
    /// ship with every layout.
    #[arg(long, default_value = "app", value_parser = choice::<ReleaseLayout>())]
    pub layout: ReleaseLayout,
    /// ECDSA P-256 private key (PKCS#8 PEM, e.g. from `chunkforge keygen`).
    #[arg(long)]
    pub key: PathBuf,
    /// Release folder to create or replace (replaced only once the new one is complete).
    #[arg(long)]
    pub output: PathBuf,
    /// Release version recorded in the manifest [default: build-<first 12 hex of build.json's SHA-256>].
    #[arg(long)]
    pub version: Option<String>,
    /// Model id recorded in the manifest and model_config.json: letters, digits, '.', '_', '-'
    /// [default: the checkpoint folder's name from build.json].
    #[arg(long, value_parser = args::model_id)]
    pub model_id: Option<String>,
    /// Base URL the files will be served from (e.g. https://huggingface.co/ORG/REPO/resolve/main):
    /// each manifest file entry gets `url`, and so does distribution.json's.
    #[arg(long)]
    pub base_url: Option<String>,
    /// Also write a deterministic zip of the release folder here, plus FILE.sha256: every
    /// entry stored (the app's iOS extractor copies raw bytes), under 4 GiB in all.
    #[arg(long)]
    pub zip: Option<PathBuf>,
    /// Rows of the RoPE tables (cos/sin_*.npy) [default: the build's context length].
    #[arg(long)]
    pub rope_positions: Option<usize>,
    /// Release without hf_model/tokenizer.json (the app must bring its own tokenizer).
    #[arg(long)]
    pub no_tokenizer: bool,
    /// If another run is writing the same --output, fail at once instead of waiting for it.
    #[arg(long)]
    pub no_wait: bool,
    /// Ship even though the build's audit (build.json `audit`, see `chunkforge audit`)
    /// has errors in the packages this release ships (warnings never refuse).
    #[arg(long)]
    pub allow_audit_findings: bool,
    /// Ship even though a runtime would pick, by file presence, a layout with a function over the
    /// Neural Engine layer ceiling (the branch runtime picks merged_full before anything else).
    #[arg(long)]
    pub allow_over_ceiling: bool,
    /// Carry the app's multimodal encoder files (vision.mlmodelc, audio.mlmodelc, the audio
    /// side files) from this existing bundle or release: chunkforge converts no encoders.
    /// Checked against the app's lists, hashed and signed with the rest.
    #[arg(long)]
    pub encoders_from: Option<PathBuf>,
}

/// `chunkforge release`.
#[derive(Args, Clone)]
pub struct ReleaseCmd {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub release: ReleaseArgs,
    /// Where the build goes (kept, for `build --check` and `parity --artifacts`) [default: OUTPUT.build].
    #[arg(long)]
    pub build_dir: Option<PathBuf>,
    /// Full-attention context length (KV cache entries), at most 131072.
    #[arg(long, default_value_t = 2048, value_parser = args::ctx)]
    pub ctx: usize,
    #[command(flatten)]
    pub functions: FunctionArgs,
    #[command(flatten)]
    pub conversion: ConversionArgs,
    /// Parity decode steps.
    #[arg(long, default_value_t = DEFAULT_STEPS)]
    pub steps: usize,
    /// After parity, evaluate the build against its source over the project's text as
    /// `chunkforge eval --fp16` does and record the figures in the signed manifest (an op
    /// that makes inf or NaN in fp16 stops the release before signing).
    #[arg(long)]
    pub eval: bool,
    /// Then compile the release to the .mlmodelc the app fetches, as `chunkforge compile` does
    /// (Core ML's compiler on macOS, chunkforge's writer elsewhere).
    #[arg(long)]
    pub compile: bool,
    /// Skip the build when --build-dir already holds a complete one of this checkpoint
    /// with these settings (anything else there is an error).
    #[arg(long)]
    pub reuse_build: bool,
    #[command(flatten)]
    pub inconclusive: InconclusiveArgs,
    #[cfg(feature = "test-hooks")]
    #[command(flatten)]
    pub sabotage: crate::test_hooks::SabotageArgs,
}

/// `chunkforge run`.
#[derive(Args, Clone)]
pub struct RunCmd {
    /// Release folder (from `package` or `release`).
    pub release_dir: PathBuf,
    /// Prompt text, tokenized with the release's hf_model/tokenizer.json.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt token ids (comma-separated) instead of text.
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// Tokens to generate (fewer if the model emits eos first).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// Decode layout: auto picks by file presence, as the runtime does.
    #[arg(long, default_value = "auto", value_parser = choice::<RunLayout>())]
    pub layout: RunLayout,
    /// Run as this build of the app's runtime does: its layout pick by file presence (with
    /// --layout auto) and the weight blobs its download links or copies between packages
    /// [default: either build's pick, main's first].
    #[arg(long, value_parser = named::<RuntimeBuild>())]
    pub runtime: Option<RuntimeBuild>,
    /// Speculative decoding with chunk1..4's verify_qK: K tokens per call (the
    /// packages' K), drafts by prompt lookup, committed as the --runtime build
    /// does (main: the accepted rows; branch: write-through, the whole caches
    /// verify returns).
    #[arg(long)]
    pub speculate: Option<usize>,
    /// Round every fp16 op output to fp16 in the MIL interpreter (the closest
    /// the CPU gets to the device's arithmetic); default: fp32.
    #[arg(long)]
    pub fp16: bool,
    /// Print {"layout", "prompt_ids", "generated_ids", "text", ...} as JSON.
    #[arg(long)]
    pub json: bool,
    /// The free-running gate: also generate greedily with transformers on the source
    /// checkpoint and hold the release's tokens to them; exit 1 at the first token that
    /// differs, unless transformers' top-2 margin there is under --near-tie.
    #[arg(long)]
    pub against_source: bool,
    /// The source checkpoint for --against-source [default: the built-in checkpoint, when
    /// the release was made from it].
    #[arg(long, requires = "against_source")]
    pub hf_dir: Option<PathBuf>,
    /// transformers' top-2 logit margin under which a divergence is a near-tie, excused
    /// (--against-source).
    #[arg(long, default_value_t = crate::bench::transcript::DEFAULT_NEAR_TIE, value_parser = args::non_negative)]
    pub near_tie: f64,
    /// Write the gate's transcript here (JSON: prompt ids, both token streams with their
    /// margins, the verdict, versions, the checkpoint's digests), for `device-report --transcript`.
    #[arg(long, requires = "against_source")]
    pub transcript: Option<PathBuf>,
}

/// `chunkforge eval`.
#[derive(Args, Clone)]
pub struct EvalCmd {
    /// A release folder (from `package` or `release`) or a build folder (build.json).
    pub target: PathBuf,
    /// The source checkpoint transformers runs [default: a build's own; for a release, the
    /// built-in checkpoint when the release was made from it].
    #[arg(long, env = "GEMMA4_HF_DIR")]
    pub hf_dir: Option<PathBuf>,
    /// The text (UTF-8) [default: the project's own, eval/default.txt].
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens of the text read at most (<bos> included) [default: the context length].
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Round every fp16 op output to fp16 in the MIL interpreter, as `run --fp16`, and report
    /// the fp16 range: the op nearest to overflow, and any that makes inf or NaN.
    #[arg(long)]
    pub fp16: bool,
    /// Print the report as JSON (schema: eval/report.schema.json).
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report here (`package --eval-report` embeds it in the manifest).
    #[arg(long)]
    pub report: Option<PathBuf>,
}

/// `chunkforge exec`.
#[derive(Args, Clone, Debug)]
pub struct ExecCmd {
    /// The .mlpackage (or a compiled .mlmodelc with text MIL) to run.
    pub package: PathBuf,
    /// Function to run (default: the package's default function).
    #[arg(long)]
    pub function: Option<String>,
    /// .npz with one array per input of the function, by input name (float16 or float32 for
    /// fp16/fp32 inputs, int32 for int32 ones, of the declared shapes).
    #[arg(long)]
    pub inputs: PathBuf,
    /// .npz to write, one array per output by name (written to a temporary file, then renamed).
    #[arg(long)]
    pub output: PathBuf,
    /// Round every fp16-typed tensor to fp16 after each op (the device's arithmetic, as close as
    /// the CPU gets); without it every tensor is computed in fp32.
    #[arg(long)]
    pub fp16: bool,
    /// Print {"function", "ops", "inputs", "outputs", ...} as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `chunkforge device-report`.
#[derive(Args, Clone, Debug)]
pub struct DeviceReportCmd {
    /// Device logs, one file per run (one launch of the app), each optionally
    /// labelled with the layout it was meant to run: LAYOUT=FILE (four, three,
    /// two, one), e.g. two=two-1.log.
    #[arg(required = true, value_name = "LOG")]
    pub logs: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 unless every layout with a target reaches this verdict, with
    /// no error finding and no unparsed runtime line.
    #[arg(long, value_parser = named::<Level>())]
    pub require: Option<Level>,
    /// A transcript of `run --against-source --transcript`: each log's `[Gate] tokens:`
    /// line (the ids the device generated after the transcript's prompt ids) is held to
    /// transformers' stream by the gate's rule; exit 1 when one fails.
    #[arg(long)]
    pub transcript: Option<PathBuf>,
}

/// `chunkforge verify`.
#[derive(Args, Clone, Debug)]
pub struct VerifyCmd {
    /// Release folder (with model.sig).
    pub release_dir: PathBuf,
    /// ECDSA P-256 public key (SubjectPublicKeyInfo PEM, e.g. KEY.pub from `chunkforge keygen`).
    #[arg(long)]
    pub public_key: PathBuf,
    /// Also check this zip of the release (and FILE.sha256 beside it).
    #[arg(long)]
    pub archive: Option<PathBuf>,
}

/// `chunkforge compile`.
#[derive(Args, Clone, Debug)]
pub struct CompileCmd {
    /// Release folder (uncompiled, from `package` or `release`); replaced when complete.
    pub release_dir: PathBuf,
    /// ECDSA P-256 private key to re-sign it with.
    #[arg(long)]
    pub key: PathBuf,
    /// Compile each package both ways, Core ML's compiler and chunkforge's writer, and fail
    /// naming the first file that differs (macOS only: exit 2 elsewhere, before anything is read).
    #[arg(long)]
    pub check: bool,
}

/// `chunkforge client-check`.
#[derive(Args, Clone, Debug)]
pub struct ClientCheckCmd {
    /// Release folder (from `package` or `release`).
    pub release_dir: PathBuf,
    /// The app's download entry: main (gemma4-e2b, four chunks), main-3way (gemma4-e2b-3way),
    /// branch (fix/2chunk-kv-prefill-transfer's gemma4-e2b).
    #[arg(long, value_parser = named::<Client>())]
    pub client: Client,
    /// The app's "include multimodal" toggle (main's gemma4DownloadMultimodal, default on);
    /// the branch always fetches the encoders.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub multimodal: String,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the model folder as it stands after the app's download (local names, shared
    /// blobs linked or copied, RoPE tables at the root, plus manifest.json) to this new
    /// folder: `chunkforge run DIR` runs it.
    #[arg(long)]
    pub materialize: Option<PathBuf>,
}

/// `chunkforge bench hash`.
#[derive(Args, Clone, Debug)]
pub struct HashBenchArgs {
    /// Folder for the test data (removed afterwards unless --keep) [default: the system temp folder].
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Size of the single big file, MiB.
    #[arg(long, default_value_t = 2048)]
    pub big_mib: u64,
    /// Size of each of the smaller files, MiB.
    #[arg(long, default_value_t = 256)]
    pub small_mib: u64,
    /// Number of smaller files.
    #[arg(long, default_value_t = 8)]
    pub small_count: usize,
    /// Runs per tool; the best is reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    /// model_signing executable [default: signing-venv/bin/model_signing in the cache folder (README: Cache folders),
    /// made by scripts/setup-signing.sh]; skipped with a note when absent.
    #[arg(long)]
    pub model_signing: Option<PathBuf>,
    /// Keep the generated data.
    #[arg(long)]
    pub keep: bool,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// Every option and positional argument of every command that `--help`
    /// shows, with the command path that holds it, lacking a help text.
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_hide_set() || id == "help" || id == "version" {
                continue;
            }
            if arg
                .get_help()
                .is_none_or(|h| h.to_string().trim().is_empty())
            {
                out.push(format!("{path} {id}"));
            }
        }
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            undocumented(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    /// `bench build`'s baselines refuse the conversion options they set
    /// themselves, which live in the flattened `ConversionArgs`: a
    /// `conflicts_with` naming an option by a name it no longer has is
    /// silent in a release build (clap checks the names in debug builds only).
    #[test]
    fn bench_build_baselines_refuse_the_conversion_options_they_set() {
        use clap::Parser;
        for (baseline, option) in [
            ("--baseline", &["--no-compose"][..]),
            ("--baseline", &["--pass-pipeline", "coremltools"][..]),
        ] {
            let args = ["chunkforge", "bench", "build", baseline]
                .into_iter()
                .chain(option.iter().copied());
            let e = Cli::try_parse_from(args).err();
            assert_eq!(
                e.as_ref().map(|e| e.kind()),
                Some(clap::error::ErrorKind::ArgumentConflict),
                "{baseline} {option:?}: {e:?}"
            );
        }
    }

    #[test]
    fn every_argument_has_a_help_text() {
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "chunkforge", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
