"""One node's side of duvm: the daemon (the NBD server in front of a store), attaching its device
(kernel nbd or nbdfuse and a loop device), supervision and resume, the config file, and the
enable, disable, status, doctor and node commands.

May import: duvm.base, duvm.wire, duvm.store, duvm.memserver.
"""
