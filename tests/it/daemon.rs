//! Tests: daemon.
