"""Fast greedy decoding on CPU: a compiled single-token step over fixed-size caches, with bfloat16, int8 or int4
weights — :func:`fast_generate` and :class:`FastDecoder` (``headkit generate --fast --weights …``).

What it does, following transformers' own recipe for compiled generation (a static cache and
``torch.compile`` of the decoding forward, ``CompileConfig(fullgraph=True, dynamic=False)``; prefill eager):

* **Fixed-size buffers.** Key/value layers get transformers' ``StaticCache`` entries (keys and values
  preallocated for the whole bucket, written in place; sliding-window layers its fixed sliding entries).
  Linearized layers (:func:`headkit.linearize`) get a :class:`~headkit.layers.hybrid.RingHybridStateCacheLayer`:
  the LoLCATs window as a ring buffer and the linear sums, updated in place by the op's one decoding step
  (:func:`headkit.ops.hybrid_attention_step_`, the eager cache's too) — no window re-concatenated per token. What
  such a layer keeps exact beyond its window is fixed buffers too: sinks and the sparse cache are slots that a key
  enters in place, evicting the worst kept key (:func:`headkit.ops.hybrid.sparse_hybrid_attention_step_`,
  no re-gathering of the cache per token), and retrieval heads write their keys and values into buffers of the
  bucket's length (:func:`headkit.ops.softmax.softmax_attention_static_step_`). A compressed cache stored in 8 or
  4 bits (``[CompressedCacheConfig, QuantizedKVConfig]``) keeps those buffers as codes, scales and zero points
  (:class:`~headkit.layers.quantized_cache.QuantizedRingHybridStateCacheLayer`): the step dequantizes them, runs
  the same op, and quantizes the new token into its slot, the eager cache's codes (KIVI's quantizer per token).
  A stock model's quantized key/value cache (``QuantizedKVConfig`` alone) is refused: ``model.generate``.
  Latent key/value layers (``LatentKVConfig``) keep their rows [c ; k_rope] in one buffer of the bucket's length
  (:class:`~headkit.surgery.latent_heads.StaticLatentCacheLayer`), a step's row written at its slot and the
  absorbed attention (:func:`headkit.ops.latent.latent_attention`) reading the whole buffer under the model's mask.
* **Compiled once per machine, one graph per step.** By default (``ahead_of_time=True``) the step — the model's
  forward on one token per row and the argmax — is exported with the cache's buffers as inputs it writes in
  place, compiled by AOTInductor into one graph (weights frozen in as constants, a C++ wrapper) and saved as a
  packaged ``.pt2`` in a per-machine folder (:mod:`headkit.runtime.packaged`), keyed by the weights, the shape
  bucket, the weight type, the thread count, the CPU, the library versions and headkit's sources. The first
  process compiles (about a minute for SmolLM2); every later one loads the package in about a second and runs no
  tracing and no compiler. A bucket is (batch, cache length rounded up to :data:`CACHE_BUCKET` tokens), or
  (batch) alone when every layer is linearized without retrieval heads (the state does not depend on the
  context).
  ``ahead_of_time=False`` compiles in the process instead, with ``torch.compile`` (``fullgraph=True``: a graph
  break is an error, not a silent eager fallback), each decoder layer and the output layer as a region
  (``regions=True``) or the whole step as one graph; after a bucket's first step every step runs under dynamo's
  ``fail_on_recompile`` stance, checking only the guards that tell its graphs apart (:func:`_steady_state`).
  Either way inductor freezes the weights and writes a C++ wrapper; quantized weights get its autotuned C++ GEMM
  templates (:func:`compile_config_for`). :attr:`FastDecoder.compile_seconds` records what each bucket's first
  step cost (finding or compiling the step included), and ``headkit generate --fast`` says whether it loaded or
  compiled.
* **Weights.** ``float32`` (as loaded), ``bfloat16`` (the model cast; AVX-512 BF16 / AMX CPUs run it natively),
  ``int8`` / ``int4``: weight-only quantization of every ``nn.Linear`` outside the attention mechanisms headkit
  adds — int8 with one scale per output row (torchao's fused int8 matmul; per-group int8 dequantized the whole
  weight every step, 8× slower on this CPU), int4 with one per group of :data:`GROUP_SIZE` input features —
  through torchao (the optional extra
  ``headkit[fast]``; PyTorch's own packed kernels are private aten ops), computing in bfloat16. A tied output
  projection is untied first (the quantized copy is the output layer's; the embedding stays exact).

The decoded tokens are the eager model's in the same dtype (tests compare them on tiny models, and the
buffers' states with the eager cache's); bfloat16 and int8 are judged against float32 by held-out perplexity in
``headkit bench decode``. Without a C++ compiler (inductor's CPU backend needs one) the same fixed-size step runs
eagerly, announced in one line, as with ``compile=False``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, CompileConfig, StaticCache

from headkit.compat import cache_keyword
from headkit.errors import HeadkitError
from headkit.evaluation.timing import timed_call
from headkit.layers.hybrid import RingHybridStateCacheLayer
from headkit.layers.quantized_cache import QuantizedRingHybridStateCacheLayer
from headkit.ops.softmax import grouped_query_step_attention
from headkit.runs.models import dequantized_from_gguf, forget_gguf_quantization
from headkit.runtime.packaged import cache_buffers
from headkit.surgery.attention import (
    base_implementation,
    mechanism_of,
    register_base_mask,
    set_attention_implementation,
)
from headkit.surgery.latent_heads import LatentKVHeads, StaticLatentCacheLayer
from headkit.surgery.linearize import LinearizedHeads
from headkit.surgery.quantized_cache import quantized_mechanisms

logger = logging.getLogger(__name__)

WEIGHTS = ("float32", "bfloat16", "int8", "int4")
QUANTIZED_WEIGHTS = ("int8", "int4")  # weight-only, through torchao
GROUP_SIZE = 32  # input features per quantization scale (int8, int4): llama.cpp's Q4_1/Q8_0 use 32 as well
CACHE_BUCKET = 256  # static cache lengths are rounded up to a multiple of this: one compiled graph per bucket
# Inductor's options for the step, measured on SmolLM2 (docs/decoding.md, "How the step is compiled, and
# why"): weights frozen into the graphs as constants (inductor packs them for its GEMMs) and the C++ wrapper (no
# Python between a graph's kernels) — float32 46.0 ms/token against 53.2 with inductor's defaults, both with the
# steady-state guards below; quantized weights add max-autotune's C++ GEMM templates (torchao's int8 weight-only
# matmul as one AVX-512/AMX micro-kernel): 38.5 ms against 43.7.
# reorder_for_locality off: that pass moves each read of a state buffer next to its use, after the step's
# indexed write into the same buffer, and inductor then cannot write in place: the linearized model's step
# copied its whole window and sparse cache twice per token (docs/decoding.md).
INDUCTOR_OPTIONS: dict[str, Any] = {"freezing": True, "cpp_wrapper": True, "reorder_for_locality": False}
QUANTIZED_INDUCTOR_OPTIONS: dict[str, Any] = {
    **INDUCTOR_OPTIONS,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


def compile_config_for(weights: str) -> CompileConfig:
    """transformers' conventions for a compiled decoding forward, strict (a graph break is an error, shapes
    static), with the inductor options measured best for ``weights``."""
    options = QUANTIZED_INDUCTOR_OPTIONS if check_weights(weights) in QUANTIZED_WEIGHTS else INDUCTOR_OPTIONS
    return CompileConfig(fullgraph=True, dynamic=False, mode=None, options=dict(options))


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise HeadkitError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return weights


def compiler_found() -> bool:
    """Whether torch.compile / AOTInductor can build CPU code here (inductor compiles C++)."""
    candidates = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    return any(name and shutil.which(name) for name in candidates)


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers weight-only quantization replaces: all but those inside a headkit mechanism
    (a linearized layer's feature maps stay exact: they are tiny and shape the attention weights)."""
    inside = {
        id(sub)
        for module in model.modules()
        if (mechanism := mechanism_of(module)) is not None
        for sub in mechanism.modules()
    }
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and id(module) not in inside
    }


def held_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds: its elements, or for a tensor subclass (torchao's quantized weights) the tensors
    it is made of, codes and scales."""
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None and type(tensor) not in (torch.Tensor, nn.Parameter):
        names, _ = inner()
        return sum(held_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def check_group_size(model: nn.Module, weights: str, group_size: int = GROUP_SIZE) -> None:
    """A HeadkitError naming every layer whose input features are not a multiple of ``group_size`` (int4
    weights hold one scale per group of input features; int8 one per output row)."""
    if weights != "int4":  # int8 scales whole rows
        return
    misfits = [
        f"{name} (in_features {module.in_features}, weight {tuple(module.weight.shape)})"
        for name, module in quantizable_linears(model).items()
        if module.in_features % group_size
    ]
    if misfits:
        shown = "; ".join(misfits[:5]) + (f"; … {len(misfits) - 5} more" if len(misfits) > 5 else "")
        raise HeadkitError(
            f"--weights {weights} quantizes in groups of {group_size} input features, which these layers' "
            f"shapes do not fit: {shown}"
        )


def _torchao() -> Any:
    try:
        import torchao.quantization as quantization
    except ImportError as error:
        raise HeadkitError(
            "int8 and int4 weights need torchao: pip install 'headkit[fast]' (or torchao)"
        ) from error
    return quantization


def prepare_weights(model: nn.Module, weights: str, group_size: int = GROUP_SIZE) -> nn.Module:
    """A copy of ``model`` (left untouched) with ``weights``: float32, bfloat16, or weight-only quantized
    through torchao, computing in bfloat16: int8 with one scale per output row, int4 with one per group of
    ``group_size`` input features."""
    check_weights(weights)
    check_group_size(model, weights, group_size)
    quantization = _torchao() if weights in QUANTIZED_WEIGHTS else None
    prepared = copy.deepcopy(model).eval()
    if dequantized_from_gguf(prepared):  # cast below, which transformers refuses a "quantized" model
        forget_gguf_quantization(prepared)
    if weights == "float32":
        return prepared.float()
    prepared = prepared.to(torch.bfloat16)
    if quantization is None:
        return prepared
    output, embedding = prepared.get_output_embeddings(), prepared.get_input_embeddings()
    if output is not None and embedding is not None and output.weight is embedding.weight:
        # Tied: the output layer gets its own (quantized) copy; the embedding lookup stays exact.
        output.weight = nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
        prepared.config.tie_word_embeddings = False
    chosen = {id(module) for module in quantizable_linears(prepared).values()}
    granularity = quantization.PerGroup(group_size) if hasattr(quantization, "PerGroup") else None
    if granularity is None:
        from torchao.quantization.granularity import PerGroup

        granularity = PerGroup(group_size)
    if weights == "int8":
        # One scale per output row: torchao lowers it to the fused int8 weight-only matmul (per-group int8
        # dequantizes the whole weight every step on CPU: ~8× slower per token than this, measured).
        config = quantization.Int8WeightOnlyConfig()
    else:
        config = quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=granularity)
    quantization.quantize_(prepared, config, filter_fn=lambda module, name: id(module) in chosen)
    return prepared


GROUPED_QUERY_DECODE = "grouped_query_decode"


def grouped_query_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for one query token per row over grouped key/value heads: there the
    query heads of a group attend as rows of one SDPA call (:func:`headkit.ops.softmax.grouped_query_step_attention`)
    instead of over keys repeated per query head, a copy of the whole static cache per layer and step (measured:
    the packaged SmolLM2 step at 8,192 tokens, see docs/decoding.md)."""
    one_token = query.shape[2] == 1 and query.shape[1] != key.shape[1]
    shared_mask = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if one_token and shared_mask and not (module.training and dropout) and kwargs.get("softcap") is None:
        output = grouped_query_step_attention(query, key, value, attention_mask, scale=scaling)
        return output.transpose(1, 2).contiguous(), None
    sdpa = AttentionInterface()["sdpa"]
    return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def use_grouped_query_decode(model: nn.Module) -> None:
    """Run a model whose layers use sdpa through :func:`grouped_query_decode_attention` (the decoder's own copy
    of the model; headkit's mechanisms keep dispatching through ``headkit_<base>`` with it as the base)."""
    if base_implementation(model) != "sdpa":  # eager or flash attention: left as chosen
        return
    if GROUPED_QUERY_DECODE not in AttentionInterface():
        AttentionInterface.register(GROUPED_QUERY_DECODE, grouped_query_decode_attention)
        register_base_mask(GROUPED_QUERY_DECODE, "sdpa")
    set_attention_implementation(model, GROUPED_QUERY_DECODE)


def _decoder_layer_count(model: nn.Module) -> int:
    config = model.config.get_text_config(decoder=True)
    return int(config.num_hidden_layers)


def linearized_layer_indices(model: nn.Module) -> list[int]:
    """The ``layer_idx`` of every attention layer the model runs through :class:`LinearizedHeads`."""
    return sorted(module.layer_idx for module in model.modules() if isinstance(module, LinearizedHeads))


class FastDecoder:
    """Greedy decoding of one model through compiled single-token steps over fixed-size caches (see the module
    docstring). Build it once and call :meth:`generate` as often as needed: each shape bucket is compiled on
    its first use and reused after; the caches are reset, not rebuilt, between calls.

    ``weights``: float32, bfloat16, int8 or int4 (:func:`prepare_weights`; the model passed in is not changed).
    ``compile``: False runs the same steps eagerly (announced in the log; so does a machine without a C++
    compiler). ``ahead_of_time``: the step compiled once per machine and loaded by later processes (AOTInductor
    packages in ``artifacts``, default :func:`headkit.runtime.packaged.artifact_folder`); False compiles it in this
    process with ``torch.compile``, as regions (``regions``) or as one graph. ``compile_config``: transformers'
    ``CompileConfig`` (default :func:`compile_config_for` the weights; ``fullgraph`` must stay True); ahead of
    time only its inductor ``options`` apply. The weights are frozen into the compiled step: build a new decoder
    after changing the model (a changed model is another package, never the old one).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        weights: str = "float32",
        compile: bool = True,
        group_size: int = GROUP_SIZE,
        compile_config: CompileConfig | None = None,
        regions: bool = True,
        ahead_of_time: bool = True,
        artifacts: str | os.PathLike[str] | None = None,
    ) -> None:
        check_weights(weights)
        if not callable(getattr(model, "get_output_embeddings", None)) or not hasattr(model, "config"):
            raise HeadkitError(f"model must be a 🤗 causal LM, got {type(model).__name__}")
        if getattr(model.config, "model_type", None) == "headkit":
            raise HeadkitError(
                "the fast path decodes stock 🤗 models and those headkit converted (pruned, compressed, "
                "linearized); headkit's own HeadkitForCausalLM compiles as a whole: torch.compile(model)"
            )
        if compile and not compiler_found():
            logger.warning(
                "no C++ compiler found (CXX, g++, c++, clang++), which compiling the decoding step needs on CPU: "
                "the fixed-size step runs eagerly"
            )
            compile = False
        elif not compile:
            logger.warning("fast decoding without compilation: the fixed-size step runs eagerly")
        self.weights, self.compiled = weights, compile
        self.compile_config = compile_config_for(weights) if compile_config is None else compile_config
        if not self.compile_config.fullgraph:
            raise HeadkitError(
                "compile_config.fullgraph must be True: a graph break would hide eager code in the step"
            )
        if quantized_mechanisms(model):
            name = getattr(model.config, "name_or_path", "") or type(model).__name__
            raise HeadkitError(
                f"model: {name} keeps its key/value cache quantized (QuantizedKVConfig), which the fast decoder's "
                "static cache would not: decode it with model.generate (a compressed cache stored quantized decodes "
                "here)"
            )
        self.model = prepare_weights(model, weights, group_size)
        use_grouped_query_decode(self.model)
        self.linearized = linearized_layer_indices(self.model)
        # Latent key/value layers: their rows in one fixed buffer per layer (StaticLatentCacheLayer).
        self.latent = sorted(
            module.layer_idx for module in self.model.modules() if isinstance(module, LatentKVHeads)
        )
        # The storage settings of the linearized layers whose exact keys and values are stored quantized.
        self.quantized_storage = {
            module.layer_idx: module.quantized_storage
            for module in self.model.modules()
            if isinstance(module, LinearizedHeads) and module.quantized_storage is not None
        }
        self.layer_count = _decoder_layer_count(self.model)
        self.all_linearized = len(self.linearized) == self.layer_count
        # Retrieval heads keep a key/value buffer as long as the context: a static length per bucket again.
        self.context_free = self.all_linearized and not any(
            getattr(module, "exact_heads", ()) for module in self.model.modules()
        )
        parameters = inspect.signature(self.model.forward).parameters
        self._takes_cache_position = "cache_position" in parameters
        self.ahead_of_time = ahead_of_time and compile
        self.artifacts = None if artifacts is None else Path(artifacts)
        self.regions = regions and compile and not self.ahead_of_time
        if self.regions:
            self._compile_regions()
        self.compile_seconds: dict[tuple[int, int], float] = {}
        # Ahead of time: each bucket's packaged step, as found or built (its source, path and seconds).
        self.packaged_steps: dict[tuple[int, int], Any] = {}
        # perf_counter() when the last generate() had its first token from the decoding step (None: it had none).
        self.step_ready_at: float | None = None
        self._caches: dict[tuple[int, int], Any] = {}
        self._compiled_for: set[tuple[tuple[int, int], int]] = set()
        self._steps: dict[Any, Any] = {}
        self._weights_digest: str | None = None

    @property
    def weight_bytes(self) -> int:
        """The bytes of the weights each decoding step reads, as the step holds them (a quantized weight's codes
        and scales): every parameter but the input embedding, of which a step reads one row per sequence (unless
        the output layer shares it, read whole)."""
        output = self.model.get_output_embeddings()
        embedding = self.model.get_input_embeddings()
        shared = output is not None and embedding is not None and output.weight is embedding.weight
        skipped = set() if embedding is None or shared else {id(embedding.weight)}
        unique = {id(p): p for p in self.model.parameters() if id(p) not in skipped}
        return sum(held_bytes(p) for p in unique.values())

    @property
    def step_sources(self) -> dict[tuple[int, int], str]:
        """How each bucket's packaged step was found: "loaded", "compiled" (and saved) or "compiled in memory"."""
        return {bucket: step.source for bucket, step in self.packaged_steps.items()}

    # -- buckets and caches -------------------------------------------------------------------------------------

    def bucket(self, batch: int, total_length: int) -> tuple[int, int]:
        """(batch, static cache length) of a generation; the length is 0 when no layer's state grows with the
        context (every layer linearized, no retrieval heads)."""
        if self.context_free:
            return batch, 0
        return batch, -(-total_length // CACHE_BUCKET) * CACHE_BUCKET

    def _cache(self, bucket: tuple[int, int], prompt_length: int) -> Any:
        batch, length = bucket
        cache = self._caches.get(bucket)
        if cache is None:
            cache = StaticCache(config=self.model.config, max_cache_len=max(length, 1))
            for index in self.linearized:
                cache.layers[index] = self._ring_layer(index)
            for index in self.latent:
                cache.layers[index] = StaticLatentCacheLayer()
            self._caches[bucket] = cache
        else:
            for layer in cache.layers:
                layer.reset()
        # Mask sizes during the prompt: the static length, or the prompt itself when nothing else is cached.
        for index in [*self.linearized, *self.latent]:
            cache.layers[index].mask_length = length if length else prompt_length
            cache.layers[index].capacity = length
        return cache

    def _ring_layer(self, index: int) -> RingHybridStateCacheLayer:
        """The fixed-size entry of linearized layer ``index``: its exact keys and values stored as the model
        stores them (quantized after a QuantizedKVConfig: the eager cache's codes, in fixed buffers)."""
        if index not in self.quantized_storage:
            return RingHybridStateCacheLayer()
        return QuantizedRingHybridStateCacheLayer().configure(**self.quantized_storage[index])

    def _compile_options(self) -> dict[str, Any]:
        config = self.compile_config  # its to_dict() deep-copies: a backend object would be a copy
        return {
            name: getattr(config, name) for name in ("fullgraph", "dynamic", "backend", "mode", "options")
        }

    def _compile_regions(self) -> None:
        """Regional compilation (torch's recipe against cold-start time): each decoder layer and the output
        layer compiled on its own (``nn.Module.compile``). The decoder layers share one code object, so
        inductor builds one layer's kernels and its cache serves the others; the whole-model graph (30 layers
        unrolled for SmolLM2) compiles for ten minutes on two cores. Between the regions run the embedding
        lookup, the rotary angles and the mask: a few operations per step."""
        layers = decoder_layers(self.model)
        # torch's own modules are skipped as top frames by dynamo: the output layer is compiled inside a wrapper.
        output = CompiledRegion(self.model.get_output_embeddings())
        self.model.set_output_embeddings(output)
        for module in [*layers, output]:
            module.compile(**self._compile_options())
        self._region_count = len(layers) + 1

    def _step_function(
        self, bucket: tuple[int, int], token: torch.Tensor, position: torch.Tensor, mask: Any, cache: Any
    ) -> Any:
        """The step of ``bucket`` as ``step(token, position, mask, cache)``: compiled in this process, or, ahead
        of time, a packaged step loaded (or built and saved once per machine) on the bucket's first call."""
        if not self.ahead_of_time:
            step = self._steps.get(bucket)
            if step is None:
                step = self._decode_step
                if self.compiled and not self.regions:
                    step = torch.compile(step, **self._compile_options())
                self._steps[bucket] = step
            return step
        threads = torch.get_num_threads()  # inductor writes the thread count into its parallel loops
        buffers = cache_buffers(cache)  # the same tensors for the whole generation: written in place
        packaged = self._steps.get((bucket, threads))
        if packaged is None:
            packaged = self._packaged_step(bucket, token, position, mask, cache, buffers)
            self._steps[(bucket, threads)] = packaged
            self.packaged_steps[bucket] = packaged

        def step(token: torch.Tensor, position: torch.Tensor, mask: Any, cache: Any) -> torch.Tensor:
            masks = () if mask is None else (mask,)
            return packaged(token, position, *masks, *buffers)

        return step

    def _packaged_step(
        self,
        bucket: tuple[int, int],
        token: torch.Tensor,
        position: torch.Tensor,
        mask: Any,
        cache: Any,
        buffers: list[torch.Tensor],
    ) -> Any:
        from headkit.runtime.packaged import StepWithStateInputs, artifact_key, packaged_step, weights_digest

        if self._weights_digest is None:
            self._weights_digest = weights_digest(self.model)
        step = StepWithStateInputs(self.model, cache, self._decode_step, takes_mask=mask is not None)
        description = {
            "weight_type": self.weights,
            "bucket": list(bucket),
            "mask": mask is not None,
            "inductor": self.compile_config.options or {},
        }
        key = artifact_key(self.model, buffers, description, weights=self._weights_digest)
        inputs = [token, position.clone(), *(() if mask is None else (mask,)), *buffers]
        # The export runs the step once on fake tensors: the cache's buffers are neither read nor written.
        return packaged_step(step, inputs, key, dict(self.compile_config.options or {}), self.artifacts)

    def _decode_step(
        self, token: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any
    ) -> torch.Tensor:
        """One token per row in, the greedy next token per row out [B, 1]: the compiled hot path."""
        return self._next_token(token, positions, attention_mask, cache)

    def _next_token(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """The greedy next token [B, 1] after ``input_ids`` (one forward with the cache, the last logits only)."""
        arguments = {"position_ids": positions}
        if self._takes_cache_position:  # transformers < 5.24 places new keys by cache_position
            arguments["cache_position"] = positions[0]
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=1,
            **arguments,
            **cache_keyword(cache),
        ).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    # -- generation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        eos_token_id: int | list[int] | None = None,
        streamer: Any = None,
        step_seconds: list[float] | None = None,
        cache_length: int | None = None,
    ) -> torch.Tensor:
        """Greedy continuation of ``input_ids`` [B, P] (left padding marked by ``attention_mask`` [B, P]):
        [B, P + n] ids, n ≤ ``max_new_tokens`` (fewer when every row has produced ``eos_token_id``).
        ``streamer``: a transformers streamer (``put``/``end``). ``step_seconds``: appended the wall time of
        every decoding step after the first token (for benchmarks). ``cache_length``: the tokens the fixed
        buffers hold (default P + ``max_new_tokens``; either rounded up to :data:`CACHE_BUCKET`): one compiled
        bucket for generations of different lengths. A step reads its whole buffers whatever they hold, so its
        time at a cache length is that after a prompt of that length."""
        input_ids, attention_mask = self._check_inputs(
            input_ids, attention_mask, max_new_tokens, cache_length
        )
        batch, prompt_length = input_ids.shape
        bucket = self.bucket(batch, cache_length or prompt_length + max_new_tokens)
        cache = self._cache(bucket, prompt_length)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # The prompt runs eagerly, as in transformers' generate(): one graph per prompt length would not pay.
        with torch.compiler.set_stance("force_eager"):
            token = self._next_token(input_ids, positions, attention_mask, cache)
        generated = [token]
        if streamer is not None:
            streamer.put(token.cpu())
        if self.all_linearized:
            decode_mask = None  # no layer reads a mask in a step: every new token is real
            for index in self.linearized:
                cache.layers[index].mask_length = 1
        else:
            decode_mask = torch.ones(batch, bucket[1], dtype=torch.long)
            decode_mask[:, :prompt_length] = attention_mask
        position = positions[:, -1:].clone()
        finished = _finished(token, eos_token_id)
        self.step_ready_at = None
        step = None
        for _ in range(max_new_tokens - 1):
            if finished is not None and bool(finished.all()):
                break
            position += 1
            # torch.compile guards on the thread count: a new count is a new graph, compiled like a new bucket.
            first = (bucket, torch.get_num_threads()) not in self._compiled_for
            prepared = 0.0  # finding or building a packaged step, counted in the bucket's first step
            if step is None or first:
                step, prepared = timed_call(
                    lambda token=token, position=position: self._step_function(
                        bucket, token, position, decode_mask, cache
                    ),
                    token.device,
                )
            with _first_step(self) if first else _steady_state():
                token, seconds = timed_call(
                    lambda token=token, position=position, step=step: step(
                        token, position.clone(), decode_mask, cache
                    ),
                    token.device,
                )
            if self.step_ready_at is None:
                self.step_ready_at = time.perf_counter()
            if first:
                self._compiled_for.add((bucket, torch.get_num_threads()))
                self.compile_seconds[bucket] = seconds + prepared
                if self.compiled and not self.ahead_of_time:
                    logger.info(
                        "compiled the decoding step for batch %d, cache %s in %.1f s (once per shape bucket)",
                        batch,
                        bucket[1] or "state only",
                        seconds,
                    )
            elif step_seconds is not None:
                step_seconds.append(seconds)
            if finished is not None:  # a finished row repeats its end token, as generate() pads it
                token = torch.where(finished, generated[-1], token)
                finished = finished | _finished(token, eos_token_id)
            generated.append(token)
            if streamer is not None:
                streamer.put(token.cpu())
        if streamer is not None:
            streamer.end()
        return torch.cat([input_ids, *generated], dim=1)

    def _check_inputs(
        self, input_ids: Any, attention_mask: Any, max_new_tokens: int, cache_length: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise HeadkitError(
                f"input_ids must be a [batch, prompt length ≥ 1] tensor of token ids, got {got}"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise HeadkitError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        needed = input_ids.shape[1] + max_new_tokens
        if cache_length is not None and (
            isinstance(cache_length, bool) or not isinstance(cache_length, int) or cache_length < needed
        ):
            raise HeadkitError(
                f"cache_length must be an integer of at least the prompt's {input_ids.shape[1]} tokens plus "
                f"max_new_tokens ({max_new_tokens}) = {needed}, got {cache_length!r}"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise HeadkitError(
                f"attention_mask must be a [batch, prompt length] = {list(input_ids.shape)} padding mask, got {got}"
            )
        if not bool(attention_mask[:, -1].all()):
            raise HeadkitError(
                "attention_mask: the fast decoder takes left padding only (each row's last token real)"
            )
        return input_ids, attention_mask.long()


def _finished(token: torch.Tensor, eos_token_id: int | list[int] | None) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.isin(token, torch.tensor(ids, device=token.device))


class CompiledRegion(nn.Module):
    """A module run through another one's forward, so that ``nn.Module.compile`` can compile a torch module
    (dynamo does not start a frame inside torch's own modules)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a 🤗 causal LM: the module list of ``num_hidden_layers`` modules of one class."""
    count = _decoder_layer_count(model)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and len({type(m) for m in module}) == 1:
            return list(module)
    raise HeadkitError(
        f"found no list of {count} decoder layers in {type(model).__name__} to compile: pass regions=False"
    )


def _steady_state() -> Any:
    """The stance of every step after a bucket's first: a recompile raises, and dynamo runs only the guards that
    tell its cache entries apart. Evaluating all of them cost more than the step's matrix products on SmolLM2
    (31 regions, 30 of them entries of one code object: 79.2 ms/token with int8 weights, 38.5 without).
    Nothing the skipped guards check changes between steps of a bucket: the same model and cache objects (reset
    in place), the same shapes; a new thread count is a new first step, which runs with every guard. A model
    changed after its decoder was built is not seen (frozen weights are constants anyway): build a new one."""
    return torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True)


@contextlib.contextmanager
def _first_step(decoder: FastDecoder) -> Iterator[None]:
    """The first step of a bucket compiles: with regions, every decoder layer is an entry of one code object's
    cache (they differ in guards only), so dynamo's default budget of 8 per code object is raised to fit them."""
    if not decoder.regions:
        yield
        return
    limit = 64 * decoder._region_count
    with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=limit):
        yield


def fast_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    weights: str = "float32",
    compile: bool = True,
    eos_token_id: int | list[int] | None = None,
    streamer: Any = None,
) -> torch.Tensor:
    """Greedy decoding of ``model`` (stock or converted by headkit) through a compiled single-token step over
    fixed-size caches, with ``weights`` float32 / bfloat16 / int8 / int4: [B, P + n] ids (see
    :class:`FastDecoder`, which keeps compiled steps between calls — this builds a new one every call)."""
    decoder = FastDecoder(model, weights=weights, compile=compile)
    return decoder.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        streamer=streamer,
    )


__all__ = [
    "CACHE_BUCKET",
    "GROUP_SIZE",
    "WEIGHTS",
    "FastDecoder",
    "check_group_size",
    "fast_generate",
    "prepare_weights",
]
