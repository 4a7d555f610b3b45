"""The Textual TUI: the live app, the replay app, the fleet app, their widgets and screens.
Nothing below this layer imports Textual or Rich.

May import: gputaskman.base, gputaskman.intel, gputaskman.sampling, gputaskman.document,
gputaskman.render, gputaskman.offline, gputaskman.fleet.
"""
