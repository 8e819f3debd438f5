"""``headkit compress MODEL --kv-budget 1/8``: the model's key/value cache in a fraction of its bytes, no training.

The budget is a fraction of the original's bfloat16 key/value bytes at ``--kv-budget-context`` tokens (the
model's context by default). :func:`cache_plan` chooses the configuration from the 🤗 config alone — before any
weight is read — in the order the measurements rank them (``headkit bench frontier``; docs/compressed-cache.md):

1. 8-bit storage (:class:`~headkit.surgery.quantized_cache.QuantizedKVConfig`, KIVI), where it fits: perplexity
   1.000× on SmolLM2 at 0.56 of the bytes;
2. 4-bit storage, where it fits: 1.006× at 0.31;
3. below that, the compressed cache (:class:`~headkit.surgery.compressed_cache.CompressedCacheConfig`): sinks, a
   window of at most 256 tokens and the most question-chosen keys per head that fit — its keys and values in
   bfloat16, 8 or 4 bits (``[CompressedCacheConfig, QuantizedKVConfig]``), whichever keeps the most tokens per
   head (a tie to the more bits). 4 bits keep about 3.2 times the tokens of bfloat16 at head width 64: at 1/8
   and 1/16 of the bytes, where 4-bit storage alone does not fit, fewer bits drop fewer tokens, at the small
   error the bits add (measured on SmolLM2: docs/compressed-cache.md). In 8 or 4 bits the window stays in
   full precision (``QuantizedKVConfig(full_precision_window=True)``) where the budget still holds a window as
   large: a prompt the window holds is then read as the unquantized cache reads it (2,715 tokens per head at 1/8
   of 8,192 instead of 3,276).

``--kv-bits`` asks for storage in those bits whatever the budget: alone where it fits, else the compressed cache
in those bits; ``--kv-bits 16`` for none — the compressed cache in bfloat16, what the fast decoder steps quickest
today (its quantized step dequantizes every stored set first: docs/compressed-cache.md). ``--kv-retrieval-heads N``
keeps N key/value heads whole in the compressed cache, within the same budget: counted with placeholders in the
plan, chosen on the loaded original (:func:`headkit.recipes.retrieval_heads.chosen_retrieval_heads`); unset, about
9% of the compressed layers' key/value heads, where their whole caches take at most half the budget
(:func:`default_retrieval_heads`: 8 of SmolLM2's 90 at 1/8 and 1/16, measured better on every column there). The
conversion is checked on the loaded model, applied with :func:`headkit.apply_`, measured — perplexity of held-out
text read through the cache against the original's — and saved with its record, so :func:`headkit.from_pretrained`
rebuilds it; the report states the configuration and its bytes per token at 8,192 tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from headkit.errors import HeadkitError
from headkit.evaluation.quality import continuation_perplexity
from headkit.ops.key_selection import QUESTION, RECONSTRUCTION
from headkit.ops.quantized_cache import BITS as QUANTIZED_BITS
from headkit.recipes.retrieval_heads import chosen_retrieval_heads
from headkit.recipes.steps import Steps
from headkit.runs.models import CAUSAL_LM, shared_copy
from headkit.runs.text import held_out_by_length, load_text
from headkit.surgery.apply import apply_, bytes_per_token, check_steps
from headkit.surgery.compressed_cache import CompressedCacheConfig
from headkit.surgery.gating import kv_head_counts
from headkit.surgery.quantized_cache import QuantizedKVConfig
from headkit.surgery.reconstruction import repetition_request

REPORTED_CONTEXT = 8192  # the report's bytes per token are stated at this context, whatever the budget's
LARGEST_WINDOW, SINKS, OBSERVATION = 256, 4, 32
BFLOAT16_BITS = 16  # --kv-bits 16: no quantized storage (the others are QUANTIZED_BITS, the quantizer's own)
# the measurement: the last tokens (at most 256, half the window) of two held-out windows, fed 16 at a time
SCORED_TOKENS, CHUNK = 256, 16
# --kv-retrieval-heads' default: this share of the compressed layers' key/value heads keep their whole cache, where
# their bytes take at most RETRIEVAL_SHARE of the budget. Measured on SmolLM2 at 8,192 tokens
# (docs/compressed-cache.md), 8 heads of 90 in 4 bits: at 1/8 (22% of the budget) perplexity at 4K 1.033× → 1.013×,
# the passkey beyond the kept tokens 14 → 18 of 50, the second turn 0 → 4; at 1/16 (44%) 1.148× → 1.040× and 5 → 14
# of 50. At 1/32 they would take 89%: none (not measured with them).
RETRIEVAL_HEADS, RETRIEVAL_SHARE = 0.09, 0.5


def parse_fraction(text: Any) -> float:
    """``"1/8"``, ``"0.125"`` or a number in (0, 1]: the budget as a float; anything else refused naming
    --kv-budget."""
    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise HeadkitError(
            f"--kv-budget must be a fraction in (0, 1] such as 1/8 or 0.125, got {text!r}"
        ) from None
    if not 0 < value <= 1:
        raise HeadkitError(f"--kv-budget must be a fraction in (0, 1] such as 1/8 or 0.125, got {text!r}")
    return value


@dataclass(frozen=True)
class CachePlan:
    """The configuration chosen for a budget: the configs applied in order, their bfloat16 bytes per token at the
    budget's context and at :data:`REPORTED_CONTEXT`, the original's at both, and why it was chosen."""

    configs: tuple[Any, ...]
    budget: float
    context: int
    bytes_per_token: float
    original_bytes_per_token: float
    bytes_per_token_8192: float
    original_bytes_per_token_8192: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "configs": [{"config": type(c).__name__} | c.record() for c in self.configs],
            "budget": self.budget,
            "context": self.context,
            "bytes_per_token": self.bytes_per_token,
            "original_bytes_per_token": self.original_bytes_per_token,
            "fraction": self.bytes_per_token / self.original_bytes_per_token,
            "bytes_per_token_8192": self.bytes_per_token_8192,
            "original_bytes_per_token_8192": self.original_bytes_per_token_8192,
            "reason": self.reason,
        }


def _compressed(tokens: int, heads: tuple[tuple[int, int], ...] = ()) -> CompressedCacheConfig:
    """The compressed cache keeping `tokens` per head beyond the sinks: a window of half of them (at most
    :data:`LARGEST_WINDOW`), the rest chosen by the question; `heads` keep their whole cache."""
    window = max(1, min(LARGEST_WINDOW, tokens // 2))
    return CompressedCacheConfig(
        window=window,
        sinks=SINKS,
        budget=max(0, tokens - window),
        observation=min(OBSERVATION, window),
        retrieval_heads=heads,
    )


def default_retrieval_heads(model_config: Any) -> int:
    """--kv-retrieval-heads' default: :data:`RETRIEVAL_HEADS` of the key/value heads of the layers the compressed
    cache converts, rounded (8 of SmolLM2's 90; none of a model with fewer than 6), kept only where their whole
    caches take at most :data:`RETRIEVAL_SHARE` of the budget (:func:`cache_plan`)."""
    counts = kv_head_counts(model_config)
    if counts is None:
        return 0
    layers = _compressed(1).linearize_config().layers_to_convert(model_config, len(counts))
    return round(RETRIEVAL_HEADS * sum(counts[layer] for layer in layers))


def placeholder_heads(model_config: Any, count: int) -> tuple[tuple[int, int], ...]:
    """`count` (layer, key/value head) pairs of the layers the compressed cache converts, in order: what the plan
    counts the retrieval heads' bytes with before the model is loaded (the bytes do not depend on which heads;
    the recipe chooses them on the loaded model). Refused in one line naming --kv-retrieval-heads beyond the
    heads there are."""
    counts = kv_head_counts(model_config)
    if counts is None:
        raise HeadkitError("--kv-retrieval-heads needs a config that states its key/value heads")
    layers = _compressed(1).linearize_config().layers_to_convert(model_config, len(counts))
    pairs = [(layer, head) for layer in layers for head in range(counts[layer])]
    if count > len(pairs):
        raise HeadkitError(
            f"--kv-retrieval-heads must be at most {len(pairs)} (the key/value heads of the {len(layers)} "
            f"compressed layers), got {count}"
        )
    return tuple(pairs[:count])


def cache_plan(
    model_config: Any,
    budget: float,
    context: int,
    *,
    bits: int | None = None,
    retrieval_heads: int | None = None,
    selection: str | None = None,
) -> CachePlan:
    """The configuration for `budget` (a fraction of the original's bfloat16 KV bytes at `context` tokens) of a
    model with the 🤗 `model_config` (module docstring), the compressed cache with `retrieval_heads` heads kept
    whole (:func:`placeholder_heads` until the recipe chooses them; None: :func:`default_retrieval_heads`) and
    its keys chosen by `selection` (None: the question's; the bytes are the same either way); refused in one line
    naming --kv-budget where nothing fits."""

    def per_token(configs: list[Any], at: int = context) -> float:
        value = bytes_per_token(model_config, configs, bytes_per_number=2, context=at)
        if value is None:
            raise HeadkitError("--kv-budget needs a config that states its attention widths")
        return value

    original = per_token([])
    target = budget * original
    check_storage_bits(bits, budget)
    if bits in QUANTIZED_BITS:
        QuantizedKVConfig(bits=bits).check(model_config)  # a group that does not divide the heads
    default = retrieval_heads is None
    count = default_retrieval_heads(model_config) if default else retrieval_heads
    heads = placeholder_heads(model_config, count) if count else ()
    chosen, reason = None, ""
    alone = (8, 4) if bits is None else () if bits == BFLOAT16_BITS else (bits,)  # quantized storage alone
    for bits_tried in alone:
        candidate = [QuantizedKVConfig(bits=bits_tried)]
        if _refused(candidate, model_config):
            continue
        if per_token(candidate) <= target:
            chosen, reason = candidate, f"{bits_tried}-bit storage fits the budget (measured the best there)"
            if heads and not default:
                reason += ": every head keeps its whole cache, retrieval heads or not"
            break
    if chosen is None and heads and default:
        # The default heads where the plan holds them and their whole caches, in the storage it chose, take at
        # most RETRIEVAL_SHARE of the budget; else none.
        try:
            chosen, reason = _most_tokens(
                model_config, per_token, target, context, budget, original, bits, heads
            )
        except HeadkitError:
            chosen = None
        else:
            storage = chosen[1:]
            whole = per_token([_compressed(1, heads), *storage]) - per_token([_compressed(1), *storage])
            if whole > RETRIEVAL_SHARE * target:
                chosen = None
            else:
                reason += (
                    f" (the default: about {RETRIEVAL_HEADS:.0%} of the compressed layers' key/value heads)"
                )
        heads = heads if chosen is not None else ()
    if chosen is None:
        chosen, reason = _most_tokens(model_config, per_token, target, context, budget, original, bits, heads)
    if selection is not None and isinstance(chosen[0], CompressedCacheConfig):
        chosen = [replace(chosen[0], selection=selection), *chosen[1:]]
        reason += f"; its keys chosen by {selection}" if selection != QUESTION else ""
    elif selection is not None:
        reason += ": every token is kept, so no key is chosen by the question or by reconstruction"
    check_steps(model_config, chosen)
    return CachePlan(
        configs=tuple(chosen),
        budget=budget,
        context=context,
        bytes_per_token=per_token(chosen),
        original_bytes_per_token=original,
        bytes_per_token_8192=per_token(chosen, REPORTED_CONTEXT),
        original_bytes_per_token_8192=per_token([], REPORTED_CONTEXT),
        reason=reason,
    )


def check_storage_bits(bits: int | None, budget: float) -> None:
    """--kv-bits: 8 or 4 (quantized storage), 16 (none: bfloat16), or None (the plan chooses); 16 at a budget of
    the whole cache is the original's. Refused in one line naming the option."""
    if bits is not None and (isinstance(bits, bool) or bits not in (*QUANTIZED_BITS, BFLOAT16_BITS)):
        raise HeadkitError(
            f"--kv-bits must be 8 or 4 (quantized storage) or 16 (bfloat16, none), got {bits!r}"
        )
    if bits == BFLOAT16_BITS and budget >= 1:
        raise HeadkitError(
            "--kv-bits 16 at --kv-budget 1 is the original cache: nothing to convert (lower --kv-budget)"
        )


def _refused(configs: list[Any], model_config: Any) -> bool:
    """Whether the model refuses the composition (a group size that does not divide its heads)."""
    try:
        check_steps(model_config, configs)
    except HeadkitError:
        return True
    return False


def _most_tokens(
    model_config: Any,
    per_token: Callable[[list[Any]], float],
    target: float,
    context: int,
    budget: float,
    original: float,
    bits: int | None,
    heads: tuple[tuple[int, int], ...] = (),
) -> tuple[list[Any], str]:
    """Below what quantized storage alone keeps: the compressed cache in bfloat16, or its keys and values in 8 or
    4 bits (``--kv-bits``: in those bits only), whichever keeps the most tokens per head within `target` bytes
    (at most the context's; a tie goes to the more bits: fewer tokens dropped first, then the finer numbers)."""
    storages = [None, 8, 4] if bits is None else [None if bits == BFLOAT16_BITS else bits]
    found, smallest = [], {}
    for storage in storages:
        tail = [] if storage is None else [QuantizedKVConfig(bits=storage)]
        if tail and _refused([_compressed(1, heads), *tail], model_config):
            continue
        smallest[storage] = per_token([_compressed(1, heads), *tail]) / original

        def fitting(tail: list[Any]) -> CompressedCacheConfig | None:
            tokens = largest_fitting(
                lambda n: [_compressed(max(n, 1), heads), *tail], per_token, target, context
            )
            return None if tokens is None else _compressed(max(tokens, 1), heads)

        made = fitting(tail)
        if made is None:
            continue
        if tail:
            # The window in full precision, where the budget still holds it as large: a prompt the window holds is
            # then attended as the unquantized cache attends it (a short chat in 4 bits otherwise leaves the
            # original's greedy path: docs/compressed-cache.md).
            whole = [QuantizedKVConfig(bits=storage, full_precision_window=True)]
            exact_window = fitting(whole)
            if exact_window is not None and exact_window.window == made.window > 1:
                made, tail = exact_window, whole
        found.append((min(context, made.sinks + made.window - 1 + made.budget), storage, [made, *tail]))
    if not found:
        # the smallest cache of the storages allowed: the fewest bits, unless the model refuses them
        smallest = smallest or {None: per_token([_compressed(1, heads)]) / original}
        least = min(smallest, key=lambda storage: smallest[storage])
        whole = f", {len(heads)} retrieval heads whole" if heads else ""
        stored = "bfloat16" if least is None else f"{least} bits"
        raise HeadkitError(
            f"--kv-budget {budget:.4g} is below the smallest cache this model can keep at {context} tokens "
            f"({smallest[least]:.4g} of its bytes: {SINKS} sinks and one token per head{whole}, in {stored}); "
            "raise it or "
            "--kv-budget-context" + (", or lower --kv-retrieval-heads" if heads else "")
        )
    # max keeps the first of equals: bfloat16 before 8 bits before 4
    kept, storage, chosen = max(found, key=lambda entry: entry[0])
    alone = next((tokens for tokens, bits_of, _ in found if bits_of is None), None)
    how = "the compressed cache" if storage is None else f"the compressed cache in {storage} bits"
    if storage is not None and chosen[-1].full_precision_window:
        how += " (its window in bfloat16)"
    reason = f"below what quantized storage alone keeps: {how}, {kept} tokens per head of {context}"
    if storage is not None and alone is not None:
        reason += f" ({alone} in bfloat16)"
    if heads:
        reason += f"; {len(heads)} retrieval heads keep their whole cache"
    return chosen, reason


def largest_fitting(
    make: Callable[[int], list[Any]], bytes_of: Callable[[list[Any]], float], target: float, top: int
) -> int | None:
    """The largest n in [0, top] whose configs `make(n)` take at most `target` bytes (`bytes_of` grows with n),
    or None if not even n = 0 fits: a binary search, the bytes being monotone in n."""
    if bytes_of(make(0)) > target:
        return None
    low, high = 0, top
    while low < high:
        middle = (low + high + 1) // 2
        if bytes_of(make(middle)) <= target:
            low = middle
        else:
            high = middle - 1
    return low


def budget_context(settings: Any, model_config: Any) -> int:
    """--kv-budget-context, or the model's context (its ``max_position_embeddings``), or 8,192."""
    if settings.kv_budget_context is not None:
        return settings.kv_budget_context
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return int(getattr(text, "max_position_embeddings", None) or REPORTED_CONTEXT)


def evaluation_window(settings: Any, context: int) -> int:
    """The held-out windows' length the cache's perplexity is read over: --eval-window, or the budget's context
    up to 2,048 tokens."""
    return settings.eval_window or min(2048, context)


class CacheBudgetSteps(Steps):
    """``headkit compress --kv-budget``: the plan checked on the loaded model, applied, measured; no repair and no
    training (nothing is learned)."""

    result_name = "compressed"

    def check(self) -> None:
        settings = self.settings
        if not self.loaded.is_causal_lm:
            raise HeadkitError("--kv-budget compresses the key/value cache of a causal LM")
        config = self.teacher.config
        self.plan = cache_plan(
            config,
            parse_fraction(settings.kv_budget),
            budget_context(settings, config),
            bits=settings.kv_bits,
            retrieval_heads=settings.kv_retrieval_heads,
            selection=settings.kv_selection,
        )
        check_steps(self.teacher, self.plan.configs)

    def data(self) -> None:
        settings = self.settings
        length = evaluation_window(settings, self.plan.context)
        self.corpus = corpus = load_text(settings.data)
        self.held_out = held_out_by_length(self.tokenizer, corpus, (length,), 2, settings.seed)[length]
        self.length, self.scored = length, min(SCORED_TOKENS, length // 2)
        self.perplexity_original = self._perplexity(self.teacher)

    def _perplexity(self, model: Any) -> float:
        return continuation_perplexity(model, self.held_out, scored=self.scored, chunk=CHUNK)

    def convert(self) -> None:
        started = time.perf_counter()
        made, *rest = self.plan.configs
        if isinstance(made, CompressedCacheConfig):
            # What the plan, from the 🤗 config alone, could not know: the retrieval heads (their bytes counted with
            # placeholders) are the original's best retrievers, and the request to repeat the prompt is in the
            # model's own tokens.
            resolved: dict[str, Any] = {}
            if made.retrieval_heads:
                layers = made.linearize_config().layers_to_convert(self.teacher)
                resolved["retrieval_heads"] = chosen_retrieval_heads(
                    self.teacher, self.tokenizer, self.corpus, layers, len(made.retrieval_heads),
                    seed=self.settings.seed, echo=self.echo,
                )  # fmt: skip
            if made.selection == RECONSTRUCTION:
                resolved["reconstruction_prompt"] = repetition_request(self.tokenizer)
            self.plan = replace(self.plan, configs=(replace(made, **resolved), *rest))
        # The cache's configs change no weight: the student is the original's tensors under cache layers of its own.
        self.student = shared_copy(self.teacher)
        apply_(self.student, list(self.plan.configs))
        self.convert_seconds = time.perf_counter() - started
        self.echo(f"{self.plan.reason}: {', '.join(type(c).__name__ for c in self.plan.configs)}")

    def recover(self) -> None:
        return None

    def measure(self) -> None:
        converted = self._perplexity(self.student)
        plan = self.plan
        self.report |= {
            "method": "kv_budget",
            "kind": CAUSAL_LM,
            "plan": plan.to_dict(),
            "kv_bytes_per_token_8192": plan.bytes_per_token_8192,
            "kv_bytes_per_token_8192_original": plan.original_bytes_per_token_8192,
            "perplexity_window": self.length,
            "perplexity_scored_tokens": self.scored,
            "perplexity_original": self.perplexity_original,
            "perplexity": converted,
            "perplexity_ratio": converted / self.perplexity_original,
            "convert_seconds": self.convert_seconds,
            "recovery_steps": 0,
        }


def format_budget_report(report: dict[str, Any]) -> str:
    """The printed lines of a --kv-budget report."""
    plan = report["plan"]
    lines = [
        f"KV budget {plan['budget']:.4g} of the original's bfloat16 bytes at {plan['context']} tokens: "
        + "; ".join(
            f"{entry['config']}({', '.join(f'{k}={v}' for k, v in entry.items() if k not in ('config', 'op'))})"
            for entry in plan["configs"]
        ),
        f"why: {plan['reason']}",
        f"bytes per token at 8,192 tokens: {plan['original_bytes_per_token_8192']:,.0f} -> "
        f"{plan['bytes_per_token_8192']:,.0f} ({plan['bytes_per_token_8192'] / plan['original_bytes_per_token_8192']:.3f})",
        f"perplexity of the last {report['perplexity_scored_tokens']} tokens of {report['perplexity_window']}-token "
        f"held-out windows, read through the cache: original {report['perplexity_original']:.3f}, compressed "
        f"{report['perplexity']:.3f} ({report['perplexity_ratio']:.3f}x)",
    ]
    if "seconds" in report:
        lines.append(f"saved to {report['out']} in {report['seconds']:.0f} s")
    return "\n".join(lines)


__all__ = [
    "CacheBudgetSteps",
    "CachePlan",
    "budget_context",
    "cache_plan",
    "default_retrieval_heads",
    "evaluation_window",
    "format_budget_report",
    "largest_fitting",
    "parse_fraction",
]
