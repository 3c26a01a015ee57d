"""Builds the optional native kernels (byte planes, non-finite counts); the rest is in
pyproject.toml.

``optional=True``: where no C compiler is at hand the install still succeeds,
and the bytegroup codec runs its numpy fallback (same bytes, slower with
several threads; ``dcp_multilevel.codecs.bytegroup.NATIVE`` says which).
"""

import sys

from setuptools import Extension, setup

# No FMA contraction: the plane judge must round like bytegroup.py's fallback.
flags = [] if sys.platform == "win32" else ["-O3", "-std=gnu11", "-ffp-contract=off"]
setup(
    ext_modules=[
        Extension(
            "dcp_multilevel.codecs._planes",
            ["dcp_multilevel/codecs/_planes.c"],
            extra_compile_args=flags,
            # dlopen, for libzstd at import (see _planes.c); in libc on recent glibc.
            libraries=[] if sys.platform == "win32" else ["dl"],
            optional=True,
        ),
        # Counting non-finite values where the writer hashes or codes the bytes
        # (health/finite.py: numpy fallback, and the measurement behind it).
        Extension(
            "dcp_multilevel.health._finite",
            ["dcp_multilevel/health/_finite.c"],
            extra_compile_args=flags,
            optional=True,
        ),
    ]
)
