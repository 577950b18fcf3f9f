//! What outbox_pg installs into every backend while preloaded: hooks on catalog changes and
//! utility statements (relays step aside, the launcher looks again, COMMIT PREPARED wakes the
//! relays), and the log hook that masks Redis credentials.

pub mod logredact;
pub mod object_access;
