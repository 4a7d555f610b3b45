"""Fetch a Debian kernel that has nbd, and build the initramfs that boots it into our test.

Theory of operation
-------------------
The host kernel may have no nbd driver, so the kernel-nbd attach path is tested in a QEMU guest
running Debian 12's stock kernel (``linux-image-amd64``, 6.1). The package is fetched with
``apt-get download`` (never installed on the host) and only the pieces the guest needs are
pulled out of it: ``vmlinuz`` and the modules in :data:`MODULES`. They land in a fixed cache
directory (:data:`DEFAULT_CACHE`), one folder per kernel package, so later runs need neither
apt nor the network.

The initramfs is a ``newc`` cpio written here (no ``cpio`` tool needed, no root needed: device
nodes are just header fields). It holds a static busybox, the modules in load order, the init
script (``init.sh``) and ``duvm.env``: shell assignments with this run's parameters (Python
path, guest script, peers), so the kernel command line carries nothing of ours. It is small
(about 4 MiB, uncompressed: the kernel unpacks it faster than it would gunzip it under TCG) and
is built for every run.

Module order matters and ``modules.dep`` is not in the package (depmod makes it on install), so
:data:`MODULES` spells it out: the 6.1 kernel's 9p needs netfs and fscache first, virtio's
pieces come before the 9p and network transports; nbd, loop and fuse have no dependencies.

:data:`RDMA_MODULES` is the Soft-RoCE stack (``rdma_rxe`` and what it and rdma-cm need, in the
order of their ``modinfo -F depends``), loaded only by guests that ask for it
(``ensure_kernel(extra=RDMA_MODULES)``, ``tools/qemu_guest/rdma_check.py``): the other guests'
initramfs stays as it was. A cache made before they were wanted gets them added from the same
kernel package. ``crc32_generic`` is in the list because rxe asks the crypto API for "crc32"
when a device is added, and the guest has no modprobe to load it on demand.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = Path(os.environ.get("DUVM_TEST_KERNEL_CACHE", "/var/cache/duvm-test-kernel"))
META_PACKAGE = "linux-image-amd64"
BUSYBOX = Path("/bin/busybox")

# insmod order (each module after everything it needs)
MODULES = (
    "netfs",
    "fscache",
    "9pnet",
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "failover",
    "net_failover",
    "virtio_net",
    "nbd",
    "loop",  # with fuse: the nbdfuse + loop path (boot.py --method nbdfuse-loop)
    "fuse",
)

# Soft-RoCE (issue 31), only when asked: each after what `modinfo -F depends` names for it
RDMA_MODULES = (
    "configfs",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "crc32_generic",  # the "crc32" shash rxe allocates per device (no modprobe in the guest)
    "ib_core",
    "ib_uverbs",  # ib_core
    "rdma_rxe",  # ib_uverbs, ib_core, udp_tunnel, ip6_udp_tunnel
    "iw_cm",  # ib_core
    "ib_cm",  # ib_core
    "rdma_cm",  # ib_cm, ib_core, iw_cm, configfs
    "rdma_ucm",  # rdma_cm, ib_core, ib_uverbs
    "veth",  # rxe on both ends of a veth pair (rdma_check.py --veth)
)


class KernelUnavailable(Exception):
    """The guest kernel cannot be had here (no apt, no package, download failed)."""


@dataclass(frozen=True)
class GuestKernel:
    package: str  # e.g. linux-image-6.1.0-57-amd64
    vmlinuz: Path
    modules: dict[str, Path]  # module name -> .ko, in insmod order

    @property
    def release(self) -> str:
        return self.vmlinuz.name.removeprefix("vmlinuz-")


def _cached(folder: Path, extra: tuple[str, ...] = ()) -> GuestKernel | None:
    kernels = sorted(folder.glob("vmlinuz-*"))
    mods = {m: folder / "modules" / f"{m}.ko" for m in (*MODULES, *extra)}
    if len(kernels) != 1 or not all(p.is_file() for p in mods.values()):
        return None
    return GuestKernel(folder.name, kernels[0], mods)


def find_cached(cache: Path = DEFAULT_CACHE, extra: tuple[str, ...] = ()) -> GuestKernel | None:
    """The newest complete extracted kernel in `cache` (with the `extra` modules), or None."""
    if not cache.is_dir():
        return None
    found = [
        k
        for d in sorted(cache.glob("linux-image-*"), reverse=True)
        if d.is_dir() and (k := _cached(d, extra)) is not None
    ]
    return found[0] if found else None


def _apt_package_name() -> str:
    """linux-image-amd64 is a metapackage; the real one is its linux-image-* dependency."""
    try:
        out = subprocess.run(
            ["apt-cache", "depends", META_PACKAGE],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"apt-cache depends {META_PACKAGE} failed: {exc}") from exc
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "Depends:" and parts[1].startswith("linux-image-"):
            return parts[1]
    raise KernelUnavailable(
        f"apt knows no kernel package behind {META_PACKAGE} (not a Debian/amd64 apt source?)"
    )


def _extract(deb: Path, dest: Path, names: tuple[str, ...] = MODULES) -> None:
    """Stream the package's data tar and keep vmlinuz and the modules `names`."""
    wanted = {f"{m}.ko": m for m in names}
    (dest / "modules").mkdir(parents=True)
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = Path(member.name).name
                if member.isfile() and member.name.startswith("./boot/vmlinuz-"):
                    target = dest / name
                elif member.isfile() and "/kernel/" in member.name and name in wanted:
                    target = dest / "modules" / name
                else:
                    continue
                src = tar.extractfile(member)
                assert src is not None
                with open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
    finally:
        proc.stdout.close()
        if proc.wait() != 0:
            raise KernelUnavailable(f"dpkg-deb --fsys-tarfile {deb} failed")


def _download(package: str, folder: Path) -> Path:
    """`apt-get download` one package into `folder`; the .deb."""
    # apt's sandbox user cannot write into root's temp folder; it falls back and warns
    res = subprocess.run(
        ["apt-get", "download", "-q", package],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    debs = list(folder.glob(f"{package}_*.deb"))
    if res.returncode != 0 or len(debs) != 1:
        raise KernelUnavailable(
            f"apt-get download {package} failed: {(res.stderr or res.stdout).strip()[-500:]}"
        )
    return debs[0]


def _need_tools() -> None:
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise KernelUnavailable(f"{tool} not found: the guest kernel comes from Debian apt")


def _add_modules(kernel: GuestKernel, cache: Path, extra: tuple[str, ...]) -> GuestKernel:
    """Extract the `extra` modules from the cached kernel's own package into its folder; each
    file appears whole (renamed into place) or not at all."""
    _need_tools()
    folder = kernel.vmlinuz.parent
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        deb = _download(kernel.package, Path(tmp))
        staging = Path(tmp) / "extra"
        _extract(deb, staging, extra)
        missing = [m for m in extra if not (staging / "modules" / f"{m}.ko").is_file()]
        if missing:
            raise KernelUnavailable(f"{kernel.package} lacks modules {missing}")
        for m in extra:
            (staging / "modules" / f"{m}.ko").rename(folder / "modules" / f"{m}.ko")
    k = _cached(folder, extra)
    assert k is not None
    return k


def ensure_kernel(cache: Path = DEFAULT_CACHE, extra: tuple[str, ...] = ()) -> GuestKernel:
    """The cached guest kernel with :data:`MODULES` and the `extra` ones (e.g.
    :data:`RDMA_MODULES`, loaded after them); downloads and extracts what is missing first."""
    if (k := find_cached(cache, extra)) is not None:
        return k
    if extra and (base := find_cached(cache)) is not None:
        # the same kernel, so the modules match it; when the archive no longer has that
        # version, the current kernel package is fetched whole below (a new cache folder)
        with contextlib.suppress(KernelUnavailable):
            return _add_modules(base, cache, extra)
    _need_tools()
    package = _apt_package_name()
    cache.mkdir(parents=True, exist_ok=True)
    names = (*MODULES, *extra)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        deb = _download(package, Path(tmp))
        staging = Path(tmp) / package
        _extract(deb, staging, names)
        if _cached(staging, extra) is None:
            missing = [m for m in names if not (staging / "modules" / f"{m}.ko").exists()]
            raise KernelUnavailable(f"{package} lacks vmlinuz or modules {missing}")
        final = cache / package
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)  # atomic: a half-extracted kernel is never found by find_cached
    k = _cached(final, extra)
    assert k is not None
    return k


# --- cpio (newc) ----------------------------------------------------------------------------


class Cpio:
    """A newc cpio archive built in memory (what the kernel unpacks as initramfs)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._ino = 1

    def _entry(
        self,
        name: str,
        mode: int,
        data: bytes = b"",
        rdev: tuple[int, int] = (0, 0),
        nlink: int = 1,
    ) -> None:
        raw = name.encode() + b"\0"
        fields = (self._ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(raw), 0)
        self._ino += 1
        head = b"070701" + b"".join(f"{f:08x}".encode() for f in fields) + raw
        self._parts += [head, b"\0" * (-len(head) % 4), data, b"\0" * (-len(data) % 4)]

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def bytes(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return b"".join(self._parts)


def is_static_elf(data: bytes) -> bool:
    """A 64-bit little-endian ELF without a PT_INTERP header (needs no dynamic loader)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    for i in range(phnum):
        off = phoff + i * phentsize
        if phentsize < 4 or off + phentsize > len(data):  # a cut-off table proves nothing
            return False
        if int.from_bytes(data[off : off + 4], "little") == 3:  # PT_INTERP
            return False
    return True


def build_initramfs(
    kernel: GuestKernel, env: dict[str, str], out: Path, busybox: Path = BUSYBOX
) -> Path:
    """Write the initramfs for one run to `out`; `env` becomes /duvm.env in the guest."""
    bb = busybox.read_bytes()
    if not is_static_elf(bb):
        raise KernelUnavailable(f"{busybox} is not a static executable; install busybox-static")
    c = Cpio()
    for d in ("bin", "dev", "proc", "sys", "host", "modules"):
        c.dir(d)
    c.chardev("dev/console", 5, 1)  # the kernel opens it for init's stdio before /dev exists
    c.file("bin/busybox", bb, 0o755)
    c.symlink("bin/sh", "busybox")
    c.file("init", (HERE / "init.sh").read_bytes(), 0o755)
    c.file("modules/order", ("\n".join(kernel.modules) + "\n").encode())
    for name, path in kernel.modules.items():
        c.file(f"modules/{name}.ko", path.read_bytes())
    c.file("duvm.env", "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()).encode())
    out.write_bytes(c.bytes())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fetch the guest kernel into the cache and say where")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--rdma", action="store_true", help="also the Soft-RoCE modules (RDMA_MODULES)")
    a = p.parse_args(argv)
    try:
        k = ensure_kernel(a.cache, RDMA_MODULES if a.rdma else ())
    except KernelUnavailable as exc:
        print(f"build_initramfs: {exc}", file=sys.stderr)
        return 1
    print(f"{k.package}: {k.vmlinuz} ({len(k.modules)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
