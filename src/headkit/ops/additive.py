"""Additive attention pooling: Fastformer's global summary vector and its causal form for language models.

Wu et al. 2021, "Fastformer: Additive Attention Can Be All You Need", Eqs. 1–2 (Eqs. 3–4 for the keys): each
token gets one scalar score s_i (Fastformer uses s_i = w_qᵀ q_i / √d) and the sequence is summarised as

    α_i = exp(s_i) / Σ_j exp(s_j),        g = Σ_i α_i x_i.

That is the bidirectional form, one g per sequence. A language model needs the causal form, one g_t per
position over the prefix i ≤ t, or the windowed causal form over t − window < i ≤ t. With the running
log-normaliser L_t = log Σ_{i ≤ t} exp(s_i), the causal output is

    g_t = Σ_{i ≤ t} exp(s_i − L_t) x_i,        every weight exp(s_i − L_t) ≤ 1.

No score is ever exponentiated unless shifted by a log-normaliser (or row maximum) that dominates it, so any
score magnitude (±1e4, bf16 activations ×100) gives exact, finite results. Shifting by the global maximum
instead would underflow every early prefix to 0/0.

A pooled past (an earlier chunk, a state) acts as one token: score = its log-normaliser, value = its normalised
pooled vector. That is what lets chunks, states and single decoding steps continue one another exactly.

Everything is accumulated in float32 (float64 inputs stay float64) with autocast disabled inside; outputs come
back in x's dtype. :func:`naive_additive_pool` is the plain loop that the tests compare against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from headkit.ops._precision import autocast_disabled
from headkit.ops._validation import check_padding_mask, check_positive_int, check_rank

# Every softmax here has one more, implicit entry: the empty past, score _EMPTY_PAST, value the zero vector.
# Beside any real score s (|s| far below 1e29) its weight exp(_EMPTY_PAST − s) is exactly 0, so it changes
# nothing. In a row of nothing but −inf (padding, the future, outside the window) it takes all the weight: the
# row pools to 0 with log-normaliser _EMPTY_PAST instead of 0/0 = NaN, and gradients stay finite.
# _EMPTY_PAST + log(n) rounds back to _EMPTY_PAST, so "nothing seen" never drifts; states report it as −inf.
_EMPTY_PAST = -1e30


class AdditivePoolState(NamedTuple):
    """Constant-size summary of the tokens pooled so far, for recurrent decoding and chunked prefill.

    One of two forms:

    * global causal form (``window=None``): ``log_normalizer`` [B, H] = log Σ_i exp(s_i) over the tokens seen
      (−inf when none) and ``pooled`` [B, H, D] = Σ_i exp(s_i − log_normalizer) x_i, their normalised pooled
      vector (zeros when none); float32 (float64 for float64 inputs).
    * windowed form: ``recent_scores`` [B, H, window − 1] (float32) and ``recent_x`` [B, H, window − 1, D]
      (x's dtype), the last window − 1 tokens, oldest first, as a rolling buffer. Slots not filled yet and
      padding tokens have score −inf and x zero.
    """

    log_normalizer: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    recent_scores: torch.Tensor | None = None
    recent_x: torch.Tensor | None = None

    @property
    def window(self) -> int | None:
        """The window of a windowed state, None for the global form."""
        return None if self.recent_scores is None else self.recent_scores.shape[-1] + 1


def additive_pool(
    x: torch.Tensor,
    scores: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    attention_mask: torch.Tensor | None = None,
    initial_state: AdditivePoolState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 32,
    validate: bool = True,
) -> tuple[torch.Tensor, AdditivePoolState | None]:
    """Softmax-weighted pooling g = Σ_i softmax(scores)_i x_i (Fastformer, Wu et al. 2021, Eqs. 1–2).

    Args:
        x: values [B, H, T, D].
        scores: one score per token [B, H, T].
        causal: pool over i ≤ t for every position t instead of over the whole sequence.
        window: with ``causal``, pool over t − window < i ≤ t only (a positive int); None = the whole prefix.
        attention_mask: key padding mask [B, T], bool or 0/1 integers, True = a real token. Padding tokens get
            no weight; a position that has seen no real token yet outputs 0.
        initial_state: the tokens pooled by earlier calls, which precede x: the global form when ``window`` is
            None (bidirectional included), the windowed form of the same window otherwise.
        output_final_state: also return the state after x, to continue with :func:`additive_pool_step` or
            another call.
        chunk_size: positions per chunk of the parallel scan; the cost is O(T·(chunk_size + window)·D).
        validate: check the arguments. ``False`` is for callers that have (an attention layer on its own
            projections and a validated mask): the mask must then be bool. ``initial_state`` is checked either
            way (it comes from an earlier call, perhaps of another batch).

    Returns:
        (pooled, state): pooled is [B, H, D] (bidirectional) or [B, H, T, D] (causal), in x's dtype; state is
        an :class:`AdditivePoolState`, or None unless ``output_final_state``.
    """
    keep = attention_mask
    if validate:
        keep = _check_inputs(x, scores, causal, window, attention_mask)
        check_positive_int("chunk_size", chunk_size)
    _check_state(initial_state, window, x)
    seq = x.shape[2]
    dtype = _compute_dtype(x)
    log_normalizer0, pooled0, recent_scores0, recent_x0 = _unpack_state(initial_state, window, x, dtype)
    with autocast_disabled(x.device):
        values = x.to(dtype)
        padded_scores = scores.to(dtype)
        if keep is not None:
            padded_scores = padded_scores.masked_fill(~keep.to(x.device)[:, None, :], float("-inf"))

        if not causal:
            pooled, final = _bidirectional_pool(values, padded_scores, log_normalizer0, pooled0)
        elif window is None:
            pooled, final = _causal_pool(values, padded_scores, log_normalizer0, pooled0, chunk_size)
        else:
            if initial_state is None and window >= seq:
                # Nothing precedes x and the window covers it whole: every window is a full prefix.
                pooled, _ = _causal_pool(values, padded_scores, log_normalizer0, pooled0, chunk_size)
            else:
                pooled = _windowed_pool(values, padded_scores, recent_scores0, recent_x0, window, chunk_size)
            final = _roll_window(recent_scores0, recent_x0, padded_scores, x) if output_final_state else None
    return pooled.to(x.dtype), (final if output_final_state else None)


def additive_pool_step(
    x: torch.Tensor,
    score: torch.Tensor,
    state: AdditivePoolState | None,
    *,
    window: int | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, AdditivePoolState]:
    """One decoding step of causal additive pooling, equal to the next position of :func:`additive_pool`.

    Args:
        x: the new token's values [B, H, 1, D].
        score: its score [B, H, 1]; −inf marks a padding token (no weight).
        state: the tokens so far (None = none yet), in the form for ``window``.
        window: None for the global causal form, else the window of the windowed form.
        validate: check x, score and window (``False``: the caller has); the state is checked either way.

    Returns:
        (pooled [B, H, 1, D] in x's dtype, the state including this token).

    Tested token by token against :func:`naive_additive_pool` (outputs, states and gradients).
    """
    if validate:
        _check_inputs(x, score, True, window, None, scores_name="score")
        if x.shape[2] != 1:
            raise ValueError(
                f"x must have shape [batch, heads, 1, head_dim] (one token), got {tuple(x.shape)}"
            )
    _check_state(state, window, x)
    if window is None:
        return _global_step(x, score, state)
    return _windowed_step(x, score, state, window)


def _global_step(
    x: torch.Tensor, score: torch.Tensor, state: AdditivePoolState | None
) -> tuple[torch.Tensor, AdditivePoolState]:
    """The global causal step as an online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation
    for softmax", Alg. 3) over two tokens: the past (score L, value g) and the new one (score s, value x).
    Their softmax weights are 1 − w and w with w = σ(s − L), so

        g' = (1 − w)·g + w·x = lerp(g, x, w),        L' = log(exp(L) + exp(s)) = logaddexp(L, s).

    A handful of elementwise kernels and no stack, cat or matmul: this is what one decoding step costs. The
    empty past (L = −inf, g = 0) enters w as _EMPTY_PAST: beside a real s, w = σ(s + 1e30) is exactly 1 and
    g' = x; beside a padding token (s = −inf) w = 0 and g' = g, where −inf − (−inf) would give NaN. Clamping L,
    not s, keeps a padding token at weight exactly 0, and the clamp passes no gradient to an empty past.
    None of these ops is one that autocast lowers, so no autocast guard is needed.
    """
    dtype = _compute_dtype(x)
    value, score = _as_dtype(x.squeeze(2), dtype), _as_dtype(score.squeeze(-1), dtype)
    if state is None:
        past_log_normalizer = torch.full_like(score, float("-inf"))
        past_pooled = torch.zeros_like(value)
    else:
        past_log_normalizer = _as_dtype(state.log_normalizer, dtype)
        # A past that has seen nothing pools to 0 whatever its pooled field holds, as in additive_pool.
        past_pooled = _as_dtype(state.pooled, dtype) * ~past_log_normalizer.isneginf().unsqueeze(-1)
    clamped_past = past_log_normalizer.clamp_min(_EMPTY_PAST)
    new_weight = torch.sigmoid(score - clamped_past)
    new_pooled = torch.lerp(past_pooled, value, new_weight.unsqueeze(-1))
    if torch.is_grad_enabled() and (score.requires_grad or past_log_normalizer.requires_grad):
        # logaddexp's backward is NaN at (−inf, −inf) (a padding token over an empty past), so differentiate
        # the clamped form; its value differs only there, _EMPTY_PAST instead of −inf, and is reported as −inf.
        new_log_normalizer = _as_log_normalizer(torch.logaddexp(clamped_past, score))
    else:
        new_log_normalizer = torch.logaddexp(past_log_normalizer, score)  # −inf exactly when both are
    return _as_dtype(new_pooled.unsqueeze(2), x.dtype), AdditivePoolState(new_log_normalizer, new_pooled)


def _windowed_step(
    x: torch.Tensor, score: torch.Tensor, state: AdditivePoolState | None, window: int
) -> tuple[torch.Tensor, AdditivePoolState]:
    """The windowed step: a softmax over the buffered window − 1 tokens and the new one."""
    dtype = _compute_dtype(x)
    if state is None:
        batch, heads, _, dim = x.shape
        recent_scores = x.new_full((batch, heads, window - 1), float("-inf"), dtype=dtype)
        recent_x = x.new_zeros(batch, heads, window - 1, dim)
    else:
        recent_scores, recent_x = _as_dtype(state.recent_scores, dtype), state.recent_x
    score = _as_dtype(score, dtype)
    with autocast_disabled(x.device):  # the matmul below stays in dtype
        weights, total, _ = _softmax_parts(torch.cat([recent_scores, score], dim=-1))
        visible_x = _as_dtype(torch.cat([recent_x, x], dim=-2), dtype)
        new_pooled = (weights[..., None, :] @ visible_x) / total[..., None, None]
    return _as_dtype(new_pooled, x.dtype), _roll_window(recent_scores, recent_x, score, x)


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor in dtype, skipping the dispatch of a no-op .to() (it counts at one token per step)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def naive_additive_pool(
    x: torch.Tensor,
    scores: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    attention_mask: torch.Tensor | None = None,
    initial_state: AdditivePoolState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, AdditivePoolState | None]:
    """Test reference for :func:`additive_pool`: for each t, torch.softmax over the visible real scores.

    A plain loop in x's own dtype (pass float64 for a high-precision reference). A global initial state is one
    more token (score log_normalizer, value pooled) before x; a windowed one is its buffered tokens before x.
    """
    keep = _check_inputs(x, scores, causal, window, attention_mask)
    _check_state(initial_state, window, x)
    batch, heads, seq, dim = x.shape
    keep = torch.ones(batch, seq, dtype=torch.bool) if keep is None else keep
    token_x, token_s, token_real = x, scores.to(x.dtype), keep[:, None, :].expand(batch, heads, seq)
    if initial_state is not None:
        if initial_state.window is None:
            past_x, past_s = initial_state.pooled[..., None, :], initial_state.log_normalizer[..., None]
        else:
            past_x, past_s = initial_state.recent_x, initial_state.recent_scores
        token_x = torch.cat([past_x.to(x.dtype), token_x], dim=-2)
        token_s = torch.cat([past_s.to(x.dtype), token_s], dim=-1)
        token_real = torch.cat([past_s > float("-inf"), token_real], dim=-1)
    first = token_s.shape[-1] - seq

    def pool(start: int, stop: int) -> torch.Tensor:
        """softmax over the real tokens in [start, stop), for every (batch, head); 0 where there are none."""
        real = token_real[..., start:stop]
        sees_something = real.any(dim=-1, keepdim=True)
        visible_scores = token_s[..., start:stop].masked_fill(~real, float("-inf"))
        weights = torch.softmax(visible_scores.masked_fill(~sees_something, 0.0), dim=-1) * sees_something
        return (weights[..., None, :] @ token_x[..., start:stop, :])[..., 0, :]

    if not causal:
        pooled = pool(0, first + seq)
    else:
        ends = range(first + 1, first + seq + 1)
        starts = [0 if window is None else max(0, end - window) for end in ends]
        pooled = torch.stack([pool(start, end) for start, end in zip(starts, ends, strict=True)], dim=2)
    if not output_final_state:
        return pooled, None

    token_s = token_s.masked_fill(~token_real, float("-inf"))
    token_x = token_x.masked_fill(~token_real[..., None], 0.0)
    if window is None:
        everything = pooled if not causal else pooled[..., -1, :]
        return pooled, AdditivePoolState(log_normalizer=torch.logsumexp(token_s, dim=-1), pooled=everything)
    never_filled = torch.full((batch, heads, window - 1), float("-inf"), dtype=x.dtype)
    token_s = torch.cat([never_filled, token_s], dim=-1)
    token_x = torch.cat([torch.zeros(batch, heads, window - 1, dim, dtype=x.dtype), token_x], dim=-2)
    last = token_s.shape[-1] - (window - 1)
    return pooled, AdditivePoolState(recent_scores=token_s[..., last:], recent_x=token_x[..., last:, :])


def _bidirectional_pool(
    x: torch.Tensor, scores: torch.Tensor, log_normalizer0: torch.Tensor, pooled0: torch.Tensor
) -> tuple[torch.Tensor, AdditivePoolState]:
    """g = softmax over [the initial state as one token (L_0, g_0), every token of x]."""
    weights, total, log_normalizer = _softmax_parts(torch.cat([log_normalizer0[..., None], scores], dim=-1))
    pooled = (weights[..., None, 1:] @ x)[..., 0, :] + weights[..., :1] * pooled0
    pooled = pooled / total[..., None]
    return pooled, AdditivePoolState(_as_log_normalizer(log_normalizer), pooled)


def _causal_pool(
    x: torch.Tensor,
    scores: torch.Tensor,
    log_normalizer0: torch.Tensor,
    pooled0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, AdditivePoolState]:
    """g_t = Σ_{i ≤ t} exp(s_i − L_t) x_i for every t, exactly and in parallel, in chunks of C positions.

    1. Chunk c is summarised by its log-normaliser ℓ_c and its normalised sum u_c = Σ_{i ∈ c} exp(s_i − ℓ_c)
       x_i; the initial state is one more summary before chunk 0.
    2. The summaries are pooled causally: the past before chunk c has log-normaliser P_c = log Σ_{c' < c}
       exp(ℓ_{c'}) and pooled vector Σ_{c' < c} exp(ℓ_{c'} − P_c) u_{c'}, one [N+1, N+1] lower-triangular
       matmul with entries ≤ 1.
    3. Position t of chunk c is a softmax over [the past as one token (P_c, its pooled vector), the chunk's
       tokens i ≤ t]: weights exp(P_c − L_t) and exp(s_i − L_t), a [C, C+1] masked block per chunk.
    Cost O(T·C·D + (T/C)²·D); no loop over positions.
    """
    batch, heads, seq, dim = x.shape
    chunk = min(chunk_size, seq)
    n_chunks = math.ceil(seq / chunk)
    tail = n_chunks * chunk - seq
    if tail:
        x = F.pad(x, (0, 0, 0, tail))
        scores = F.pad(scores, (0, tail), value=float("-inf"))
    x_chunks = x.view(batch, heads, n_chunks, chunk, dim)
    s_chunks = scores.view(batch, heads, n_chunks, chunk)

    chunk_weights, chunk_total, chunk_log_normalizer = _softmax_parts(s_chunks)
    chunk_sums = (chunk_weights[..., None, :] @ x_chunks)[..., 0, :] / chunk_total[..., None]
    summary_log_normalizer = torch.cat([log_normalizer0[..., None], chunk_log_normalizer], dim=-1)
    summaries = torch.cat([pooled0[..., None, :], chunk_sums], dim=-2)

    # Row c pools the summaries before chunk c (row N: all of them). Not logcumsumexp: its backward works
    # in exp(log|grad| − L + s), which loses ~1e-3 relative at |s| ~ 1e4 in float32.
    later = _after_diagonal(n_chunks + 1, n_chunks + 1, x.device)
    summary_rows = summary_log_normalizer[..., None, :].masked_fill(later, float("-inf"))
    summary_weights, summary_total, past_log_normalizer = _softmax_parts(summary_rows)
    past_pooled = (summary_weights @ summaries) / summary_total[..., None]

    # The past column scores at least _EMPTY_PAST: it is each row's empty past, and its pooled vector is 0
    # while nothing real has been seen.
    row_keys = torch.cat([past_log_normalizer[..., :-1, None], s_chunks], dim=-1)
    visible = ~_after_diagonal(chunk, chunk + 1, x.device, first_key=-1)
    weights = torch.softmax(torch.where(visible, row_keys[..., None, :], float("-inf")), dim=-1)
    pooled = (weights[..., 1:] @ x_chunks).addcmul_(weights[..., :1], past_pooled[..., :-1, None, :])

    pooled = pooled.view(batch, heads, n_chunks * chunk, dim)[:, :, :seq]
    final = AdditivePoolState(_as_log_normalizer(past_log_normalizer[..., -1]), past_pooled[..., -1, :])
    return pooled, final


def _windowed_pool(
    x: torch.Tensor,
    scores: torch.Tensor,
    recent_scores: torch.Tensor,
    recent_x: torch.Tensor,
    window: int,
    chunk_size: int,
) -> torch.Tensor:
    """g_t = softmax over t − window < i ≤ t, banded: each chunk of C queries against the keys it can see.

    Those keys are the query chunk itself and the history = ⌈(window − 1)/C⌉·C positions before it, so the
    cost is O(T·(C + window)·D). The initial state's window − 1 buffered tokens are the positions before x, so a
    continued call is exact.
    """
    batch, heads, seq, dim = x.shape
    chunk = min(chunk_size, seq)
    n_chunks = math.ceil(seq / chunk)
    tail = n_chunks * chunk - seq
    history = math.ceil((window - 1) / chunk) * chunk
    lead = history - (window - 1)
    keys_s = F.pad(torch.cat([recent_scores, scores], dim=-1), (lead, tail), value=float("-inf"))
    keys_x = F.pad(torch.cat([recent_x.to(x.dtype), x], dim=-2), (0, 0, lead, tail))
    span = history + chunk
    band_s = keys_s.unfold(-1, span, chunk)  # [B, H, N, span]
    key_chunks = keys_x.view(batch, heads, -1, chunk, dim)  # [B, H, history / C + N, C, D]

    # Query r of a chunk sits at band position history + r and sees band positions j with
    # 0 ≤ history + r − j < window.
    distance = history + torch.arange(chunk, device=x.device)[:, None] - torch.arange(span, device=x.device)
    in_window = (distance >= 0) & (distance < window)
    weights, total, _ = _softmax_parts(torch.where(in_window, band_s[..., None, :], float("-inf")))
    # Multiply block by block (a loop over the span's chunks, not over positions) rather than materialise the
    # overlapping [N, span, D] key bands, which would copy x span / C times.
    pooled = weights[..., :chunk] @ key_chunks[:, :, :n_chunks]
    for block in range(1, span // chunk):
        pooled += (
            weights[..., block * chunk : (block + 1) * chunk] @ key_chunks[:, :, block : block + n_chunks]
        )
    pooled = pooled / total[..., None]
    return pooled.view(batch, heads, n_chunks * chunk, dim)[:, :, :seq]


def _softmax_parts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over the last dim plus the implicit empty past, in parts: weights exp(rows − m), their total
    (the empty past's share exp(_EMPTY_PAST − m) included) and the log-normaliser m + log(total).

    softmax = weights / total; callers divide the smaller pooled result instead. Rows may hold −inf. The shift
    m = max(row maximum, _EMPTY_PAST) is detached: softmax does not depend on it, so gradients stay exact.
    One max, one exp and one sum serve both the weights and the log-normaliser.
    """
    shift = rows.detach().amax(dim=-1, keepdim=True).clamp_min(_EMPTY_PAST)
    weights = (rows - shift).exp_()
    total = weights.sum(dim=-1) + torch.exp(_EMPTY_PAST - shift[..., 0])
    return weights, total, shift[..., 0] + total.log()


def _roll_window(
    recent_scores: torch.Tensor, recent_x: torch.Tensor, scores: torch.Tensor, x: torch.Tensor
) -> AdditivePoolState:
    """The windowed state after x: the last window − 1 tokens of the buffer followed by x."""
    size, seq = recent_scores.shape[-1], scores.shape[-1]
    newest = max(0, seq - size)
    all_scores = torch.cat([recent_scores, scores[..., newest:]], dim=-1)
    all_x = torch.cat([recent_x.to(x.dtype), x[..., newest:, :]], dim=-2)
    kept_scores = all_scores[..., all_scores.shape[-1] - size :]
    kept_x = all_x[..., all_x.shape[-2] - size :, :]
    # Padding and empty slots never get weight; zeroing their x keeps garbage (even NaN) out of 0 · x products.
    kept_x = kept_x.masked_fill(kept_scores[..., None] == float("-inf"), 0.0)
    return AdditivePoolState(recent_scores=kept_scores, recent_x=kept_x)


def _after_diagonal(rows: int, cols: int, device: torch.device, first_key: int = 0) -> torch.Tensor:
    """[rows, cols] bool, True where key column j (numbered from first_key) comes after query row i."""
    keys = torch.arange(first_key, first_key + cols, device=device)
    return keys[None, :] > torch.arange(rows, device=device)[:, None]


def _as_log_normalizer(log_normalizer: torch.Tensor) -> torch.Tensor:
    """Report a log-normaliser that saw no real score (only the empty past) as the true log(0) = −inf."""
    return log_normalizer.masked_fill(log_normalizer <= _EMPTY_PAST, float("-inf"))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _unpack_state(
    state: AdditivePoolState | None, window: int | None, x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_normalizer, pooled, recent_scores, recent_x): the state's, or empty ones for the other form."""
    batch, heads, _, dim = x.shape
    buffered = 0 if window is None else window - 1
    log_normalizer = torch.full((batch, heads), float("-inf"), dtype=dtype, device=x.device)
    pooled = torch.zeros(batch, heads, dim, dtype=dtype, device=x.device)
    recent_scores = torch.full((batch, heads, buffered), float("-inf"), dtype=dtype, device=x.device)
    recent_x = torch.zeros(batch, heads, buffered, dim, dtype=x.dtype, device=x.device)
    if state is not None and state.window is None:
        log_normalizer, pooled = state.log_normalizer.to(dtype), state.pooled.to(dtype)
    elif state is not None:
        recent_scores, recent_x = state.recent_scores.to(dtype), state.recent_x
    return log_normalizer, pooled, recent_scores, recent_x


def _check_inputs(
    x: torch.Tensor,
    scores: torch.Tensor,
    causal: bool,
    window: int | None,
    attention_mask: torch.Tensor | None,
    scores_name: str = "scores",
) -> torch.Tensor | None:
    """Check x, the scores, the window and the mask; return the mask as bool (or None)."""
    check_rank("x", x, 4, "[batch, heads, seq, head_dim]")
    check_rank(scores_name, scores, 3, "[batch, heads, seq]")
    batch, heads, seq, dim = x.shape
    if tuple(scores.shape) != (batch, heads, seq):
        raise ValueError(
            f"{scores_name} must have shape [batch, heads, seq] = [{batch}, {heads}, {seq}] to match x, "
            f"got {tuple(scores.shape)}"
        )
    if seq == 0:
        raise ValueError("x must hold at least one position: shape [batch, heads, seq >= 1, head_dim]")
    if window is not None:
        check_positive_int("window", window)
        if not causal:
            raise ValueError(f"window={window} needs causal=True: bidirectional pooling has no window")
    return check_padding_mask(attention_mask, batch, seq)


def _check_state(state: AdditivePoolState | None, window: int | None, x: torch.Tensor) -> None:
    """A state (None passes) of the form for ``window`` that continues x [B, H, T, D]."""
    if state is None:
        return
    batch, heads, _, dim = x.shape
    if not isinstance(state, AdditivePoolState):
        raise ValueError(f"initial_state / state must be an AdditivePoolState, got {type(state).__name__}")
    if window is None:
        if state.log_normalizer is None or state.pooled is None or state.recent_scores is not None:
            raise ValueError(
                "initial_state / state must be the global form (log_normalizer, pooled) for window=None, "
                f"got the windowed form for window={state.window}"
            )
        if tuple(state.log_normalizer.shape) != (batch, heads) or tuple(state.pooled.shape) != (
            batch,
            heads,
            dim,
        ):
            raise ValueError(
                f"state.log_normalizer must have shape [batch, heads] = [{batch}, {heads}] and state.pooled "
                f"[batch, heads, head_dim] = [{batch}, {heads}, {dim}], got {tuple(state.log_normalizer.shape)} "
                f"and {tuple(state.pooled.shape)}"
            )
        return
    if state.recent_scores is None or state.recent_x is None:
        raise ValueError(
            f"initial_state / state must be the windowed form (recent_scores, recent_x) for window={window}, "
            "got the global form"
        )
    scores_shape, x_shape = (batch, heads, window - 1), (batch, heads, window - 1, dim)
    if tuple(state.recent_scores.shape) != scores_shape or tuple(state.recent_x.shape) != x_shape:
        raise ValueError(
            f"for window={window}, state.recent_scores must have shape [batch, heads, window - 1] = "
            f"{list(scores_shape)} and state.recent_x [batch, heads, window - 1, head_dim] = {list(x_shape)}, "
            f"got {tuple(state.recent_scores.shape)} and {tuple(state.recent_x.shape)}"
        )
