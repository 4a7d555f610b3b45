"""The snapshot core: the collector that samples a backend, the host and the processes into a
`Snapshot`, the host sample (RAM, swap, CPU, duvm's pool), and the report that turns a snapshot
into text, the JSON document and Prometheus metrics.

May import: gputaskman.base, gputaskman.backends, gputaskman.intel.
"""
