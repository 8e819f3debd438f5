"""headkit.fast_generate / FastDecoder: the compiled fixed-size decoding path against the eager model.

Greedy tokens equal eager ``generate()``'s in the same dtype (stock, fully linearized and hybrid tiny LLaMAs,
left padding included); the fixed buffers end in the eager cache's state; the step is one graph per shape bucket
(no graph break: fullgraph; no recompile across steps and calls); bad input gets a clear error. Most compiled
checks use the aot_eager backend (dynamo capture + functionalization, what compiling needs from the code, in
seconds); one test runs inductor itself."""

from __future__ import annotations

import importlib.util
import re
import shutil

import pytest
import torch
import transformers
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from transformers import CompileConfig, DynamicCache

import headkit
from headkit import HeadkitError, fast_generate, linearize
from headkit.compat import cache_keyword
from headkit.layers.cache import state_tensors
from headkit.layers.hybrid import RingHybridStateCacheLayer
from headkit.layers.quantized_cache import (
    QuantizedHybridStateCacheLayer,
    QuantizedRingHybridStateCacheLayer,
    exact_leaves,
)
from headkit.ops import (
    ring_from_state,
    sparse_hybrid_attention,
    sparse_hybrid_attention_step_,
    state_from_ring,
)
from headkit.ops.hybrid.quantized import dequantized_ring, store_ring_step_
from headkit.ops.quantized_cache import QuantizedTensor, quantize_values, unpack_codes
from headkit.runtime.fast import INDUCTOR_OPTIONS, FastDecoder, prepare_weights, quantizable_linears
from headkit.surgery import CompressedCacheConfig, LatentKVConfig, QuantizedKVConfig, recorded_configs
from headkit.surgery.latent_heads import StaticLatentCacheLayer, latent_cache_layer
from headkit.surgery.linearize import hybrid_cache_layer

VOCAB, PROMPT, NEW = 61, 9, 10
has_torchao = importlib.util.find_spec("torchao") is not None


def tiny_llama(layers: int = 2, hidden: int = 32, seed: int = 0) -> transformers.LlamaForCausalLM:
    # Wide initial weights: peaked, prompt-dependent logits, so that greedy tokens vary and an error would show.
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    # No end token: eager generate() runs all its NEW tokens, as the fast path is asked to.
    model.generation_config.eos_token_id = None
    return model


def linearized(layers: list[int] | None = None, window: int = 4, **options) -> transformers.LlamaForCausalLM:
    model = tiny_llama()
    linearize(model, window=window, layers=layers, **options)
    with torch.no_grad():  # a linear term that matters (trained balances are not 1 either)
        for name, parameter in model.named_parameters():
            if name.endswith("log_balance"):
                parameter.uniform_(-0.5, 0.5)
    return model


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first row
    return ids, mask


def eager_greedy(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def eager_cache_after(model, seen, mask) -> DynamicCache:
    """The eager cache after ``seen`` (a prompt of PROMPT tokens with its padding ``mask``, then generated tokens),
    fed as generate() feeds them: the prompt, then one token per step. The fast decoder's fixed buffers hold its
    state after the same tokens (all but the last generated)."""
    eager_cache = DynamicCache(config=model.config)
    full_mask = torch.cat([mask, torch.ones(2, seen.shape[1] - PROMPT, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # as generate() places left-padded rows
    with torch.no_grad():
        for start, stop in [(0, PROMPT), *((t, t + 1) for t in range(PROMPT, seen.shape[1]))]:
            model(
                input_ids=seen[:, start:stop],
                attention_mask=full_mask[:, :stop],
                position_ids=positions[:, start:stop],
                use_cache=True,
                **cache_keyword(eager_cache),
            )
    return eager_cache


def capture_config(counter) -> CompileConfig:
    return CompileConfig(fullgraph=True, dynamic=False, backend=counter, mode=None)


@pytest.mark.parametrize("recall", [False, True])
def test_the_compiled_sparse_ring_step_writes_its_slots_in_place(recall):
    # Under the fast path's inductor options the window, sink and cache slots are written row by row into the
    # caller's buffers: the generated code allocates no temporary of a slot buffer's shape (a whole copy of it,
    # made every token). With inductor's locality reordering back on, it does: the reason the option is off.
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, features, window, sinks, budget, prompt = 2, 4, 2, 8, 6, 6, 2, 3, 12
    q, k, v = (torch.randn(batch, h, prompt + 4, dim) for h in (heads, kv_heads, kv_heads))
    qf, kf = torch.rand(batch, heads, prompt + 4, features), torch.rand(batch, kv_heads, prompt + 4, features)
    balance = torch.rand(heads)
    options = {"window": window, "sinks": sinks, "budget": budget}
    _, state = sparse_hybrid_attention(
        *(x[:, :, :prompt] for x in (q, k, v, qf, kf)), balance, output_final_state=True, **options
    )
    ring = ring_from_state(state, prompt)
    slot_buffers = [ring.window.keys, ring.window.key_features, ring.window.keep]
    slot_buffers += [ring.sink_keys, ring.sparse_keys, ring.sparse_key_features]
    slot_shapes = {", ".join(map(str, buffer.shape)) for buffer in slot_buffers}

    def step(q, k, v, qf, kf, ring):
        # The question's choice: a decoding step asks none, its keys score 0.
        scores = None if recall else torch.zeros(batch, kv_heads, 1)
        return sparse_hybrid_attention_step_(
            q, k, v, qf, kf, balance, ring, sinks=sinks, budget=budget, scale=dim**-0.5, validate=False,
            key_scores=scores,
        )  # fmt: skip

    def temporaries(inductor: dict) -> set[str]:
        torch._dynamo.reset()
        ring, eager_ring = ring_from_state(state, prompt), ring_from_state(state, prompt)
        compiled = torch.compile(step, backend="inductor", fullgraph=True, options=inductor)
        shapes: set[str] = set()
        for t in range(prompt, prompt + 3):
            inputs = [x[:, :, t : t + 1] for x in (q, k, v, qf, kf)]
            out, code = run_and_get_code(compiled, *inputs, ring)
            torch.testing.assert_close(out, step(*inputs, eager_ring))
            shapes |= set(re.findall(r"empty_strided_cpu\(\((\d+(?:, \d+)*)\)", "".join(code)))
        for got, want in zip(state_from_ring(ring), state_from_ring(eager_ring), strict=True):
            torch.testing.assert_close(got, want)
        return shapes

    # cpp_wrapper only changes the host code around the kernels: off, for Python code to read and a faster test
    fast = {**INDUCTOR_OPTIONS, "cpp_wrapper": False}
    assert not temporaries(fast) & slot_shapes
    assert temporaries({**fast, "reorder_for_locality": True}) & slot_shapes


@pytest.mark.parametrize("full_window", [False, True], ids=["", "full-precision-window"])
def test_the_compiled_quantized_ring_step_stores_the_eager_codes(full_window):
    # Inductor's kernels for the quantized fixed buffers (dequantize, the op's step, the new token quantized into its
    # slot, a leaving key's codes copied into a sink or an empty kept slot) store the eager step's codes bit for bit:
    # the rounding, the scale rounded up (nextafter) and the 4-bit packing survive compilation. (float32: in bfloat16
    # attention reads the dequantized keys in float32, inductor fusing their cast to bfloat16 and back away where
    # eager rounds them, so its outputs are not eager's to the bit.)
    # The question's choice (a decoding step's keys score 0): which slot a key enters does not hang on the last bits
    # of a score. A prompt of 3 tokens: every key that leaves the window in the 5 steps moves. With the window in
    # full precision (`full_window`), a key that leaves it is quantized where it enters.
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, features = 2, 4, 2, 16, 6
    window, sinks, budget, prompt, steps, bits = 4, 1, 3, 3, 5, 4
    q, k, v = (torch.randn(batch, h, prompt + steps, dim) for h in (heads, kv_heads, kv_heads))
    qf = torch.rand(batch, heads, prompt + steps, features)
    kf = torch.rand(batch, kv_heads, prompt + steps, features)
    balance = torch.rand(heads)
    options = {"window": window, "sinks": sinks, "budget": budget}
    first = [x[:, :, :prompt] for x in (q, k, v, qf, kf)]
    _, state = sparse_hybrid_attention(*first, balance, output_final_state=True, **options)

    def stored_ring():
        ring = ring_from_state(state, prompt)

        def quantized(x):
            return quantize_values(x, bits=bits, group_size=8)

        window_ring = ring.window
        if not full_window:
            window_ring = window_ring._replace(
                keys=quantized(window_ring.keys), values=quantized(window_ring.values)
            )
        names = ("sink_keys", "sink_values", "sparse_keys", "sparse_values")
        return ring._replace(window=window_ring, **{name: quantized(getattr(ring, name)) for name in names})

    def step(q, k, v, qf, kf, stored):
        working = dequantized_ring(stored, bits=bits, group_size=8, kept_codes=True)  # as the decoder's
        out = sparse_hybrid_attention_step_(
            q, k, v, qf, kf, balance, working, sinks=sinks, budget=budget, validate=False,
            key_scores=torch.zeros(batch, kv_heads, 1),
        )  # fmt: skip
        store_ring_step_(stored, working, bits=bits, group_size=8)
        return out

    torch._dynamo.reset()
    inductor = {**INDUCTOR_OPTIONS, "cpp_wrapper": False}
    compiled = torch.compile(step, backend="inductor", fullgraph=True, options=inductor)
    mine, eager = stored_ring(), stored_ring()
    for t in range(prompt, prompt + steps):
        inputs = [x[:, :, t : t + 1] for x in (q, k, v, qf, kf)]
        torch.testing.assert_close(compiled(*inputs, mine), step(*inputs, eager), atol=1e-5, rtol=1e-5)
    quantized = {"window": not full_window}
    for got, want in zip(exact_leaves(mine, **quantized), exact_leaves(eager, **quantized), strict=True):
        assert all(torch.equal(*pair) for pair in zip(got[1], want[1], strict=True)), got[0]
    for got, want in zip(state_tensors(mine), state_tensors(eager), strict=True):
        if got.is_floating_point():  # the linear sums: inductor's own order of additions
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # the slots' bookkeeping
            assert torch.equal(got, want)
    assert bool(mine.sink_keep.all()) and bool(mine.window.keep.all())
    assert bool((mine.sparse_order >= budget).all())  # every kept slot filled by a key that left the window


def compressed_quantized(
    bits: int = 4, retrieval: bool = True, full_window: bool = False
) -> transformers.LlamaForCausalLM:
    """A compressed cache (window 4, a sink, 3 question-chosen keys; layer 0's key/value head 1 a retrieval head)
    whose exact keys and values are stored in ``bits`` bits, per token in groups of 8 channels (the window's in
    full precision with `full_window`)."""
    model = tiny_llama()
    compressed = CompressedCacheConfig(
        window=4, sinks=1, budget=3, observation=2, retrieval_heads=((0, 1),) if retrieval else ()
    )
    storage = QuantizedKVConfig(bits=bits, group_size=8, full_precision_window=full_window)
    headkit.apply_(model, [compressed, storage])
    return model


def compressed_by_reconstruction() -> transformers.LlamaForCausalLM:
    model = tiny_llama()
    headkit.apply_(
        model,
        CompressedCacheConfig(
            window=4, sinks=1, budget=3, selection="reconstruction", reconstruction_prompt=(5, 6),
            retrieval_heads=((1, 0),),
        ),
    )  # fmt: skip
    return model


def latent(**options) -> transformers.LlamaForCausalLM:
    model = tiny_llama()
    headkit.apply_(model, LatentKVConfig(kv_rank=6, rope_dims=4, **options))
    return model


FAST_MODELS = {
    "stock": tiny_llama,
    "linearized": linearized,
    "hybrid": lambda: linearized(layers=[1]),
    # the feature maps reading the slow rotary pairs rotated back: the module's tables reach the compiled step
    "rotated-back": lambda: linearized(feature_wavelength=8),
    # what is kept exact beyond the window: sinks and the sparse cache's slots, chosen by recall error or by the
    # question; retrieval heads' key/value buffers (a whole layer of them too); the dropping baseline
    "sinks-recall": lambda: linearized(sinks=2, budget=3),
    "question-retrieval": lambda: linearized(
        sinks=1, budget=4, selection="question", observation=4, retrieval_heads=[(0, 1)]
    ),
    "exact-layer": lambda: linearized(budget=2, retrieval_heads=[(1, 0), (1, 1)], feature_wavelength=8),
    "drop": lambda: linearized(sinks=1, budget=3, selection="question", fold=False),
    # the same kind of cache stored in 4 bits: codes, scales and zero points in the fixed buffers
    "quantized-retrieval": compressed_quantized,
    "quantized-full-window": lambda: compressed_quantized(full_window=True),
    # the keys chosen by the prompt's repetition (a scoring forward before the eager prefill)
    "reconstruction": lambda: compressed_by_reconstruction(),
    # latent keys/values (absorbed attention over one fixed buffer of rows), per-head rotary dims and RoRoPE's
    "latent": lambda: latent(rope_selection="norms"),
    "latent-rorope": lambda: latent(rope_selection="rorope"),
}


@pytest.mark.parametrize("kind", list(FAST_MODELS))
def test_fast_path_gives_eager_greedy_tokens_and_states(kind):
    model = FAST_MODELS[kind]()
    ids, mask = prompts()
    expected = eager_greedy(model, ids, mask)
    assert len(set(expected[:, PROMPT:].flatten().tolist())) > 2, (
        "degenerate model: tokens would prove little"
    )
    decoder = FastDecoder(model, compile=False)
    generated = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(generated, expected)

    (cache,) = decoder._caches.values()
    seen = generated[:, :-1]
    eager_cache = eager_cache_after(model, seen, mask)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, StaticLatentCacheLayer):
            want = latent_cache_layer(eager_cache, index).get_state()
            ((_, length),) = decoder._caches  # the buffer: the bucket's static length, written up to `seen`
            assert layer.get_seq_length() == seen.shape[1] and layer.state.shape[1] == length
            torch.testing.assert_close(layer.get_state(), want, atol=1e-5, rtol=1e-5)
        elif isinstance(layer, RingHybridStateCacheLayer):
            got = state_tensors(layer.get_state())
            want = state_tensors(hybrid_cache_layer(eager_cache, index).get_state())
            assert len(got) == len(want)
            for got_tensor, want_tensor in zip(got, want, strict=True):
                torch.testing.assert_close(got_tensor, want_tensor, atol=1e-5, rtol=1e-5)
            assert layer.get_seq_length() == seen.shape[1]
        else:
            stored = seen.shape[1]
            torch.testing.assert_close(layer.keys[:, :, :stored], eager_cache.layers[index].keys)
            torch.testing.assert_close(layer.values[:, :, :stored], eager_cache.layers[index].values)
    special = (RingHybridStateCacheLayer, StaticLatentCacheLayer)
    assert kind == "stock" or any(isinstance(layer, special) for layer in cache.layers)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("retrieval", [False, True], ids=["compressed", "retrieval-head"])
@pytest.mark.parametrize("full_window", [False, True], ids=["", "full-precision-window"])
def test_a_compressed_cache_stored_quantized_decodes_as_the_eager_cache_with_its_codes(
    bits, retrieval, full_window
):
    """[CompressedCacheConfig, QuantizedKVConfig] on the fast decoder: model.generate's greedy tokens (at 4 bits
    not those of the unquantized compressed cache), and fixed buffers that end holding the eager quantized cache's
    state. Layer 0's keys and values reach both by the same arithmetic: its codes, scales and zero points are the
    eager cache's bit for bit (a retrieval head's buffer in its first slots). A later layer's new keys differ from
    the eager ones in the last bits (the layer before attended through other kernels: the static buffers' step,
    another matmul order), as in the unquantized test above, and so do their scales and zero points: its
    dequantized state is compared within that test's 1e-5, its codes within one step. A window kept in full
    precision is compared with the rest of the state."""
    model = compressed_quantized(bits, retrieval, full_window)
    ids, mask = prompts()
    expected = eager_greedy(model, ids, mask)
    if bits == 4 and not full_window:
        # 8 bits leave this model's greedy tokens as they were; the codes below show they are stored
        unquantized = tiny_llama()
        headkit.apply_(unquantized, recorded_configs(model)[0])
        assert not torch.equal(eager_greedy(unquantized, ids, mask), expected), "the bits change nothing here"
    decoder = FastDecoder(model, compile=False)
    generated = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(generated, expected)

    (cache,) = decoder._caches.values()
    eager_cache = eager_cache_after(model, generated[:, :-1], mask)
    for index, (layer, eager) in enumerate(zip(cache.layers, eager_cache.layers, strict=True)):
        assert isinstance(layer, QuantizedRingHybridStateCacheLayer)
        assert isinstance(eager, QuantizedHybridStateCacheLayer)
        stored, eager_stored = (
            dict(layer.quantized_fields(layer.state)),
            dict(eager.quantized_fields(eager.state)),
        )
        assert stored.keys() == eager_stored.keys() and stored
        for path, quantized in stored.items():
            got, want = (QuantizedTensor(*(x[..., : eager_stored[path].codes.shape[-2], :] for x in quantized)),
                         eager_stored[path])  # fmt: skip
            if index == 0:
                assert all(torch.equal(*pair) for pair in zip(got, want, strict=True)), path
            else:
                codes = (unpack_codes(got.codes, bits).int() - unpack_codes(want.codes, bits).int()).abs()
                assert int(codes.max()) <= 1, path
        for got, want in zip(state_tensors(layer.get_state()), state_tensors(eager.get_state()), strict=True):
            if index == 0:
                assert torch.equal(got, want)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert layer.get_seq_length() == eager.get_seq_length() == generated.shape[1] - 1


@pytest.mark.parametrize(
    "kind, regions",
    [
        ("stock", True),
        ("linearized", True),
        ("linearized", False),
        ("question-retrieval", True),
        ("exact-layer", False),
        ("quantized-retrieval", True),
        ("reconstruction", True),
        ("latent", True),
        ("latent-rorope", False),
    ],
    ids=[
        "stock",
        "linearized",
        "linearized-whole-step",
        "sparse-retrieval",
        "sparse-exact-layer-whole-step",
        "int4-compressed-retrieval",
        "reconstruction-chosen",
        "latent",
        "latent-rorope-whole-step",
    ],
)
def test_compiled_step_is_one_graph_per_bucket_with_eager_tokens(kind, regions):
    model = FAST_MODELS[kind]()
    graphs = 3 if regions else 1  # per decoder layer and the output layer, or the whole step
    ids, mask = prompts()
    expected = eager_greedy(model, ids, mask)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    decoder = FastDecoder(model, compile_config=capture_config(counter), regions=regions, ahead_of_time=False)
    assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW), expected)
    # Another prompt in the same bucket: the caches are reset, not rebuilt, and the graph is reused.
    other = torch.randint(1, VOCAB, (2, PROMPT + 3), generator=torch.Generator().manual_seed(2))
    again = decoder.generate(other, max_new_tokens=NEW)
    assert torch.equal(again, eager_greedy(model, other, torch.ones_like(other)))
    assert counter.frame_count == graphs, (
        f"{counter.frame_count} graphs for one bucket: a recompile or a break"
    )
    assert len(decoder.compile_seconds) == 1
    if kind == "linearized":  # the state does not depend on the context: one bucket for any length
        longer = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
        decoder.generate(longer, max_new_tokens=4)
        assert counter.frame_count == graphs and list(decoder.compile_seconds) == [(2, 0)]


@pytest.mark.slow
def test_inductor_steps_decode_each_model_with_its_own_weights():
    """Inductor with the default options (weights frozen into the graphs as constants; autotuned C++ GEMMs for
    int8) and steady-state steps that check only the guards telling graphs apart: decoders of one architecture
    with different weights, alternating in one process, each decode their own model — a graph that served
    another model's frozen weights would give other tokens."""
    if not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler for inductor")
    torch._dynamo.reset()
    ids, mask = prompts()
    other = torch.randint(1, VOCAB, (2, PROMPT + 2), generator=torch.Generator().manual_seed(2))
    models = {
        "first": tiny_llama(),
        "second": tiny_llama(seed=1),
        "linearized": linearized(),
        "question-retrieval": FAST_MODELS["question-retrieval"](),
    }
    decoders = {name: FastDecoder(model) for name, model in models.items()}
    expected = {name: eager_greedy(model, ids, mask) for name, model in models.items()}
    assert not torch.equal(expected["first"], expected["second"])  # the two weight sets decode differently
    for _ in range(2):  # the second round runs every bucket in its steady state
        for name, decoder in decoders.items():
            assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW), expected[name])
    for name, decoder in decoders.items():  # another prompt in the same buckets
        got = decoder.generate(other, max_new_tokens=NEW)
        assert torch.equal(got, eager_greedy(models[name], other, torch.ones_like(other))), name
    # The public function: a decoder of its own, whose graphs come from inductor's cache.
    got = fast_generate(models["linearized"], ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(got, expected["linearized"])
    if has_torchao:
        # int8 computes in bfloat16 (8 significant bits), and inductor rounds inside its fused kernels where eager
        # rounds after every op: a near-tie may go either way. Each token the compiled path picks is the eager
        # int8 model's argmax up to such a tie (teacher-forced on the compiled path's own sequence).
        quantized = prepare_weights(models["first"], "int8")
        compiled = FastDecoder(models["first"], weights="int8")
        assert compiled.compile_config.options["max_autotune"]
        for prompt, padding in ((ids, mask), (other, torch.ones_like(other))):
            got = compiled.generate(prompt, attention_mask=padding, max_new_tokens=NEW)
            full = torch.cat([padding, torch.ones(len(got), NEW, dtype=padding.dtype)], dim=1)
            with torch.no_grad():
                logits = quantized(
                    got, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp_min(0)
                ).logits.float()[:, prompt.shape[1] - 1 : -1]
            picked = logits.gather(-1, got[:, prompt.shape[1] :, None])[..., 0]
            best = logits.max(dim=-1).values
            assert bool((picked >= best - 0.05 * best.abs().clamp_min(1)).all()), (best - picked).max()
            assert (picked == best).float().mean() >= 0.9  # ties are rare: most picks are the exact argmax


@pytest.mark.skipif(not has_torchao, reason="torchao (headkit[fast]) is not installed")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_weights_keep_the_model_and_decode_as_their_eager_selves(weights):
    model = tiny_llama()
    reference = {name: p.clone() for name, p in model.state_dict().items()}
    quantized = prepare_weights(model, weights)
    for name, tensor in model.state_dict().items():  # the model passed in is untouched
        assert torch.equal(tensor, reference[name])
    assert quantized.get_input_embeddings().weight is not quantized.get_output_embeddings().weight
    # Each quantized layer against its exact self (int8: a scale per row; int4: per 32 input features).
    inputs = torch.randn(16, 32)
    with torch.no_grad():
        exact = model.model.layers[0].self_attn.q_proj(inputs)
        approximate = quantized.model.layers[0].self_attn.q_proj(inputs.bfloat16()).float()
    error = ((approximate - exact).norm() / exact.norm()).item()
    assert error < (0.02 if weights == "int8" else 0.2), error
    ids, mask = prompts()
    eager = FastDecoder(model, weights=weights, compile=False).generate(
        ids, attention_mask=mask, max_new_tokens=6
    )
    counter = CompileCounterWithBackend("aot_eager")
    compiled = FastDecoder(
        model, weights=weights, compile_config=capture_config(counter), ahead_of_time=False
    )
    assert torch.equal(compiled.generate(ids, attention_mask=mask, max_new_tokens=6), eager)
    assert counter.frame_count == 3


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_are_what_a_step_reads_of_its_weights(tied):
    """Every parameter once in the step's dtype; the input embedding (a row per sequence read) only where the
    output layer shares it; quantized weights by their codes and scales."""
    model = tiny_llama()
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    embedding = model.get_input_embeddings().weight.numel()
    numbers = sum(p.numel() for p in model.parameters()) - (0 if tied else embedding)
    assert FastDecoder(model, weights="float32", compile=False).weight_bytes == 4 * numbers
    assert FastDecoder(model, weights="bfloat16", compile=False).weight_bytes == 2 * numbers
    if has_torchao:
        int8 = FastDecoder(model, weights="int8", compile=False)
        linear = sum(module.weight.numel() for module in quantizable_linears(model).values())
        # one byte per quantized number, a scale (and zero point) per output row, the norms in bfloat16
        assert linear < int8.weight_bytes < 2 * numbers
        scales = int8.weight_bytes - linear - 2 * (numbers - linear)
        rows = sum(module.weight.shape[0] for module in quantizable_linears(model).values())
        assert 2 * rows <= scales <= 8 * rows, scales  # torchao's layout: at most two float32 numbers a row


@pytest.mark.parametrize("kind", ["stock", "latent", "question-retrieval"])
def test_a_longer_cache_length_decodes_the_same_tokens_in_its_own_bucket(kind):
    """cache_length sizes the fixed buffers (one bucket for generations of different lengths): the same greedy
    tokens as the shortest bucket, with buffers of the length asked for, rounded up to the bucket size."""
    model = FAST_MODELS[kind]()
    ids, mask = prompts()
    decoder = FastDecoder(model, compile=False)
    short = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    longer = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW, cache_length=600)
    assert torch.equal(longer, short) and set(decoder._caches) == {(2, 256), (2, 768)}


def test_bad_input_is_named():
    model = tiny_llama(hidden=40)  # in_features 40 and 80: no group of 32 fits
    with pytest.raises(HeadkitError, match="weights must be one of float32, bfloat16, int8, int4"):
        FastDecoder(model, weights="int3", compile=False)
    with pytest.raises(
        HeadkitError,
        match=r"groups of 32 input features.*model\.layers\.0\.self_attn\.q_proj "
        r"\(in_features 40, weight \(32, 40\)\)",
    ):
        FastDecoder(model, weights="int4", compile=False)
    decoder = FastDecoder(tiny_llama(), compile=False)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(HeadkitError, match="left padding only"):
        decoder.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(HeadkitError, match="max_new_tokens must be a positive integer"):
        decoder.generate(ids, max_new_tokens=0)
    with pytest.raises(HeadkitError, match=r"cache_length must be an integer of at least .* = 12, got 11"):
        decoder.generate(ids, max_new_tokens=8, cache_length=11)
    with pytest.raises(HeadkitError, match="fullgraph must be True"):
        FastDecoder(tiny_llama(), compile_config=CompileConfig(fullgraph=False))


def test_one_token_attention_groups_query_heads_instead_of_repeating_keys():
    from headkit.compat import attention_implementation

    model, hybrid = tiny_llama(), FAST_MODELS["hybrid"]()
    before = attention_implementation(model), attention_implementation(hybrid)
    decoder, hybrid_decoder = FastDecoder(model, compile=False), FastDecoder(hybrid, compile=False)
    assert attention_implementation(decoder.model) == "grouped_query_decode"
    assert attention_implementation(hybrid_decoder.model) == "headkit_grouped_query_decode"
    assert (attention_implementation(model), attention_implementation(hybrid)) == before  # theirs untouched
    ids, mask = prompts()
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(got, eager_greedy(model, ids, mask))


def test_without_a_compiler_the_step_runs_eagerly_after_one_line(monkeypatch, caplog):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    model = tiny_llama()
    ids, mask = prompts()
    with caplog.at_level("WARNING", logger="headkit.runtime.fast"):
        decoder = FastDecoder(model)
    assert not decoder.compiled and not decoder.ahead_of_time
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "no C++ compiler found" in lines[0] and "\n" not in lines[0]
    assert torch.equal(
        decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW), eager_greedy(model, ids, mask)
    )


def test_a_model_loaded_from_gguf_is_decoded_and_left_as_loaded():
    # transformers marks a model loaded with gguf_file= as quantized (dequantized on load, plain float tensors)
    # and refuses .float()/.to(dtype) on it: the decoder's copy is told it is a plain model, the user's is not.
    model = tiny_llama()
    ids, mask = prompts()
    expected = eager_greedy(model, ids, mask)
    model.is_quantized, model.quantization_method = True, "gguf"
    for weights in ("float32", "bfloat16"):
        decoder = FastDecoder(model, weights=weights, compile=False)
        if weights == "float32":
            assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW), expected)
    assert model.is_quantized and model.quantization_method == "gguf"
