"""Optional compiled kernels: C++ sources under ``ops/csrc`` built on first use with torch's JIT extension loader.

Every op keeps its pure-PyTorch path, which works everywhere with nothing to build; an extension is an accelerator
on top that an op chooses by itself where it is available. Available means: the environment variable
``HEADKIT_EXTENSIONS`` is not ``0``, and the source builds here (a C++ compiler and ninja; the first build takes
~30 s and is cached on disk, under torch's ``TORCH_EXTENSIONS_DIR``, one folder per CPU and version of the source,
so later processes load it in a second). A build that fails warns once and leaves the op on its PyTorch path for
the rest of the process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import warnings
from pathlib import Path
from types import ModuleType

_SOURCES = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp"]
_LOADED: dict[str, ModuleType | None] = {}
_LOCK = threading.Lock()
logger = logging.getLogger(__name__)


def extensions_enabled() -> bool:
    """False when ``HEADKIT_EXTENSIONS=0``: every op then runs its PyTorch path."""
    return os.environ.get("HEADKIT_EXTENSIONS", "1").strip() != "0"


def load_extension(name: str) -> ModuleType | None:
    """The compiled module of ``ops/csrc/<name>.cpp`` (built on first use), or None where it cannot be had."""
    if not extensions_enabled():
        return None
    with _LOCK:
        if name not in _LOADED:
            _LOADED[name] = _build(name)
        return _LOADED[name]


def _cpu_tag() -> str:
    """A short hash of this CPU's instruction sets: the build uses ``-march=native``, so a cache shared between
    machines (a network home folder) must not hand one CPU's build to another."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _source_tag(source: Path) -> str:
    """A short hash of the source: two checkouts of different versions (a worktree beside the main one) must not
    build into one cache folder in turn, where a process could load the other's module (e.g. one without the
    backward this version calls). The headers beside it count: a source includes them."""
    digest = hashlib.sha1(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the sources include builds into them too
        digest.update(header.read_bytes())
    return digest.hexdigest()[:8]


def _build(name: str) -> ModuleType | None:
    try:
        from torch.utils import cpp_extension

        logger.info("headkit: loading the %s kernel (built once per machine, ~30 s the first time)", name)
        source = _SOURCES / f"{name}.cpp"
        return cpp_extension.load(
            name=f"headkit_{name}_{_cpu_tag()}_{_source_tag(source)}",
            sources=[str(source)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, a link error: the PyTorch path serves
        warnings.warn(
            f"headkit: the compiled {name} kernel is not available ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[-1] if str(error).strip() else error!r}); using the PyTorch path. "
            "Set HEADKIT_EXTENSIONS=0 to skip the attempt.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
