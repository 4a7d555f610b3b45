"""The daemon: the NBD server the kernel's block device talks to (the handshake, then the
transmission phase, with its compiled twin `_transmission.pyx`), in front of a store whose
pages live on memservers or in local RAM. It runs as its own process (`duvm daemon`), started
by the lifecycle commands through the command line (or forked from the supervisor, which
loaded its modules by name and calls only `daemon.main`), never imported by the rest of the node.
It reports one typed status (`status.py`) on its control socket and to its metrics.

May import: duvm.base, duvm.wire, duvm.store.
"""
