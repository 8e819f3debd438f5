"""Teacher-forced NLL of the pass key in second turns, by the storage of a plan's cache (SmolLM2-135M).

    PYTHONPATH=src python docs/scripts/second_turn_nll.py OUT.json LENGTH PROMPTS ROWS   (torch threads: THREADS, 1)

PLAN=8 (default) keeps the ``--kv-budget 1/8`` plan's tokens, PLAN=16 the 1/16 plan's (W 256, S 4, B 740, the same
8 retrieval heads, the window quantized with the rest in ``int4``); TURN=first scores the key right after the prompt
(the one-turn passkey: the prompt, its question included, prefilled, then the key through the cache) instead of
after a second turn.

The second turns of headkit bench frontier (the first turn prefilled without its last 512 tokens, then those through
the cache), each followed by " " and its key: the summed negative log-likelihood of the key's tokens, the first
token's, and how many keys are every token the argmax. ROWS, a comma list: ``original``; ``bf16`` (the plan's
tokens — W 256, S 4, B 1,977, its 8 retrieval heads — in bfloat16); ``int8``; ``int4`` (the plan itself, the window
in bfloat16); ``int4rot`` (int4 with every stored token rotated by a normalised Hadamard matrix before it is
quantized and rotated back after it is dequantized, QuaRot's rotation, patched into headkit's quantizer here: not
built). A continuous score of the same prompts, where a count of 20 moves by whole prompts.
"""

import copy
import json
import math
import os
import sys
import time

import torch

import headkit.layers.quantized_cache as lq
import headkit.ops.hybrid.quantized as hq
import headkit.ops.hybrid.step as hs
import headkit.ops.quantized_attention as qa
import headkit.ops.quantized_cache as qc
from headkit.bench.retrieval import beyond_window_trials
from headkit.compat import cache_keyword, output_cache
from headkit.evaluation.retrieval import prose_sentences
from headkit.runs.models import CAUSAL_LM, load_model, smollm2_gguf_path
from headkit.runs.text import load_text
from headkit.surgery import CompressedCacheConfig, QuantizedKVConfig
from headkit.surgery.apply import apply_

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
out, length, prompts, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
GAP = 512
RETRIEVAL = ((7, 2), (14, 1), (17, 0), (17, 1), (18, 2), (20, 1), (21, 2), (23, 0))


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


plain_q, plain_dq = qc.quantize_values, qc.dequantize_values


def rot_q(values, *, bits, group_size):
    h = hadamard(values.shape[-1]).to(torch.float32)
    return plain_q((values.to(torch.float32) @ h).to(values.dtype), bits=bits, group_size=group_size)


def rot_dq(quantized, *, bits, group_size, dtype=None):
    width = quantized.codes.shape[-1] * 8 // bits
    h = hadamard(width).to(torch.float32)
    return (plain_dq(quantized, bits=bits, group_size=group_size, dtype=torch.float32) @ h.T).to(
        dtype or quantized.scale.dtype
    )


def rotation(on):
    for m in (qc, hq, qa, hs, lq):
        if hasattr(m, "quantize_values"):
            m.quantize_values = rot_q if on else plain_q
        if hasattr(m, "dequantize_values"):
            m.dequantize_values = rot_dq if on else plain_dq


loaded = load_model(smollm2_gguf_path(), kind=CAUSAL_LM)
original, tok = loaded.model.eval(), loaded.tokenizer
sentences = prose_sentences(load_text(None), seed=0)
first_turn = os.environ.get("TURN", "second") == "first"
budget, exact_window = {"8": (1977, True), "16": (740, False)}[os.environ.get("PLAN", "8")]
one_turn, second = beyond_window_trials(tok, sentences, (length,), prompts, 256, GAP, 0)
compressed = CompressedCacheConfig(
    window=256, sinks=4, budget=budget, observation=32, retrieval_heads=RETRIEVAL
)
configs = {
    "original": [],
    "bf16": [compressed],
    "int8": [compressed, QuantizedKVConfig(bits=8, full_precision_window=exact_window)],
    "int4": [compressed, QuantizedKVConfig(bits=4, full_precision_window=exact_window)],
    "int4rot": [compressed, QuantizedKVConfig(bits=4, full_precision_window=exact_window)],
}
results = {}
for row in rows:
    rotation(row == "int4rot")
    model = copy.deepcopy(original)
    if configs[row]:
        apply_(model, configs[row])
    started, nll, firsts, argmax_ok = time.time(), [], [], 0
    with torch.no_grad():
        for trial in one_turn if first_turn else second:
            ids = torch.tensor([trial.input_ids])
            answer = torch.tensor([tok(" " + trial.key, add_special_tokens=False).input_ids])
            cut = ids.shape[1] - (0 if first_turn else GAP)
            prefill = model(input_ids=ids[:, :cut], use_cache=True)
            cache = output_cache(prefill)
            rest = torch.cat([ids[:, cut:], answer], 1)
            logits = model(input_ids=rest, use_cache=True, **cache_keyword(cache)).logits.float()
            # The one-turn key's first token is the prefill's prediction, as in the benchmark's greedy answer.
            logits = torch.cat([prefill.logits[:, -1:].float(), logits], 1)
            n = answer.shape[1]
            pred = logits[0, -n - 1 : -1].log_softmax(-1)
            token_nll = -pred.gather(-1, answer[0, :, None])[:, 0]
            nll.append(token_nll.sum().item())
            firsts.append(token_nll[0].item())
            argmax_ok += int((pred.argmax(-1) == answer[0]).all())
    results[row] = {
        "nll_mean": sum(nll) / len(nll),
        "nll": nll,
        "first_token_nll_mean": sum(firsts) / len(firsts),
        "teacher_forced_all_correct": argmax_ok,
        "prompts": len(second),
        "seconds": time.time() - started,
    }
    print(row, {k: v for k, v in results[row].items() if k != "nll"}, flush=True)
    json.dump(results, open(out, "w"), indent=1)
