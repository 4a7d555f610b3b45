"""One node's side of duvm, one sub-package per job: `daemon` (the NBD server in front of a
store), `attach` (the daemon's export as a block device, kernel nbd or nbdfuse and a loop
device, and the swap on it), `lifecycle` (the config file and the enable, disable, status,
supervise and node commands, resume) and `doctor` (this node's prerequisites, checked the way
enable will need them). Each sub-package's "May import:" line says which of the others it uses;
this folder has no modules of its own.

May import: duvm.base, duvm.wire, duvm.rdma, duvm.store, duvm.memserver.
"""
