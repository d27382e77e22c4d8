//! The device bench: what a release needs to be measured on an iPhone and
//! what comes back. `runtime_layout` says which packages each runtime loads
//! and how a layout is selected; `targets` holds the bench's targets;
//! `runbook` renders `DEVICE_RUNBOOK.md` from the manifest (`load_step`: its first step for compiled models no device has loaded); `device_log`
//! reads the app's console lines and `device_report` turns saved logs into a
//! verdict per layout. Nothing here writes or signs a release: `package`
//! calls `runbook` and the rest of the crate reads `runtime_layout`.

pub mod device_log;
pub mod device_report;
pub mod load_step;
pub mod runbook;
pub mod runtime_layout;
pub mod targets;
pub mod transcript;
