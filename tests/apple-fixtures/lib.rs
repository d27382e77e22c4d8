//! Empty: this package only names the fixtures' crate (see Cargo.toml).
