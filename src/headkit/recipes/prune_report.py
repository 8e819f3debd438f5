"""The pruning report as printed (:func:`format_report`, the table under ``headkit prune``), and the notes a
decoder family's report carries beyond the numbers (:func:`family_notes`).
"""

from __future__ import annotations

from typing import Any

from headkit.surgery.families import DecoderFamily


def format_report(report: dict[str, Any]) -> str:
    """The printed table of a pruning report."""
    before, after = sum(report["heads_before"].values()), sum(report["heads_after"].values())
    lines = [f"heads kept: {after}/{before}"]
    lines.append(
        f"parameters: {report['parameters_before']:,} -> {report['parameters_after']:,} "
        f"({report['parameters_after'] / report['parameters_before']:.1%})"
    )
    if report["kind"] == "causal_lm":
        original = report["perplexity_original"]
        speed = report["speed"]
        kv_b, kv_a = report["kv_cache_bytes_per_token_before"], report["kv_cache_bytes_per_token_after"]
        lines += [
            f"KV cache per token: {kv_b:,.0f} -> {kv_a:,.0f} bytes"
            + (f" ({kv_a / kv_b - 1:+.0%})" if kv_b else " (a constant-size recurrent state, no KV cache)"),
            f"held-out perplexity: original {original:.3f}, pruned {report['perplexity_pruned']:.3f} "
            f"({report['perplexity_pruned'] / original:.2f}x), "
            + (
                f"repaired {report['repair']['perplexity']:.3f} ({report['repair']['perplexity'] / original:.2f}x), "
                if report.get("repair")
                else ""
            )
            + f"recovered {report['perplexity_recovered']:.3f} ({report['perplexity_recovered'] / original:.2f}x)",
            f"top-1 next-token agreement with the original: {report['top1_agreement']:.1%}",
            f"prefill ({speed['prefill_tokens']} tokens): {speed['prefill_ratio']:.2f}x the original; decode per "
            f"token at {speed['decode_context']}: {speed['decode_ratio']:.2f}x",
            f"stock architecture: {'yes (loads in plain transformers)' if report['stock_architecture'] else 'no (load with headkit.from_pretrained)'}",
            *(f"note: {note}" for note in report.get("notes", [])),
            f"sample before: {report['sample_original']!r}",
            f"sample after:  {report['sample_recovered']!r}",
        ]
    else:
        lines += [
            f"fidelity on held-out text: mean cosine {report['fidelity_mean_cosine_pruned']:.4f} pruned, "
            f"{report['fidelity_mean_cosine']:.4f} after recovery (min {report['fidelity_min_cosine']:.4f})",
            f"forward time: {report['forward_ms_before']:.1f} ms -> {report['forward_ms_after']:.1f} ms "
            f"({report['forward_ms_after'] / report['forward_ms_before']:.2f}x)",
        ]
    if "out" in report:
        lines.append(
            f"saved to {report['out']}" + (f" in {report['seconds']:.0f} s" if "seconds" in report else "")
        )
    return "\n".join(lines)


def family_notes(family: DecoderFamily) -> list[str]:
    """What the report must say about pruning this family beyond the numbers."""
    if family.head_norm == "across_heads":
        return [
            f"{family.model_type} normalises queries and keys over all heads together (q_norm / k_norm): their "
            "weights were sliced to the kept heads, but the kept heads' normalisation changed (its statistic now "
            "spans fewer heads), so the pruned model is not exactly the original with those heads zeroed; "
            "recovery absorbs the change"
        ]
    return []


__all__ = [
    "family_notes",
    "format_report",
]
