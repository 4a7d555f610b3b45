"""Block stores behind the NBD server: the BlockStore interface, the local RAM store, the store
whose pages live on memservers (placement, replicas, read-ahead, repair, the memserver client),
the encryption filter and the state a restarted daemon needs, and the command-line flags of the
memory client's security, which the daemon takes and the lifecycle and doctor commands read
alike. Also `Pool`, the explicit API to the same memservers.

May import: duvm.base, duvm.wire, duvm.rdma.
"""
