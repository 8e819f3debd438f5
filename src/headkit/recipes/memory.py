"""A recipe's peak resident memory, estimated from MODEL's 🤗 config before any weight is loaded (prune:
:func:`estimate_prune_memory`, compress: :func:`estimate_compress_memory`, linearize:
:func:`estimate_linearize_memory`), and ``--max-memory`` checked against it in the preflight
(:func:`check_max_memory`): a run that would not fit is refused in one line that states the estimate and the
option that brings it down. The recipe's report keeps the estimate beside the measured peak
(``peak_memory.estimate``).

Each estimate is the largest of the stages' peaks, each the weights the stage holds plus its largest working set:
the parameters are counted exactly on a model built on the meta device (no memory). The student holds the
original's tensors from the surgery on (:func:`headkit.runs.models.shared_copy`) until a training copies what it
changes, so a stage before the recovery holds one model's weights and what the surgery replaced. The calibration's
gradient pass holds one slice of :data:`~headkit.surgery.repair.PASS_TOKENS` tokens' activations and one chunk of
logits (:mod:`headkit.ops.chunked_loss`); the loss-weighted ranking one layer's per-token samples in float32; the
measurements one forward's capped logits (:data:`headkit.evaluation.quality.LOGIT_ENTRIES`) and, where a recipe
times decoding, the original's cache at the longest context and largest batch; a training the student's
gradients, AdamW's two moments, one forward's activations and one chunk of both models' logits (the
distillation's KL is computed from the heads' inputs in chunks: :class:`~headkit.runs.objectives.CausalLMObjective`).
The constants are fitted to the runs measured in docs/memory.md (SmolLM2-135M and random-weight models of published
shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from headkit.errors import HeadkitError
from headkit.evaluation.quality import LOGIT_ENTRIES
from headkit.evaluation.timing import prefill_tokens
from headkit.ops.chunked_loss import CHUNK_ENTRIES
from headkit.recipes.settings import recovery_lora_rank, training_forwards
from headkit.runs.models import CAUSAL_LM, DTYPES
from headkit.runs.resident import GIB, machine_memory_bytes
from headkit.surgery.families import text_config
from headkit.surgery.repair import CAPTURE_BYTES, PASS_TOKENS

# What the process holds beside the weights: Python, torch, transformers, the tokenizer and the text (measured on
# SmolLM2 after loading: 1.13 GiB with its 0.5 GiB of float32 weights).
RUNTIME_BYTES = int(0.65 * GIB)
# Saved activations per token and layer, in numbers: the norms' inputs, queries, keys, values, the attention's
# output and its backward's workspace, and the MLP's intermediate tensors (SmolLM2: 8·576 + 4·1,536 ≈ 10,752;
# fitted to the gradient pass measured there, 2.2 GiB).
HIDDEN_ACTIVATIONS, MLP_ACTIVATIONS = 8, 4
# What glibc's heap keeps beyond a training forward's live tensors, as a fraction of what the forward's every
# layer's activations would be: the forward's and backward's freed buffers (hidden-sized, below glibc's mmap threshold
# once it has risen, so carved from the heap) fragment it, and the next layer's cannot reuse them. The loop returns
# the free pages before each forward (headkit.recipes.loop); within one, SmolLM2's LoRA distillation over 1,024 tokens
# grew the process by 0.9–1.1 GiB around 0.4 GiB of live tensors (docs/memory.md).
HEAP_FRACTION = 0.5
# Chunk-sized float32 buffers the distillation's chunked KL holds at once (headkit.ops.chunked_loss).
KL_CHUNKS = 5
# Logit-sized float32 tensors a measurement holds at once: the forward's logits, perplexity's float copy of the
# predicted rows and their log-softmax (the agreement: both models' logits, its KL a slice at a time).
MEASURE_LOGITS = 3
FLOAT32 = 4
# Block-score-sized tensors ([heads, T, C + W − 1]) of one linearized layer's window attention in the backward: its
# scores and weights, recomputed there (headkit.layers.hybrid: a training forward keeps none), and their gradients.
WINDOW_SCORES_SAVED = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated peak resident bytes of a run, the stage expected to reach it, and each stage's."""

    total: int
    stage: str
    stages: dict[str, int]

    def __str__(self) -> str:
        return f"{self.total / GIB:.2f} GiB (stage {self.stage})"

    def to_dict(self) -> dict[str, Any]:
        """The report's ``peak_memory.estimate``."""
        return {"bytes": self.total, "stage": self.stage, "stages": dict(self.stages)}

    @classmethod
    def of(cls, stages: dict[str, int]) -> MemoryEstimate:
        stage = max(stages, key=stages.__getitem__)
        return cls(stages[stage], stage, stages)


@dataclass(frozen=True)
class ModelShape:
    """The sizes an estimate reads from a causal LM's 🤗 config, and the bytes of one number in ``dtype``."""

    parameters: int
    attention_parameters: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    vocabulary: int
    number: int
    # whether 🤗 gradient checkpointing can recompute its layers (--gradient-checkpointing's default)
    checkpointing: bool = False

    @property
    def weights(self) -> int:
        return self.parameters * self.number

    @property
    def attention_weights(self) -> int:
        """The attention projections' bytes: what a surgery of the attention replaces or a LoRA merge copies."""
        return self.attention_parameters * self.number

    @property
    def per_token_layer(self) -> int:
        """Saved activations of one token through one layer, in bytes."""
        return (HIDDEN_ACTIVATIONS * self.width + MLP_ACTIVATIONS * self.inner) * self.number

    def kv_cache(self, tokens: int) -> int:
        """The original's key/value cache for `tokens` tokens (all rows), in the model's dtype."""
        return tokens * self.layers * 2 * self.kv_heads * self.head_dim * self.number

    def logits(self, rows: int) -> int:
        """One forward's float32 logits for `rows` positions."""
        return rows * self.vocabulary * FLOAT32


def model_shape(config: Any, dtype: str) -> ModelShape:
    """The sizes of the causal LM `config` describes (its text model's), its parameters counted on a model built on
    the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    text = text_config(config)
    width = getattr(text, "hidden_size", None) or text.n_embd
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    head_dim = getattr(text, "head_dim", None) or width // heads
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return ModelShape(
        parameters=parameters,
        # queries and output (heads × head_dim each way), keys and values (KV heads × head_dim), every layer
        attention_parameters=layers * width * head_dim * 2 * (heads + kv_heads),
        width=width,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        inner=getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * width,
        vocabulary=text.vocab_size,
        number=DTYPES[dtype].itemsize,
        checkpointing=bool(getattr(model, "supports_gradient_checkpointing", False)),
    )


def model_file_bytes(model_path: Any) -> int:
    """The bytes of MODEL's weight files (a GGUF file; a folder's safetensors or PyTorch files), which loading
    maps beside the weights it makes of them; 0 where there are none to read."""
    from pathlib import Path

    path = Path(model_path)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(file.stat().st_size for pattern in ("*.safetensors", "*.bin") for file in path.glob(pattern))


def _load(shape: ModelShape, file_bytes: int) -> int:
    # the weights, beside the file they are read from (mapped: a GGUF file dequantized, a safetensors file cast)
    return RUNTIME_BYTES + shape.weights + file_bytes


def _save(shape: ModelShape) -> int:
    # the result and its copy reloaded from the saved folder (the save step's reload check)
    return RUNTIME_BYTES + 2 * shape.weights


def _measure_logits(shape: ModelShape, window: int) -> int:
    """A measurement's logits: forwards of as many windows as LOGIT_ENTRIES allows, one at least."""
    rows = max(1, LOGIT_ENTRIES // (window * shape.vocabulary))
    return MEASURE_LOGITS * shape.logits(rows * window)


def _training(shape: ModelShape, settings: Any, tokens: int, trained: int, copied: int) -> int:
    """A distillation's stage: both models (the student's `copied` bytes its own), the `trained` bytes' gradients
    and AdamW's two float32 moments, one forward's activations over `tokens` tokens and the chunked KL's buffers
    (and the head's float32 gradient where it trains)."""
    optimizer = 2 * (trained // shape.number) * FLOAT32
    head_trains = trained >= shape.weights
    return (
        RUNTIME_BYTES
        + shape.weights
        + copied
        + trained
        + optimizer
        + _activations(shape, settings, tokens)
        + _heap(shape, tokens)
        + KL_CHUNKS * CHUNK_ENTRIES * FLOAT32
        + (shape.vocabulary * shape.width * FLOAT32 if head_trains else 0)
    )


def _heap(shape: ModelShape, tokens: int) -> int:
    """The heap a training forward over `tokens` tokens leaves fragmented beyond its live tensors (HEAP_FRACTION)."""
    return int(HEAP_FRACTION * tokens * shape.layers * shape.per_token_layer)


def _activations(shape: ModelShape, settings: Any, tokens: int) -> int:
    """What one training forward over `tokens` tokens keeps for its backward: every layer's activations, or with
    gradient checkpointing (``--gradient-checkpointing``, by default where the model supports it) each layer's input
    and one layer's activations, recomputed in the backward."""
    checkpointing = getattr(settings, "gradient_checkpointing", False)
    if checkpointing or (checkpointing is None and shape.checkpointing):
        return tokens * (shape.layers * shape.width * shape.number + shape.per_token_layer)
    return tokens * shape.layers * shape.per_token_layer


def estimate_prune_memory(settings: Any, config: Any, *, file_bytes: int = 0) -> MemoryEstimate:
    """The pruning recipe's peak resident memory on a causal LM of `config` with `settings` (see the module
    docstring)."""
    shape = model_shape(config, settings.dtype)
    window = settings.window
    calibration_rows = min(settings.importance_batches * settings.batch_size, settings.train_texts)
    calibration_tokens = calibration_rows * window
    stages = {
        "load": _load(shape, file_bytes),
        "save": _save(shape),
        # the gradient pass: one slice's activations, one chunk of logits and its gradient
        "convert": RUNTIME_BYTES
        + shape.weights
        + max(
            max(PASS_TOKENS, window) * shape.layers * shape.per_token_layer + 3 * CHUNK_ENTRIES * FLOAT32,
            # the ranking: one layer's samples, bfloat16 read back and float32 copies, and the products' copies
            calibration_tokens * shape.heads * shape.head_dim * (2 * 2 + 2 * 4 + 2 * 4),
        ),
    }
    # after a training the student's weights are its own (a LoRA merge copies the projections it wraps: all)
    copied = shape.weights if settings.recovery_steps else shape.attention_weights
    stages["measure"] = RUNTIME_BYTES + shape.weights + copied + _measure_logits(shape, window)
    if settings.recovery_steps:
        per_forward = training_forwards(settings, window)[0] * window
        trained = shape.weights if recovery_lora_rank(settings, CAUSAL_LM) is None else 0
        # LoRA's student trains on the original's tensors (its merge, after the training, copies what it wraps:
        # the measure stage's second copy)
        stages["recover"] = _training(
            shape, settings, per_forward, trained, shape.weights if trained else shape.attention_weights
        )
    return MemoryEstimate.of(stages)


def estimate_compress_memory(
    settings: Any, config: Any, *, repair_tokens: int, cache_window: int | None, file_bytes: int = 0
) -> MemoryEstimate:
    """The compression recipe's peak resident memory on a causal LM of `config`: --kv-budget's cache (no weight
    changes: one model, and the continuation's perplexity through the cache over windows of `cache_window` tokens,
    fed a few tokens at a time), latent keys/values (a copy of the model; the layer-local repair's inputs and
    targets over `repair_tokens` tokens) or collaborative heads (a copy), then the recovery."""
    shape = model_shape(config, settings.dtype)
    window = settings.window
    stages = {"load": _load(shape, file_bytes), "save": _save(shape)}
    if settings.kv_budget is not None and cache_window is not None:
        stages["measure"] = RUNTIME_BYTES + shape.weights + shape.kv_cache(cache_window)
        return MemoryEstimate.of(stages)
    # a deep copy of the original: the latent and collaborative surgeries rewrite the attention in place
    stages["convert"] = RUNTIME_BYTES + 2 * shape.weights + _measure_logits(shape, window)
    if settings.repair:
        # the original's attention inputs and outputs, captured a group of layers at a time within CAPTURE_BYTES
        # (headkit.surgery.repair.reconstruct_attention), beside one layer's activations
        per_layer = repair_tokens * 2 * shape.width * shape.number
        captured = per_layer * min(shape.layers, max(1, CAPTURE_BYTES // per_layer))
        stages["repair"] = (
            RUNTIME_BYTES + 2 * shape.weights + captured + repair_tokens * shape.per_token_layer
        )
    stages["measure"] = RUNTIME_BYTES + 2 * shape.weights + _measure_logits(shape, window)
    if settings.recovery_steps:
        per_forward = training_forwards(settings, window)[0] * window
        trained = shape.weights if settings.lora_rank is None else 0
        stages["recover"] = _training(shape, settings, per_forward, trained, shape.weights)
    return MemoryEstimate.of(stages)


def estimate_linearize_memory(settings: Any, config: Any, *, file_bytes: int = 0) -> MemoryEstimate:
    """The linearizing recipe's peak resident memory on a causal LM of `config`: the student held with the
    original's tensors; the attention transfer's and the recovery's forwards over ``--batch-size`` (or
    ``--micro-batch``) windows of ``--train-length`` tokens; the measurement's perplexity at the longest held-out
    length and the original's key/value cache at the longest decoding context and largest batch."""
    shape = model_shape(config, settings.dtype)
    longest = max(settings.eval_lengths)
    stages = {
        "load": _load(shape, file_bytes),
        "save": _save(shape),
        "convert": RUNTIME_BYTES + shape.weights + _measure_logits(shape, longest),
    }
    copied = 0
    trains = settings.fold and (settings.transfer_steps or settings.recovery_steps)
    if trains:
        per_forward = training_forwards(settings, settings.train_length)[0] * settings.train_length
        if settings.recovery_steps:
            copied = shape.attention_weights  # trained in full, or the projections a LoRA merge writes
        trained = shape.attention_weights if settings.recovery_steps and settings.lora_rank is None else 0
        # one layer's window scores at a time, recomputed in the backward
        conversion = settings.conversion
        block = conversion.chunk_size + conversion.window - 1
        scores = WINDOW_SCORES_SAVED * per_forward * shape.heads * block * FLOAT32
        stages["recover"] = _training(shape, settings, per_forward, trained, copied) + scores
    longest_context = max(settings.decode_contexts)
    decode = longest_context * max(settings.decode_batch_sizes)
    chunk = prefill_tokens(settings.conversion)
    if chunk is None:
        # one forward of the whole prompt: one layer's window scores (half of them, causal), fitted to SmolLM2
        prefill = shape.heads * longest_context**2 * FLOAT32 // 2
    else:
        # in forwards of `chunk` tokens (headkit.evaluation.timing.prefill): a chunk's scores against the cache
        prefill = shape.heads * min(chunk, longest_context) * longest_context * FLOAT32
    stages["measure"] = (
        RUNTIME_BYTES
        + shape.weights
        + copied
        + max(_measure_logits(shape, longest), shape.kv_cache(decode + longest_context) + prefill)
    )
    return MemoryEstimate.of(stages)


def check_max_memory(
    settings: Any, config: Any, estimate: Callable[..., MemoryEstimate], model_path: Any = None
) -> MemoryEstimate | None:
    """Refuse, in one line, a run whose peak as ``estimate(settings, config, file_bytes=…)`` gives it (MODEL's
    weight files at `model_path` counted while loading) exceeds ``--max-memory`` (default: the machine's memory),
    naming the estimate and the option that would bring it down; the estimate, or None where `config` cannot give
    one (the run goes ahead)."""
    try:
        found = estimate(
            settings, config, file_bytes=0 if model_path is None else model_file_bytes(model_path)
        )
    except (AttributeError, TypeError, ValueError, KeyError):
        return None  # a config without the sizes this reads: nothing to refuse on
    limit = machine_memory_bytes() if settings.max_memory is None else int(settings.max_memory * GIB)
    if limit is None or found.total <= limit:
        return found
    # --gradient-checkpointing is named where it is off (it is on by default)
    checkpointing = (
        "--gradient-checkpointing, " if getattr(settings, "gradient_checkpointing", None) is False else ""
    )
    advice = {
        "recover": f"--micro-batch (a divisor of --batch-size), {checkpointing}--lora-rank 8, a smaller --window, "
        "or --dtype bfloat16",
        "convert": "fewer calibration tokens (a smaller --batch-size or --window) or --dtype bfloat16",
        "repair": "fewer --repair-windows or --dtype bfloat16",
    }.get(found.stage, "--dtype bfloat16")
    if hasattr(settings, "decode_contexts"):  # linearize's own levers
        advice = {
            "measure": "shorter --decode-contexts, smaller --decode-batch-sizes or --dtype bfloat16",
            "recover": f"{checkpointing}a shorter --train-length, --micro-batch 1, or --dtype bfloat16",
        }.get(found.stage, advice)
    source = "--max-memory" if settings.max_memory is not None else "the machine's memory"
    raise HeadkitError(
        f"--max-memory: this run needs about {found} and {source} is {limit / GIB:.2f} GiB; lower it with "
        f"{advice}"
    )


__all__ = [
    "MemoryEstimate",
    "ModelShape",
    "check_max_memory",
    "estimate_compress_memory",
    "estimate_linearize_memory",
    "estimate_prune_memory",
    "model_file_bytes",
    "model_shape",
]
