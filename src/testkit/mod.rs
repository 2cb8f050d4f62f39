//! Test support shared by unit tests, `tests/`, `benches/` and `fuzz/` (cargo feature
//! `testkit`); never part of the release library.

pub mod frames;
pub mod fuzz;
pub mod oracle;
