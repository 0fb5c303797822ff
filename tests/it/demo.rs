//! Tests: demo.
