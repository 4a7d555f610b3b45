"""What crosses a socket: the page protocol between daemons and memservers and its
authentication, the NBD protocol and its constants, the kernel's nbd netlink family, the local
status socket, Prometheus exposition and the request trace format. Codecs and their checks; no
policy about what is stored where.

May import: duvm.base.
"""
