//! How chunkforge's processes give freed memory back to the system.
//!
//! A conversion allocates and frees its weights several times over (the
//! torch module, the frontend's fp32 constants, their fp16 casts, the
//! palettizer's indices, the serialised blobs): gigabytes per full-width
//! chunk. glibc's defaults hand every block above 32 MiB to `mmap` and give
//! it back with `munmap` when freed, and `malloc_trim` returns the rest, so
//! each of those arrays is written into pages the kernel must fault in and
//! zero again. That cost is the build's largest on a virtual machine whose
//! host reclaims freed guest memory: measured on the development VM, a fresh
//! 37 MiB fp16-to-fp32 cast takes 0.14 s against 0.014 s into memory the
//! process already holds, about 3.5 s per GB touched anew.
//!
//! `CHUNKFORGE_HEAP=keep` makes a chunkforge process (and the conversion
//! workers it starts) keep what it frees for its own next allocations: no
//! `mmap` for large blocks, no trimming, and the Python side skips its
//! `malloc_trim` (`runtime.release_memory`). Full-width `--mode all`: 608 s
//! to 506 s, but the peak grows from 5.5 to 6.9 GB (the resident size stays
//! at the heap's high-water mark, fragmentation included), over the 6.5 GiB
//! the build plans for. So the default stays `release`, glibc's own
//! behaviour; `bench build --compare heap` measures both on a machine.

/// The environment variable that selects the policy, and that tells the
/// embedded Python (and worker processes) which one is in force.
pub const ENV: &str = "CHUNKFORGE_HEAP";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Freed memory stays with the process for its next allocations.
    Keep,
    /// glibc's defaults: large blocks are unmapped when freed, the heap is trimmed.
    Release,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Keep => "keep",
            Policy::Release => "release",
        }
    }
}

/// Applies the policy `CHUNKFORGE_HEAP` asks for (default `release`) to this
/// process's allocator and records it in `CHUNKFORGE_HEAP` for the embedded
/// interpreter and any child process. Call before any thread starts and
/// before the interpreter does. Where the allocator is not glibc's, nothing
/// can be set and the policy is `release`.
pub fn configure() -> Policy {
    let asked = match std::env::var(ENV).as_deref() {
        Ok("keep") => Policy::Keep,
        _ => Policy::Release,
    };
    let policy = if asked == Policy::Keep && keep_freed_memory() {
        Policy::Keep
    } else {
        Policy::Release
    };
    std::env::set_var(ENV, policy.name());
    policy
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() -> bool {
    // SAFETY: mallopt only changes glibc's allocator parameters; it is
    // called before any other thread exists.
    unsafe {
        // Every block comes from the heap, whatever its size, so a freed
        // one is reused instead of unmapped...
        let no_mmap = libc::mallopt(libc::M_MMAP_MAX, 0) == 1;
        // ...and the heap is never trimmed (-1 disables trimming: mallopt(3)).
        let no_trim = libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1;
        no_mmap && no_trim
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() -> bool {
    false
}
