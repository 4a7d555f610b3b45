"""Build duvm with its optional compiled hot path.

Everything but `ext_modules` is in pyproject.toml. Each extension is a Cython module beside the
pure-Python module it accelerates; it is optional: without a C compiler or the OpenSSL headers
the build still succeeds and duvm runs the pure-Python path, saying so at start and in
`duvm doctor` (duvm.base.accel). Each extension is built with the SHA-256 of its .pyx source
and of the .pxd beside it, if any (DUVM_SOURCE_DIGEST: its C interface, which other compiled
modules cimport), so a build older than its source is noticed and not used.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent

# module -> C libraries it links against
COMPILED = {
    "duvm.store._pagecipher": ["crypto"],
    "duvm.memserver._hotloop": [],
    "duvm.wire._nbdcodec": [],
    "duvm.store._replies": [],
    "duvm.store._fanout": [],
    "duvm.store._cryptpath": [],
    "duvm.store._readpath": [],
    "duvm.store._sendqueue": [],
    "duvm.node.daemon._transmission": [],
    "duvm.store._slabtable": [],
}
# The RDMA transport's verbs calls: built when the verbs headers are here (Debian:
# libibverbs-dev, librdmacm-dev). It has no pure-Python twin: without it peers use TCP.
RDMA = {"duvm.rdma._verbs": ["ibverbs", "rdmacm"]}


def extension(module: str, libraries: list[str]) -> Extension:
    rel = Path("src", *module.split(".")).with_suffix(".pyx")
    pxd = (HERE / rel).with_suffix(".pxd")  # duvm.base.accel digests the same bytes
    source = (HERE / rel).read_bytes() + (pxd.read_bytes() if pxd.exists() else b"")
    digest = hashlib.sha256(source).hexdigest()
    return Extension(
        module,
        [str(rel)],
        libraries=libraries,
        include_dirs=[str((HERE / rel).parent)],
        define_macros=[("DUVM_SOURCE_DIGEST", f'"{digest}"')],
        extra_compile_args=["-O2"],
    )


extensions = cythonize(
    [extension(m, libs) for m, libs in (COMPILED | RDMA).items()],
    language_level=3,
    include_path=[str(HERE / "src")],  # cimports of .pxd files by package path
    compiler_directives={"boundscheck": False, "wraparound": False, "cdivision": True},
    quiet=True,
)
for ext in extensions:
    ext.optional = True  # cythonize builds new Extension objects without it

setup(ext_modules=extensions)
