"""Leaf helpers every layer may use: size and address parsing, socket options, the swap path's
protections against memory pressure, its logging, ramfs mounts and memory cgroups, the local
status socket a daemon or memserver answers on, and the Prometheus exposition (latency
histograms, scrape on the loop, the endpoint) that both processes' collectors share.

May import: nothing else of duvm.
"""
