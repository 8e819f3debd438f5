"""Attention of one decoding step over quantized keys and values, compiled by Inductor in four forms, side by side:
the numbers as stored in float32 (the reference speed), the codes dequantized then the two products (what the fast
path's quantized step did until 2026-12-02), the codes read inside the products (the score and the weighted sum
written as broadcast-and-sum, so that Inductor can fuse the dequantization into the reductions and never write the
float copy), and headkit's kernel (:func:`headkit.ops.quantized_attention.quantized_attention_partials`, what the
fast step calls now: each row dequantized in registers). Shapes of SmolLM2's compressed cache at 1/8
and batch B: 3 key/value heads of 3 query heads, 3,300 kept tokens each, head width 64, per-token groups of 32
channels (:func:`headkit.ops.quantized_cache.quantize_values`), 30 layers per "step". Arguments: batch, bits,
threads.

    PYTHONPATH=src python docs/scripts/quantized_attention_forms.py 8 8 1
"""

from __future__ import annotations

import sys
import time

import torch

from headkit.ops.quantized_attention import quantized_attention_partials
from headkit.ops.quantized_cache import QuantizedTensor, dequantize_values, quantize_values, unpack_codes

HEADS, GROUPS, TOKENS, WIDTH, GROUP_SIZE, LAYERS, SCALE = 3, 3, 3300, 64, 32, 30, 0.125


def main(batch: int, bits: int, threads: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(threads)

    def stored(x: torch.Tensor) -> QuantizedTensor:
        return quantize_values(x, bits=bits, group_size=GROUP_SIZE)

    def numbers(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize_values(QuantizedTensor(codes, scale, zero), bits=bits, group_size=GROUP_SIZE)

    def attend_float(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax((q @ k.transpose(-1, -2)) * SCALE, dim=-1) @ v

    def attend_dequantized(q: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
        return attend_float(q, numbers(*fields[:3]), numbers(*fields[3:]))

    def attend_codes(q: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
        key_codes, key_scale, key_zero, value_codes, value_scale, value_zero = fields
        # q·k_j = Σ_g s_jg (q_g · c_jg) + z_jg Σ q_g, per group g of channels
        grouped_q = q.unflatten(-1, (-1, GROUP_SIZE))  # [B, H, G, D/32, 32]
        codes = unpack_codes(key_codes, bits).unflatten(-1, (-1, GROUP_SIZE)).float()  # [B, H, N, D/32, 32]
        dots = (grouped_q[:, :, :, None] * codes[:, :, None]).sum(-1)  # [B, H, G, N, D/32]
        scores = (dots * key_scale[:, :, None] + grouped_q.sum(-1)[:, :, :, None] * key_zero[:, :, None]).sum(
            -1
        )
        weights = torch.softmax(scores * SCALE, dim=-1)  # [B, H, G, N]
        value_numbers = unpack_codes(value_codes, bits).unflatten(-1, (-1, GROUP_SIZE)).float()
        scaled = weights[..., None] * value_scale[:, :, None]  # [B, H, G, N, D/32]
        out = (scaled[..., None] * value_numbers[:, :, None]).sum(3)
        out = out + (weights[..., None] * value_zero[:, :, None]).sum(3)[..., None]
        return out.flatten(-2)

    visible = torch.ones(batch, 1, TOKENS, dtype=torch.bool)

    def attend_kernel(q: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
        keys, values = QuantizedTensor(*fields[:3]), QuantizedTensor(*fields[3:])
        _, total, weighted = quantized_attention_partials(q, keys, values, visible, scale=SCALE, value_dim=WIDTH)
        return weighted / total

    queries = [torch.randn(batch, HEADS, GROUPS, WIDTH) for _ in range(LAYERS)]
    keys = [torch.randn(batch, HEADS, TOKENS, WIDTH) for _ in range(LAYERS)]
    values = [torch.randn(batch, HEADS, TOKENS, WIDTH) for _ in range(LAYERS)]
    quantized = [(*stored(k), *stored(v)) for k, v in zip(keys, values, strict=True)]
    forms = {
        "float32 numbers": (attend_float, [(q, k, v) for q, k, v in zip(queries, keys, values, strict=True)]),
        "dequantized, then attended": (
            attend_dequantized,
            [(q, *f) for q, f in zip(queries, quantized, strict=True)],
        ),
        "attended on the codes": (attend_codes, [(q, *f) for q, f in zip(queries, quantized, strict=True)]),
        "headkit's kernel": (attend_kernel, [(q, *f) for q, f in zip(queries, quantized, strict=True)]),
    }
    compiled = {name: torch.compile(function, dynamic=False) for name, (function, _) in forms.items()}
    reference = attend_dequantized(*forms["dequantized, then attended"][1][0])
    for name, (_, arguments) in forms.items():
        out = compiled[name](*arguments[0])
        if name != "float32 numbers":
            print(
                f"{name}: largest difference from dequantize-then-attend {(out - reference).abs().max():.2e}"
            )
    timings: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(3):  # rounds, the forms alternated
        for name, (_, arguments) in forms.items():
            started = time.perf_counter()
            for _ in range(3):
                for layer in arguments:
                    compiled[name](*layer)
            timings[name].append((time.perf_counter() - started) / 3)
    for name, seconds in timings.items():
        print(
            f"batch {batch}, {bits} bits, {threads} thread(s), {name}: {1000 * min(seconds):.1f} ms per 30 layers"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
