"""Checkpoints to exact revisions: hub, lock file, file selection, pre-flight checks, provenance."""
