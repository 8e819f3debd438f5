"""Continuing a prompt with a saved causal LM: what ``headkit generate`` runs, as a library function.

:func:`generate` checks its options, loads the model quietly (:func:`load_generator`), streams the continuation
to standard output as it comes — through transformers' ``generate`` (greedy or sampled), or greedily through
headkit's compiled fixed-size step (:class:`~headkit.runtime.fast.FastDecoder`, ``fast=True``) — then reports
tokens per second and the size of the decoding cache (key/value cache or recurrent state) of the whole text.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.evaluation.memory import cache_bytes
from headkit.evaluation.sampling import pad_token_of
from headkit.surgery.linearize import max_context


@dataclass(frozen=True)
class GeneratedText:
    """What :func:`generate` produced: the token ids of the whole text (prompt and continuation) [1, P + n], the
    new tokens among them, the seconds they took, and the bytes of the decoding cache of the whole text. On the
    fast path: each shape bucket's first step in seconds (compilation or loading included), keyed by (batch, cache
    length), and the seconds of every step after each bucket's first. ``load_seconds``: loading the model;
    ``ready_seconds`` (fast path): from the model loaded to the first token out of the decoding step (the prompt,
    the decoder's set-up and finding or compiling the step included)."""

    ids: torch.Tensor
    new_tokens: int
    seconds: float
    cache_bytes: int
    compile_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    load_seconds: float = 0.0
    ready_seconds: float | None = None


def position_limit(model: nn.Module) -> int | None:
    """The number of positions `model` can embed when it learns absolute positions (a table of
    ``config.max_position_embeddings`` rows besides the token embeddings: GPT-2's ``n_positions``, a headkit
    model with ``position_embedding_type="learned"``), else None: rotary or ALiBi models extrapolate, so their
    ``max_position_embeddings`` is no hard limit."""
    limit = max_context(model)
    if limit is None:
        return None
    tokens = model.get_input_embeddings()
    tables = (
        module
        for module in model.modules()
        if isinstance(module, nn.Embedding) and module is not tokens and module.num_embeddings == limit
    )
    return limit if any(tables) else None


def load_generator(path: Path, dtype: str = "float32") -> tuple[nn.Module, Any]:
    """The causal LM at `path` (in `dtype`) and its tokenizer, offline (see headkit.runs.models.load_model); a
    folder trained by headkit before it wrote tokenizer.json gets its byte tokenizer from headkit."""
    from headkit.data import TOKENIZER_FILE, load_tokenizer
    from headkit.runs.models import CAUSAL_LM, load_model, model_kind, resolve_dtype
    from headkit.surgery.io import from_pretrained

    path = Path(path)
    if not path.exists():
        raise HeadkitError(f"MODEL {str(path)!r} does not exist")
    if model_kind(path) != CAUSAL_LM:
        raise HeadkitError(f"MODEL {str(path)!r} is not a causal LM (no *ForCausalLM in config.json)")
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        return from_pretrained(path, dtype=resolve_dtype(dtype)), load_tokenizer(path).to_transformers()
    loaded = load_model(path, kind=CAUSAL_LM, dtype=dtype)
    return loaded.model, loaded.tokenizer


def check_generate_options(
    prompt: str,
    max_new_tokens: int,
    *,
    sample: bool,
    temperature: float | None,
    top_k: int | None,
    fast: bool,
    weights: str | None,
    compile: bool,
) -> None:
    """The checks of :func:`generate`'s options that need no model, worded as ``headkit generate``'s options."""
    if not prompt.strip():
        raise HeadkitError("--prompt must not be empty")
    if max_new_tokens < 1:
        raise HeadkitError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    # not > 0: NaN is refused too
    if temperature is not None and not temperature > 0:
        raise HeadkitError(f"--temperature must be a positive number, got {temperature}")
    if top_k is not None and top_k < 0:
        raise HeadkitError(f"--top-k must be 0 (all tokens) or a positive integer, got {top_k}")
    if not sample and (temperature is not None or top_k is not None):
        raise HeadkitError("--temperature and --top-k shape sampling: add --sample")
    if not fast and (weights is not None or not compile):
        raise HeadkitError("--weights and --no-compile choose how --fast decodes: add --fast")
    if fast and sample:
        raise HeadkitError("--fast decodes greedily: drop --sample")


def generate(
    model: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    fast: bool = False,
    weights: str | None = None,
    compile: bool = True,
    echo: Callable[[str], None] = print,
) -> GeneratedText:
    """Continue `prompt` with the causal LM at `model` (a folder headkit wrote, a stock 🤗 folder or a GGUF
    file, loaded in `dtype` without progress bars), streaming the text to standard output as it comes; then
    `echo` the tokens per second and the size of the decoding cache of the whole text (and, with `fast`, each
    shape bucket's first step and the median step after it).

    Greedy unless `sample` (at `temperature`, default 1, among the `top_k` most likely tokens, default the
    model's; 0 = all), seeded by `seed`. `fast` decodes greedily through headkit's compiled fixed-size step
    (:class:`~headkit.runtime.fast.FastDecoder`) in `weights` (float32, bfloat16, int8 or int4; default
    `dtype`), compiled or, without `compile`, run eagerly. Every option is checked before the model loads; a
    prompt that would run past the positions a model learns (:func:`position_limit`) is refused before
    generating."""
    from transformers import TextStreamer

    from headkit.runs.models import no_loading_bars

    check_generate_options(
        prompt,
        max_new_tokens,
        sample=sample,
        temperature=temperature,
        top_k=top_k,
        fast=fast,
        weights=weights,
        compile=compile,
    )
    if fast:
        from headkit.runtime.fast import check_weights

        weights = check_weights(dtype if weights is None else weights)
    # no "Loading weights" or GGUF bar between the command and its text
    loading = time.perf_counter()
    with no_loading_bars():
        network, tokenizer = load_generator(Path(model), dtype)
    loaded = time.perf_counter()

    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise HeadkitError(f"--prompt {prompt!r} encodes to no tokens with this model's tokenizer")
    limit = position_limit(network)
    if limit is not None and ids.shape[1] + max_new_tokens > limit:
        raise HeadkitError(
            f"--prompt is {ids.shape[1]:,} tokens and --max-new-tokens {max_new_tokens} would reach position "
            f"{ids.shape[1] + max_new_tokens - 1:,}, beyond this model's {limit:,} positions "
            "(max_position_embeddings)"
        )
    config = copy.deepcopy(network.generation_config)
    config.max_new_tokens, config.max_length, config.do_sample = max_new_tokens, None, sample
    if sample:
        config.temperature = 1.0 if temperature is None else temperature
        config.top_k = top_k if top_k is not None else config.top_k
    else:
        # greedy: the model's own sampling defaults would only draw warnings
        config.temperature = config.top_k = config.top_p = config.min_p = None
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_of(tokenizer)
    torch.manual_seed(seed)
    streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    decoder = None
    if fast:
        from headkit.runtime.fast import FastDecoder

        decoder = FastDecoder(network, weights=weights, compile=compile)
    started = time.perf_counter()
    # the fast path's steps after each bucket's first (which compiles)
    steady: list[float] = []
    with torch.no_grad():
        if decoder is not None:
            output = decoder.generate(
                ids,
                max_new_tokens=max_new_tokens,
                eos_token_id=config.eos_token_id,
                streamer=streamer,
                step_seconds=steady,
            )
        else:
            output = network.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=streamer
            )
    seconds = time.perf_counter() - started
    new_tokens = output.shape[1] - ids.shape[1]
    # The cache of the whole text (prompt and continuation): its size depends on the length only.
    cache = cache_bytes(network, int(output.shape[1]))
    echo(
        f"{new_tokens} tokens in {seconds:.2f} s: {new_tokens / seconds:.1f} tokens/s; "
        f"cache {cache:,} bytes for {output.shape[1]} tokens"
    )
    ready = None
    if decoder is not None:
        for bucket, first_step in decoder.compile_seconds.items():
            batch, length = bucket
            echo(
                f"fast path, {weights} weights, batch {batch}, "
                f"{f'cache {length} tokens' if length else 'fixed-size state'}: {_step_origin(decoder, bucket)}; "
                f"first step {first_step:.2f} s"
            )
        if decoder.step_ready_at is not None:
            ready = decoder.step_ready_at - loaded
            echo(
                f"model loaded in {loaded - loading:.1f} s; ready {ready:.1f} s later "
                "(the first token out of the decoding step)"
            )
        if steady:
            median = statistics.median(steady)
            echo(
                f"fast path after the first step: median {median * 1e3:.1f} ms per token "
                f"({1 / median:.1f} tokens/s) over {len(steady)} steps"
            )
    return GeneratedText(
        ids=output,
        new_tokens=int(new_tokens),
        seconds=seconds,
        cache_bytes=cache,
        compile_seconds=dict(decoder.compile_seconds) if decoder is not None else {},
        step_seconds=steady,
        load_seconds=loaded - loading,
        ready_seconds=ready,
    )


def _step_origin(decoder: Any, bucket: tuple[int, int]) -> str:
    """Where the fast decoder's step for ``bucket`` came from, in words."""
    if not decoder.compiled:
        return "decoding step run eagerly (not compiled)"
    packaged = decoder.packaged_steps.get(bucket)
    if packaged is None:
        return "decoding step compiled in this process (once per shape bucket)"
    if packaged.source == "loaded":
        return f"decoding step loaded from {packaged.path} in {packaged.seconds:.1f} s (compiled once per machine)"
    if packaged.source == "compiled":
        return (
            f"decoding step compiled in {packaged.seconds:.1f} s and saved to {packaged.path} "
            "(once per machine: later processes load it)"
        )
    return f"decoding step compiled in memory in {packaged.seconds:.1f} s (the cache folder could not be written)"
