"""The fast decoder's step compiled once per machine: exported with ``torch.export``, compiled ahead of time by
AOTInductor into one graph and packaged as a ``.pt2`` file that later processes load in about a second.

Why this and not the compile caches: a second process that finds every region of the in-process compile in
inductor's caches (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` fill the same caches) still
spent 33.8 s before its first SmolLM2 token — 6.5 s of dynamo tracing and 22.9 s of AOTAutograd and graph passes
that those caches do not skip (docs/decoding.md). A package holds the compiled step itself; loading it runs no
tracing and no compiler.

* **The step.** :class:`StepWithStateInputs` is the decoder's one-token forward and argmax with the cache's
  buffers passed in as inputs (:func:`cache_buffers`), which the step writes in place. torch.export records those
  writes as input mutations and the packaged step performs them on whatever buffers it is given, so a later
  process hands it its own cache. The whole step is one graph: weights frozen in as constants (inductor's
  ``freezing``), a C++ wrapper, no Python between kernels.
* **Keyed, never stale.** An artifact is named by a hash of everything its code depends on (:func:`artifact_key`):
  the weights' bytes, the model's class, config and attention implementation, the cache's buffers (shapes,
  dtypes), the shape bucket, the weight type, the thread count (inductor writes it into its parallel loops), the
  CPU (model and instruction flags), the versions of torch and transformers, and headkit's own sources.
  Another torch, another CPU or changed weights is another key: that artifact is built, the foreign one never
  loaded.
* **Checked.** Beside each ``<key>.pt2`` a ``<key>.json`` records its SHA-256 and size. A package whose bytes do
  not match (truncated, corrupted) is rebuilt, with one line saying so. Both are written to temporary files and
  renamed into place, the package first, so a reader never sees half an artifact.
* **Where.** :func:`artifact_folder`: ``$HEADKIT_CACHE/compiled`` (else ``$XDG_CACHE_HOME/headkit/compiled``, else
  ``~/.cache/headkit/compiled``). Deleting the folder (``headkit cache --clear``) only costs the next process a
  compile. A folder that cannot be written falls back to compiling into a temporary folder for this process only,
  with one line saying so.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.compat import attention_implementation
from headkit.files import regular_file_mode, write_json_atomic
from headkit.layers.cache import map_state, state_tensors
from headkit.layers.hybrid import RingHybridStateCacheLayer

logger = logging.getLogger(__name__)

CACHE_ENVIRONMENT = "HEADKIT_CACHE"
ARTIFACT_FORMAT = 1  # bumped when what a package expects of its inputs changes


def artifact_folder() -> Path:
    """Where compiled steps are kept: ``$HEADKIT_CACHE/compiled``, else ``$XDG_CACHE_HOME/headkit/compiled``,
    else ``~/.cache/headkit/compiled``."""
    root = os.environ.get(CACHE_ENVIRONMENT)
    if root:
        return Path(root).expanduser() / "compiled"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "headkit" / "compiled"


def clear_artifacts(folder: Path | None = None) -> tuple[int, int]:
    """Delete every compiled step in ``folder`` (default :func:`artifact_folder`): (files, bytes) removed. Only
    headkit's own files (``*.pt2`` — unfinished temporaries included — and ``*.json``) are touched."""
    folder = artifact_folder() if folder is None else Path(folder)
    removed = size = 0
    if not folder.is_dir():
        return 0, 0
    for path in folder.iterdir():
        if path.is_file() and path.suffix in (".pt2", ".json"):
            size += path.stat().st_size
            path.unlink()
            removed += 1
    return removed, size


# -- the cache's buffers as inputs ----------------------------------------------------------------------------


def _tensor_attributes(layer: Any) -> list[str]:
    return sorted(name for name, value in vars(layer).items() if isinstance(value, torch.Tensor))


def cache_buffers(cache: Any) -> list[torch.Tensor]:
    """Every buffer a decoding step reads or writes in ``cache``, in a fixed order: a fixed-size hybrid layer's
    state tensors (:func:`headkit.layers.cache.state_tensors`), and every tensor attribute of other layers
    (transformers' static layers: keys, values and, from 5.24, the token count), by name."""
    buffers: list[torch.Tensor] = []
    for layer in cache.layers:
        if isinstance(layer, RingHybridStateCacheLayer):
            buffers.extend(state_tensors(layer.state))
        else:
            buffers.extend(getattr(layer, name) for name in _tensor_attributes(layer))
    return buffers


@contextlib.contextmanager
def buffers_installed(cache: Any, buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """``cache`` holding ``buffers`` (in :func:`cache_buffers`' order) in place of its own, restored on exit:
    what lets torch.export see the buffers as the step's inputs."""
    supplied = iter(buffers)
    saved: list[tuple[Any, str, Any]] = []
    try:
        for layer in cache.layers:
            if isinstance(layer, RingHybridStateCacheLayer):
                saved.append((layer, "state", layer.state))
                layer.state = map_state(layer.state, lambda _: next(supplied))
            else:
                for name in _tensor_attributes(layer):
                    saved.append((layer, name, getattr(layer, name)))
                    setattr(layer, name, next(supplied))
        if next(supplied, None) is not None:
            raise ValueError("more buffers than the cache holds")
        yield
    finally:
        for layer, name, value in reversed(saved):
            setattr(layer, name, value)


class StepWithStateInputs(nn.Module):
    """``next_token(token, positions, mask, cache)`` as a module whose inputs are (token [B, 1], positions [B, 1],
    the padding mask [B, L] where the step takes one, then every cache buffer): the form torch.export needs to
    record the step's writes to the cache as writes to its inputs. ``model`` is registered so that its weights
    become the graph's constants."""

    def __init__(
        self, model: nn.Module, cache: Any, next_token: Callable[..., torch.Tensor], takes_mask: bool
    ) -> None:
        super().__init__()
        self.model = model
        self.cache, self.next_token, self.takes_mask = cache, next_token, takes_mask

    def forward(self, token: torch.Tensor, positions: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mask, buffers = (rest[0], rest[1:]) if self.takes_mask else (None, rest)
        with buffers_installed(self.cache, buffers):
            return self.next_token(token, positions, mask, self.cache)


# -- what an artifact depends on ------------------------------------------------------------------------------


def cpu_identity() -> str:
    """The CPU as compiled code sees it: the architecture, the model name and the instruction-set flags."""
    model = flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    flags_digest = hashlib.sha256(flags.encode()).hexdigest()[:16] if flags else ""
    return f"{platform.machine()} | {model or platform.processor()} | flags {flags_digest}"


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor, or the plain tensors a wrapper subclass (torchao's quantized weights) is made of."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, nn.Parameter):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _plain_tensors(getattr(tensor, name))]


def weights_digest(model: nn.Module) -> str:
    """A hash of every parameter's and buffer's name, type, shape and bytes (quantized weights through their
    inner tensors)."""
    digest = hashlib.sha256()  # hardware-accelerated on x86 and ARM CPUs of the last years: ~2× blake2b here
    # Tied weights once (which are tied is in the config): the largest tensor of a small LM is often tied.
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in sorted(named):
        for tensor in _plain_tensors(named[name].detach()):
            digest.update(f"{name}|{type(tensor).__name__}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            flat = tensor.contiguous().reshape(-1)
            if flat.numel():
                digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def artifact_key(
    model: nn.Module,
    buffers: Sequence[torch.Tensor],
    description: dict[str, Any],
    weights: str | None = None,
) -> dict[str, Any]:
    """Everything a packaged step's code depends on (see the module docstring), as a JSON-able record;
    ``description`` adds the decoder's own (weight type, bucket, mask); ``weights``: the model's
    :func:`weights_digest`, when already computed."""
    import transformers

    return {
        "format": ARTIFACT_FORMAT,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "headkit_source": headkit_source_digest(),  # any change to headkit, released or not, writes other code
        "attention": attention_implementation(model),
        "cpu": cpu_identity(),
        "threads": torch.get_num_threads(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest(),
        "weights": weights_digest(model) if weights is None else weights,
        "buffers": [[str(buffer.dtype), list(buffer.shape)] for buffer in buffers],
        **description,
    }


@functools.cache
def headkit_source_digest() -> str:
    """A hash of headkit's own Python sources: the step's code is theirs as much as the model's."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _digest_of(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# -- building and loading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedStep:
    """A loaded step: ``runner(token, positions, [mask], *buffers)`` → next token [B, 1]. ``source``: "loaded"
    (found on disk), "compiled" (built and saved) or "compiled in memory" (built, not saved); ``path``: the
    package (None in memory); ``seconds``: what finding or building it took."""

    runner: Any
    source: str
    path: Path | None
    seconds: float

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.runner(*inputs)


def _export_and_package(
    step: StepWithStateInputs, inputs: Sequence[torch.Tensor], path: Path, inductor_options: dict[str, Any]
) -> None:
    with torch.no_grad():
        exported = torch.export.export(step, tuple(inputs), strict=False)
    options = {name: value for name, value in inductor_options.items() if name != "cpp_wrapper"}
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=options)


def _load(path: Path) -> Any:
    return torch._inductor.aoti_load_package(str(path))


def _stored(folder: Path, name: str, key: dict[str, Any]) -> tuple[Path | None, str | None]:
    """(the package, None) when a sound artifact is stored under ``name``, else (None, why not: None when there
    is none at all)."""
    package, record = folder / f"{name}.pt2", folder / f"{name}.json"
    if not record.is_file():
        return None, None
    try:
        stored = json.loads(record.read_text())
    except (OSError, ValueError):
        return None, f"its record {record} is unreadable"
    if stored.get("key") != key:
        return None, f"its record {record} was written for something else"
    if not package.is_file():
        return None, f"{package} is missing"
    if package.stat().st_size != stored.get("bytes") or _file_sha256(package) != stored.get("sha256"):
        return None, f"{package} does not match its checksum (truncated or corrupted)"
    return package, None


def _write_artifact(folder: Path, name: str, key: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Build into temporary files in ``folder`` and rename them into place, the package first."""
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{name}.partial-", suffix=".pt2")
    os.close(handle)
    partial_path = Path(partial)
    try:
        build(partial_path)
        partial_path.chmod(regular_file_mode())  # mkstemp's 0600 is for the unfinished file only
        record = {"key": key, "bytes": partial_path.stat().st_size, "sha256": _file_sha256(partial_path)}
        package = folder / f"{name}.pt2"
        os.replace(partial_path, package)
        write_json_atomic(folder / f"{name}.json", record)
        return package
    finally:
        partial_path.unlink(missing_ok=True)


def packaged_step(
    step: StepWithStateInputs,
    inputs: Sequence[torch.Tensor],
    key: dict[str, Any],
    inductor_options: dict[str, Any],
    folder: Path | None = None,
) -> PackagedStep:
    """The step for ``key``: loaded from ``folder`` (default :func:`artifact_folder`) when a sound artifact is
    there, else exported from ``step`` on ``inputs`` (the real first-step inputs: their shapes and the cache's
    contents at the time do not enter the code), compiled, saved and loaded. Each outcome is logged in one line."""
    folder = artifact_folder() if folder is None else Path(folder)
    name = _digest_of(key)
    started = time.perf_counter()
    package, problem = _stored(folder, name, key)
    if package is not None:
        try:
            runner = _load(package)
        except Exception as error:  # a package that passes its checksum but not the loader: rebuild it
            problem = f"{package} failed to load ({type(error).__name__}: {error})"
        else:
            seconds = time.perf_counter() - started
            logger.info("loaded the compiled decoding step from %s in %.1f s", package, seconds)
            return PackagedStep(runner, "loaded", package, seconds)
    if problem is not None:
        logger.warning("rebuilding a compiled decoding step: %s", problem)

    def build(path: Path) -> None:
        _export_and_package(step, inputs, path, inductor_options)

    try:
        package = _write_artifact(folder, name, key, build)
    except OSError as error:  # a read-only or full folder: this process compiles for itself
        logger.warning(
            "the compiled-step folder %s cannot be written (%s): compiling in memory for this process only "
            "(set %s to a writable folder to keep it)",
            folder,
            error.strerror or error,
            CACHE_ENVIRONMENT,
        )
        with tempfile.TemporaryDirectory(prefix="headkit-step-") as scratch:
            path = Path(scratch) / "step.pt2"
            build(path)
            runner = _load(path)
        seconds = time.perf_counter() - started
        return PackagedStep(runner, "compiled in memory", None, seconds)
    runner = _load(package)
    seconds = time.perf_counter() - started
    logger.info(
        "compiled the decoding step in %.1f s and saved it to %s (later processes load it)", seconds, package
    )
    return PackagedStep(runner, "compiled", package, seconds)


__all__ = [
    "CACHE_ENVIRONMENT",
    "PackagedStep",
    "StepWithStateInputs",
    "artifact_folder",
    "artifact_key",
    "buffers_installed",
    "cache_buffers",
    "clear_artifacts",
    "packaged_step",
    "weights_digest",
]
