"""Bundles: create (orchestrates), engine plans, pack, keys, wheelhouse and bootstrap."""
