//! The Python half, seen from Rust: the pinned environment (`env`), the
//! native module Python imports (`native`), and the error of a failed call.

pub mod calls;
pub mod env;
pub mod error;
pub mod native;
