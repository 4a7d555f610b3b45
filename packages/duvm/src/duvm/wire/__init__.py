"""What crosses a socket: the page protocol between daemons and memservers and its
authentication, the NBD protocol and its constants, the kernel's nbd netlink family and the
request trace format. Codecs and their checks; no policy about what is stored where, and no
process's status or metrics (those live with the process that reports them).

May import: duvm.base.
"""
