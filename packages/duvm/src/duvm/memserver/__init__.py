"""The memserver: a node's spare RAM, lent to other nodes' daemons page by page.

May import: duvm.base, duvm.wire, duvm.rdma.
"""
