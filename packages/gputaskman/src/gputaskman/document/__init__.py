"""The snapshot document read back: `reader`, the one reader of the JSON document (the fleet,
replay, diff and summary read snapshots through it), the document's shape as msgspec Structs
(`docshape`), the types it is read into (`doctypes`), the reference reader over a parsed
object (`docfields`, with `jsonfields`), and the fleet document's envelope (`fleetdoc`).
Nothing here samples or renders.

May import: gputaskman.base, gputaskman.intel, gputaskman.sampling.
"""
