"""A snapshot (plus the host sample) rendered for people and programs: the JSON document
(`report`, with `report_models` for the model and system objects), the ``--once`` text
report and the process table's cells (`text_report`), and Prometheus metric families
(`exporter`). Pure functions of what was sampled or read back; nothing here samples.

May import: gputaskman.base, gputaskman.intel, gputaskman.sampling, gputaskman.document.
"""
