"""Leaf helpers every layer may use: size and address parsing, socket options, the swap path's
protections against memory pressure, its logging, ramfs mounts and memory cgroups.

May import: nothing else of duvm.
"""
