"""The fast path's decoding step (headkit.FastDecoder) of SmolLM2-135M and of a latent student saved by
``headkit compress`` (a folder), their buffers sized for 8,192 tokens (a step reads its whole buffers, so its time
is that after a prompt of that length): per batch size, the median of the steps of ROUNDS generations of 8 tokens
after a 1,500-token prompt repeated per row, the two models alternated. One thread.

    python docs/scripts/latent_fast_step.py STUDENT_FOLDER 1,8 2
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import headkit
from headkit.runs.models import load_model, smollm2_gguf_path
from headkit.runs.text import load_text
from headkit.runtime.fast import FastDecoder


def main(student_folder: str, batches: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    loaded = load_model(smollm2_gguf_path(), dtype="float32")
    student = headkit.from_pretrained(student_folder).eval()
    text = "\n".join(document.text for document in load_text(None).held_out)
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, :1500]
    decoders = {"original": FastDecoder(loaded.model), "latent": FastDecoder(student)}
    times: dict[tuple[str, int], list[float]] = {(name, b): [] for name in decoders for b in batches}
    for round_ in range(rounds + 1):  # round 0 compiles each bucket
        for batch in batches:
            prompt = ids.expand(batch, -1).contiguous()
            for name, decoder in decoders.items():
                steps: list[float] = []
                started = time.perf_counter()
                decoder.generate(prompt, max_new_tokens=8, cache_length=8192, step_seconds=steps)
                if round_ == 0:
                    print(
                        f"{name}, batch {batch}: compiled in {time.perf_counter() - started:.0f} s",
                        flush=True,
                    )
                else:
                    times[(name, batch)] += steps[1:]
    for batch in batches:
        original = statistics.median(times[("original", batch)])
        latent = statistics.median(times[("latent", batch)])
        print(
            f"batch {batch}: original {1000 * original:.1f} ms, latent {1000 * latent:.1f} ms, "
            f"speed-up {original / latent:.2f}x"
        )


if __name__ == "__main__":
    main(sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]))
