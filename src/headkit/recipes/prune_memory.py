"""The pruning recipe's memory, estimated from MODEL's 🤗 config before any weight is loaded
(:func:`estimate_prune_memory`), and ``--max-memory`` checked against it in the preflight
(:func:`check_max_memory`): a run that would not fit is refused in one line that states the estimate and the
option that brings it down.

The estimate is the largest of the stages' peaks, each the weights the stage holds plus its largest working set:
the parameters are counted exactly on a model built on the meta device (no memory); the calibration's gradient
pass holds one slice of :data:`~headkit.surgery.repair.PASS_TOKENS` tokens' activations and one chunk of logits
(:mod:`headkit.ops.chunked_loss`); the loss-weighted ranking one layer's per-token samples in float32; the
measurements one forward's capped logits (:data:`headkit.evaluation.quality.LOGIT_ENTRIES`); the recovery the
student's gradients, AdamW's two moments, a batch's activations and one chunk of both models' logits (the
distillation's KL is computed from the heads' inputs in chunks:
:class:`~headkit.runs.objectives.CausalLMObjective`). The constants are fitted to the runs measured in
docs/memory.md (SmolLM2-135M and random-weight models of published shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from headkit.errors import HeadkitError
from headkit.evaluation.quality import LOGIT_ENTRIES
from headkit.ops.chunked_loss import CHUNK_ENTRIES
from headkit.recipes.settings import training_forwards
from headkit.runs.models import DTYPES
from headkit.runs.resident import GIB, machine_memory_bytes
from headkit.surgery.families import text_config
from headkit.surgery.repair import PASS_TOKENS

# What the process holds beside the weights: Python, torch, transformers, the tokenizer and the text (measured on
# SmolLM2 after loading: 1.13 GiB with its 0.5 GiB of float32 weights).
RUNTIME_BYTES = int(0.65 * GIB)
# Saved activations per token and layer, in numbers: the norms' inputs, queries, keys, values, the attention's
# output and its backward's workspace, and the MLP's intermediate tensors (SmolLM2: 8·576 + 4·1,536 ≈ 10,752;
# fitted to the gradient pass measured there, 2.2 GiB).
HIDDEN_ACTIVATIONS, MLP_ACTIVATIONS = 8, 4
# Chunk-sized float32 buffers the distillation's chunked KL holds at once (headkit.ops.chunked_loss).
KL_CHUNKS = 5


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated peak resident bytes of a run, the stage expected to reach it, and each stage's."""

    total: int
    stage: str
    stages: dict[str, int]

    def __str__(self) -> str:
        return f"{self.total / GIB:.2f} GiB (stage {self.stage})"


def _parameters(config: Any) -> int:
    """The model's parameter count, from a model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())


def estimate_prune_memory(settings: Any, config: Any) -> MemoryEstimate:
    """The pruning recipe's peak resident memory on a causal LM of `config` with `settings` (see the module
    docstring)."""
    text = text_config(config)
    width = getattr(text, "hidden_size", None) or text.n_embd
    layers = getattr(text, "num_hidden_layers", None) or text.n_layer
    heads = getattr(text, "num_attention_heads", None) or text.n_head
    head_dim = getattr(text, "head_dim", None) or width // heads
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * width
    vocabulary = text.vocab_size
    number = DTYPES[settings.dtype].itemsize
    weights = _parameters(config) * number
    per_token_layer = (HIDDEN_ACTIVATIONS * width + MLP_ACTIVATIONS * inner) * number
    window = settings.window
    calibration_rows = min(settings.importance_batches * settings.batch_size, settings.train_texts)
    calibration_tokens = calibration_rows * window
    logits = 4  # float32
    stages = {
        # a GGUF file is dequantized beside the weights it becomes
        "load": RUNTIME_BYTES + 2 * weights,
        # the gradient pass: one slice's activations, one chunk of logits and its gradient
        "convert": RUNTIME_BYTES
        + weights
        + max(
            max(PASS_TOKENS, window) * layers * per_token_layer + 3 * CHUNK_ENTRIES * logits,
            # the ranking: one layer's samples, bfloat16 read back and float32 copies, and the products' copies
            calibration_tokens * heads * head_dim * (2 * 2 + 2 * 4 + 2 * 4),
        ),
        # teacher and student, and a measurement's capped logits (the agreement's two models' and their softmaxes)
        "measure": RUNTIME_BYTES + 2 * weights + 6 * LOGIT_ENTRIES * logits,
    }
    if settings.recovery_steps:
        batch_tokens = training_forwards(settings)[0] * window  # the activations of one forward
        trained = weights if settings.lora_rank is None else 0
        optimizer = 2 * (trained // number) * 4  # AdamW's two float32 moments
        stages["recover"] = (
            RUNTIME_BYTES
            + 2 * weights
            + trained
            + optimizer
            + batch_tokens * layers * per_token_layer
            # the distillation's KL from both heads' inputs, a chunk of tokens at a time (chunked_kl_divergence):
            # the chunk's student and teacher logits, the teacher's probabilities, their product and the
            # soft-cap's slope; and the head's float32 weight gradient where the head trains
            + KL_CHUNKS * CHUNK_ENTRIES * logits
            + (vocabulary * width * logits if settings.lora_rank is None else 0)
        )
    stage = max(stages, key=stages.__getitem__)
    return MemoryEstimate(stages[stage], stage, stages)


def check_max_memory(settings: Any, config: Any) -> MemoryEstimate | None:
    """Refuse, in one line, a run whose estimated peak exceeds ``--max-memory`` (default: the machine's memory),
    naming the estimate and the option that would bring it down; the estimate, or None where `config` cannot
    give one (the run goes ahead)."""
    try:
        estimate = estimate_prune_memory(settings, config)
    except (AttributeError, TypeError, ValueError, KeyError):
        return None  # a config without the sizes this reads: nothing to refuse on
    limit = machine_memory_bytes() if settings.max_memory is None else int(settings.max_memory * GIB)
    if limit is None or estimate.total <= limit:
        return estimate
    advice = {
        "recover": "--micro-batch (a divisor of --batch-size), --lora-rank 8, a smaller --window, or --dtype "
        "bfloat16",
        "convert": "fewer calibration tokens (a smaller --batch-size or --window) or --dtype bfloat16",
    }.get(estimate.stage, "--dtype bfloat16")
    source = "--max-memory" if settings.max_memory is not None else "the machine's memory"
    raise HeadkitError(
        f"--max-memory: this run needs about {estimate} and {source} is {limit / GIB:.2f} GiB; lower it with "
        f"{advice}"
    )


__all__ = [
    "MemoryEstimate",
    "check_max_memory",
    "estimate_prune_memory",
]
