#!/bin/sh
# /init of the duvm test guest (busybox sh, PID 1).
#
# Loads the modules in /modules/order, mounts the host's / read-only over 9p at /host (with
# the guest's own proc, sys, dev and a tmpfs on /run over it), brings up user-mode networking
# (10.0.2.2 is the host's loopback), then runs the guest script with the host's own Python
# inside chroot /host, so the guest executes exactly the project's code and tools.
# Results go to the second serial port (/dev/ttyS1), the console (ttyS0) gets progress and
# kernel messages. The machine powers off when the script ends, whatever happened.
export PATH=/bin
/bin/busybox --install -s /bin

say() { echo "duvm-guest: $*"; }
finish() {
    echo "DUVM-GUEST-END $1" > /dev/ttyS1
    sync
    poweroff -f
}
fail() { say "FAILED: $*"; echo "DUVM-GUEST-FAILED $*" > /dev/ttyS1; finish 99; }

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
set -a
. /duvm.env
set +a

for m in $(cat /modules/order); do
    insmod "/modules/$m.ko" || fail "insmod $m"
done

# default msize (131072); cache=loose: nothing on the host changes under the guest's feet
mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,ro hostroot /host || fail "9p mount"
mount -t proc proc /host/proc || fail "proc in /host"
mount -t sysfs sysfs /host/sys || fail "sysfs in /host"
mount -t devtmpfs devtmpfs /host/dev || fail "devtmpfs in /host"
mount -t tmpfs -o mode=0755 tmpfs /host/run || fail "tmpfs on /host/run"
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup 2>/dev/null || say "no cgroup2 mount"
mkdir -p /host/run/tmp

# a stalled swap path shows up as tasks blocked in D state: have the kernel print their stacks
[ -n "$DUVM_HUNG_TASK_S" ] && echo "$DUVM_HUNG_TASK_S" > /proc/sys/kernel/hung_task_timeout_secs
# every SysRq function: boot.py --sysrq-at sends Alt-SysRq-w/m from QEMU's monitor to show
# the blocked tasks' stacks and the memory state when the guest itself can no longer report
echo 1 > /proc/sys/kernel/sysrq
# settings a stress run varies (boot.py --sysctl), "name=value" words: kernel.x.y=1 -> /proc/sys
for kv in $DUVM_SYSCTL; do
    key=${kv%%=*}
    echo "${kv#*=}" > "/proc/sys/$(echo "$key" | tr . /)" || fail "sysctl $kv"
done
# their task stacks and memory counters are KERN_INFO: show them when asked for (--sysrq-at)
[ -n "$DUVM_CONSOLE_LOGLEVEL" ] && echo "$DUVM_CONSOLE_LOGLEVEL" > /proc/sys/kernel/printk

ip link set lo up
ip link set eth0 up || fail "no eth0 (virtio_net)"
ip addr add "${DUVM_GUEST_IP:-10.0.2.15}/24" dev eth0
ip route add default via "${DUVM_GATEWAY:-10.0.2.2}"

say "booted in $(cut -d' ' -f1 /proc/uptime) s; running $DUVM_SCRIPT"
echo "DUVM-GUEST-BOOTED $(cut -d' ' -f1 /proc/uptime)" > /dev/ttyS1
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/run/tmp \
    PYTHONDONTWRITEBYTECODE=1 chroot /host "$DUVM_PYTHON" -u "$DUVM_SCRIPT"
rc=$?
say "guest script exited $rc"
finish "$rc"
