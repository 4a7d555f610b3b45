"""`duvm doctor`: this node's prerequisites (system tools, the kernel nbd device or the
nbdfuse fallback, swap, memory cgroup, the swap path's protections, locked or pinned RAM and,
on an NVIDIA GPU node, whether HMM is active) and the cluster's (secret file, peers answering
under that secret), each with how to fix a gap. It checks what enable
will need the way enable finds it, so it reads the attach and lifecycle code; neither imports
it.

May import: duvm.base, duvm.wire, duvm.rdma, duvm.store, duvm.node.attach, duvm.node.lifecycle.
"""
