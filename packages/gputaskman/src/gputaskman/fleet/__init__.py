"""The fleet: many hosts' ``gputaskman serve`` polled at once. Which hosts (`targets`), the
HTTP answer read without trusting it (`httpwire`, sans-io), the answer read as a snapshot or
as the reason it is not one (`reader`), the concurrent poller with per-host timeouts and
backoff (`poller`), the rows and fleet totals the TUI and the text output show (`view`), and
the fleet document and record lines (`output`). Nothing here imports Textual or Rich.

May import: gputaskman.base, gputaskman.document, gputaskman.render, gputaskman.offline.
"""
