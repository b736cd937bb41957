"""Attention primitives shared by every method: one implementation each (see docs/architecture.md)."""
