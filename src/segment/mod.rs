//! Software GSO engine: pure functions over bytes, no I/O.
