"""``headkit bench compress`` on a rotary decoder: the curve over R and a saved latent student, side by side with
the original (tiny llama, seconds)."""

import json

import pytest
import torch
import transformers

from headkit.bench.compress import CompressBenchmarkConfig, render_latent_markdown, run_latent_benchmark
from headkit.errors import HeadkitError
from headkit.recipes.compress import load_teacher
from headkit.surgery.latent import compress_kv_to_latent

transformers.logging.set_verbosity_error()


class _Console:
    def print(self, *args, **kwargs):
        pass


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    for i in range(16):
        (folder / f"doc{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 31}" for j in range(400)))
    return folder


def test_the_curve_over_r_and_a_student_side_by_side(save_tiny_causal_lm, text_folder, tmp_path):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    teacher = load_teacher(model_dir)
    student_dir = tmp_path / "student"
    student = load_teacher(model_dir).model
    compress_kv_to_latent(
        student, kv_rank=6, rope_dims=2, calibration=[{"input_ids": torch.randint(3, 90, (2, 16))}]
    )
    student.save_pretrained(student_dir)
    twin_dir = tmp_path / "twin" / "student"  # the same folder name: both measured, told apart by their paths
    student.save_pretrained(twin_dir)
    config = CompressBenchmarkConfig.quick(
        model=model_dir,
        kv_ranks=(28, 6),
        rope_dims=2,
        rope_selections=("fitted", "norms"),
        students=(str(student_dir), str(twin_dir)),
        contexts=(12,),
        decode_batches=(1, 2),
        eval_window=16,
        timing_repeats=2,
        data=text_folder,
    )
    report = run_latent_benchmark(config, teacher, model_dir, _Console())
    latent = report["latent"]
    full, full_norms, low, low_norms = latent["curve"]
    assert [p["rope_selection"] for p in latent["curve"]] == ["fitted", "norms"] * 2
    assert full["max_key_error"] < 1e-6 and low["max_key_error"] > 1e-3
    # The fitted selection minimises the score-term error the partial RoPE leaves on the calibration text.
    assert 0 < full["max_rope_error"] <= full_norms["max_rope_error"]
    # 2 layers × (R + 2 kv heads × 2 rotary dims) float32 numbers per token.
    assert (full["kv_bytes_per_token"], low["kv_bytes_per_token"]) == (2 * 32 * 4, 2 * 10 * 4)
    measured, twin = latent["students"]
    assert (measured["name"], twin["name"]) == (str(student_dir), str(twin_dir))
    assert twin["perplexity"] == pytest.approx(measured["perplexity"])
    assert measured["kv_rank"] == 6 and measured["kv_bytes_per_token"] == 2 * 10 * 4
    assert [(row["context"], row["batch"]) for row in measured["decode"]] == [(12, 1), (12, 2)]
    assert all(row["speedup"] > 0 and len(row["rounds_ms"]) == 2 for row in measured["decode"])
    json.dumps(report)
    report["machine"] = {"cpu_model": "cpu", "torch_threads": 1}
    assert "speed-up" in render_latent_markdown(report)


def test_an_unknown_rope_selection_is_named_before_any_work(save_tiny_causal_lm, text_folder, tmp_path):
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    config = CompressBenchmarkConfig.quick(
        model=model_dir, kv_ranks=(6,), rope_dims=2, rope_selections=("best",)
    )
    with pytest.raises(
        HeadkitError, match=r"--rope-selections takes fitted, norms, rorope, rorope_fitted, got \['best'\]"
    ):
        run_latent_benchmark(config, load_teacher(model_dir), model_dir, _Console())


def test_the_fast_path_is_timed_for_the_original_and_each_student(
    save_tiny_causal_lm, text_folder, tmp_path, monkeypatch
):
    """--fast-decode: the fast path's ms per token of the original and the student at each context and batch
    (here its fixed-size step run eagerly: no compiler), their ratio the speed-up; without it the columns are
    None."""
    import headkit.runtime.fast as fast

    monkeypatch.setattr(fast, "compiler_found", lambda: False)
    model_dir = save_tiny_causal_lm(tmp_path / "llama", "llama")
    teacher = load_teacher(model_dir)
    student = load_teacher(model_dir).model
    compress_kv_to_latent(
        student, kv_rank=6, rope_dims=2, calibration=[{"input_ids": torch.randint(3, 90, (2, 16))}]
    )
    student.save_pretrained(tmp_path / "student")
    options = {
        "model": model_dir,
        "kv_ranks": (),
        "rope_dims": 2,
        "students": (str(tmp_path / "student"),),
        "contexts": (12, 300),
        "decode_batches": (2,),
        "eval_window": 16,
        "timing_repeats": 1,
        "data": text_folder,
    }
    fast_report = run_latent_benchmark(
        CompressBenchmarkConfig.quick(**options, fast_decode=True), teacher, model_dir, _Console()
    )
    (measured,) = fast_report["latent"]["students"]
    assert [(row["context"], row["batch"]) for row in measured["decode"]] == [(12, 2), (300, 2)]
    for row in measured["decode"]:
        assert row["fast_ms_per_token"] > 0 and row["fast_ms_per_token_original"] > 0
        assert row["fast_speedup"] == pytest.approx(
            row["fast_ms_per_token_original"] / row["fast_ms_per_token"]
        )
    fast_report["machine"] = {"cpu_model": "cpu", "torch_threads": 1}
    assert "fast path speed-up" in render_latent_markdown(fast_report)
    plain = run_latent_benchmark(CompressBenchmarkConfig.quick(**options), teacher, model_dir, _Console())
    (measured,) = plain["latent"]["students"]
    assert all(row["fast_speedup"] is None and row["fast_ms_per_token"] is None for row in measured["decode"])
