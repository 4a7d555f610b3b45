"""The memserver: a node's spare RAM, lent to other nodes' daemons page by page, with its
status on a local control socket and its Prometheus metrics.

May import: duvm.base, duvm.wire, duvm.rdma.
"""
