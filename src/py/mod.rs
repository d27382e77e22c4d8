//! The Python half, seen from Rust: the pinned environment and the embedded
//! interpreter (`env`), the typed calls into `chunkforge_py` (`calls`) and their request and
//! reply types (`contract`), the
//! native module Python imports (`native`), and the error of a failed call.

pub mod calls;
pub mod contract;
pub mod env;
pub mod error;
pub mod native;
pub mod worker;
