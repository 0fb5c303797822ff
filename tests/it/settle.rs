//! Tests: settle.
