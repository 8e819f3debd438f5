"""Repair after head removal, before any training: each layer's output projection refit in closed form.

Removing heads from a layer drops their terms from its attention output y = W_O h = W_K h_K + W_R h_R (h: the
concatenated head outputs, K the kept heads' columns, R the removed ones'). Plain slicing keeps W_K and loses
W_R h_R entirely. The least-squares refit on calibration activations instead keeps what the kept heads can say of
the removed ones (Kwon et al. 2022, "A Fast Post-Training Pruning Framework for Transformers", §4.3: per-layer
least squares after structured pruning):

    W' = argmin_W E‖W h_K − W_O h‖² = W_K + W_R G_RK (G_KK + λI)⁻¹,    G = E[h hᵀ],

which needs only G, the second moment of each layer's output-projection input in the *original* model (one
forward pass over calibration text, accumulated in float64): every layer is repaired from the original's own
inputs, so no error crosses layers, and the whole repair is one teacher pass plus one small solve per layer
(9·64 = 576 columns for SmolLM2). The refit W' has W_K's shape: a stock checkpoint stays stock.

The ridge λ matters. Under grouped-query attention the query heads of one group output vectors of one value
subspace, so G_KK is rank-deficient (SmolLM2: 9 heads of 64 read 3 groups' values: rank ≤ 192 of 576) and the
plain least-squares fit puts large weights on directions the original's activations barely use — directions the
pruned model's own, drifted activations then do use. Measured on SmolLM2 (one KV group removed per layer, held-out
perplexity; sliced 38.27): λ = 10⁻⁶·mean diag(G_KK) 58.52 (worse than slicing, though each layer's local error fell
4×), 10⁻³ 28.54, 10⁻² 23.82, **10⁻¹ 23.06**, 1 24.35; a quarter of the query heads (sliced 20.00): 18.46, 16.95,
15.65, **15.20**, 15.88. The default is 0.1 (:data:`RIDGE`).
"""

from __future__ import annotations

import inspect
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headkit.errors import HeadkitError
from headkit.ops.chunked_loss import IGNORE_INDEX, chunked_cross_entropy
from headkit.surgery.adapters import AttentionAdapter, get_adapter, linear_parameters

RIDGE = 0.1  # λ relative to the mean diagonal of the kept heads' second moment (see above)
# Tokens one forward (and backward) of a calibration pass holds at most: a batch runs in slices of whole rows, so the
# activations autograd keeps are bounded (SmolLM2: ~1 MB a token; 256 tokens: 0.33 GB) whatever the batch size. The
# sums are the same.
PASS_TOKENS = 256
# Tokens of the loss-weighted ranking's samples one product takes at a time (headkit.surgery.repair's
# _loss_weighted_error).
SCORE_TOKENS = 4096
# What :func:`reconstruct_attention` holds of the original's attention inputs and outputs at once: the layers are
# captured in groups that fit it (one pass of the original per group, stopped after the group's last layer). All
# 30 of SmolLM2's layers over its 72 repair windows are 2.4 GiB; a Llama-3.2-1B-shaped layer alone is 0.3 GiB.
CAPTURE_BYTES = 512 << 20
WEIGHTINGS = ("relative", "absolute", "loss")  # how refit_error_scores weighs a removal's error


@dataclass
class OutputStatistics:
    """The second moment G = Σ h hᵀ (float64) of one layer's output-projection input over `tokens` tokens, its sum
    Σ h, and the projection's weight W_O [out, heads·head_dim] as the original had it."""

    gram: torch.Tensor
    tokens: int
    weight: torch.Tensor
    head_dim: int
    total: torch.Tensor | None = (
        None  # Σ h (float64): the mean's numerator, for a bias that absorbs the removed heads'
    )
    # With ``output_statistics(..., gradients=True)``, per real token (bfloat16, to halve their memory): h, the
    # projection's input [tokens, heads·head_dim], and the summed next-token loss's gradient with respect to it,
    # W_Oᵀ g — what ``refit_error_scores(..., weighting="loss")`` weighs errors by.
    activations: torch.Tensor | None = None
    input_gradients: torch.Tensor | None = None
    # Or the same samples in files (:class:`SampleFiles`), read one layer at a time by :meth:`loss_samples`.
    sample_files: SampleFiles | None = None
    layer: int = 0

    @property
    def has_loss_samples(self) -> bool:
        return self.input_gradients is not None or self.sample_files is not None

    def loss_samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, W_Oᵀ g) per real token, [tokens, heads·head_dim] each: in memory, or read from the files."""
        if self.input_gradients is not None and self.activations is not None:
            return self.activations, self.input_gradients
        if self.sample_files is None:
            raise HeadkitError("no per-token samples: output_statistics(..., gradients=True)")
        return self.sample_files.load(self.layer)


class SampleFiles:
    """Per-token samples of every layer — the output projection's input h and the loss's gradient there, bfloat16
    — appended batch by batch to two files per layer in a temporary folder (``$TMPDIR``), so that memory holds one
    layer's at a time when they are read (:meth:`load`) instead of every layer's at once (SmolLM2, 32,768
    calibration tokens: 2.3 GB). The folder goes when the object does."""

    def __init__(self, layers: int) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="headkit-samples-")
        self.rows = [0] * layers
        self.widths = [0] * layers

    def _path(self, layer: int, kind: str) -> str:
        return f"{self._folder.name}/{kind}{layer}.bin"

    def append(self, layer: int, activations: torch.Tensor, gradients: torch.Tensor) -> None:
        for kind, rows in (("h", activations), ("u", gradients)):
            with open(self._path(layer, kind), "ab") as handle:
                handle.write(rows.to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy().tobytes())
        self.rows[layer] += activations.shape[0]
        self.widths[layer] = activations.shape[1]

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(activations, gradients) of `layer`, [tokens, width] bfloat16 each, read into memory."""
        size, shape = self.rows[layer] * self.widths[layer], (self.rows[layer], self.widths[layer])
        return tuple(  # type: ignore[return-value]
            torch.from_file(self._path(layer, kind), shared=False, size=size, dtype=torch.bfloat16).view(
                shape
            )
            for kind in ("h", "u")
        )


@dataclass
class _LayerwiseReport:
    """Per-layer errors of a repair, the calibration tokens it saw and its seconds."""

    layers: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def mean(self, errors: list[float]) -> float:
        return sum(errors) / max(len(errors), 1)


@dataclass
class RepairReport(_LayerwiseReport):
    """What :func:`refit_output_projections` did: per repaired layer, the layer-local relative error
    E‖W h_K − W_O h‖² / E‖W_O h‖² on the calibration activations with the sliced projection (`error_sliced`) and
    with the refit one (`error_refit`)."""

    error_sliced: list[float] = field(default_factory=list)
    error_refit: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.layers:
            return "repair: no layer lost a head; nothing to refit"
        sliced, refit = self.mean(self.error_sliced), self.mean(self.error_refit)
        return (
            f"repair: {len(self.layers)} output projections refit by least squares on {self.tokens:,} calibration "
            f"tokens in {self.seconds:.1f} s; layer-local error {sliced:.3g} sliced -> {refit:.3g} refit (mean)"
        )


def _no_cache(model: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` for a model whose forward takes it (a decoder); nothing for an encoder's."""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def _real_tokens(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A batch's [B, T] bool mask of real tokens, or None where its attention mask says nothing of padding."""
    return None if mask is None or mask.dim() != 2 else mask.bool()


def _slices(batch: Mapping[str, Any]) -> Iterable[dict[str, torch.Tensor]]:
    """A batch's ids and mask in slices of whole rows of at most :data:`PASS_TOKENS` tokens (at least one row)."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    ids = inputs["input_ids"]
    rows = max(1, PASS_TOKENS // max(ids.shape[-1], 1)) if ids.dim() == 2 else len(ids)
    for start in range(0, len(ids), rows):
        yield {k: v[start : start + rows] for k, v in inputs.items()}


def _skipping_head(model: nn.Module) -> Any:
    """A hook that stops `model`'s forward at its LM head (its logits unused: :class:`_Captured`), or None where the
    model has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        return None

    def stop(module: nn.Module, args: tuple) -> None:
        raise _Captured

    return head.register_forward_pre_hook(stop)


def _run_hooked(
    model: nn.Module,
    handles: list[Any],
    batches: Iterable[Mapping[str, Any]],
    real: list[torch.Tensor | None] | None = None,
    *,
    skip_head: bool = False,
) -> None:
    """Run `model` over `batches` (their ids and mask; no cache), then remove the hooks `handles`, also on error.
    `real`: a one-item holder the hooks read, set to each batch's [B, T] bool mask of real tokens (None without
    padding). `skip_head`: the hooks need nothing from the LM head, so the forward stops before it (no [tokens,
    vocabulary] logits)."""
    if skip_head:
        handles = [*handles, *filter(None, [_skipping_head(model)])]
    try:
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            if real is not None:
                real[0] = _real_tokens(inputs.get("attention_mask"))
            try:
                model(**inputs, **_no_cache(model))
            except _Captured:
                pass
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def output_statistics(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    *,
    gradients: bool = False,
) -> list[OutputStatistics]:
    """Run `model` (the original, before any head is removed) on calibration `batches` (model inputs; padding slots,
    marked by their attention mask, are left out) and return each attention site's :class:`OutputStatistics`.

    `gradients` (a causal LM): also back-propagate the batches' summed next-token cross-entropy and keep, per real
    token, each output projection's input and the loss's gradient with respect to it (``activations``,
    ``input_gradients``), for ``refit_error_scores(..., weighting="loss")``. They take 2 × 2 bytes per token,
    layer and feature (SmolLM2, 32,768 calibration tokens: 2.3 GB), written batch by batch to files
    (:class:`SampleFiles`, ``sample_files``), which the scores read one layer at a time; no parameter gradient is
    computed. The next-token loss is computed in chunks of tokens (:func:`headkit.ops.chunked_loss.chunked_cross_entropy`)
    and the batches run in slices of :data:`PASS_TOKENS` tokens, so neither the logits nor the activations of a
    whole batch are held at once."""
    adapter = get_adapter(model, adapter)
    sites = adapter.sites(model)
    grams: list[torch.Tensor | None] = [None] * len(sites)
    totals: list[torch.Tensor | None] = [None] * len(sites)
    tokens = [0] * len(sites)
    files = SampleFiles(len(sites)) if gradients else None

    real: list[torch.Tensor | None] = [None]

    def hook(index: int):
        def accumulate(module: nn.Module, args: tuple) -> None:
            inputs = args[0].detach().reshape(-1, args[0].shape[-1])
            mask = real[0]
            if mask is not None:  # padding slots (texts of unequal length) are not what the model is asked
                inputs = inputs[mask.reshape(-1)]
            if gradients and args[0].requires_grad:
                kept = inputs.to(torch.bfloat16)

                def pair(gradient: torch.Tensor) -> None:
                    rows = gradient.detach().reshape(-1, gradient.shape[-1])
                    rows = rows if mask is None else rows[mask.reshape(-1)]
                    files.append(index, kept, rows)

                args[0].register_hook(pair)
            inputs = inputs.double()
            gram, total = inputs.T @ inputs, inputs.sum(dim=0)
            grams[index] = gram if grams[index] is None else grams[index] + gram
            totals[index] = total if totals[index] is None else totals[index] + total
            tokens[index] += inputs.shape[0]

        return accumulate

    head = _next_token_head(model) if gradients else None  # before the hooks: its check reaches none of them
    handles = [site.output_projection.register_forward_pre_hook(hook(i)) for i, site in enumerate(sites)]
    if gradients:
        _run_backward(model, handles, batches, real, head=head)
    else:
        _run_hooked(model, handles, batches, real, skip_head=True)
    if any(gram is None for gram in grams):
        raise HeadkitError("calibration needs at least one batch of text, got none")
    if files is not None and not all(files.rows):
        missing = [i for i, rows in enumerate(files.rows) if not rows]
        raise HeadkitError(f"the loss's gradient never reached the output projections of layers {missing}")
    return [
        OutputStatistics(
            gram=gram.cpu(),
            tokens=count,
            weight=linear_parameters(site.output_projection)[0].detach().double().cpu().clone(),
            head_dim=site.head_dim,
            total=total.cpu(),
            sample_files=files,
            layer=index,
        )
        for index, (gram, total, count, site) in enumerate(zip(grams, totals, tokens, sites, strict=True))
    ]


def refit_weight(
    statistics: OutputStatistics, kept_heads: list[int], ridge: float = RIDGE, intercept: bool = False
) -> tuple[torch.Tensor, float, float]:
    """(W' [out, |K|·head_dim], sliced error, refit error) for the kept heads of one layer (the closed form of
    the module docstring). ``intercept``: the projection has a bias that moves too (FLAP's bias compensation,
    An et al. 2024): the fit is on the centred second moment C = E[h hᵀ] − μμᵀ, and :func:`bias_shift` gives the
    bias's change, b' − b = W_O μ − W' μ_K, which absorbs the removed heads' mean contribution."""
    kept, removed = _split_columns(statistics, kept_heads)
    second_moment, weight = statistics.gram / max(statistics.tokens, 1), statistics.weight
    moment = second_moment
    if intercept:
        mean = _mean(statistics)
        moment = second_moment - torch.outer(mean, mean)
    refit = weight[:, kept] + weight[:, removed] @ _refit_coefficients(moment, kept, removed, ridge).T
    reference = torch.einsum("oi,ij,oj->", weight, second_moment, weight).clamp_min(1e-300)

    def error(candidate: torch.Tensor, moment: torch.Tensor) -> float:
        # E‖[candidate | 0] h − W h‖² from the moments alone: Δ M Δᵀ with Δ = [candidate on K, 0 on R] − W (the
        # centred moment when the bias absorbs the mean difference).
        delta = -weight.clone()
        delta[:, kept] += candidate
        return float(torch.einsum("oi,ij,oj->", delta, moment, delta) / reference)

    return refit, error(weight[:, kept], second_moment), error(refit, moment)


def _refit_coefficients(
    moment: torch.Tensor, kept: torch.Tensor, removed: torch.Tensor, ridge: float
) -> torch.Tensor:
    """Xᵀ = (G_KK + λI)⁻¹ G_KR [|K|, |R|] (λ relative to G_KK's mean diagonal): the ridge regression of the removed
    columns of h on the kept ones, so that W' = W_K + W_R X. Solved rather than inverted."""
    if not len(kept) or not len(removed):
        return moment.new_zeros(len(kept), len(removed))
    g_kk = moment[kept][:, kept]
    damping = ridge * float(g_kk.diagonal().mean())
    return torch.linalg.solve(
        g_kk + damping * torch.eye(len(kept), dtype=moment.dtype), moment[kept][:, removed]
    )


def bias_shift(statistics: OutputStatistics, kept_heads: list[int], refit: torch.Tensor) -> torch.Tensor:
    """b' − b = W_O μ − W' μ_K [out] (float64): what the bias adds so that the refit projection's mean output is
    the original's (:func:`refit_weight` with ``intercept``)."""
    mean = _mean(statistics)
    return statistics.weight @ mean - refit @ mean[_head_columns(kept_heads, statistics.head_dim)]


def _split_columns(statistics: OutputStatistics, kept_heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The output projection's input columns that `kept_heads` write, and the rest (the removed heads')."""
    kept = _head_columns(kept_heads, statistics.head_dim)
    removed = sorted(set(range(statistics.gram.shape[0])) - set(kept.tolist()))
    return kept, torch.tensor(removed, dtype=torch.long)


def _head_columns(heads: list[int], head_dim: int) -> torch.Tensor:
    """The columns of the output projection's input that `heads` write (each head's ``head_dim`` in order)."""
    if not heads:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def _mean(statistics: OutputStatistics) -> torch.Tensor:
    if statistics.total is None:
        raise HeadkitError("a bias refit needs the activations' mean: statistics from output_statistics")
    return statistics.total / max(statistics.tokens, 1)


def refit_error_scores(
    statistics: list[OutputStatistics],
    kv_of_query: list[list[int]],
    *,
    unit: str = "query",
    ridge: float = RIDGE,
    weighting: str = "relative",
) -> list[torch.Tensor]:
    """Per-layer head scores from the error each removal leaves *after* the repair: the sensitivity of every layer
    to every choice, measured with the closed form itself (issue: "the budget where it matters").

    Within each layer the units (query heads, or key/value groups with ``unit="group"``) are removed greedily:
    at each step the one whose removal leaves the smallest refit error (:func:`refit_weight`, from the Gram
    matrix alone: no forward pass) given the ones already removed. A unit's score is the error increment its
    removal costs, made non-decreasing along the layer's order (so a ranking across layers removes each layer's
    units in its greedy order); every query head of a group gets the group's score. Larger: more important —
    :func:`headkit.recipes.prune_plan.plan_pruning` then allocates the budget across layers by these increments.
    ``weighting``: "relative" scores the error relative to the layer's attention-output energy E‖W_O h‖²;
    "absolute" leaves it in the units of the residual stream; "loss" (statistics from ``output_statistics(...,
    gradients=True)``) weighs each token's error by the loss's gradient there, Σ_t (g_tᵀ Δ h_t)² with
    Δ = [W' on K, 0 on R] − W_O — twice the second-order estimate of the loss increase the repaired removal
    causes, the Hessian replaced by the empirical Fisher (as :func:`fisher_weighted_error`), in the loss's units,
    so it compares across layers too. On SmolLM2 (one key/value group per layer removed, held-out perplexity
    after the repair) it chose groups worth 1.31× against the relative error's 1.52×, and its
    Kronecker-factored form tr(E[g gᵀ] Δ E[h hᵀ] Δᵀ), which drops how g and h vary together, 1.53×
    (docs/pruning.md)."""
    if unit not in ("query", "group"):
        raise HeadkitError(f"unit must be 'query' or 'group', got {unit!r}")
    if weighting not in WEIGHTINGS:
        raise HeadkitError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    if weighting == "loss" and not all(stats.has_loss_samples for stats in statistics):
        raise HeadkitError(
            "weighting='loss' needs statistics with the loss's gradients: output_statistics(..., gradients=True)"
        )
    scores: list[torch.Tensor] = []
    for stats, kv in zip(statistics, kv_of_query, strict=True):
        heads = len(kv)
        units = (
            [[h] for h in range(heads)]
            if unit == "query"
            else [[h for h in range(heads) if kv[h] == group] for group in sorted(set(kv))]
        )
        energy = 1.0
        if (
            weighting == "loss"
        ):  # one layer's samples in memory at a time, as stored (bfloat16 from the files)
            samples = stats.loss_samples()
        if weighting == "absolute":
            energy = float(torch.einsum("oi,ij,oj->", stats.weight, stats.gram, stats.weight)) / max(
                stats.tokens, 1
            )
        removed: list[int] = []
        previous, increment = 0.0, 0.0
        layer_scores = torch.zeros(heads, dtype=torch.float64)
        remaining = list(range(len(units)))
        while remaining:
            best = None
            for candidate in remaining:
                gone = set(removed) | set(units[candidate])
                kept = [h for h in range(heads) if h not in gone]
                if weighting == "loss":
                    error = _loss_weighted_error(stats, kept, ridge, samples)
                else:
                    error = refit_weight(stats, kept, ridge)[2] if kept else 1.0
                if best is None or error < best[1]:
                    best = (candidate, error)
            candidate, error = best
            increment = max(increment, (error - previous) * energy)
            layer_scores[units[candidate]] = increment
            previous = error
            removed += units[candidate]
            remaining.remove(candidate)
        scores.append(layer_scores)
    return scores


def _loss_weighted_error(
    statistics: OutputStatistics,
    kept_heads: list[int],
    ridge: float,
    samples: tuple[torch.Tensor, torch.Tensor],
) -> float:
    """Σ_t (g_tᵀ Δ h_t)² for the repair that keeps `kept_heads` (none: the layer's whole output lost). With
    W' = W_K + W_R X, Δ h = W_R (X h_K − h_R), so g_tᵀ Δ h_t = u_R·(X h_K − h_R) with u = W_Oᵀ g the gradient with
    respect to h: |K|·|R| products per token instead of the projection's out·in."""
    kept, removed = _split_columns(statistics, kept_heads)
    coefficients = _refit_coefficients(
        statistics.gram / max(statistics.tokens, 1), kept, removed, ridge
    ).float()
    total = torch.zeros((), dtype=torch.float64)
    # A slice of tokens at a time, in float32: the products' copies are a slice's, not the calibration's (SmolLM2,
    # 32,768 tokens: 75 MB each); the sum is the same.
    for activations, gradients in zip(*(t.split(SCORE_TOKENS) for t in samples), strict=True):
        activations = activations.float()
        residual = activations[:, kept] @ coefficients - activations[:, removed]
        per_token = (gradients[:, removed].float() * residual).sum(-1)
        total += per_token.double().pow(2).sum()
    return float(total)


@torch.no_grad()
def refit_output_projections(
    model: nn.Module,
    statistics: list[OutputStatistics],
    removed: Mapping[int, Iterable[int]],
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ridge: float = RIDGE,
) -> RepairReport:
    """Refit, in place, the output projection of every layer of `model` (pruned by ``prune_heads(model,
    removed)``) that lost some but not all of its heads, from the original's `statistics`
    (:func:`output_statistics`). `removed`: ``{layer: [query heads removed]}``, as given to ``prune_heads``."""
    started = time.perf_counter()
    adapter = get_adapter(model, adapter)
    sites = adapter.sites(model)
    if len(sites) != len(statistics):
        raise HeadkitError(
            f"statistics must hold one entry per attention layer ({len(sites)}), got {len(statistics)}"
        )
    report = RepairReport(tokens=statistics[0].tokens if statistics else 0)
    for layer, heads in sorted(removed.items()):
        stats = statistics[layer]
        total = stats.gram.shape[0] // stats.head_dim
        gone = set(heads)
        kept = [h for h in range(total) if h not in gone]
        if not gone or not kept:
            continue  # untouched, or emptied: no projection left to refit
        weight, bias = linear_parameters(sites[layer].output_projection)
        # A projection with a bias (BERT, GPT-2, GPT-NeoX, …) absorbs the removed heads' mean output in it.
        intercept = bias is not None and stats.total is not None
        refit, sliced, error = refit_weight(stats, kept, ridge, intercept=intercept)
        if tuple(weight.shape) != tuple(refit.shape):
            raise HeadkitError(
                f"layer {layer}: the pruned output projection reads {weight.shape[1]} features, but the kept heads "
                f"{kept} give {refit.shape[1]}"
            )
        weight.copy_(refit.to(weight.dtype))  # a view of the module's own weight (a Conv1D's transposed)
        if intercept:
            bias.add_(bias_shift(stats, kept, refit).to(bias.dtype))
        report.layers.append(layer)
        report.error_sliced.append(sliced)
        report.error_refit.append(error)
    report.seconds = time.perf_counter() - started
    return report


class _Captured(Exception):
    """Raised by a hook once it has what it needs: the rest of the forward is not run."""


def _inputs_at(model: nn.Module, projection: nn.Module, batches: list[Mapping[str, Any]]) -> torch.Tensor:
    """The inputs [tokens, features] of `projection` over `batches`, running `model` only up to it."""
    chunks: list[torch.Tensor] = []

    real: list[torch.Tensor | None] = [None]

    def capture(module: nn.Module, args: tuple) -> None:
        rows = args[0].detach().reshape(-1, args[0].shape[-1])
        # Padding slots (texts of unequal length) say nothing the model is asked: only real tokens are fitted.
        chunks.append(rows if real[0] is None else rows[real[0].reshape(-1)])
        raise _Captured

    handle = projection.register_forward_pre_hook(capture)
    try:
        for batch in batches:
            try:
                _run_hooked(model, [], [batch], real)
            except _Captured:
                pass
    finally:  # any other error leaves the model without the hook
        handle.remove()
    if not chunks:
        raise HeadkitError("calibration needs at least one batch of text, got none")
    return torch.cat(chunks)


@torch.no_grad()
def refit_sequentially(
    model: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    removed: Mapping[int, Iterable[int]],
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    ridge: float = RIDGE,
) -> RepairReport:
    """Like :func:`refit_output_projections`, but each layer, in order, is fitted on the inputs the *pruned*
    model gives it (the layers before it already pruned and refit) against the original's output at that layer:
    W' = argmin E‖W h_s − W_O h_t‖² + λ‖W − W_K‖² = (W_O C + λ W_K)(G_s + λI)⁻¹ with G_s = E[h_s h_sᵀ],
    C = E[h_t h_sᵀ] — the fit sees the distribution the pruned model runs on (mask tuning's setting, Kwon et al.
    2022), at the cost of one partial forward of each model per repaired layer."""
    started = time.perf_counter()
    batches = list(batches)
    adapter = get_adapter(model, adapter)
    sites, teacher_sites = adapter.sites(model), adapter.sites(teacher)
    if len(sites) != len(teacher_sites):
        raise HeadkitError(
            f"teacher must have the model's {len(sites)} attention layers, got {len(teacher_sites)}"
        )
    report = RepairReport()
    for layer, heads in sorted(removed.items()):
        site, original = sites[layer], teacher_sites[layer]
        gone = set(heads)
        kept = [h for h in range(original.num_heads) if h not in gone]
        if not gone or not kept:
            continue
        target_weight, target_bias = linear_parameters(original.output_projection)
        target = _inputs_at(teacher, original.output_projection, batches).double() @ target_weight.double().T
        inputs = _inputs_at(model, site.output_projection, batches).double()
        weight, bias = linear_parameters(site.output_projection)
        sliced = weight.double()
        if bias is not None:  # an intercept: the bias is fitted with the weight (a column of ones)
            if target_bias is not None:
                target = target + target_bias.double()
            inputs = torch.cat([inputs, inputs.new_ones(inputs.shape[0], 1)], dim=1)
            sliced = torch.cat([sliced, bias.double()[:, None]], dim=1)
        gram = inputs.T @ inputs
        damping = ridge * float(gram.diagonal().mean())
        # (W_O C + λ W_K)(G_s + λI)⁻¹: the same pull towards the sliced projection as the one-pass fit
        damped = gram + damping * torch.eye(gram.shape[0], dtype=gram.dtype)
        refit = torch.linalg.solve(damped, inputs.T @ target + damping * sliced.T).T
        energy = target.pow(2).sum().clamp_min(1e-300)
        report.error_sliced.append(float((inputs @ sliced.T - target).pow(2).sum() / energy))
        report.error_refit.append(float((inputs @ refit.T - target).pow(2).sum() / energy))
        if bias is not None:
            refit, new_bias = refit[:, :-1], refit[:, -1]
            bias.copy_(new_bias.to(bias.dtype))
        weight.copy_(refit.to(weight.dtype))
        report.layers.append(layer)
        report.tokens = inputs.shape[0]
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class ReconstructionReport(_LayerwiseReport):
    """What :func:`reconstruct_attention` did: per layer, the relative error E‖f'(x) − f(x)‖² / E‖f(x)‖² of the
    converted attention's output f' against the original's f, on the original's own inputs x from held-out
    calibration windows, before and after the fit. A layer whose fit made that error worse (or not finite) is
    restored and listed in `skipped`."""

    error_before: list[float] = field(default_factory=list)
    error_after: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    steps: int = 0
    lr: float = 0.0
    precision: str = ""  # the dtype the fit's products computed in

    def __str__(self) -> str:
        if not self.layers:
            return "layer-local reconstruction: no layer to fit"
        before, after = self.mean(self.error_before), self.mean(self.error_after)
        skipped = (
            f"; {len(self.skipped)} layers kept as converted (the fit did not help)" if self.skipped else ""
        )
        return (
            f"layer-local reconstruction: {len(self.layers)} attention layers, {self.steps} steps each on "
            f"{self.tokens:,} tokens of the original's inputs ({self.precision}), in {self.seconds:.1f} s; "
            f"held-out error {before:.3g} -> {after:.3g} (mean){skipped}"
        )


@dataclass
class AttentionCallRecord:
    """One call of an attention module in the original model: its arguments and its output; with
    ``gradients=True``, also the gradient of the summed next-token loss with respect to that output."""

    args: tuple
    kwargs: dict[str, Any]
    output: torch.Tensor
    gradient: torch.Tensor | None = None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` (tensors in nested tuples, lists and dicts: a call's arguments) with `fn` applied to each tensor."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    return value


def _detached(value: Any) -> Any:
    return _map_tensors(value, torch.Tensor.detach)


def capture_attention_calls(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    layers: Iterable[int],
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    *,
    gradients: bool = False,
    stop_after_last: bool = False,
) -> dict[int, list[AttentionCallRecord]]:
    """Run `model` once over `batches` and keep, for each of `layers`, every call of its attention module (the
    hidden states, rotary embeddings and mask it was given, and what it returned).

    `stop_after_last` (without `gradients`): each forward stops once the last of `layers` has run — what comes
    after it (later layers, the LM head's logits) is not computed. Layers run in their index order.

    `gradients` (a causal LM): also back-propagate the batches' summed next-token cross-entropy and keep, per
    call, its gradient with respect to the attention output — what :func:`fisher_weighted_error` weighs an
    output's error by. No parameter gradient is computed, and the model's ``requires_grad`` flags are restored."""
    adapter = get_adapter(model, adapter)
    sites = adapter.sites(model)
    calls: dict[int, list[AttentionCallRecord]] = {index: [] for index in layers}
    last = max(calls, default=None)

    def hook(index: int):
        def keep(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            result = output[0] if isinstance(output, tuple) else output
            record = AttentionCallRecord(_detached(args), _detached(kwargs), result.detach())
            calls[index].append(record)
            if gradients and result.requires_grad:
                result.register_hook(lambda gradient: setattr(record, "gradient", gradient.detach()))
            elif stop_after_last and index == last:
                raise _Captured

        return keep

    head = _next_token_head(model) if gradients else None  # before the hooks: its check reaches none of them
    handles = [sites[i].module.register_forward_hook(hook(i), with_kwargs=True) for i in calls]
    if gradients:
        _run_backward(model, handles, batches, head=head)
    else:
        with torch.no_grad():
            _run_hooked(model, handles, batches)
    if calls and not next(iter(calls.values())):
        raise HeadkitError("calibration needs at least one batch of text, got none")
    return calls


def linear_head(model: nn.Module) -> tuple[nn.Linear, float | None] | None:
    """`model`'s LM head when it is an nn.Linear (``get_output_embeddings()``), with its logits' soft-cap (Gemma
    2/3's ``final_logit_softcapping``, None without); None for any other head. What computing a loss from the
    head's input in chunks needs — each caller checks it against the model's own output first."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return head, getattr(text, "final_logit_softcapping", None) or None


def _next_token_head(model: nn.Module) -> tuple[nn.Linear, float | None] | None:
    """The LM head of `model` and its logits' soft-cap (Gemma 2/3's ``final_logit_softcapping``) when the model's
    own next-token loss is the cross-entropy of ``cap·tanh(head(h)/cap)`` (or plain ``head(h)``) on the head's
    input h — checked on a few tokens against the model's own loss — so that :func:`_run_backward` can compute it
    in chunks; None otherwise (the model's own loss is used, logits whole)."""
    found = linear_head(model)
    if found is None:
        return None
    head, softcap = found
    ids = (torch.arange(2, 10)[None] % head.out_features).to(head.weight.device)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids, use_cache=False).loss
        hidden = lm_head_input(model, head, {"input_ids": ids})
        got = chunked_cross_entropy(
            hidden[0, :-1], head.weight, ids[0, 1:], bias=head.bias, softcap=softcap, chunk=3
        ) / (ids.shape[1] - 1)
    tolerance = 1e-4 if head.weight.dtype == torch.float32 or head.weight.dtype == torch.float64 else 2e-2
    if expected is None or not torch.isclose(got, expected.float(), rtol=tolerance, atol=tolerance):
        return None
    return head, softcap


def lm_head_input(model: nn.Module, head: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The LM head's input [B, T, hidden] (the last hidden states, after the final norm) for `inputs`, the
    forward stopped at the head: no logits are computed. Differentiable where grad is enabled (the recovery's
    chunked distillation, headkit.runs.objectives, reads it too)."""
    captured: list[torch.Tensor] = []

    def capture(module: nn.Module, args: tuple) -> None:
        captured.append(args[0])
        raise _Captured

    handle = head.register_forward_pre_hook(capture)
    try:
        model(**inputs, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise HeadkitError(f"{type(model).__name__}'s forward never reached its LM head")
    return captured[0]


def _run_backward(
    model: nn.Module,
    handles: list[Any],
    batches: Iterable[Mapping[str, Any]],
    real: list[torch.Tensor | None] | None = None,
    *,
    head: tuple[nn.Linear, float | None] | None = None,
) -> None:
    """Run `model` over `batches` and back-propagate each batch's summed next-token cross-entropy (padding slots
    excluded) to the activations only, then remove the hooks `handles`; parameters' flags restored, also on
    error. `real`: as :func:`_run_hooked`'s. Each batch runs in slices of whole rows (:data:`PASS_TOKENS` tokens),
    and with `head` (:func:`_next_token_head`, found by the caller before its hooks were registered, so that its
    check's few tokens reach none of them) the loss is computed from the head's input a chunk of tokens at a time
    (:func:`chunked_cross_entropy`): the gradients are the plain loss's, without [tokens, vocabulary] logits and
    their gradient held whole. Without it, the model's own loss."""
    flags = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    model.requires_grad_(False)
    found = head
    # The graph starts at the embeddings' output, so that no parameter needs a gradient.
    handles = [
        *handles,
        model.get_input_embeddings().register_forward_hook(
            lambda m, a, out: out.detach().requires_grad_(True)
        ),
    ]
    try:
        with torch.enable_grad():
            for batch in batches:
                for inputs in _slices(batch):
                    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
                    if real is not None:
                        real[0] = _real_tokens(mask)
                    labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
                    if found is None:
                        # The model's own loss (shifted, padding ignored) is the mean: times the tokens, the sum.
                        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
                        loss = loss * (labels[:, 1:] != IGNORE_INDEX).sum()
                    else:
                        head, softcap = found
                        hidden = lm_head_input(model, head, {"input_ids": ids, "attention_mask": mask})
                        loss = chunked_cross_entropy(
                            hidden[:, :-1].reshape(-1, hidden.shape[-1]),
                            head.weight,
                            labels[:, 1:].reshape(-1),
                            bias=head.bias,
                            softcap=softcap,
                        )
                    loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(flags[name])


def _relative_error(module: nn.Module, calls: list[AttentionCallRecord]) -> float:
    with torch.no_grad():
        error = sum(
            float(F.mse_loss(_output(module, c).float(), c.output.float(), reduction="sum")) for c in calls
        )
        energy = sum(float(c.output.float().pow(2).sum()) for c in calls)
    return error / max(energy, 1e-30)


def fisher_weighted_error(module: nn.Module, calls: list[AttentionCallRecord]) -> float:
    """Σ_t (g_tᵀ (f'(x_t) − f(x_t)))²: the error of `module`'s attention output f' against the original's f on the
    recorded calls, weighted by the recorded loss gradients g (``gradients=True``). Half of it is the
    second-order estimate of the loss increase the error causes, with the Hessian replaced by the empirical
    Fisher E[g gᵀ] (Fisher pruning: Theis et al. 2018, "Faster gaze prediction with dense networks and Fisher
    pruning"; the squared Taylor term of Molchanov et al. 2019, "Importance Estimation for Neural Network
    Pruning"), one perturbation per token. Unlike an error relative to each layer's own output, it is in the
    loss's units, so layers compare."""
    if any(call.gradient is None for call in calls):
        raise HeadkitError("fisher_weighted_error needs calls captured with gradients=True")
    with torch.no_grad():
        return sum(
            float(((_output(module, c).float() - c.output.float()) * c.gradient.float()).sum(-1).pow(2).sum())
            for c in calls
        )


def _output(module: nn.Module, call: AttentionCallRecord) -> torch.Tensor:
    output = module(*call.args, **call.kwargs)
    return output[0] if isinstance(output, tuple) else output


def reconstruct_attention(
    student: nn.Module,
    teacher: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    held_out: Iterable[Mapping[str, Any]],
    layers: Iterable[int] | None = None,
    *,
    trainable: Callable[[str], bool] | None = None,
    steps: int = 100,
    lr: float = 1e-3,
    precision: torch.dtype | None = None,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
    capture_bytes: int = CAPTURE_BYTES,
) -> ReconstructionReport:
    """Fit, in place, each converted attention layer of `student` to reproduce the original's attention output
    from the original's own inputs (mean-squared error, relative to the output's energy): LoLCATs' attention
    transfer (Zhang et al. 2025, "LoLCATs", §3.1) as a repair any surgery can run before training through the
    model.

    Passes of `teacher` over `batches` capture the layers' inputs and outputs, as many layers a pass as
    `capture_bytes` holds (the first pass captures one layer and measures it; each pass stops after its last
    layer); each layer then trains alone on them (Adam, cosine decay over `steps`, one captured batch a step), so
    no gradient crosses layers and the student's forward never runs. It is a per-layer fit on cached activations,
    like the least-squares refit above, not a training of the model: that is why it does not go through 🤗
    Trainer.

    Args:
        student: the converted model; its attention modules are found by the teacher's module names, so a
            surgery may replace their projections.
        teacher: the original, untouched.
        batches: calibration windows (model inputs without padding) to fit on; `held_out` windows to judge the
            fit: a layer whose held-out error rises (or is not finite) gets its parameters back.
        layers: the layers to fit (default: all).
        trainable: which of a layer's attention parameters train, by their name inside the attention module
            (default: all of them).
        precision: ``torch.bfloat16`` or ``torch.float16``: the fit's forward and backward compute their
            products in it, under :func:`torch.autocast` (mixed precision: Micikevicius et al. 2018); the
            parameters, Adam's moments and updates, the loss and the held-out judgement stay in the parameters'
            dtype. On a CPU with AVX-512 BF16 a step takes 0.57x float32's. None: the parameters' dtype.
        capture_bytes: the most bytes of captured inputs and outputs held at once (:data:`CAPTURE_BYTES`); the
            fit is the same whatever it is, a smaller one costs more (partial) passes of `teacher`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HeadkitError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise HeadkitError(f"lr must be a positive number, got {lr!r}")
    if precision not in (None, torch.bfloat16, torch.float16):
        raise HeadkitError(f"precision must be torch.bfloat16, torch.float16 or None, got {precision!r}")
    if isinstance(capture_bytes, bool) or not isinstance(capture_bytes, int) or capture_bytes < 1:
        raise HeadkitError(f"capture_bytes must be a positive integer, got {capture_bytes!r}")
    started = time.perf_counter()
    adapter = get_adapter(teacher, adapter)
    sites = adapter.sites(teacher)
    layers = list(range(len(sites))) if layers is None else sorted(set(layers))
    if any(not 0 <= layer < len(sites) for layer in layers):
        raise HeadkitError(f"layers must be in [0, {len(sites) - 1}], got {layers}")
    try:
        modules = {layer: student.get_submodule(sites[layer].name) for layer in layers}
    except AttributeError as error:
        raise HeadkitError(
            f"student must be a converted copy of teacher, with its attention modules: {error}"
        ) from None
    batches, held_out = list(batches), list(held_out)
    computed_in = precision or next(student.parameters()).dtype
    report = ReconstructionReport(
        steps=steps, lr=float(lr), precision=str(computed_in).removeprefix("torch.")
    )
    requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
    student.requires_grad_(False)
    try:
        for layer, train_calls, check_calls in _captured_in_groups(
            teacher, batches, held_out, layers, adapter, capture_bytes
        ):
            if not report.tokens:
                report.tokens = sum(call.output.shape[:-1].numel() for call in train_calls)
            module = modules[layer]
            parameters = [p for name, p in module.named_parameters() if trainable is None or trainable(name)]
            before = _relative_error(module, check_calls)
            after = before
            if parameters:
                saved = [p.detach().clone() for p in parameters]
                _fit(module, parameters, train_calls, steps, lr, precision)
                after = _relative_error(module, check_calls)
                if not after < before:  # worse, or NaN: the converted layer stays as it was
                    with torch.no_grad():
                        for parameter, value in zip(parameters, saved, strict=True):
                            parameter.copy_(value)
                    report.skipped.append(layer)
                    after = before
            report.layers.append(layer)
            report.error_before.append(before)
            report.error_after.append(after)
    finally:
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(requires_grad.get(name, False))
    report.seconds = time.perf_counter() - started
    return report


def _captured_in_groups(
    teacher: nn.Module,
    batches: list[Mapping[str, Any]],
    held_out: list[Mapping[str, Any]],
    layers: list[int],
    adapter: AttentionAdapter,
    capture_bytes: int,
) -> Iterable[tuple[int, list[AttentionCallRecord], list[AttentionCallRecord]]]:
    """(layer, its calls on `batches`, its calls on `held_out`) for each of `layers` in order, captured a group of
    layers a pass: one layer first, whose calls measure what a layer holds, then as many as `capture_bytes` takes.
    A group's calls are released as its layers are handed out."""
    remaining, size = list(layers), 1
    while remaining:
        group, remaining = remaining[:size], remaining[size:]
        train = capture_attention_calls(teacher, batches, group, adapter, stop_after_last=True)
        check = capture_attention_calls(teacher, held_out, group, adapter, stop_after_last=True)
        if size == 1 and remaining:
            held = _records_bytes(train[group[0]]) + _records_bytes(check[group[0]])
            size = max(1, capture_bytes // max(held, 1))
        for layer in group:
            yield layer, train.pop(layer), check.pop(layer)


def _records_bytes(records: list[AttentionCallRecord]) -> int:
    """Bytes of the tensors `records` hold, each storage once (the rotary tables are shared by every layer)."""
    storages: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> None:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    for record in records:
        _map_tensors((record.args, record.kwargs, record.output, record.gradient), count)
    return sum(storages.values())


def _fit(
    module: nn.Module,
    parameters: list[nn.Parameter],
    calls: list[AttentionCallRecord],
    steps: int,
    lr: float,
    precision: torch.dtype | None = None,
) -> None:
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(parameters, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    device = parameters[0].device.type
    with torch.enable_grad():
        for step in range(steps):
            call = calls[step % len(calls)]
            target = call.output.float()
            with torch.autocast(device, dtype=precision, enabled=precision is not None):
                output = _output(module, call)
            loss = F.mse_loss(output.float(), target) / target.pow(2).mean().clamp_min(1e-30)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    for parameter in parameters:
        parameter.requires_grad_(False)


__all__ = [
    "AttentionCallRecord",
    "CAPTURE_BYTES",
    "OutputStatistics",
    "ReconstructionReport",
    "capture_attention_calls",
    "fisher_weighted_error",
    "reconstruct_attention",
    "RepairReport",
    "bias_shift",
    "output_statistics",
    "refit_output_projections",
    "refit_error_scores",
    "refit_sequentially",
    "refit_weight",
]
