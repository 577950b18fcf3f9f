//! Nothing to link: this crate holds the test of outbox_pg's PGXN distribution metadata
//! (`META.json` at the repository's root), `tests/meta.rs`.
