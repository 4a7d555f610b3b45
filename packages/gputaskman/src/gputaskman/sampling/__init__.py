"""Sampling this machine: the collector that samples a GPU backend, the host and the processes
into a `Snapshot` (`collector`), the host sample (RAM, swap, CPU, per-process RSS/CPU%:
`host`, and `hostplat` where there is no /proc), and duvm's pool as its processes report it
(`duvmpool`).

May import: gputaskman.base, gputaskman.backends, gputaskman.intel.
"""
