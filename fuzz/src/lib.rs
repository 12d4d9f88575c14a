//! The fuzz targets' inputs and properties, one module per surface. The same files are
//! compiled into `tests/fuzz.rs` (by `#[path]`), which drives them on stable with proptest and
//! replays the committed seeds and regressions, so `make test` checks what `make fuzz` checks.

pub mod config_load;
pub mod console;
pub mod decode_record;
pub mod registry_formats;
