"""Whether the compressed cache keeps the key a second turn asks for, by the way its keys are chosen (SmolLM2-135M).

    PYTHONPATH=src python docs/scripts/second_turn_kept_keys.py OUT.json LENGTH PROMPTS BITS RETRIEVAL BUDGET
        [SELECTIONS] [GROUP_SIZE]        (torch threads: THREADS, default 2)

A second turn (headkit.evaluation.retrieval.second_turn_passkeys) prefills a passkey prompt without its last 512
tokens, then feeds those (other text, then the question) through the cache. On the same prompts, each row answers
them with the same cache (window 256, 4 sinks, BUDGET chosen keys per head, RETRIEVAL retrieval heads — those of
``headkit compress --kv-budget 1/8`` —, stored in BITS 16, 8 or 4 with the window in bfloat16, a scale per
GROUP_SIZE numbers, default 32), its keys chosen by:

* ``original``: no cache of its own (every token kept), the reference;
* ``question``: the first turn's last 32 queries (SnapKV, the compressed cache's default);
* ``reconstruction``: the first turn's repetition (KVzip, the ``selection="reconstruction"`` built in);
* ``oracle``: the second turn's own last 32 queries on the original (the question that will be asked), the first
  turn's keys scored by them before it is asked — a choice that knows the question.

Beside each row's answers it counts, from the scores the first turn's prefill keeps by (the cache keeps the BUDGET
best of the keys leaving its window after the sinks: headkit.ops.hybrid.sparse), the share of the key sentence's
tokens kept per compressed layer, over its key/value heads that are not retrieval heads. The second turn can evict
some later: not counted.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from headkit.bench.retrieval import ANSWER_TOKENS, beyond_window_trials
from headkit.evaluation.retrieval import passkey_answer, prose_sentences, second_turn_passkeys
from headkit.layers.kept_exact import QuestionSelection
from headkit.ops.key_selection import observation_scores
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.text import load_text
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig
from headkit.surgery.apply import apply_
from headkit.surgery.linearize import linearized_modules
from headkit.surgery.reconstruction import repetition_request

GAP, WINDOW, SINKS, OBSERVATION = 512, 256, 4, 32
# headkit compress --kv-budget 1/8's retrieval heads on SmolLM2 (docs/compressed-cache.md)
RETRIEVAL_HEADS = ((7, 2), (14, 1), (17, 0), (17, 1), (18, 2), (20, 1), (21, 2), (23, 0))
ORACLE: dict[int, torch.Tensor] = {}  # layer → [1, Hkv, first turn] the second turn's question scores


def capture_question(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """sdpa's output, and SnapKV's scores of every key by the sequence's last queries."""
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    ORACLE[module.layer_idx] = observation_scores(query, key, observation=OBSERVATION, scale=scale)
    return sdpa_attention_forward(module, query, key, *args, **kwargs)


class OracleSelection(QuestionSelection):
    """The first turn's keys scored by the question the second turn will ask."""

    def __init__(self, layer: int, first: list[int], heads: list[int]) -> None:
        super().__init__(OBSERVATION)
        # heads: the layer's compressed key/value heads (its retrieval heads are not scored)
        self.layer, self.first, self.heads = layer, first, heads

    def key_scores(self, queries, keys, new_mask, scale, prefill, past=None):  # noqa: ANN001, ANN201 (the selection's call)
        given = ORACLE.get(self.layer)
        if prefill and given is not None and keys.shape[2] == self.first[0]:
            return given[:, self.heads, : keys.shape[2]]
        return super().key_scores(queries, keys, new_mask, scale, prefill, past)


def recording(module: Any, first: list[int], kept: dict[int, torch.Tensor]) -> None:
    """Wrap a compressed layer's selection to record the scores the first turn's prefill keeps by."""
    selection = module.kept.selection
    score = selection.key_scores

    def key_scores(queries, keys, new_mask, scale, prefill, past=None):  # noqa: ANN001, ANN202
        scores = score(queries, keys, new_mask, scale, prefill, past)
        if prefill and keys.shape[2] == first[0]:
            kept[module.layer_idx] = scores.detach().float().cpu()
        return scores

    selection.key_scores = key_scores


def kept_share(scores: torch.Tensor, budget: int, start: int, stop: int) -> float:
    """The share of tokens start..stop kept by the heads scored (a layer's compressed ones: its retrieval heads
    keep every token and are not scored): the budget best-scored keys that left the window."""
    length = scores.shape[2]
    leaving = length - (WINDOW - 1)
    ranked = scores[0, :, SINKS:leaving]
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :budget] + SINKS
    kept = torch.zeros(scores.shape[1], length, dtype=torch.bool)
    kept.scatter_(1, order, True)
    kept[:, :SINKS] = True
    kept[:, leaving:] = True
    return kept[:, start:stop].float().mean().item()


def main(
    out: str,
    length: int = 4096,
    prompts: int = 20,
    bits: int = 4,
    retrieval: int = 8,
    budget: int = 1977,
    selections: str = "original,question,reconstruction,oracle",
    group_size: int = 32,
) -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    loaded = load_model(smollm2_gguf_path(), kind=CAUSAL_LM)
    original, tokenizer = loaded.model.eval(), loaded.tokenizer
    sentences = prose_sentences(load_text(None), seed=0)
    _, turns = beyond_window_trials(tokenizer, sentences, (length,), prompts, WINDOW, GAP, 0)
    heads = RETRIEVAL_HEADS[:retrieval]
    AttentionInterface.register("headkit_capture_question", capture_question)
    scorer = copy.deepcopy(original)
    scorer.set_attn_implementation("headkit_capture_question")

    def cache(selection: str) -> list[Any]:
        chosen = "question" if selection == "oracle" else selection
        extra = {"reconstruction_prompt": repetition_request(tokenizer)} if chosen == "reconstruction" else {}
        configs: list[Any] = [
            CompressedCacheConfig(
                window=WINDOW, sinks=SINKS, budget=budget, retrieval_heads=heads, selection=chosen, **extra
            )
        ]
        if bits != 16:
            configs.append(QuantizedKVConfig(bits=bits, full_precision_window=True, group_size=group_size))
        return configs

    rows: dict[str, Any] = {}
    with torch.no_grad():
        for selection in selections.split(","):
            if selection == "original":
                started = time.perf_counter()
                answers = second_turn_passkeys(
                    original, tokenizer, turns, gap=GAP, max_new_tokens=ANSWER_TOKENS
                )
                correct = [passkey_answer(text) == t.key for t, text in zip(turns, answers, strict=True)]
                seconds = time.perf_counter() - started
                rows["original"] = {"correct": sum(correct), "per_prompt": correct, "seconds": seconds}
                print(f"original: {sum(correct)}/{len(turns)}", flush=True)
                continue
            model = copy.deepcopy(original)
            apply_(model, cache(selection))
            first = [0]
            kept: dict[int, torch.Tensor] = {}
            for module in linearized_modules(model):
                if selection == "oracle":
                    module.kept.selection = OracleSelection(
                        module.layer_idx, first, list(module.linear_heads)
                    )
                recording(module, first, kept)
            started = time.perf_counter()
            correct, shares = [], []
            for trial in turns:
                ids = torch.tensor(trial.input_ids)
                first[0] = len(ids) - GAP
                if selection == "oracle":
                    ORACLE.clear()
                    scorer(input_ids=ids[None], use_cache=False)
                answer = second_turn_passkeys(
                    model, tokenizer, [trial], gap=GAP, max_new_tokens=ANSWER_TOKENS
                )[0]
                correct.append(passkey_answer(answer) == trial.key)
                span = (trial.key_position, trial.key_position + trial.key_tokens)
                shares.append(
                    {layer: kept_share(scores, budget, *span) for layer, scores in sorted(kept.items())}
                )
            by_layer = {layer: sum(s[layer] for s in shares) / len(shares) for layer in shares[0]}
            rows[selection] = {
                "correct": sum(correct),
                "per_prompt": correct,
                "key_kept_by_layer": by_layer,
                "key_kept": sum(by_layer.values()) / len(by_layer),
                "key_kept_answered": sum(
                    sum(s.values()) / len(s) for s, c in zip(shares, correct, strict=True) if c
                )
                / max(1, sum(correct)),
                "seconds": time.perf_counter() - started,
            }
            with open(out, "w") as handle:  # each row saved as it ends
                json.dump({"length": length, "rows": rows}, handle, indent=2)
            print(
                f"{selection}: {sum(correct)}/{len(turns)}, key kept {rows[selection]['key_kept']:.3f} "
                f"({rows[selection]['seconds']:.0f} s)",
                flush=True,
            )
    results = {
        "length": length,
        "gap": GAP,
        "trials": len(turns),
        "cache": [config.record() for config in cache("question")],
        "rows": rows,
    }
    with open(out, "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main(
        sys.argv[1],
        *(int(arg) for arg in sys.argv[2:7]),
        *sys.argv[7:8],
        *(int(arg) for arg in sys.argv[8:9]),
    )
