"""Linear attention (Katharopoulos et al. 2020): the chunkwise kernel against the dense reference, the
recurrent step against the parallel form, state hand-over, causality, precision under autocast, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headkit.ops.linear as linear_module
from headkit.ops import (
    FEATURE_MAPS,
    LinearAttentionState,
    linear_attention,
    linear_attention_step,
    register_feature_map,
)
from headkit.ops.linear import naive_linear_attention

REL_TOL = 1e-5


def assert_close_scaled(
    actual: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL, scale: float | None = None
) -> None:
    """max |actual − expected| ≤ rel · scale, scale = max |expected| unless given: an error measured against
    the size of the quantity rather than entry by entry."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if scale is None:
        scale = expected.double().abs().max().item()
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= rel * max(scale, 1e-12), f"max error {error:.3g} > {rel:g} × scale {scale:.3g}"


def assert_gradients_close(grads, ref_grads, rel: float = 2 * REL_TOL) -> None:
    """Gradients of one loss, measured against the largest of them: a gradient that is ~0 by construction
    (e.g. of q when a query sees a single key) is held to the precision of its siblings, not its own size."""
    scale = max(ref.double().abs().max().item() for ref in ref_grads)
    for index, (grad, ref) in enumerate(zip(grads, ref_grads, strict=True)):
        assert grad is not None, f"no gradient for input {index}"
        assert_close_scaled(grad, ref, rel, scale=scale)


def make_qkv(
    batch: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seq: int = 37,
    head_dim: int = 8,
    head_dim_v: int = 6,
    *,
    feature_map: str = "elu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # elu + 1 is positive everywhere; relu and identity get inputs centred at 1 so that the normaliser
    # φ(q)ᵀ Σ φ(k) stays away from 0 and the comparison measures the kernel, not an ill-conditioned division.
    spread, shift = (1.0, 0.0) if feature_map == "elu" else (0.5, 1.0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * spread + shift

    return (
        draw(batch, heads, seq, head_dim),
        draw(batch, kv_heads, seq, head_dim),
        torch.randn(batch, kv_heads, seq, head_dim_v, generator=generator),
    )


def make_padding_mask(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(batch, seq, generator=generator) > 0.3
    keep[0, : min(3, seq)] = False  # left padding: the first queries of row 0 see no key at all
    return keep


def make_state(
    batch: int, kv_heads: int, head_dim: int, head_dim_v: int, seed: int = 2
) -> LinearAttentionState:
    generator = torch.Generator().manual_seed(seed)
    # A plausible state: sums of positive features times values, with a positive k_sum.
    return LinearAttentionState(
        torch.randn(batch, kv_heads, head_dim, head_dim_v, generator=generator) * 3,
        torch.rand(batch, kv_heads, head_dim, generator=generator) * 5 + 1,
    )


def use_block_size(monkeypatch: pytest.MonkeyPatch, blocks: str) -> None:
    """Block size of the causal kernel. "one_block": the default (one block at these sizes); "small_blocks":
    one to four chunks, so that the state is carried across blocks and the tail chunk ends a multi-block run."""
    if blocks == "small_blocks":
        # block_len = chunk · (_BLOCK_ELEMENTS // (batch · heads · chunk · head_dim)): 2 chunks at the usual
        # batch 2, 4 heads, head_dim 8, chunk 16.
        monkeypatch.setattr(linear_module, "_BLOCK_ELEMENTS", 2 * (2 * 4 * 16 * 8))


@pytest.fixture(params=["one_block", "small_blocks"])
def block_size(request, monkeypatch):
    use_block_size(monkeypatch, request.param)
    return request.param


def weighted_loss(out, state, seed: int = 3):
    """A scalar depending on every output and state entry with random weights (a random cotangent)."""
    generator = torch.Generator().manual_seed(seed)

    def weighted(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.randn(x.shape, generator=generator).to(x.dtype)).sum()

    loss = weighted(out)
    if state is not None:
        loss = loss + weighted(state.kv) + weighted(state.k_sum)
    return loss


# --- the fast kernel against the dense reference ------------------------------------------------------------


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    "causal,seq,chunk_size,blocks",
    [(False, seq, 64, "one_block") for seq in (1, 7, 130)]
    + [
        (True, seq, chunk, blocks)
        for seq in (1, 7, 64, 130)
        for chunk in (16, 64)
        for blocks in ("one_block", "small_blocks")
    ],
)
def test_outputs_states_and_gradients_match_the_dense_reference(
    causal, seq, chunk_size, blocks, heads, kv_heads, masked, feature_map, monkeypatch
):
    use_block_size(monkeypatch, blocks)
    q, k, v = make_qkv(2, heads, kv_heads, seq, feature_map=feature_map)
    mask = make_padding_mask(2, seq) if masked else None
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))

    # Under autograd "auto" takes the compiled kernel (forward and backward) where it builds; the small blocks
    # hold the chunked PyTorch form to its state carried across blocks, backward included.
    out, state = linear_attention(
        q,
        k,
        v,
        feature_map=feature_map,
        causal=causal,
        attention_mask=mask,
        chunk_size=chunk_size,
        output_final_state=True,
        kernel="chunked" if blocks == "small_blocks" else "auto",
    )
    ref, ref_state = naive_linear_attention(
        q64, k64, v64, feature_map=feature_map, causal=causal, attention_mask=mask, output_final_state=True
    )
    assert (
        out.dtype == torch.float32 and state.kv.dtype == torch.float32 and state.k_sum.dtype == torch.float32
    )
    assert_close_scaled(out, ref)
    assert_close_scaled(state.kv, ref_state.kv)
    assert_close_scaled(state.k_sum, ref_state.k_sum)

    grads = torch.autograd.grad(weighted_loss(out, state), (q, k, v))
    ref_grads = torch.autograd.grad(weighted_loss(ref, ref_state), (q64, k64, v64))
    assert_gradients_close(grads, ref_grads)


@pytest.mark.parametrize("causal", [False, True])
def test_initial_state_and_its_gradient_match_the_dense_reference(causal, block_size):
    q, k, v = make_qkv(2, 4, 2, 45)
    mask = make_padding_mask(2, 45)
    kv0, k_sum0 = (x.requires_grad_() for x in make_state(2, 2, 8, 6))
    kv0_64, k_sum0_64 = (x.detach().double().requires_grad_() for x in (kv0, k_sum0))

    out, state = linear_attention(
        q,
        k,
        v,
        causal=causal,
        attention_mask=mask,
        chunk_size=16,
        initial_state=LinearAttentionState(kv0, k_sum0),
        output_final_state=True,
        kernel="chunked" if block_size == "small_blocks" else "auto",
    )
    ref, ref_state = naive_linear_attention(
        q.double(),
        k.double(),
        v.double(),
        causal=causal,
        attention_mask=mask,
        initial_state=LinearAttentionState(kv0_64, k_sum0_64),
        output_final_state=True,
    )
    assert_close_scaled(out, ref)
    assert_close_scaled(state.kv, ref_state.kv)
    assert_close_scaled(state.k_sum, ref_state.k_sum)
    grads = torch.autograd.grad(weighted_loss(out, state), (kv0, k_sum0))
    ref_grads = torch.autograd.grad(weighted_loss(ref, ref_state), (kv0_64, k_sum0_64))
    assert_gradients_close(grads, ref_grads)


@pytest.mark.parametrize("kernel", ["chunked", "auto"])
def test_no_grad_path_equals_autograd_path(block_size, kernel):
    # The chunked form: without autograd the blocks are written into a preallocated output; with it they are
    # concatenated. "auto": the compiled kernel where it builds, called directly or through its autograd node.
    q, k, v = make_qkv(2, 4, 2, 130)
    mask = make_padding_mask(2, 130)
    common = dict(causal=True, attention_mask=mask, output_final_state=True, kernel=kernel)
    with torch.no_grad():
        plain, plain_state = linear_attention(q, k, v, **common)
    traced, traced_state = linear_attention(q.requires_grad_(), k, v, **common)
    assert traced.requires_grad and not plain.requires_grad
    assert_close_scaled(plain, traced.detach(), rel=1e-6)
    assert_close_scaled(plain_state.kv, traced_state.kv.detach(), rel=1e-6)


# --- the recurrent form and state hand-over -----------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_step_by_step_decoding_equals_the_parallel_forward(heads, kv_heads, block_size):
    q, k, v = make_qkv(2, heads, kv_heads, 41)
    parallel, parallel_state = linear_attention(q, k, v, causal=True, chunk_size=16, output_final_state=True)

    state, outputs = None, []
    for t in range(q.shape[2]):
        out, state = linear_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        assert out.shape == (2, heads, 1, 6)
        assert state.kv.shape == (2, kv_heads, 8, 6) and state.kv.dtype == torch.float32
        outputs.append(out)
    assert_close_scaled(torch.cat(outputs, dim=2), parallel)
    assert_close_scaled(state.kv, parallel_state.kv)
    assert_close_scaled(state.k_sum, parallel_state.k_sum)


def test_step_continues_from_a_prefill_state():
    q, k, v = make_qkv(1, 4, 2, 30)
    whole, _ = linear_attention(q, k, v, causal=True, chunk_size=16)
    _, state = linear_attention(
        q[:, :, :29], k[:, :, :29], v[:, :, :29], causal=True, output_final_state=True
    )
    last, _ = linear_attention_step(q[:, :, 29:], k[:, :, 29:], v[:, :, 29:], state)
    assert_close_scaled(last, whole[:, :, 29:])


@pytest.mark.parametrize("split", [0, 5, 16, 64, 100, 130])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "padding_mask"])
def test_prefill_then_initial_state_equals_one_call(split, masked, block_size):
    q, k, v = make_qkv(2, 4, 2, 130)
    mask = make_padding_mask(2, 130) if masked else None
    first_mask, rest_mask = (None, None) if mask is None else (mask[:, :split], mask[:, split:])
    whole, whole_state = linear_attention(
        q, k, v, causal=True, attention_mask=mask, chunk_size=16, output_final_state=True
    )
    head, state = linear_attention(
        q[:, :, :split],
        k[:, :, :split],
        v[:, :, :split],
        causal=True,
        attention_mask=first_mask,
        chunk_size=16,
        output_final_state=True,
    )
    tail, final_state = linear_attention(
        q[:, :, split:],
        k[:, :, split:],
        v[:, :, split:],
        causal=True,
        attention_mask=rest_mask,
        chunk_size=16,
        initial_state=state,
        output_final_state=True,
    )
    assert_close_scaled(torch.cat([head, tail], dim=2), whole)
    assert_close_scaled(final_state.kv, whole_state.kv)
    assert_close_scaled(final_state.k_sum, whole_state.k_sum)


def test_final_state_is_returned_only_on_request():
    q, k, v = make_qkv(1, 2, 2, 10)
    assert linear_attention(q, k, v, causal=True)[1] is None
    assert linear_attention(q, k, v, causal=False)[1] is None
    assert isinstance(
        linear_attention(q, k, v, causal=True, output_final_state=True)[1], LinearAttentionState
    )


# --- semantics ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 15, 16, 50, 98])
def test_causality_future_inputs_do_not_change_past_outputs(position, block_size):
    q, k, v = make_qkv(2, 4, 2, 100)
    out, _ = linear_attention(q, k, v, causal=True, chunk_size=16)
    future = slice(position + 1, None)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, future] += 10 * torch.randn_like(x[:, :, future])
    perturbed, _ = linear_attention(q2, k2, v2, causal=True, chunk_size=16)
    assert_close_scaled(perturbed[:, :, : position + 1], out[:, :, : position + 1], rel=1e-6)
    # The perturbation is large enough to show where it is visible.
    assert (perturbed[:, :, position + 1 :] - out[:, :, position + 1 :]).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_contribute_nothing(causal):
    q, k, v = make_qkv(1, 2, 2, 40)
    keep = torch.ones(1, 40, dtype=torch.bool)
    keep[:, 10:14] = False
    out, state = linear_attention(q, k, v, causal=causal, attention_mask=keep, output_final_state=True)
    # Garbage in the padded keys and values must not leak through.
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 10:14], v2[:, :, 10:14] = 1e4, -1e4
    out2, state2 = linear_attention(q, k2, v2, causal=causal, attention_mask=keep, output_final_state=True)
    assert_close_scaled(out2, out, rel=1e-6)
    assert_close_scaled(state2.kv, state.kv, rel=1e-6)
    # Dropping the padded tokens altogether gives the same result at the remaining positions.
    kept = keep[0]
    short, short_state = linear_attention(
        q[:, :, kept], k[:, :, kept], v[:, :, kept], causal=causal, output_final_state=True
    )
    assert_close_scaled(out[:, :, kept], short)
    assert_close_scaled(state.kv, short_state.kv)


def test_integer_padding_mask_equals_bool_mask():
    q, k, v = make_qkv(2, 2, 2, 20)
    keep = make_padding_mask(2, 20)
    as_bool, _ = linear_attention(q, k, v, causal=True, attention_mask=keep)
    as_int, _ = linear_attention(q, k, v, causal=True, attention_mask=keep.long())
    assert torch.equal(as_bool, as_int)


def test_queries_that_see_no_key_return_zeros():
    q, k, v = make_qkv(1, 2, 2, 12)
    keep = torch.ones(1, 12, dtype=torch.bool)
    keep[:, :4] = False
    out, _ = linear_attention(q, k, v, causal=True, attention_mask=keep)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert out[:, :, 4:].abs().min() > 0


def test_grouped_query_attention_equals_repeated_key_value_heads():
    q, k, v = make_qkv(2, 6, 2, 50)
    grouped, _ = linear_attention(q, k, v, causal=True, chunk_size=16)
    repeated, _ = linear_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), causal=True, chunk_size=16
    )
    assert_close_scaled(grouped, repeated, rel=1e-6)


def test_non_causal_allows_a_different_key_length():
    q, _, _ = make_qkv(1, 2, 2, 5)
    _, k, v = make_qkv(1, 2, 2, 9, seed=4)
    out, _ = linear_attention(q, k, v)
    ref, _ = naive_linear_attention(q.double(), k.double(), v.double())
    assert out.shape == (1, 2, 5, 6)
    assert_close_scaled(out, ref)


def test_empty_batch_returns_empty_outputs():
    q, k, v = make_qkv(0, 4, 2, 5)
    for causal in (False, True):
        out, state = linear_attention(q, k, v, causal=causal, output_final_state=True)
        assert out.shape == (0, 4, 5, 6) and state.kv.shape == (0, 2, 8, 6) and state.k_sum.shape == (0, 2, 8)


def test_empty_sequence_returns_an_empty_output_and_the_initial_state():
    q, k, v = make_qkv(1, 2, 2, 0)
    initial = make_state(1, 2, 8, 6)
    for causal in (False, True):
        out, state = linear_attention(q, k, v, causal=causal, initial_state=initial, output_final_state=True)
        assert out.shape == (1, 2, 0, 6)
        assert torch.equal(state.kv, initial.kv) and torch.equal(state.k_sum, initial.k_sum)


# --- precision ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_large_inputs_under_bf16_autocast_at_8192_tokens_stay_finite(causal):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (100 * torch.randn(1, 2, 8192, 16, generator=generator, dtype=torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = linear_attention(q, k, v, causal=causal, output_final_state=True)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 2, 8192, 16)
    assert torch.isfinite(out).all()
    assert (
        state.kv.dtype == torch.float32
        and torch.isfinite(state.kv).all()
        and torch.isfinite(state.k_sum).all()
    )
    # The result is the float32 computation on the same (bf16) inputs, rounded to bf16 at the end.
    ref, ref_state = linear_attention(q.float(), k.float(), v.float(), causal=causal, output_final_state=True)
    assert_close_scaled(out, ref, rel=1e-2)
    assert_close_scaled(state.kv, ref_state.kv)


@pytest.mark.parametrize("causal", [False, True])
def test_state_and_accumulation_stay_float32_under_autocast(causal):
    q, k, v = (x.bfloat16() for x in make_qkv(2, 4, 2, 130))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = linear_attention(q, k, v, causal=causal, chunk_size=16, output_final_state=True)
        step_out, step_state = linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    assert out.dtype == torch.bfloat16 and step_out.dtype == torch.bfloat16
    assert state.kv.dtype == state.k_sum.dtype == step_state.kv.dtype == torch.float32
    # bf16 accumulation would be off by ~1e-2; float32 accumulation matches the float64 reference closely.
    ref, ref_state = naive_linear_attention(
        q.double(), k.double(), v.double(), causal=causal, output_final_state=True
    )
    assert_close_scaled(state.kv, ref_state.kv)
    assert_close_scaled(state.k_sum, ref_state.k_sum)
    assert_close_scaled(out, ref, rel=1e-2)


def test_float32_inputs_under_autocast_are_not_downcast():
    q, k, v = make_qkv(2, 4, 2, 130)
    plain, _ = linear_attention(q, k, v, causal=True, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = linear_attention(q, k, v, causal=True, chunk_size=16)
    assert autocast.dtype == torch.float32
    assert_close_scaled(autocast, plain, rel=1e-6)


def test_output_has_the_query_dtype():
    q, k, v = make_qkv(1, 2, 2, 20)
    out, state = linear_attention(q.double(), k, v, causal=True, output_final_state=True)
    assert out.dtype == torch.float64 and state.kv.dtype == torch.float32


# --- feature maps -------------------------------------------------------------------------------------------


@pytest.fixture
def restore_feature_maps():
    saved = dict(FEATURE_MAPS)
    yield
    FEATURE_MAPS.clear()
    FEATURE_MAPS.update(saved)


@pytest.mark.parametrize("causal", [False, True])
def test_a_user_registered_feature_map_is_used(causal, restore_feature_maps):
    register_feature_map("softplus_test", F.softplus)
    q, k, v = make_qkv(2, 4, 2, 40)
    by_name, _ = linear_attention(q, k, v, feature_map="softplus_test", causal=causal, chunk_size=16)
    by_callable, _ = linear_attention(q, k, v, feature_map=F.softplus, causal=causal, chunk_size=16)
    ref, _ = naive_linear_attention(q.double(), k.double(), v.double(), feature_map=F.softplus, causal=causal)
    default, _ = linear_attention(q, k, v, causal=causal, chunk_size=16)
    assert_close_scaled(by_name, ref)
    assert torch.equal(by_name, by_callable)
    assert (by_name - default).abs().max() > 1e-3  # the map really changed the result

    out, _ = linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], None, feature_map="softplus_test")
    assert_close_scaled(
        out,
        ref[:, :, :1]
        if causal
        else naive_linear_attention(
            q[:, :, :1].double(), k[:, :, :1].double(), v[:, :, :1].double(), feature_map=F.softplus
        )[0],
    )


# --- bad input ----------------------------------------------------------------------------------------------


def _qkv():
    return make_qkv(2, 4, 2, 10)


def _bad_calls():
    q, k, v = _qkv()
    state = make_state(2, 2, 8, 6)
    one = (q[:, :, :1], k[:, :, :1], v[:, :, :1])
    return {
        "q_rank": (lambda: linear_attention(q[0], k, v), r"^q must have shape"),
        "k_rank": (lambda: linear_attention(q, k[0], v), r"^k must have shape"),
        "heads_do_not_divide": (
            lambda: linear_attention(q, k[:, :1].expand(2, 3, 10, 8), v[:, :1].expand(2, 3, 10, 6)),
            r"^k has 3 heads, which does not divide",
        ),
        "v_length": (lambda: linear_attention(q, k, v[:, :, :9]), r"^v must have shape"),
        "batch": (lambda: linear_attention(q, k[:1], v[:1]), "batch sizes differ"),
        "k_head_dim": (lambda: linear_attention(q, k[..., :7], v), r"^k must have head_dim 8"),
        "causal_lengths": (
            lambda: linear_attention(q[:, :, :5], k, v, causal=True),
            r"k and v .* seq length",
        ),
        "unknown_feature_map": (
            lambda: linear_attention(q, k, v, feature_map="softmax"),
            r"feature_map must be one of \['elu', 'identity', 'relu'\]",
        ),
        "feature_map_type": (lambda: linear_attention(q, k, v, feature_map=3), "feature_map must be one of"),
        "feature_map_shape": (
            lambda: linear_attention(q, k, v, feature_map=lambda x: x[..., :4]),
            "feature_map must return a tensor of its input's shape",
        ),
        "chunk_size_zero": (lambda: linear_attention(q, k, v, causal=True, chunk_size=0), "chunk_size"),
        "chunk_size_negative": (lambda: linear_attention(q, k, v, causal=True, chunk_size=-4), "chunk_size"),
        "chunk_size_float": (lambda: linear_attention(q, k, v, causal=True, chunk_size=16.0), "chunk_size"),
        "mask_shape": (
            lambda: linear_attention(q, k, v, attention_mask=torch.ones(2, 11, dtype=torch.bool)),
            r"attention_mask must have shape \[batch, seq\] = \[2, 10\]",
        ),
        "mask_rank": (
            lambda: linear_attention(q, k, v, attention_mask=torch.ones(2, 1, 10, 10, dtype=torch.bool)),
            r"attention_mask must have shape \[batch, seq\]",
        ),
        "mask_dtype": (
            lambda: linear_attention(q, k, v, attention_mask=torch.ones(2, 10)),
            "attention_mask must be bool or integer",
        ),
        "state_kv_shape": (
            lambda: linear_attention(
                q, k, v, initial_state=LinearAttentionState(state.kv[:, :1], state.k_sum)
            ),
            r"initial_state.kv must have shape \[batch, kv_heads, head_dim, head_dim_v\] = \[2, 2, 8, 6\]",
        ),
        "state_k_sum_shape": (
            lambda: linear_attention(
                q, k, v, initial_state=LinearAttentionState(state.kv, state.k_sum[..., :7])
            ),
            r"initial_state.k_sum must have shape \[batch, kv_heads, head_dim\] = \[2, 2, 8\]",
        ),
        "state_type": (
            lambda: linear_attention(q, k, v, initial_state=state.kv),
            "initial_state must be a LinearAttentionState",
        ),
        "eps_negative": (lambda: linear_attention(q, k, v, eps=-1e-6), "eps must be"),
        "step_q_two_tokens": (
            lambda: linear_attention_step(q[:, :, :2], *one[1:], None),
            "q must hold one token",
        ),
        "step_k_two_tokens": (
            lambda: linear_attention_step(one[0], k[:, :, :2], v[:, :, :2], None),
            "k must hold one token",
        ),
        "step_state_shape": (
            lambda: linear_attention_step(*one, LinearAttentionState(state.kv[..., :5], state.k_sum)),
            r"state.kv must have shape",
        ),
        "step_feature_map": (
            lambda: linear_attention_step(*one, None, feature_map="nope"),
            "feature_map must be one of",
        ),
        "step_q_rank": (lambda: linear_attention_step(one[0][0], *one[1:], None), r"^q must have shape"),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_input_raises_a_value_error_naming_the_argument(case):
    call, argument = _bad_calls()[case]
    with pytest.raises(ValueError, match=argument):
        call()


# --- FLOP count -----------------------------------------------------------------------------------------------


def test_flop_count_of_the_causal_form():
    # The figure: B=1, H=8, T=8192, D=64 with chunks of 64 tokens, 2.15 GFLOP.
    assert linear_module.causal_linear_attention_flops(1, 8, 8192, 64) == 2_147_483_648
    assert linear_module.DEFAULT_CHUNK_SIZE == 64
    # Chunk by chunk, with a shorter tail chunk and grouped key/value heads.
    batch, heads, kv_heads, seq, dk, dv, chunk = 2, 4, 2, 130, 8, 6, 16
    expected = 0
    for start in range(0, seq, chunk):
        c = min(chunk, seq - start)
        expected += batch * heads * (2 * c * c * dk + 2 * c * c * dv + 2 * c * dk * dv)  # scores, ·V, ·S
        expected += batch * kv_heads * 2 * c * dk * dv  # the chunk's state
    counted = linear_module.causal_linear_attention_flops(
        batch, heads, seq, dk, dv, kv_heads=kv_heads, chunk_size=chunk
    )
    assert counted == expected


@pytest.mark.parametrize("padded", [False, True])
def test_the_unchecked_forms_are_the_checked_ones(padded):
    """``validate=False`` (what the layer passes) skips the checks and changes nothing else: prefill, then a step."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 6)
    mask = None
    if padded:
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[0, :3] = False
    results = {}
    for validate in (True, False):
        out, state = linear_attention(
            q[:, :, :8],
            k[:, :, :8],
            v[:, :, :8],
            causal=True,
            attention_mask=mask,
            chunk_size=3,
            output_final_state=True,
            validate=validate,
        )
        step, final = linear_attention_step(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], state, validate=validate)
        results[validate] = (out, step, *state, *final)
    for unchecked, checked in zip(results[False], results[True], strict=True):
        torch.testing.assert_close(unchecked, checked, rtol=0, atol=0)
