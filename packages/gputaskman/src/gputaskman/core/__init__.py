"""The snapshot core: the collector that samples a backend, the host and the processes into a
`Snapshot`, the host sample (RAM, swap, CPU, duvm's pool), the report that turns a snapshot
into text, the JSON document and Prometheus metrics, and `document`, the one reader of that
JSON document (replay, diff and summary read saved snapshots through it).

May import: gputaskman.base, gputaskman.backends, gputaskman.intel.
"""
