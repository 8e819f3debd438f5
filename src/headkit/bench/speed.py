"""``headkit bench speed``: time and peak memory of each attention kernel against SDPA, per sequence length.

Every kernel of :data:`headkit.ops.KERNELS` (each module under :mod:`headkit.ops` cites its paper) at B=1, H=8,
head_dim=64, fp32: the forward call, and forward+backward against a fixed random cotangent, each timed and its
peak memory measured by :mod:`headkit.bench._measure`. Ratios are to ``sdpa_causal`` (softmax attention,
Vaswani et al. 2017) at the same length in the same run. Where ``fast_transformers`` is installed, the anchor
``fast_transformers_causal`` (Katharopoulos et al. 2020's own compiled kernel) is measured too. Method, targets
and outputs: docs/kernels.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from headkit.bench._measure import matmul_rate, measure_peak_memory
from headkit.bench._options import check_out_dir
from headkit.bench._report import (
    bullet_list,
    column_rows,
    figure_axes,
    find_point,
    grid_rows,
    log2_length_axis,
    machine_line,
    markdown_page,
    plot_series,
    progress_bar,
    rich_table,
    verdict,
)
from headkit.bench.registry import option, quick_preset, register_benchmark
from headkit.devices import check_device
from headkit.errors import HeadkitError
from headkit.evaluation.timing import time_call
from headkit.ops import KERNELS, KernelSpec
from headkit.ops.registry import QKV_INPUTS

BASELINE = "sdpa_causal"
BATCH, HEADS, HEAD_DIM = 1, 8, 64
DTYPE = torch.float32
MODES = ("forward", "forward_backward")
MODE_LABELS = {"forward": "fwd", "forward_backward": "fwd+bwd"}
PROBE_SEQ_LEN = 16  # of the tiny call that checks a kernel runs before any length is measured
MIN_REPEAT_S = 0.05  # a timed repeat of a faster call loops over several (see evaluate.time_call)
SEED = 0
MATMUL_SIZE = 1024  # the [n, n] @ [n, n] matmul whose rate FLOP-counting kernels are compared with
ANCHOR = "fast_transformers_causal"
PLOT_FILE = "speed.png"
MECHANISMS = KERNELS  # every kernel of the op registry, in registration order


def _fast_transformers_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fast-transformers' CausalLinearAttention on [B, H, T, D] (its elu+1 map, cumsum normaliser, eps 1e-6)."""
    from fast_transformers.causal_product import causal_dot_product

    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    normaliser = 1 / (torch.einsum("bhtd,bhtd->bht", phi_q, phi_k.cumsum(dim=2)) + 1e-6)
    return causal_dot_product(phi_q.contiguous(), phi_k.contiguous(), v.contiguous()) * normaliser[..., None]


ANCHORS = {
    ANCHOR: KernelSpec(
        "fast-transformers' compiled causal linear attention (anchor)", QKV_INPUTS, _fast_transformers_causal
    )
}


def fast_transformers_installed() -> bool:
    return importlib.util.find_spec("fast_transformers") is not None


def _spec(name: str) -> KernelSpec:
    return MECHANISMS[name] if name in MECHANISMS else ANCHORS[name]


def resolve_layout(layout: Sequence[str], *, batch: int, heads: int, seq_len: int, head_dim: int) -> tuple:
    """Concrete shape of a layout: B batch, H heads, T seq_len, D head_dim, D/2 half of it, H*D all heads."""
    sizes = dict(B=batch, H=heads, T=seq_len, D=head_dim) | {"D/2": head_dim // 2, "H*D": heads * head_dim}
    unknown = [symbol for symbol in layout if symbol not in sizes]
    if unknown:
        raise ValueError(f"layout {tuple(layout)} uses unknown symbols {unknown}; known: {sorted(sizes)}")
    return tuple(sizes[symbol] for symbol in layout)


def make_inputs(
    spec: KernelSpec,
    *,
    seq_len: int,
    batch: int = BATCH,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    device: torch.device | str = "cpu",
    requires_grad: bool = False,
    seed: int = SEED,
) -> dict[str, torch.Tensor]:
    """Standard-normal fp32 inputs of the spec's shapes (absolute values where they must be ≥ 0), seeded."""
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = {}
    for name, layout in spec.inputs.items():
        shape = resolve_layout(layout, batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim)
        tensor = torch.randn(shape, generator=generator, device=device, dtype=DTYPE)
        inputs[name] = (tensor.abs() if name in spec.non_negative else tensor).requires_grad_(requires_grad)
    return inputs


@dataclass(frozen=True)
class Target:
    """``quantity`` of ``mechanism`` in ``mode`` at ``seq_len`` over ``reference``'s must be ≤ max_ratio; quantity
    "matmul_time" is the time over that of the kernel's FLOPs at the machine's matmul rate."""

    description: str
    mechanism: str
    mode: str
    seq_len: int
    quantity: str  # "time", "peak_memory" or "matmul_time"
    max_ratio: float
    reference: str = BASELINE


LINEAR, FORWARD, BOTH = "linear_causal", *MODES
THAN_ANCHOR = "≥ 2× faster than fast-transformers, T=8192"
TARGETS = (  # from the issue
    Target("linear fwd ≥ 10× faster at T=8192", LINEAR, FORWARD, 8192, "time", 1 / 10),
    Target("linear fwd+bwd ≥ 6× faster at T=4096", LINEAR, BOTH, 4096, "time", 1 / 6),
    Target("linear fwd+bwd ≤ 1.5× slower at T=512", LINEAR, BOTH, 512, "time", 1.5),
    Target("linear fwd peak memory ≤ 1.5× at T=8192", LINEAR, FORWARD, 8192, "peak_memory", 1.5),
    Target("additive fwd ≥ 20× faster at T=8192", "additive_causal", FORWARD, 8192, "time", 1 / 20),
    Target("CoCA fwd time ≤ 1.3× at T=4096", "coca_causal", FORWARD, 4096, "time", 1.3),
    Target("CoCA fwd peak memory ≤ 1.25× at T=4096", "coca_causal", FORWARD, 4096, "peak_memory", 1.25),
    Target("linear fwd ≥ 60% of the matmul rate, T=8192", LINEAR, FORWARD, 8192, "matmul_time", 1 / 0.6),
    Target(f"linear fwd {THAN_ANCHOR}", LINEAR, FORWARD, 8192, "time", 0.5, ANCHOR),
    Target(f"linear fwd+bwd {THAN_ANCHOR}", LINEAR, BOTH, 8192, "time", 0.5, ANCHOR),
)


@dataclass
class SpeedSettings:
    """Settings of one ``headkit bench speed`` run."""

    device: str = option("cpu", "Device to measure on: cpu or cuda.", check=check_device)
    lengths: tuple[int, ...] = option(
        (512, 1024, 2048, 4096, 8192),
        "Comma-separated sequence lengths.",
        quick=(512, 1024, 2048),
        min=1,
    )
    mechanisms: tuple[str, ...] = option(
        (), "Comma-separated mechanisms (default: all registered).", choices=lambda: {**MECHANISMS, **ANCHORS}
    )
    repeats: int = option(5, "Timed repetitions per point, the median reported.", min=1, quick=3)
    threads: int | None = option(None, "torch threads during the run (default: torch's setting).", min=1)
    out: Path = option(
        Path("results/speed"), "Output directory for results.json, plot and table.", check=check_out_dir
    )
    warmup: int = 1  # untimed calls before the timed ones
    min_repeat_s: float = MIN_REPEAT_S  # a timed repeat loops over calls faster than this (their mean)

    quick = quick_preset("Short run: lengths 512..2048, 3 repeats.")


def _probe(spec: KernelSpec, device: torch.device) -> str | None:
    """None if the mechanism runs forward and backward on tiny inputs, else why it is unavailable."""
    inputs = make_inputs(spec, seq_len=PROBE_SEQ_LEN, device=device, requires_grad=True)
    try:
        spec.run(**inputs).sum().backward()
    except ImportError as exc:  # an anchor whose library is not installed
        return f"not installed ({type(exc).__name__}: {exc})"
    return None


# What a point that was not measured reports.
FAILED = {"median_s": None, "times_s": [], "calls_per_repeat": 0} | dict.fromkeys(
    ("peak_bytes", "input_bytes", "extra_peak_bytes")
)


def _measure_point(
    name: str, seq_len: int, device: torch.device, timing: dict[str, Any], out_of_memory: set[str]
) -> list[dict[str, Any]]:
    """The forward and the forward+backward point of one mechanism at one length, the backward against a fixed
    random cotangent; running out of memory is recorded, and ends its longer lengths."""
    spec, output_shape = _spec(name), None

    def forward() -> None:
        nonlocal output_shape  # recorded for the cotangent below, which saves a forward call
        with torch.no_grad():
            output_shape = spec.run(**inputs).shape

    def forward_backward() -> None:
        torch.autograd.grad(spec.run(**inputs), leaves, grad_outputs=cotangent)

    def measure(fn: Callable[[], None], live_inputs: list[torch.Tensor]) -> dict[str, Any]:
        timed = time_call(fn, device=device, **timing)
        memory = measure_peak_memory(fn, inputs=live_inputs, device=device)
        return asdict(timed) | {"times_s": list(timed.times_s)} | asdict(memory) | {"error": None}

    error = "skipped: out of memory at a shorter length" if name in out_of_memory else None
    try:
        if error is None:
            inputs = make_inputs(spec, seq_len=seq_len, device=device, requires_grad=True)
            leaves = list(inputs.values())
            forward_point = measure(forward, leaves)
            generator = torch.Generator(device=device).manual_seed(SEED + 1)
            cotangent = torch.randn(output_shape, generator=generator, device=device, dtype=DTYPE)
            measurements = [forward_point, measure(forward_backward, [*leaves, cotangent])]
    except Exception as exc:
        # The CPU allocator reports exhaustion as a plain RuntimeError.
        memory = isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
        if not (isinstance(exc, torch.OutOfMemoryError) or memory):
            raise
        error = f"out of memory: {(str(exc).splitlines() or [''])[0]}"
        out_of_memory.add(name)
        inputs = leaves = cotangent = None
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand back what the failed call cached, for the mechanisms still to run
    if error is not None:
        measurements = [FAILED | {"error": error}] * len(MODES)
    return [
        {"mechanism": name, "seq_len": seq_len, "mode": mode, **measurement}
        for mode, measurement in zip(MODES, measurements, strict=True)
    ]


def _add_rate(point: dict[str, Any], rate: float | None) -> None:
    """Of a forward point of a FLOP-counting kernel: its FLOPs, GFLOP/s, the fraction of the matmul ``rate``
    and matmul_time_ratio, its time over that of its FLOPs at the matmul rate (1 / fraction)."""
    count = _spec(point["mechanism"]).flops
    if point["mode"] != "forward" or count is None or rate is None or point["median_s"] is None:
        return
    point["flops"] = count(BATCH, HEADS, point["seq_len"], HEAD_DIM)
    point["gflops_per_s"] = point["flops"] / point["median_s"] / 1e9
    point["matmul_fraction"] = point["flops"] / point["median_s"] / rate
    point["matmul_time_ratio"] = 1 / point["matmul_fraction"]


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else value / reference


def _evaluate_target(target: Target, points: list[dict[str, Any]]) -> dict[str, Any]:
    where = {"seq_len": target.seq_len, "mode": target.mode}
    point = find_point(points, mechanism=target.mechanism, **where) or {}
    if target.quantity == "matmul_time":
        measured = point.get("matmul_time_ratio")
    else:
        key = "median_s" if target.quantity == "time" else "peak_bytes"
        measured = _ratio(
            point.get(key), (find_point(points, mechanism=target.reference, **where) or {}).get(key)
        )
    return asdict(target) | {
        "measured_ratio": measured,
        "passed": None if measured is None else measured <= target.max_ratio,
    }


# --- Rendering ---------------------------------------------------------------------------------------------


def _format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "—"
    # 0.07× reads better as "1/14" when the claim is "14× faster".
    return f"{ratio:.3g}× (1/{1 / ratio:.3g})" if 0 < ratio < 1 else f"{ratio:.3g}×"


TARGET_COLUMNS = {
    "target": lambda t: t["description"],
    "measured": lambda t: _format_ratio(t["measured_ratio"]),
    "required": lambda t: f"≤ {t['max_ratio']:.3g}×",
    "result": lambda t: verdict(t["passed"]),
}


def _grid(results: dict[str, Any], cell: Callable[[dict[str, Any] | None], str]) -> tuple[list[str], list]:
    """Headers and rows of ``cell(point)``: a row per measured mechanism and mode (registry order), a column per
    length."""
    lengths = results["config"]["lengths"]
    rows = [
        {"mechanism": name, "mode": mode}
        for name, info in results["mechanisms"].items()
        if info["available"]
        for mode in MODES
    ]
    cells = grid_rows(results["points"], rows, "seq_len", lengths, cell)
    headers = ["mechanism", "mode", *(f"T={n}" for n in lengths)]
    return headers, [[row[0], MODE_LABELS[row[1]], *row[2:]] for row in cells]


def _ratio_cell(point: dict[str, Any] | None) -> str:
    if point is not None and point["error"]:
        return point["error"].split(":")[0]
    if point is None or point["time_ratio"] is None:  # not run, or the baseline failed at this length
        return "—"
    return f"{point['time_ratio']:.3g}× / {point['memory_ratio']:.3g}×"


def _value_cell(key: str, scale: float) -> Callable[[dict[str, Any] | None], str]:
    return lambda point: "—" if point is None or point[key] is None else f"{point[key] * scale:.3g}"


def _tables(results: dict[str, Any]) -> tuple[Any, ...]:
    """The console's tables: the ratios to the baseline, and the targets."""
    ratio_title = f"time / peak memory relative to {BASELINE} (< 1 is better)"
    targets = column_rows(TARGET_COLUMNS, results["targets"])
    return (
        rich_table(ratio_title, *_grid(results, _ratio_cell), left=2),
        rich_table("targets (ratio to the baseline, same run)", *targets),
    )


def _rate_lines(results: dict[str, Any]) -> list[str]:
    """One line per point of a FLOP-counting kernel: time, GFLOP/s and the fraction of the matmul rate."""
    config = results["config"]
    return [
        f"{p['mechanism']} {MODE_LABELS[p['mode']]} T={p['seq_len']}: {p['median_s'] * 1e3:.3g} ms, "
        f"{p['flops'] / 1e9:.3g} GFLOP, {p['gflops_per_s']:.3g} GFLOP/s = {p['matmul_fraction']:.0%} of the fp32 "
        f"matmul rate ({results['matmul_gflops_per_s'][str(p['seq_len'])]:.3g} GFLOP/s, "
        f"{config['matmul_reference']}, {config['threads']} thread(s))"
        for p in results["points"]
        if p.get("gflops_per_s") is not None
    ]


def _shape(config: dict[str, Any]) -> str:
    return f"B={config['batch']}, H={config['heads']}, head_dim={config['head_dim']}, {config['dtype']}"


def render_markdown(results: dict[str, Any]) -> str:
    """table.md: medians, peak memory, ratios to the baseline, targets, and what was not measured."""
    config = results["config"]
    intro = (
        f"{_shape(config)}, {machine_line(results)}, median of {config['repeats']} after {config['warmup']} "
        "warm-up."
    )
    notes = [f"{name}: {info['note']}" for name, info in results["mechanisms"].items() if info["note"]]
    return markdown_page(
        "headkit bench speed",
        intro,
        results["command"],
        [
            ("Median time (ms)", _grid(results, _value_cell("median_s", 1e3))),
            ("Peak memory, inputs included (MiB)", _grid(results, _value_cell("peak_bytes", 2**-20))),
            (f"Time / peak memory relative to {BASELINE}", _grid(results, _ratio_cell)),
            ("Targets", column_rows(TARGET_COLUMNS, results["targets"])),
            ("Rate against the fp32 matmul rate, same run", bullet_list(_rate_lines(results))),
            ("Not measured", bullet_list(notes)),
        ],
    )


def plot_results(results: dict[str, Any]) -> Any:
    """A 2×2 figure: time (top) and peak memory (bottom) vs T, forward (left) and forward+backward (right)."""
    config = results["config"]
    figure, axes = figure_axes((11, 8), 2, 2, "constrained", sharex=True)
    available = [p for p in results["points"] if results["mechanisms"][p["mechanism"]]["available"]]
    quantities = (("median_s", 1, "median time (s)"), ("peak_bytes", 2**-20, "peak memory (MiB)"))
    for row, (key, scale, label) in enumerate(quantities):
        for column, mode in enumerate(MODES):
            ax, points = axes[row][column], [p for p in available if p["mode"] == mode]
            plot_series(ax, points, "seq_len", key, scale=scale, style=_baseline_style)
            title = f"{MODE_LABELS[mode]}: {label.split(' (')[0]}"
            log2_length_axis(ax, config["lengths"], "sequence length T" if row == 1 else None, label, title)
    axes[0][0].legend(fontsize="small")
    figure.suptitle(f"{_shape(config)}, {config['device']}")
    return figure


def _baseline_style(name: str) -> dict[str, Any]:
    return {"color": "black", "linestyle": "--"} if name == BASELINE else {}


@register_benchmark(
    "speed", SpeedSettings, render=render_markdown, plots={PLOT_FILE: plot_results}, tables=_tables
)
def run_speed_benchmark(
    settings: SpeedSettings, console: Console, show_progress: bool = True
) -> dict[str, Any]:
    """Kernel speed and peak memory against SDPA: forward and forward+backward, per sequence length.

    Writes results.json, table.md and speed.png to ``settings.out`` and returns what results.json holds; the
    baseline is always measured (first)."""
    # The anchor is measured by default where it is installed; asked for where it is not, it is skipped.
    default = [*MECHANISMS, *(ANCHORS if fast_transformers_installed() else ())]
    names = list(dict.fromkeys(name.strip() for name in settings.mechanisms)) or default
    device, lengths = torch.device(settings.device), sorted(set(settings.lengths))
    if importlib.util.find_spec("matplotlib") is None:  # found now, not after a run of several minutes
        raise HeadkitError("the speed benchmark plots with matplotlib: pip install 'headkit[bench]'")
    names = [BASELINE, *(name for name in names if name != BASELINE)]
    unavailable = {name: note for name in names if (note := _probe(_spec(name), device))}
    if BASELINE in unavailable:
        raise RuntimeError(f"the baseline {BASELINE} cannot run on {device}: {unavailable[BASELINE]}")
    for name, note in unavailable.items():
        console.print(f"[yellow]skipped[/] {name}: {note}", highlight=False)
    measured = [name for name in names if name not in unavailable]

    timing = dict(repeats=settings.repeats, warmup=settings.warmup, min_repeat_s=settings.min_repeat_s)
    points: list[dict[str, Any]] = []
    matmul_rates: dict[int, float] = {}  # FLOP/s of the reference matmul, per length
    out_of_memory: set[str] = set()
    with progress_bar(console, show_progress, 40) as progress:
        task = progress.add_task("speed", total=len(lengths) * len(measured))
        # Lengths outermost: every ratio compares measurements taken minutes apart at most, not a whole run.
        for seq_len in lengths:
            for name in measured:
                progress.update(task, description=f"{name} T={seq_len}")
                points += _measure_point(name, seq_len, device, timing, out_of_memory)
                progress.advance(task)
            if any(_spec(name).flops for name in measured):
                matmul_rates[seq_len] = matmul_rate(MATMUL_SIZE, device=device, **timing)

    baseline = {(p["seq_len"], p["mode"]): p for p in points if p["mechanism"] == BASELINE}
    for point in points:
        reference = baseline.get((point["seq_len"], point["mode"])) or {}
        point["time_ratio"] = _ratio(point["median_s"], reference.get("median_s"))
        point["memory_ratio"] = _ratio(point["peak_bytes"], reference.get("peak_bytes"))
        _add_rate(point, matmul_rates.get(point["seq_len"]))
    config = {
        "batch": BATCH,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "dtype": str(DTYPE).removeprefix("torch."),
        "device": str(device),
        "lengths": lengths,
        **timing,
        "statistic": "median",
        "mechanisms": names,
        "threads": torch.get_num_threads(),
        "matmul_reference": f"[{MATMUL_SIZE}, {MATMUL_SIZE}] @ [{MATMUL_SIZE}, {MATMUL_SIZE}]",
    }
    sections = {
        "baseline": BASELINE,
        "config": config,
        "mechanisms": {
            name: {"description": _spec(name).description, "available": name not in unavailable}
            | {"note": unavailable.get(name)}
            for name in names
        },
        "matmul_gflops_per_s": {str(n): rate / 1e9 for n, rate in matmul_rates.items()},
        "points": points,
        "targets": [_evaluate_target(target, points) for target in TARGETS],
    }
    for line in _rate_lines(sections):
        console.print(line, highlight=False)
    return sections


if __name__ == "__main__":  # python -m headkit.bench.speed: the program is the command line's `bench speed`
    from headkit.bench.registry import run_as_script

    run_as_script("speed")
