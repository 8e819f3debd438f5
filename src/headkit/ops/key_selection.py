"""Which prompt keys the question asks for: the observation-window score of SnapKV.

SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469, §4.2)
observes that the last queries of a prompt (the *observation window*, where the question is) attend to the same
few earlier keys that generation will attend to. It scores every key j of the prompt by the attention those
queries give it, summed over the window and pooled over a small neighbourhood of positions so that a kept key
keeps its context (eq. 1–2 of §4.2; pooling as in the paper's code and NVIDIA's kvpress ``SnapKVPress``):

    s_hj = Σ_{i ∈ window} Σ_{g ∈ group(h)} softmax_j(q_gi · k_hj · scale)       (causal: j ≤ i; padding excluded)
    score_hj = average of s_h over positions j − ⌊K/2⌋ … j + ⌊K/2⌋                 (K = ``kernel``, zeros beyond)

One score per key/value head: the group's query heads are summed, as a key/value head serves all of them.

:func:`observation_scores` never forms the T × T matrix, nor even window × T at once: it scans the keys in chunks
twice (the log-sum-exp of each window query, then the normalised mass), O(window · chunk) memory.
:func:`naive_observation_scores` is its test reference: the softmax rows written out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headkit.ops._precision import autocast_disabled
from headkit.ops._validation import check_positive_int

# How a sparse cache's exact keys are chosen (headkit.layers.kept_exact's selections, each under its name):
# "recall" online by how badly the linear state recalls them (LoLA), "question" by a prompt's last queries (SnapKV),
# "reconstruction" by the queries of the prompt repeated after itself (KVzip).
RECALL, QUESTION, RECONSTRUCTION = "recall", "question", "reconstruction"
SELECTION_NAMES: tuple[str, ...] = (RECALL, QUESTION, RECONSTRUCTION)

# The pooling neighbourhood of SnapKV's code and of kvpress' SnapKVPress (5 positions).
DEFAULT_KERNEL = 5
# How a key's weights from the voting queries combine: summed (SnapKV) or their largest (KVzip's statistic).
SUM, MAX = "sum", "max"
REDUCTIONS: tuple[str, ...] = (SUM, MAX)


def observation_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    observation: int,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: int = DEFAULT_KERNEL,
    chunk_size: int = 1024,
    past_keys: torch.Tensor | None = None,
    past_mask: torch.Tensor | None = None,
    reduction: str = SUM,
) -> torch.Tensor:
    """SnapKV scores of every key (module docstring), [B, Hkv, T] float32 (float64 for float64 inputs).

    Args:
        q: [B, H, T, D] the queries of the same T positions as the keys (only the last ``observation`` are read).
        k: [B, Hkv, T, D] keys, H a multiple of Hkv (grouped-query attention).
        observation: the window of last queries that vote, ≥ 1 (the whole prompt when it is shorter).
        attention_mask: [B, T] bool/0-1, True for real tokens; a padded key gets no mass and a padded query no
            vote.
        kernel: odd pooling width ≥ 1 (1: no pooling).
        chunk_size: keys per chunk (memory only).
        past_keys, past_mask: [B, Hkv, P, D] and [B, Hkv, P] bool, keys a cache already holds, which every
            voter also sees (a later turn appended to a cache). They share each voter's softmax and get no
            score: the T new keys score the weight the voters give them beside the stored ones, the weight a
            prompt prefilled into an empty cache scores — so a later turn's keys rank against the stored keys'
            scores on one scale, rather than on a softmax over their own call alone, which made them outrank
            every stored key.
        reduction: how a key's weights from the window's queries (and the group's query heads) combine before
            pooling: ``"sum"`` (SnapKV's eq. 1) or ``"max"``, the most any of them gives it — the statistic of
            :func:`reconstruction_scores`, so that keys scored by a later turn rank on the scale of keys a
            repetition scored (KVzip's cache, continued by a later turn).
    """
    batch, q_heads, seq, dim = _check(q, k, observation, attention_mask, kernel, reduction)
    check_positive_int("chunk_size", chunk_size)
    past = _check_past(past_keys, past_mask, k)
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    window = min(observation, seq)
    keep = _keep(attention_mask, batch, seq, q.device)
    with torch.no_grad(), autocast_disabled(q.device):
        voters = q[:, :, seq - window :].to(dtype).reshape(batch, kv_heads, groups * window, dim)
        positions = torch.arange(seq - window, seq, device=q.device).repeat(groups)  # [G·window]
        voting = keep[:, seq - window :].repeat(1, groups)  # [B, G·window]

        def logits(start: int, stop: int) -> torch.Tensor:  # [B, Hkv, G·window, stop − start]
            block = (voters @ k[:, :, start:stop].to(dtype).transpose(-1, -2)) * scale
            columns = torch.arange(start, stop, device=q.device)
            visible = (columns <= positions[:, None])[None] & keep[:, None, start:stop]  # [B, G·window, C]
            return block.masked_fill(~visible[:, None], float("-inf"))

        chunks = [(start, min(start + chunk_size, seq)) for start in range(0, seq, chunk_size)]
        peak = torch.full((batch, kv_heads, groups * window, 1), float("-inf"), dtype=dtype, device=q.device)
        for start, stop in chunks:
            peak = torch.maximum(peak, logits(start, stop).amax(dim=-1, keepdim=True))
        if past is not None:
            stored = (voters @ past[0].to(dtype).transpose(-1, -2)) * scale  # [B, Hkv, G·window, P]
            stored = stored.masked_fill(~past[1][:, :, None, :], float("-inf"))
            peak = torch.maximum(peak, stored.amax(dim=-1, keepdim=True))
        peak = peak.masked_fill(~torch.isfinite(peak), 0.0)
        total = torch.zeros_like(peak)
        if past is not None:
            total += torch.exp(stored - peak).sum(dim=-1, keepdim=True)
        for start, stop in chunks:
            total += torch.exp(logits(start, stop) - peak).sum(dim=-1, keepdim=True)
        weight = voting[:, None, :, None].to(dtype) / total.clamp_min(torch.finfo(dtype).tiny)
        # a voter that does not vote has weight 0: its weights are all 0, below or equal to any voter's
        combine = torch.sum if reduction == SUM else torch.amax
        scores = torch.cat(
            [combine(torch.exp(logits(start, stop) - peak) * weight, dim=2) for start, stop in chunks], dim=-1
        )
        return _pooled(scores, kernel)


def naive_observation_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    observation: int,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: int = DEFAULT_KERNEL,
    past_keys: torch.Tensor | None = None,
    past_mask: torch.Tensor | None = None,
    reduction: str = SUM,
) -> torch.Tensor:
    """Test reference of :func:`observation_scores`: every window query's softmax row over the stored keys and
    all T keys, per query head, then the new keys' part summed (or its largest taken) per key/value head and
    pooled with an explicit loop."""
    batch, q_heads, seq, dim = _check(q, k, observation, attention_mask, kernel, reduction)
    past = _check_past(past_keys, past_mask, k)
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    keep = _keep(attention_mask, batch, seq, q.device)
    window = min(observation, seq)
    dtype = torch.float64
    sums = torch.zeros(batch, kv_heads, seq, dtype=dtype)
    for b in range(batch):
        for head in range(q_heads):
            h = head // groups
            for i in range(seq - window, seq):
                if not keep[b, i]:
                    continue
                visible = [j for j in range(i + 1) if keep[b, j]]
                stored = [] if past is None else [p for p in range(past[0].shape[2]) if past[1][b, h, p]]
                rows = [] if past is None else [past[0][b, h, stored].to(dtype)]
                row = (torch.cat([*rows, k[b, h, visible].to(dtype)]) @ q[b, head, i].to(dtype)) * scale
                weights = torch.softmax(row, dim=0)[len(stored) :]
                if reduction == SUM:
                    sums[b, h, visible] += weights
                else:
                    sums[b, h, visible] = torch.maximum(sums[b, h, visible], weights)
    half = kernel // 2
    pooled = torch.zeros_like(sums)
    for j in range(seq):
        for offset in range(-half, half + 1):
            if 0 <= j + offset < seq:
                pooled[..., j] += sums[..., j + offset]
    return pooled / kernel


def _pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    if kernel == 1:
        return scores
    batch, heads, seq = scores.shape
    # count_include_pad: the ends are averaged over K positions too, zeros beyond the sequence (as kvpress).
    pooled = F.avg_pool1d(scores.reshape(batch * heads, 1, seq), kernel, stride=1, padding=kernel // 2)
    return pooled.view(batch, heads, seq)


def _keep(attention_mask: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(batch, seq, dtype=torch.bool, device=device)
    return attention_mask.to(device=device, dtype=torch.bool).expand(batch, seq)


def _check_past(
    past_keys: torch.Tensor | None, past_mask: torch.Tensor | None, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if past_keys is None and past_mask is None:
        return None
    if past_keys is None or past_mask is None:
        raise ValueError("past_keys and past_mask go together: give both or neither")
    batch, kv_heads, _, dim = k.shape
    if past_keys.dim() != 4 or past_keys.shape[:2] != (batch, kv_heads) or past_keys.shape[3] != dim:
        raise ValueError(f"past_keys must be [{batch}, {kv_heads}, P, {dim}], got {tuple(past_keys.shape)}")
    if past_mask.dtype != torch.bool or tuple(past_mask.shape) != tuple(past_keys.shape[:3]):
        raise ValueError(
            f"past_mask must be a {list(past_keys.shape[:3])} bool mask, got {past_mask.dtype} "
            f"{tuple(past_mask.shape)}"
        )
    return past_keys, past_mask.to(past_keys.device)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    observation: int,
    attention_mask: torch.Tensor | None,
    kernel: int,
    reduction: str = SUM,
) -> tuple[int, int, int, int]:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, q_heads, seq, dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != dim:
        raise ValueError(
            f"k must be [{batch}, Hkv, {seq}, {dim}] (q's batch, length and width), got {tuple(k.shape)}"
        )
    if q_heads % k.shape[1]:
        raise ValueError(f"q's {q_heads} heads must be a multiple of k's {k.shape[1]}")
    check_positive_int("observation", observation)
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be an odd positive integer, got {kernel!r}")
    if attention_mask is not None and tuple(attention_mask.shape) not in ((batch, seq), (1, seq)):
        raise ValueError(f"attention_mask must be [{batch}, {seq}], got {tuple(attention_mask.shape)}")
    return batch, q_heads, seq, dim


def reconstruction_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    voters: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """KVzip's score of every key, [B, Hkv, T] float32 (float64 for float64 inputs).

    KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
    arXiv:2505.23416, §3.2) runs the context, then a prompt asking for it again and the context repeated, and
    scores each context key by the most attention any query of the repetition (the `voters`) gives it:

        score_hj = max_{i: voter} max_{g ∈ group(h)} softmax_j(q_gi · k_h · scale)

    the softmax over every key the query sees (causal: j ≤ i; padding excluded). A key the model reads to rebuild
    the context scores high whatever question comes later, so the choice does not depend on the question.

    Args:
        q: [B, H, T, D] the queries of the same T positions as the keys.
        k: [B, Hkv, T, D] keys, H a multiple of Hkv.
        voters: [B, T] bool, the queries that vote (the repetition's); a padded one does not.
        attention_mask: [B, T] bool/0-1, True for real tokens; a padded key scores 0.
        chunk_size: queries per chunk (memory only: B·H·chunk·T numbers at once).
    """
    batch, q_heads, seq, dim = _check(q, k, 1, attention_mask, 1)
    if voters.dtype != torch.bool or tuple(voters.shape) != (batch, seq):
        raise ValueError(
            f"voters must be a [{batch}, {seq}] bool mask, got {voters.dtype} {tuple(voters.shape)}"
        )
    check_positive_int("chunk_size", chunk_size)
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    keep = _keep(attention_mask, batch, seq, q.device)
    voting = voters.to(q.device) & keep
    scores = torch.zeros(batch, kv_heads, seq, dtype=dtype, device=q.device)
    with torch.no_grad(), autocast_disabled(q.device):
        keys = k.to(dtype)
        hidden = ~keep[:, None, None, :]  # [B, 1, 1, T] padded keys
        for start in range(0, seq, chunk_size):
            stop = min(start + chunk_size, seq)
            if not bool(voting[:, start:stop].any()):
                continue
            size = stop - start
            chunk = q[:, :, start:stop].to(dtype).reshape(batch, kv_heads, groups * size, dim)
            logits = (chunk @ keys[:, :, :stop].transpose(-1, -2)) * scale  # [B, Hkv, G·C, stop]
            logits.masked_fill_(hidden[..., :stop], float("-inf"))
            # causality only bites in the chunk's own block: a query sees the keys up to its own
            future = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1).repeat(groups, 1)
            logits[..., start:stop].masked_fill_(future, float("-inf"))
            # max over queries of softmax = exp(max over queries of (logit − logsumexp)); a query that does not
            # vote gets logsumexp +inf, so that it gives −inf (a padded query's row is all −inf: −inf − inf too)
            normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
            votes = voting[:, start:stop].repeat(1, groups)[:, None, :, None]  # [B, 1, G·C, 1]
            normaliser.masked_fill_(~votes, float("inf"))
            best = logits.sub_(normaliser).amax(dim=2).exp_()
            scores[..., :stop] = torch.maximum(scores[..., :stop], best)
    return scores


def naive_reconstruction_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    voters: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Test reference of :func:`reconstruction_scores`: every voting query's softmax row, one at a time."""
    batch, q_heads, seq, dim = _check(q, k, 1, attention_mask, 1)
    groups = q_heads // k.shape[1]
    scale = dim**-0.5 if scale is None else scale
    keep = _keep(attention_mask, batch, seq, q.device)
    scores = torch.zeros(batch, k.shape[1], seq, dtype=torch.float64)
    for b in range(batch):
        for head in range(q_heads):
            h = head // groups
            for i in range(seq):
                if not (keep[b, i] and voters[b, i]):
                    continue
                visible = [j for j in range(i + 1) if keep[b, j]]
                row = torch.softmax((k[b, h, visible].double() @ q[b, head, i].double()) * scale, dim=0)
                for position, weight in zip(visible, row.tolist(), strict=True):
                    scores[b, h, position] = max(scores[b, h, position].item(), weight)
    return scores


__all__ = [
    "DEFAULT_KERNEL",
    "naive_observation_scores",
    "naive_reconstruction_scores",
    "observation_scores",
    "reconstruction_scores",
]
