"""Screens of the gputaskman TUI (help)."""
