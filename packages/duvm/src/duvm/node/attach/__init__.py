"""Attaching the daemon's export as a block device and swapping to it: kernel nbd (netlink, or
the ioctl holder process as fallback) or nbdfuse and a loop device, the swap and cgroup steps,
the attachment record that detach undoes, the system tools they run by absolute path, and the
helper processes they start (told apart from a recycled PID), which the lifecycle commands
use for the daemon and its supervisor too.

May import: duvm.base, duvm.wire.
"""
