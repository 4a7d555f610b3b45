"""A node's lifecycle: the config file, `duvm enable` (start the daemon, attach, swap on),
`duvm disable`, `duvm status`, the supervisor that restarts a crashed daemon onto its live
device and the resume it runs, the control socket, and `duvm node` (this node's memserver).
The daemon is started as a process (`duvm daemon`), not imported: a new one by its command line,
or, for a restart without a standby, forked from the supervisor, which loads its modules by name
and calls only its entry point (`warm_start`).

May import: duvm.base, duvm.wire, duvm.store, duvm.memserver, duvm.node.attach.
"""
