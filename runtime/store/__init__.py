"""The chain of trust on the device: read, verify, decide, unpack, commit; copy; registries."""
