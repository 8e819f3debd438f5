"""A refused family or setting exits 2 with one line before any text is read or weight changed: the surgery's
config is checked against the model (or only its config.json) first."""

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "surgery"))
from family_models import save_family_model  # noqa: E402

import headkit.recipes.steps as steps  # noqa: E402
from headkit.cli import main  # noqa: E402
from headkit.errors import HeadkitError  # noqa: E402
from headkit.runs.models import read_model_config, smollm2_gguf_path  # noqa: E402

_save = save_family_model


def _refused(args, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


def _no_text(*args, **kwargs):
    raise AssertionError("text was read before the refusal")


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were loaded before the refusal")


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_compress_kv_rank_refuses_a_per_head_key_norm_before_reading_text(
    model_type, tmp_path, monkeypatch, capsys
):
    recipe = importlib.import_module(
        "headkit.recipes.compress"
    )  # the package exports a function of the same name

    monkeypatch.setattr(recipe, "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)  # the family is refused from config.json alone
    folder = _save(model_type, tmp_path / "model")
    error = _refused(
        ["compress", str(folder), "--kv-rank", "8", "--rope-dims", "4", "--out", str(tmp_path / "o")], capsys
    )
    assert "k_norm" in error or "not registered for latent" in error or "latent" in error
    assert not (tmp_path / "o").exists()


def test_linearize_refuses_a_window_beyond_the_context_before_loading_weights(tmp_path, monkeypatch, capsys):
    recipe = importlib.import_module(
        "headkit.recipes.linearize"
    )  # the package exports a function of the same name

    monkeypatch.setattr(recipe, "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)
    folder = _save("llama", tmp_path / "model")  # context 128
    error = _refused(["linearize", str(folder), "--window", "129", "--out", str(tmp_path / "o")], capsys)
    assert "window must be at most the model's context of 128 tokens, got 129" in error


def test_prune_refuses_more_heads_than_the_model_has_before_reading_text(tmp_path, monkeypatch, capsys):
    import headkit.recipes.prune_causal as causal_steps  # where a causal LM's pruning reads its text

    monkeypatch.setattr(causal_steps, "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)  # layers × heads from config.json
    folder = _save("llama", tmp_path / "model")  # 2 layers × 4 query heads
    error = _refused(["prune", str(folder), "--heads", "9", "--out", str(tmp_path / "o")], capsys)
    assert "--heads must be in [1, 8]" in error


@pytest.mark.parametrize(
    "options, message",
    [
        (["--kv-rank", "999", "--rope-dims", "4"], r"kv_rank must be an integer in [1, "),
        (["--kv-rank", "8", "--rope-dims", "3"], "whole number of rotary pairs"),
    ],
)
def test_compress_kv_rank_out_of_range_is_refused_before_loading_weights(
    options, message, tmp_path, monkeypatch, capsys
):
    recipe = importlib.import_module("headkit.recipes.compress")
    monkeypatch.setattr(recipe, "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)
    folder = _save("llama", tmp_path / "model")
    assert message in _refused(["compress", str(folder), *options, "--out", str(tmp_path / "o")], capsys)


def test_compress_dim_on_an_encoder_is_refused_from_config_json_before_loading(
    save_tiny_encoder, tmp_path, monkeypatch, capsys
):
    recipe = importlib.import_module("headkit.recipes.compress")
    monkeypatch.setattr(recipe, "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)  # the widths come from config.json
    folder = save_tiny_encoder(tmp_path / "model")  # hidden 32 = heads·head_dim
    out = tmp_path / "o"
    error = _refused(["compress", str(folder), "--dim", "33", "--out", str(out)], capsys)
    assert "dim_shared_query_key must be at most the hidden size 32 (or heads·head_dim = 32" in error
    assert not out.exists() and sorted(path.name for path in tmp_path.iterdir()) == ["model"]
    # the exact width, a smaller one and the default (half) pass the preflight
    config = read_model_config(folder)
    for dim in (32, 8, None):
        settings = recipe.CompressSettings(model=folder, dim=dim)
        recipe.preflight(settings, folder, config, out)


@pytest.mark.parametrize(
    "model_type, options, message",
    [
        ("gpt2", ["--dim", "999"], "dim_shared_query_key must be at most the hidden size"),
        ("llama", ["--dim", "16"], "llama applies rotary embeddings: --dim"),
    ],
)
def test_compress_dim_on_a_decoder_is_refused_from_config_json_before_loading(
    model_type, options, message, tmp_path, monkeypatch, capsys
):
    recipe = importlib.import_module("headkit.recipes.compress")
    monkeypatch.setattr(recipe, "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)
    folder = _save(model_type, tmp_path / "model")
    assert message in _refused(["compress", str(folder), *options, "--out", str(tmp_path / "o")], capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["prune", "--heads", "271"], "--heads must be in [1, 270]"),
        (["linearize", "--window", "8193"], "window must be at most the model's context of 8192 tokens"),
    ],
)
def test_the_smollm2_gguf_is_refused_from_its_metadata_alone(args, message, tmp_path, monkeypatch, capsys):
    try:
        path = smollm2_gguf_path()
    except HeadkitError as exc:
        pytest.skip(str(exc))
    # The module whose steps read a causal LM's text (a module, not the function the package exports).
    reader = {"prune": "headkit.recipes.prune_causal", "linearize": "headkit.recipes.linearize"}[args[0]]
    monkeypatch.setattr(importlib.import_module(reader), "load_text", _no_text)
    monkeypatch.setattr(steps, "load_model", _no_weights)
    command, *options = args
    assert message in _refused([command, str(path), *options, "--out", str(tmp_path / "o")], capsys)
    assert not (tmp_path / "o").exists()


def test_prune_max_memory_below_the_estimate_refuses_in_one_line_before_loading(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(steps, "load_model", _no_weights)
    error = _refused(
        ["prune", str(smollm2_gguf_path()), "--max-memory", "0.5", "--out", str(tmp_path / "o")], capsys
    )
    assert "--max-memory" in error and "GiB (stage" in error and "is 0.50 GiB" in error
    assert not (tmp_path / "o").exists()


def test_prune_max_memory_must_be_positive(tmp_path, capsys):
    error = _refused(
        ["prune", str(smollm2_gguf_path()), "--max-memory", "0", "--out", str(tmp_path / "o")], capsys
    )
    assert "--max-memory" in error


def test_the_memory_estimate_grows_with_the_run():
    from headkit.recipes.memory import estimate_prune_memory
    from headkit.recipes.prune_settings import PruneSettings

    config = read_model_config(smollm2_gguf_path())
    plain = estimate_prune_memory(PruneSettings(recovery_steps=0), config)
    trained = estimate_prune_memory(PruneSettings(recovery_steps=10, micro_batch=16), config)
    half = estimate_prune_memory(PruneSettings(recovery_steps=0, dtype="bfloat16"), config)
    assert trained.stage == "recover" and trained.total > plain.total > half.total
    assert set(plain.stages) == {"load", "convert", "measure", "save"}


def test_the_recovery_estimate_holds_a_chunk_of_logits_not_the_batch_s():
    """The distillation's KL is computed in chunks of tokens: a larger batch adds activations, no logits."""
    from headkit.recipes import memory as prune_memory
    from headkit.recipes.prune_settings import PruneSettings
    from headkit.runs.models import DTYPES

    config = read_model_config(smollm2_gguf_path())
    one, two = (
        prune_memory.estimate_prune_memory(
            PruneSettings(recovery_steps=10, batch_size=size, micro_batch=size, gradient_checkpointing=False),
            config,
        )
        for size in (16, 32)
    )
    settings = PruneSettings()
    per_token_layer = (
        prune_memory.HIDDEN_ACTIVATIONS * config.hidden_size
        + prune_memory.MLP_ACTIVATIONS * config.intermediate_size
    ) * DTYPES[settings.dtype].itemsize
    added = 16 * settings.window * config.num_hidden_layers * per_token_layer
    # every layer's activations, and the heap those leave fragmented (a fraction of them)
    heap = int(
        prune_memory.HEAP_FRACTION * 32 * settings.window * config.num_hidden_layers * per_token_layer
    ) - int(prune_memory.HEAP_FRACTION * 16 * settings.window * config.num_hidden_layers * per_token_layer)
    assert two.stages["recover"] - one.stages["recover"] == added + heap


def test_gradient_checkpointing_is_on_by_default_where_the_model_supports_it_and_keeps_a_layers_activations():
    """Its default (None) is estimated as on for a 🤗 decoder; on or off, a larger batch adds each layer's input
    (and one layer's activations) or every layer's activations."""
    from headkit.recipes import memory
    from headkit.recipes.prune_settings import PruneSettings

    config = read_model_config(smollm2_gguf_path())
    recover = {
        (checkpointing, size): memory.estimate_prune_memory(
            PruneSettings(
                recovery_steps=10, batch_size=size, micro_batch=size, gradient_checkpointing=checkpointing
            ),
            config,
        ).stages["recover"]
        for checkpointing in (None, True, False)
        for size in (16, 32)
    }
    assert recover[None, 16] == recover[True, 16] < recover[False, 16]
    shape = memory.model_shape(config, "float32")
    assert shape.checkpointing
    tokens = 16 * PruneSettings().window
    heap = memory._heap(shape, 2 * tokens) - memory._heap(shape, tokens)  # the same on or off
    assert recover[True, 32] - recover[True, 16] == heap + tokens * (
        shape.layers * shape.width * shape.number + shape.per_token_layer
    )
    assert recover[False, 32] - recover[False, 16] == heap + tokens * shape.layers * shape.per_token_layer


def test_micro_batches_bound_the_recoverys_activations_by_a_forward_not_the_batch():
    from headkit.recipes.memory import estimate_prune_memory
    from headkit.recipes.prune_settings import PruneSettings

    config = read_model_config(smollm2_gguf_path())
    whole = estimate_prune_memory(PruneSettings(recovery_steps=10, batch_size=16, micro_batch=16), config)
    micro = estimate_prune_memory(PruneSettings(recovery_steps=10, batch_size=16, micro_batch=4), config)
    small = estimate_prune_memory(PruneSettings(recovery_steps=10, batch_size=4, micro_batch=4), config)
    assert micro.stages["recover"] == small.stages["recover"] < whole.stages["recover"]
    # by default a forward holds 1,024 tokens: 4 of the 16 windows of 256
    default = estimate_prune_memory(PruneSettings(recovery_steps=10, batch_size=16), config)
    assert default.stages["recover"] == micro.stages["recover"]


def test_the_max_memory_refusal_names_micro_batches_for_the_recovery(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(steps, "load_model", _no_weights)
    # the whole batch of 16 windows in one forward: the recovery is the peak
    args = [
        "prune",
        str(smollm2_gguf_path()),
        "--recovery-steps",
        "10",
        "--micro-batch",
        "16",
        "--max-memory",
        "1.9",
    ]
    error = _refused([*args, "--out", str(tmp_path / "o")], capsys)
    assert "(stage recover)" in error and "--micro-batch" in error
    assert "--gradient-checkpointing" not in error  # on already
    error = _refused([*args, "--no-gradient-checkpointing", "--out", str(tmp_path / "o")], capsys)
    assert "(stage recover)" in error and "--gradient-checkpointing" in error


@pytest.mark.parametrize(
    "args, advice",
    [
        (["compress", "--kv-rank", "96", "--rope-dims", "16"], "--dtype bfloat16"),
        (["compress", "--kv-budget", "1/8"], "--dtype bfloat16"),
        (
            ["linearize", "--decode-contexts", "1024", "--no-gradient-checkpointing"],
            "--gradient-checkpointing, a shorter --train-length",
        ),
        (["linearize", "--decode-batch-sizes", "1,8", "--max-memory", "2.9"], "--decode-contexts"),
    ],
)
def test_compress_and_linearize_refuse_a_max_memory_below_the_estimate_before_loading(
    args, advice, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(steps, "load_model", _no_weights)
    command, *options = args
    limit = [] if "--max-memory" in options else ["--max-memory", "0.3"]
    error = _refused(
        [command, str(smollm2_gguf_path()), *options, *limit, "--out", str(tmp_path / "o")], capsys
    )
    assert "--max-memory: this run needs about" in error and "GiB; lower it with" in error and advice in error
    assert not (tmp_path / "o").exists()


def test_the_estimates_count_what_each_recipe_holds():
    """One model's weights where the student holds the original's tensors (a cache, a linearized model before
    training), two where the surgery copies them (latent keys/values), and the original's cache at the longest
    decoding context and batch."""
    from headkit.recipes import memory
    from headkit.recipes.compress_settings import CompressSettings
    from headkit.recipes.linearize_settings import LinearizeSettings

    config = read_model_config(smollm2_gguf_path())
    shape = memory.model_shape(config, "float32")
    assert shape.parameters == 134_515_008 and shape.kv_heads == 3 and shape.head_dim == 64
    cache = memory.estimate_compress_memory(
        CompressSettings(kv_budget="1/8"), config, repair_tokens=0, cache_window=2048
    )
    assert cache.stages["measure"] == memory.RUNTIME_BYTES + shape.weights + shape.kv_cache(2048)
    latent = memory.estimate_compress_memory(
        CompressSettings(), config, repair_tokens=64 * 256, cache_window=None
    )
    assert latent.stages["measure"] - cache.stages["measure"] > shape.weights - shape.kv_cache(2048)
    # the repair's captures: as many layers as CAPTURE_BYTES holds (all 30 layers at 72 windows would be 2.4 GiB)
    from headkit.surgery.repair import CAPTURE_BYTES

    captured = latent.stages["repair"] - (
        memory.RUNTIME_BYTES + 2 * shape.weights + 64 * 256 * shape.per_token_layer
    )
    per_layer = 64 * 256 * 2 * shape.width * 4
    assert captured == per_layer * (CAPTURE_BYTES // per_layer) and captured <= CAPTURE_BYTES
    one, eight = (
        memory.estimate_linearize_memory(
            LinearizeSettings(decode_contexts=(8192,), decode_batch_sizes=(b,)), config
        )
        for b in (1, 8)
    )
    assert eight.stages["measure"] - one.stages["measure"] == shape.kv_cache(7 * 8192)
