"""Textual widgets of the gputaskman TUI; each renders plain data from a `Snapshot`."""
