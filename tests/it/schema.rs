//! Tests: schema.
