"""Which attention heads matter: gradient-based importance and attention statistics, per layer and head.

* Importance (Michel, Levy & Neubig, "Are Sixteen Heads Really Better than One?", NeurIPS 2019, §4.1): put a
  mask ξ_h = 1 on every head's output (MultiHead = Concat_h(ξ_h · head_h) W^O) and take the
  expected sensitivity of the loss to it,

      I_h = E_x |∂L(x) / ∂ξ_h|,

  estimated as in their reference implementation: |∂L/∂ξ_h| of each batch's loss, summed over the batches.
  Their §4.1 normalises the scores of each layer by their L2 norm (layer-wise comparisons then do not depend on
  the layer's scale); the reference code also min–max scales all scores to [0, 1] (global normalisation).
* Confidence and entropy (Voita, Talbot, Moiseev, Sennrich & Titov, ACL 2019, define a head's "confidence" as
  the average of its maximum attention weight over tokens): per head, the mean over real query tokens of
  max_k p(k | q) and of −Σ_k p(k | q) log p(k | q) (in nats). Confident, low-entropy heads point at one
  token; Voita et al. found the heads that survive pruning to be mostly confident ones.

Layers are attention *sites* (:meth:`headkit.surgery.adapters.AttentionAdapter.sites`): the transformer layer
for every model except ALBERT, whose one shared module is one site (its statistics average over the layers
that run it, its importance sums over them). Layers may have different head counts (after pruning), so the
results are lists of per-layer tensors; :meth:`HeadImportance.matrix` pads them with NaN into [layers, heads].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.surgery.adapters import AttentionAdapter, AttentionSite, get_adapter
from headkit.surgery.attention import set_attention_implementation

LossFunction = Callable[[nn.Module, Any], torch.Tensor]
# Michel et al.'s reference code adds this to the layer norm so that a layer whose heads all score 0 stays 0.
_NORM_EPSILON = 1e-20


@dataclass
class HeadImportance:
    """Per-layer, per-head scores of one model (see the module docstring).

    Attributes:
        layers: for each attention site, the transformer layers that run it.
        importance: gradient importance per site [heads], after the requested normalisations.
        raw_importance: Σ_batches |∂L/∂ξ_h| per site [heads], before normalisation.
        confidence, entropy: per site [heads] (None when not computed).
        num_batches: batches the scores were accumulated over.
    """

    layers: list[tuple[int, ...]]
    importance: list[torch.Tensor]
    raw_importance: list[torch.Tensor]
    confidence: list[torch.Tensor] | None
    entropy: list[torch.Tensor] | None
    num_batches: int

    def matrix(self, kind: str = "importance") -> torch.Tensor:
        """One score as a [layers, max heads] float tensor; NaN where a layer has fewer heads."""
        per_layer = {
            "importance": self.importance,
            "raw_importance": self.raw_importance,
            "confidence": self.confidence,
            "entropy": self.entropy,
        }
        if kind not in per_layer:
            raise HeadkitError(f"kind must be one of {sorted(per_layer)}, got {kind!r}")
        if per_layer[kind] is None:
            raise HeadkitError(f"{kind} was not computed (head_importance(..., attention_stats=True))")
        return pad_to_matrix(per_layer[kind])

    def pruning_plan(self, heads_to_keep: int, *, allow_empty_layers: bool = False) -> dict[int, list[int]]:
        """``{layer: [heads to remove]}`` keeping the `heads_to_keep` most important heads overall (Michel et al.
        prune by ascending importance), for :func:`headkit.prune_heads`. Unless `allow_empty_layers`, the
        best head of each layer is kept whatever its score, so no layer is emptied."""
        total = sum(len(scores) for scores in self.importance)
        minimum = 0 if allow_empty_layers else sum(1 for scores in self.importance if len(scores))
        if isinstance(heads_to_keep, bool) or not isinstance(heads_to_keep, int):
            raise HeadkitError(f"heads_to_keep must be an int, got {heads_to_keep!r}")
        if not minimum <= heads_to_keep <= total:
            raise HeadkitError(
                f"heads_to_keep must be in [{minimum}, {total}] (one head per layer is kept unless "
                f"allow_empty_layers=True), got {heads_to_keep}"
            )
        protected = set()
        if not allow_empty_layers:
            protected = {
                (layer, int(scores.argmax())) for layer, scores in enumerate(self.importance) if len(scores)
            }
        # Ascending importance; ties broken by position so that the plan is deterministic.
        candidates = sorted(
            (float(score), layer, head)
            for layer, scores in enumerate(self.importance)
            for head, score in enumerate(scores.tolist())
            if (layer, head) not in protected
        )
        plan: dict[int, list[int]] = {}
        for _, layer, head in candidates[: total - heads_to_keep]:
            plan.setdefault(layer, []).append(head)
        return {layer: sorted(heads) for layer, heads in sorted(plan.items())}


def pad_to_matrix(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer vectors of possibly different lengths → [layers, longest] float tensor, NaN-padded."""
    width = max((len(values) for values in per_layer), default=0)
    matrix = torch.full((len(per_layer), width), float("nan"))
    for layer, values in enumerate(per_layer):
        matrix[layer, : len(values)] = values.detach().float().cpu()
    return matrix


# -- gradient importance ---------------------------------------------------------------------------------------


class _HeadMaskProbe:
    """Forward pre-hook on an output projection: multiplies head h's slice of its input by ξ_h."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def __call__(self, projection: nn.Module, args: tuple) -> tuple:
        heads = args[0]
        per_head = heads.unflatten(-1, (self.mask.shape[0], -1))
        scaled = per_head * self.mask.to(heads.dtype)[:, None]
        return (scaled.flatten(-2), *args[1:])


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss``: the loss a 🤗 model computes itself when the batch holds labels."""
    if not isinstance(batch, Mapping):
        raise HeadkitError(
            f"without loss_fn, every batch must be a mapping of model inputs with labels, got {type(batch).__name__}"
        )
    loss = getattr(model(**batch), "loss", None)
    if loss is None:
        raise HeadkitError("the model returned no loss for this batch: add labels to it or pass loss_fn")
    return loss


def gradient_importance(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFunction | None = None,
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Σ over batches of |∂L/∂ξ_h| with every ξ_h = 1 (Michel et al. 2019, §4.1), per site [heads]; and the
    number of batches. The model's parameters get no gradient (``torch.autograd.grad`` on the masks only) and
    the model keeps its mode (evaluation mode gives the deterministic scores the paper reports)."""
    loss_fn = default_loss if loss_fn is None else loss_fn
    sites = get_adapter(model, adapter).sites(model)
    device = next(model.parameters()).device
    masks = [torch.ones(site.num_heads, device=device, requires_grad=True) for site in sites]
    totals = [torch.zeros(site.num_heads) for site in sites]
    handles = [
        site.output_projection.register_forward_pre_hook(_HeadMaskProbe(mask))
        for site, mask in zip(sites, masks, strict=True)
        if site.num_heads > 0
    ]
    probed = [index for index, site in enumerate(sites) if site.num_heads > 0]
    num_batches = 0
    try:
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise HeadkitError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
            gradients = torch.autograd.grad(loss, [masks[i] for i in probed], allow_unused=True)
            for index, gradient in zip(probed, gradients, strict=True):
                if gradient is not None:
                    totals[index] += gradient.detach().abs().float().cpu()
            num_batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if num_batches == 0:
        raise HeadkitError("batches must hold at least one batch, got an empty iterable")
    return totals, num_batches


def normalize_importance(
    raw: list[torch.Tensor], *, normalize_layers: bool = True, normalize_global: bool = True
) -> list[torch.Tensor]:
    """Michel et al.'s normalisations: each layer divided by its L2 norm (§4.1), then all scores min–max scaled
    to [0, 1] together (their reference code). Layers with no head stay empty."""
    scores = [values.clone().float() for values in raw]
    if normalize_layers:
        scores = [values / (values.norm(p=2) + _NORM_EPSILON) for values in scores]
    if normalize_global:
        flat = torch.cat(scores) if scores else torch.zeros(0)
        if flat.numel():
            low, high = flat.min(), flat.max()
            span = high - low
            scores = [(values - low) / span if span > 0 else torch.zeros_like(values) for values in scores]
    return scores


# -- attention statistics --------------------------------------------------------------------------------------


def attention_statistics(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-site (confidence [heads], entropy [heads]) averaged over the real query tokens of all batches
    (Voita et al. 2019). Batches are model inputs (``model(**batch, output_attentions=True)``); a batch's
    ``attention_mask`` [B, T] tells the real tokens. Models whose attention implementation returns no weights
    (sdpa) are switched to eager for the duration and switched back."""
    adapter = get_adapter(model, adapter)
    sites = adapter.sites(model)
    layer_to_site = {layer: site.index for site in sites for layer in site.layers}
    confidence_sums = [torch.zeros(site.num_heads, dtype=torch.float64) for site in sites]
    entropy_sums = [torch.zeros(site.num_heads, dtype=torch.float64) for site in sites]
    query_counts = [0.0 for _ in sites]
    previous_implementation = getattr(model.config, "_attn_implementation", None)
    switched = False
    try:
        with torch.no_grad():
            for batch in batches:
                if not isinstance(batch, Mapping):
                    raise HeadkitError(
                        f"batches must be mappings of model inputs, got {type(batch).__name__}"
                    )
                attentions = _attentions(model, batch, len(layer_to_site))
                if attentions is None and not switched and _can_switch_to_eager(model):
                    set_attention_implementation(model, "eager")
                    switched = True
                    attentions = _attentions(model, batch, len(layer_to_site))
                if attentions is None:
                    raise HeadkitError(
                        f"{type(model).__name__} returned no attention weights; load it with "
                        "attn_implementation='eager'"
                    )
                _accumulate(
                    attentions, batch, layer_to_site, sites, confidence_sums, entropy_sums, query_counts
                )
    finally:
        if switched:
            model.set_attn_implementation(previous_implementation)
    if not any(query_counts):
        raise HeadkitError("batches must hold at least one real token, got none")
    confidence = [
        (total / max(count, 1.0)).float() for total, count in zip(confidence_sums, query_counts, strict=True)
    ]
    entropy = [
        (total / max(count, 1.0)).float() for total, count in zip(entropy_sums, query_counts, strict=True)
    ]
    return confidence, entropy


def _attentions(
    model: nn.Module, batch: Mapping[str, Any], num_layers: int
) -> tuple[torch.Tensor, ...] | None:
    """The attention weights of every layer, or None when the implementation returns none for some layer (sdpa
    modules return None, which transformers' recorders leave out of the tuple)."""
    attentions = getattr(model(**batch, output_attentions=True), "attentions", None)
    if attentions is None or len(attentions) != num_layers or any(weights is None for weights in attentions):
        return None
    return tuple(attentions)


def _can_switch_to_eager(model: nn.Module) -> bool:
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return implementation not in (None, "eager") and hasattr(model, "set_attn_implementation")


def _accumulate(
    attentions: tuple[torch.Tensor, ...],
    batch: Mapping[str, Any],
    layer_to_site: dict[int, int],
    sites: list[AttentionSite],
    confidence_sums: list[torch.Tensor],
    entropy_sums: list[torch.Tensor],
    query_counts: list[float],
) -> None:
    for layer, weights in enumerate(attentions):
        site = layer_to_site[layer]
        batch_size, heads, q_len, _ = weights.shape
        if heads != sites[site].num_heads:
            raise HeadkitError(
                f"layer {layer} returned weights for {heads} heads, expected {sites[site].num_heads}"
            )
        real_queries = _real_queries(batch, batch_size, q_len, weights.device)  # [B, Tq]
        probabilities = weights.double()
        confidence = probabilities.amax(dim=-1)  # [B, H, Tq]
        entropy = -(probabilities * probabilities.clamp_min(1e-30).log()).sum(dim=-1)
        confidence_sums[site] += (confidence * real_queries[:, None]).sum(dim=(0, 2)).cpu()
        entropy_sums[site] += (entropy * real_queries[:, None]).sum(dim=(0, 2)).cpu()
        query_counts[site] += float(real_queries.sum())


def _real_queries(
    batch: Mapping[str, Any], batch_size: int, q_len: int, device: torch.device
) -> torch.Tensor:
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == (batch_size, q_len):
        return mask.to(device=device, dtype=torch.float64)
    return torch.ones(batch_size, q_len, dtype=torch.float64, device=device)


# -- both ------------------------------------------------------------------------------------------------------


def head_importance(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFunction | None = None,
    *,
    normalize_layers: bool = True,
    normalize_global: bool = True,
    attention_stats: bool = True,
    adapter: AttentionAdapter | type[AttentionAdapter] | str | None = None,
) -> HeadImportance:
    """Score every attention head of `model` on `batches`.

    Args:
        model: a supported 🤗 or headkit model (see :func:`headkit.surgery.adapters.get_adapter`); left as it was.
        batches: re-iterable batches (a list or a DataLoader; read once per measure).
        loss_fn: ``loss_fn(model, batch) -> scalar`` for the gradient importance; default ``model(**batch).loss``.
        normalize_layers: divide each layer's importance by its L2 norm (Michel et al. §4.1).
        normalize_global: then min–max scale all importances to [0, 1].
        attention_stats: also compute Voita et al.'s confidence and the attention entropy (batches must then
            be mappings of model inputs).

    Returns:
        a :class:`HeadImportance`.
    """
    if iter(batches) is batches:
        raise HeadkitError("batches must be re-iterable (a list or a DataLoader), not a one-shot iterator")
    adapter = get_adapter(model, adapter)
    sites = adapter.sites(model)
    raw, num_batches = gradient_importance(model, batches, loss_fn, adapter=adapter)
    confidence = entropy = None
    if attention_stats:
        confidence, entropy = attention_statistics(model, batches, adapter=adapter)
    return HeadImportance(
        layers=[site.layers for site in sites],
        importance=normalize_importance(
            raw, normalize_layers=normalize_layers, normalize_global=normalize_global
        ),
        raw_importance=raw,
        confidence=confidence,
        entropy=entropy,
        num_batches=num_batches,
    )
