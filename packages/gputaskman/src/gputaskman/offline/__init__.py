"""The offline tools over saved snapshots: recording, reading a record file back, replay's
frames and clock, diff, summary and its charts. None of them samples a GPU except `record`,
through the collector.

May import: gputaskman.base, gputaskman.sampling, gputaskman.document, gputaskman.render.
"""
