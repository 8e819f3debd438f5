"""NVIDIA kvpress' ``SnapKVPress`` answering passkey prompts: the reference row of ``headkit bench retrieval``.

kvpress (PyPI ``kvpress``) pins ``transformers<5.3``, below the range headkit supports, so it cannot share
headkit's environment. This file is run as a script by another interpreter (``--kvpress-python``, a venv made by
``make kvpress``): it imports nothing of headkit, only torch, transformers and kvpress, and talks through two JSON
files::

    python _kvpress_reference.py REQUEST.json ANSWER.json

The request names the model (a folder, or a GGUF file), the prompts' token ids, the tokens each key/value head
keeps (``kept``), the observation window and the answer length. For each prompt of T tokens the whole prompt,
question included, is prefilled under ``SnapKVPress(compression_ratio = 1 − kept / T, window_size =
observation)`` — SnapKV as published (Li et al. 2024): the prompt's last queries choose what each head keeps, and
the prefill itself attends in full — and then greedily decoded from the compressed cache, each new token at its
true position (T, T + 1, …), as kvpress' own pipeline decodes. The answer holds the generated ids per prompt,
the versions that produced them and the seconds spent.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _load(model: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(model)
    if path.is_file():  # a GGUF file: transformers de-quantizes it, as headkit's loader does
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return loaded.eval()


def _answer(model, press_type, ids: list[int], kept: int, observation: int, max_new_tokens: int) -> list[int]:
    import torch
    from transformers import DynamicCache

    length = len(ids)
    prompt = torch.tensor([ids], dtype=torch.long)
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [] if stop is None else [stop])
    cache = DynamicCache()
    press = press_type(compression_ratio=max(0.0, 1.0 - kept / length), window_size=observation)
    with torch.no_grad():
        with press(model):
            logits = model(input_ids=prompt, past_key_values=cache, logits_to_keep=1).logits
        generated = [int(logits[0, -1].argmax())]
        # After the press the cache is shorter than the prompt: positions are given, not counted from the cache.
        for position in range(length, length + max_new_tokens - 1):
            if generated[-1] in stop:
                break
            logits = model(
                input_ids=torch.tensor([[generated[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[position]]),
            ).logits
            generated.append(int(logits[0, -1].argmax()))
    return generated


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _kvpress_reference.py REQUEST.json ANSWER.json", file=sys.stderr)
        return 2
    import kvpress
    import torch
    import transformers

    request = json.loads(Path(argv[0]).read_text())
    started = time.perf_counter()
    model = _load(request["model"], int(request["threads"]))
    answers = [
        _answer(
            model,
            kvpress.SnapKVPress,
            ids,
            int(request["kept"]),
            int(request["observation"]),
            int(request["max_new_tokens"]),
        )
        for ids in request["prompts"]
    ]
    answer = {
        "answers": answers,
        "seconds": time.perf_counter() - started,
        "versions": {
            "kvpress": getattr(kvpress, "__version__", None) or _version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }
    partial = Path(argv[1]).with_suffix(".partial")
    partial.write_text(json.dumps(answer))
    partial.replace(argv[1])
    return 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
