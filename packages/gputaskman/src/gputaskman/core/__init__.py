"""The snapshot core: the collector that samples a backend, the host and the processes into a
`Snapshot`, the host sample (RAM, swap, CPU, duvm's pool), the report that turns a snapshot
into text, the JSON document and Prometheus metrics, and `document`, the one reader of that
JSON document (the fleet, replay, diff and summary read snapshots through it), with the
document's shape as msgspec Structs (`docshape`), the types it reads into (`doctypes`) and
the reference reader over a parsed object (`docfields`, with `jsonfields`).

May import: gputaskman.base, gputaskman.backends, gputaskman.intel.
"""
