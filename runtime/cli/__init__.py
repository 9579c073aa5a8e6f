"""The `bundle` command (main) and the floor's commands."""
