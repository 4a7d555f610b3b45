"""RDMA transport: one-sided reads and writes between a daemon and the memservers' arenas
over verbs (InfiniBand, RoCE, Soft-RoCE), set up through rdma-cm after the page protocol's
authenticated handshake. The verbs calls are compiled (`_verbs`, built when the verbs headers
are here); without the build, or without a usable device, peers use TCP.

May import: duvm.base.
"""
