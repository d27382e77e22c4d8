//! Which build of the product kernels runs on this CPU.

use std::sync::OnceLock;

/// The instruction sets the kernels are built for, slowest first. Every
/// build computes the same bits (the order of `super`'s doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, 16 lanes as an array (fused multiply-adds by `mul_add`).
    Portable,
    /// AVX2 with FMA and F16C: each 16 lanes are two 8-lane registers.
    Avx2,
    /// AVX-512 (F, BW, VL): one register of 16 lanes.
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// `portable`, `avx2` or `avx512`.
    pub fn parse(s: &str) -> Option<Isa> {
        match s {
            "portable" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            _ => None,
        }
    }
}

/// The builds this CPU can run, slowest first.
pub fn available_isas() -> Vec<Isa> {
    let mut isas = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            isas.push(Isa::Avx2);
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                isas.push(Isa::Avx512);
            }
        }
    }
    isas
}

/// Caps the build the kernels choose (`portable`, `avx2`): for comparisons
/// and the forced-portable tests; every build computes the same bits.
pub const ISA_ENV: &str = "CHUNKFORGE_MATMUL_ISA";

/// The fastest build this CPU runs, capped by `$CHUNKFORGE_MATMUL_ISA`
/// (read once per process).
pub fn best_isa() -> Isa {
    static BEST: OnceLock<Isa> = OnceLock::new();
    *BEST.get_or_init(|| {
        let cap = std::env::var(ISA_ENV)
            .ok()
            .and_then(|v| Isa::parse(&v))
            .unwrap_or(Isa::Avx512);
        available_isas()
            .into_iter()
            .filter(|&i| i <= cap)
            .max()
            .unwrap_or(Isa::Portable)
    })
}

/// The register tile of a build: rows and tokens whose accumulators it
/// holds at once (each weight block is widened once per tile row and
/// used for every token of the tile).
pub(super) fn tile(isa: Isa) -> (usize, usize) {
    match isa {
        Isa::Portable => (1, 1),
        Isa::Avx2 => (2, 3),
        Isa::Avx512 => (4, 4),
    }
}
