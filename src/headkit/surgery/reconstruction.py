"""The scoring forward of a compressed cache that keeps what the model reads to repeat a prompt (KVzip).

KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv:2505.23416, §3.2) scores a prompt's keys before any question: it runs the prompt, a request to repeat it,
and the prompt again, and keeps the keys the repetition attends to most
(:func:`headkit.ops.key_selection.reconstruction_scores`). A question asked later, in a second turn, then finds
what it needs, where SnapKV's choice (the prompt's own last queries) keeps what the first turn asked about.

:class:`ReconstructionPrefill` is a forward pre-hook on the converted model (the one ``headkit.apply_`` or
:func:`headkit.from_pretrained` was given): when a prompt of more than one token is prefilled into an empty cache
(``generate()``, ``model(ids, use_cache=True)``, the fast decoder's prefill), it first runs the model's base
without a cache on ``[prompt, request, prompt[a:b]]`` for each chunk ``[a, b)`` of the repetition, with every
compressed layer's :class:`~headkit.layers.kept_exact.ReconstructionSelection` recording scores, then lets the
prefill go on, which keeps by them. The repetition is split into chunks of at most :data:`REPETITION_CHUNK`
tokens, and fewer where the prompt, the request and a chunk would run past the model's context (KVzip repeats
long contexts in chunks too): each chunk attends to the whole prompt, so the cost is about ``1 + chunks`` prompt
lengths of prefill instead of one. A forward hook clears any score a failed prefill left behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from headkit.compat import CACHE_ARGUMENT_NAMES
from headkit.layers.kept_exact import ReconstructionSelection
from headkit.surgery.linearize_config import max_context

# The most tokens of the repetition scored in one forward: a whole 4K prompt where the context leaves room (each
# forward also reruns the prompt, so fewer chunks cost less; KVzip repeats in chunks of 2K on a GPU, for memory).
REPETITION_CHUNK = 4096
# Below this many tokens a chunk, the context's limit gives way (see repetition_chunks).
SHORTEST_CHUNK = 256
# The request between the prompt and its repetition (KVzip's "Repeat the previous context exactly.").
REPETITION_REQUEST = "\n\nRepeat the previous context exactly.\n\n"


class ReconstructionPrefill:
    """Forward pre-hook and hook (``with_kwargs=True``) of a model whose compressed cache chooses by
    reconstruction: the scoring forwards before a prefill into an empty cache (module docstring)."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt = tuple(prompt)
        self.running = False
        self.scored: list[ReconstructionSelection] = []  # those whose scores the prefill under way keeps by

    def selections(self, model: nn.Module) -> list[ReconstructionSelection]:
        """The selections of the model's layers that choose by reconstruction (those with a budget to fill)."""
        found = {}
        for module in model.modules():
            kept = getattr(module, "kept", None)
            if isinstance(getattr(kept, "selection", None), ReconstructionSelection) and kept.budget:
                found[id(kept.selection)] = kept.selection
        return list(found.values())

    def before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.running:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if input_ids is not None and embeds is not None:
            input_ids = None  # generate() hands both for a prompt given as embeddings; the model reads those
        prompt_input = input_ids if input_ids is not None else embeds
        if prompt_input is None or prompt_input.shape[1] < 2 or kwargs.get("use_cache") is False:
            return
        cache = next((kwargs[name] for name in CACHE_ARGUMENT_NAMES if kwargs.get(name) is not None), None)
        if cache is not None and cache.get_seq_length() > 0:
            return  # a later turn: its tokens are scored by their own last queries
        selections = self.selections(model)
        if not selections:
            return
        self.running, self.scored = True, selections
        try:
            with torch.no_grad():
                self.score(model, selections, input_ids, embeds, kwargs.get("attention_mask"))
        except BaseException:
            self.after(model, args, kwargs, None)
            raise
        finally:
            for selection in selections:
                selection.scoring = None
            self.running = False

    def after(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After the prefill (or its failure): no score is left for a later prompt. A decoding step finds
        nothing to do (the fast decoder compiles it with this hook)."""
        if self.running and output is not None:
            return  # the scoring forward of a model that is its own base
        for selection in self.scored:
            selection.pending = None
        self.scored = []

    def score(
        self,
        model: nn.Module,
        selections: list[Any],
        input_ids: torch.Tensor | None,
        embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> None:
        """Run the scoring forwards: each selection's ``pending`` holds its layer's scores after."""
        given = input_ids if input_ids is not None else embeds
        batch, length, device = given.shape[0], given.shape[1], given.device
        mask = (
            torch.ones(batch, length, dtype=torch.long, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.long).expand(batch, length)
        )
        prompt = torch.tensor(self.prompt, dtype=torch.long, device=device).expand(batch, -1)
        for selection in selections:
            selection.pending = None
        base = model.base_model
        for start, stop in repetition_chunks(length, len(self.prompt), max_context(model)):
            chunk_mask = torch.cat([mask, torch.ones_like(prompt), mask[:, start:stop]], dim=1)
            # Each row's padding moved to its left end, as a prompt alone has none in its middle: a sliding
            # window counts the tokens between a query and a key, padding included.
            order = torch.sort(chunk_mask, dim=1, stable=True).indices
            voters = torch.zeros_like(chunk_mask, dtype=torch.bool)
            voters[:, length + len(self.prompt) :] = True
            chunk_mask, voters = chunk_mask.gather(1, order), voters.gather(1, order)
            positions = torch.argsort(order, dim=1)[:, :length]  # where each prompt token went
            inputs: dict[str, Any]
            if input_ids is not None:
                ids = torch.cat([input_ids, prompt, input_ids[:, start:stop]], dim=1)
                inputs = {"input_ids": ids.gather(1, order)}
            else:
                request = model.get_input_embeddings()(prompt).to(embeds.dtype)
                sequence = torch.cat([embeds, request, embeds[:, start:stop]], dim=1)
                inputs = {
                    "inputs_embeds": sequence.gather(1, order[..., None].expand(-1, -1, sequence.shape[-1]))
                }
            for selection in selections:
                selection.scoring = (positions, voters & chunk_mask.bool())
            base(
                **inputs,
                attention_mask=chunk_mask,
                position_ids=(chunk_mask.cumsum(-1) - 1).clamp_min(0),
                use_cache=False,
            )


def repetition_chunks(length: int, prompt: int, context: int | None) -> list[tuple[int, int]]:
    """The spans of a `length`-token prompt repeated one forward each, of equal size: at most
    :data:`REPETITION_CHUNK` tokens, and no more than the model's `context` leaves after the prompt and the
    `prompt`-token request — unless that is under :data:`SHORTEST_CHUNK`: a prompt that (nearly) fills the context
    is repeated beyond it rather than in hundreds of forwards."""
    room = REPETITION_CHUNK
    if context is not None and context - length - prompt >= SHORTEST_CHUNK:
        room = min(room, context - length - prompt)
    size = min(length, room)
    count = -(-length // size)
    size = -(-length // count)
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def repetition_request(tokenizer: Any, text: str = REPETITION_REQUEST) -> tuple[int, ...]:
    """The token ids of `text` (default :data:`REPETITION_REQUEST`), without special tokens: what
    ``CompressedCacheConfig(reconstruction_prompt=...)`` takes."""
    return tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])


def attach_reconstruction_prefill(model: nn.Module, prompt: Sequence[int] | None = None) -> None:
    """Give `model` the scoring forward of a compressed cache that chooses by reconstruction, asking `prompt`
    before the repetition (once: a model that has it keeps the one it has, its request replaced by `prompt`, or
    kept where `prompt` is None)."""
    prefill = getattr(model, "_headkit_reconstruction_prefill", None)
    if isinstance(prefill, ReconstructionPrefill):
        prefill.prompt = prefill.prompt if prompt is None else tuple(prompt)
        return
    prefill = ReconstructionPrefill(() if prompt is None else prompt)
    model.register_forward_pre_hook(prefill.before, with_kwargs=True)
    model.register_forward_hook(prefill.after, with_kwargs=True, always_call=True)
    model._headkit_reconstruction_prefill = prefill


__all__ = [
    "REPETITION_CHUNK",
    "REPETITION_REQUEST",
    "ReconstructionPrefill",
    "attach_reconstruction_prefill",
    "repetition_chunks",
    "repetition_request",
]
