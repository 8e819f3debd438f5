"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300, §4.2): a key stated once
inside natural filler text (:func:`prose_sentences`), asked for at the end (:func:`passkey_trials`), answered
greedily (:func:`retrieve_passkeys`) and scored by exact match with Wilson 95% intervals
(:func:`score_passkeys`, :func:`wilson_interval`)."""

from __future__ import annotations

import ast
import io
import math
import random
import re
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from headkit.analysis.retrieval import RetrievalExample, retrieval_head_scores
from headkit.compat import cache_keyword, output_cache
from headkit.data import Corpus
from headkit.devices import model_device
from headkit.errors import HeadkitError
from headkit.evaluation.sampling import generate_tokens, pad_token_of
from headkit.evaluation.settings import check_depths

KEY_DIGITS = 5
# z of a two-sided 95% interval.
Z_95 = 1.959963984540054
# A filler sentence from prose: letters, spaces and plain punctuation only, so no code reads as prose and the key
# is the only number in the text.
_PROSE_SENTENCE = re.compile(r"[A-Za-z][A-Za-z ,;:'()\-]*[.!?]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
MIN_SENTENCE_WORDS, MAX_SENTENCE_WORDS = 5, 40


@dataclass(frozen=True)
class PasskeyFormat:
    """How a passkey prompt reads: ``instruction``, the document (filler with ``key_sentence`` inside),
    ``question``; then the answer starts with ``answer_prefix``. With ``chat`` and a tokenizer that has a chat
    template, the instruction, document and question are the user's turn and the answer prefix opens the
    assistant's (``apply_chat_template(..., add_generation_prompt=True)``); otherwise they are plain text, one
    after the other."""

    key_sentence: str = "The pass key is {key}. Remember it. {key} is the pass key."
    instruction: str = (
        "There is a pass key, a five-digit number, hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about it."
    )
    # Calibrated on SmolLM2-135M-Instruct with the embedded corpus' prose (docs/evaluate.md):
    # "What is the pass key?" answered by "The pass key is" lets it define the term instead ("… is a string
    # that …": 0-15% at 1,024 tokens); naming the five digits twice gets the number (9/10).
    question: str = "What is the five-digit pass key?"
    answer_prefix: str = "The five-digit pass key is"
    chat: bool = True
    separator: str = "\n\n"  # between the instruction, the document and the question


# The format of instruction-tuned models (SmolLM2-135M-Instruct): the default of headkit eval.
INSTRUCTION_FORMAT = PasskeyFormat()


@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey prompt: ``length`` tokens with the answer, the prompt ``input_ids`` the ``length −
    answer_tokens`` before it; the key sentence starts at token ``key_position``, at ``depth`` (the share of the
    filler before it: 0 = first, 1 = just before the question) and is ``key_tokens`` long."""

    input_ids: tuple[int, ...]
    key: str
    depth: float
    key_position: int
    length: int
    key_tokens: int = 0


def prose_sentences(corpus: Corpus, limit: int = 20_000, seed: int = 0) -> list[str]:
    """Up to `limit` filler sentences from `corpus`'s held-out documents (then its training ones), in a seeded
    document order and in reading order within a document: of Python source, the prose of its docstrings and
    comments (:func:`python_prose`); of any other text, the text itself. Only sentences that read as prose are
    kept: 5 to 40 words of letters and plain punctuation (no digits: the key is the only number)."""
    documents = list(corpus.held_out) + list(corpus.train)
    random.Random(seed).shuffle(documents)
    sentences: list[str] = []
    for document in documents:
        text = python_prose(document.text) if document.name.endswith(".py") else document.text
        for paragraph in re.split(r"\n\s*\n", text):
            for sentence in _SENTENCE_END.split(" ".join(paragraph.split())):
                if (
                    _PROSE_SENTENCE.fullmatch(sentence)
                    and MIN_SENTENCE_WORDS <= len(sentence.split()) <= MAX_SENTENCE_WORDS
                ):
                    sentences.append(sentence)
        if len(sentences) >= limit:
            break
    if len(sentences) < 10:
        raise HeadkitError(
            f"the text ({corpus.source}) holds {len(sentences)} prose sentences, too few for passkey filler: "
            "give --data a text of sentences"
        )
    return sentences[:limit]


def python_prose(source: str) -> str:
    """The docstrings and comments of Python `source`, paragraphs apart ("" where it does not parse)."""
    paragraphs = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node)
            if docstring:
                paragraphs.append(docstring)
    comments = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                comments.append(token.string.lstrip("#").strip())
            elif (
                token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
                and comments
            ):
                paragraphs.append(" ".join(comments))  # a run of comment lines is one paragraph
                comments = []
    except (tokenize.TokenError, SyntaxError):
        pass
    return "\n\n".join(paragraphs)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def passkey_frame(tokenizer: Any, format: PasskeyFormat = INSTRUCTION_FORMAT) -> tuple[list[int], list[int]]:
    """(token ids before the document, token ids after it) of `format` with `tokenizer` (see
    :class:`PasskeyFormat`)."""
    marker = "\x00DOCUMENT\x00"
    user = format.separator.join(part for part in (format.instruction, marker, format.question) if part)
    if format.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        text += format.answer_prefix
    else:
        text = user + (" " if format.question and format.answer_prefix else "") + format.answer_prefix
    head, tail = text.split(marker)
    # Plain text starts as the tokenizer starts any text (with its BOS, if it adds one); a chat template writes
    # its own special tokens.
    start: list[int] = []
    if not uses_chat_template(tokenizer, format):
        special, plain = list(tokenizer("a", add_special_tokens=True)["input_ids"]), _encode(tokenizer, "a")
        start = next((special[:i] for i in range(len(special)) if special[i : i + len(plain)] == plain), [])
    return start + _encode(tokenizer, head), _encode(tokenizer, tail)


def uses_chat_template(tokenizer: Any, format: PasskeyFormat = INSTRUCTION_FORMAT) -> bool:
    return bool(format.chat and getattr(tokenizer, "chat_template", None))


def min_passkey_length(
    tokenizer: Any, format: PasskeyFormat = INSTRUCTION_FORMAT, key_digits: int = KEY_DIGITS
) -> int:
    """Tokens of a passkey prompt with no filler: the frame, the key sentence and the question."""
    head, tail = passkey_frame(tokenizer, format)
    key = _encode(tokenizer, " " + format.key_sentence.format(key="9" * key_digits))
    return len(head) + len(key) + len(tail)


def random_key(rng: np.random.Generator, digits: int = KEY_DIGITS) -> str:
    """A `digits`-digit decimal key without a leading zero (a model may rightly drop one)."""
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def passkey_trials(
    tokenizer: Any,
    sentences: Sequence[str],
    length: int,
    trials: int,
    depths: Sequence[float],
    *,
    seed: int = 0,
    answer_tokens: int = 8,
    format: PasskeyFormat = INSTRUCTION_FORMAT,
    key_digits: int = KEY_DIGITS,
) -> list[PasskeyTrial]:
    """`trials` passkey prompts of exactly `length` − `answer_tokens` tokens (so that prompt and answer fill
    `length`), seeded by (`seed`, `length`): trial i puts its key at
    ``depths[i % len(depths)]`` (stratified: every depth as often, ±1), its filler a run of consecutive
    `sentences` from a random start, cut to the token. The key sentence goes between two filler sentences: the
    boundary nearest the depth."""
    check_depths(depths)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise HeadkitError(f"--trials must be a positive integer, got {trials!r}")
    shortest = min_passkey_length(tokenizer, format, key_digits) + answer_tokens
    if length < shortest:
        raise HeadkitError(
            f"--passkey-lengths: {length} tokens cannot hold the key sentence and the question with this "
            f"tokenizer ({shortest} tokens without filler, with a {answer_tokens}-token answer): use lengths of "
            f"at least {shortest}"
        )
    if not sentences:
        raise HeadkitError("passkey filler needs at least one sentence")
    head, tail = passkey_frame(tokenizer, format)
    rng = np.random.default_rng([seed, length])
    encoded: dict[int, list[int]] = {}

    def sentence_ids(index: int) -> list[int]:
        index %= len(sentences)
        if index not in encoded:
            encoded[index] = _encode(tokenizer, " " + sentences[index])
        return encoded[index]

    result = []
    for trial in range(trials):
        key, depth = random_key(rng, key_digits), float(depths[trial % len(depths)])
        key_ids = _encode(tokenizer, " " + format.key_sentence.format(key=key))
        room = length - answer_tokens - len(head) - len(tail) - len(key_ids)
        filler, boundaries, index = [], [0], int(rng.integers(len(sentences)))
        while len(filler) < room:
            filler += sentence_ids(index)
            boundaries.append(min(len(filler), room))
            index += 1
        filler = filler[:room]
        cut = min(boundaries, key=lambda boundary: abs(boundary - depth * room))
        ids = head + filler[:cut] + key_ids + filler[cut:] + tail
        result.append(PasskeyTrial(tuple(ids), key, depth, len(head) + cut, length, len(key_ids)))
    return result


def passkey_examples(
    tokenizer: Any,
    sentences: Sequence[str],
    length: int,
    count: int,
    *,
    seed: int = 0,
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75),
    format: PasskeyFormat = INSTRUCTION_FORMAT,
) -> list[RetrievalExample]:
    """`count` passkey prompts of `length` tokens followed by their right answer, with the key sentence's token
    span: what :func:`headkit.analysis.retrieval.retrieval_head_scores` reads the retrieval heads from."""
    examples = []
    for trial in passkey_trials(tokenizer, sentences, length, count, depths, seed=seed, format=format):
        key_tokens = trial.key_tokens
        answer = _encode(tokenizer, " " + trial.key)
        examples.append(
            RetrievalExample(
                trial.input_ids + tuple(answer),
                trial.key_position,
                trial.key_position + key_tokens,
                len(trial.input_ids),
            )
        )
    return examples


# Passkey prompts that score the retrieval heads: their own seed, so that no measured prompt is among them.
RETRIEVAL_SCORING_PROMPTS = 16
RETRIEVAL_SCORING_LENGTH = 1024
RETRIEVAL_SCORING_SEED = 1_000_003


def passkey_retrieval_scores(
    model: nn.Module, tokenizer: Any, sentences: Sequence[str], *, context: int | None, seed: int = 0
) -> tuple[torch.Tensor, int]:
    """The retrieval-head scores of `model` (:func:`headkit.analysis.retrieval.retrieval_head_scores`, [layers,
    kv_heads]) on :data:`RETRIEVAL_SCORING_PROMPTS` passkey prompts of their own seed, 1,024 tokens or the
    model's `context` if shorter; returns (scores, the prompts' length)."""
    length = min(RETRIEVAL_SCORING_LENGTH, context or RETRIEVAL_SCORING_LENGTH)
    examples = passkey_examples(
        tokenizer, sentences, length, RETRIEVAL_SCORING_PROMPTS, seed=RETRIEVAL_SCORING_SEED + seed
    )
    return retrieval_head_scores(model, examples), length


@torch.no_grad()
def retrieve_passkeys(
    model: nn.Module,
    tokenizer: Any,
    trials: Sequence[PasskeyTrial],
    *,
    max_new_tokens: int = 8,
    batch_tokens: int = 8192,
) -> list[str]:
    """The model's greedy answers (decoded text, at most `max_new_tokens` tokens) to the trials' prompts,
    prompts of equal length decoded together, about `batch_tokens` prompt tokens per batch."""
    pad = pad_token_of(tokenizer)

    def answer(ids: torch.Tensor) -> torch.Tensor:
        return generate_tokens(model, ids, max_new_tokens, pad)

    return _answers(model, tokenizer, trials, batch_tokens, answer)


def _answers(
    model: nn.Module,
    tokenizer: Any,
    trials: Sequence[PasskeyTrial],
    batch_tokens: int,
    answer: Any,
) -> list[str]:
    """`answer(ids [N, L]) → [N, L + n]` over the trials' prompts, those of equal length together (about
    `batch_tokens` prompt tokens per batch), decoded in the trials' order."""
    device = model_device(model)
    answers: dict[int, str] = {}
    by_length: dict[int, list[int]] = {}
    for index, trial in enumerate(trials):
        by_length.setdefault(len(trial.input_ids), []).append(index)
    for length, indices in by_length.items():
        rows = max(1, batch_tokens // length)
        for start in range(0, len(indices), rows):
            chunk = indices[start : start + rows]
            ids = torch.tensor([trials[i].input_ids for i in chunk], dtype=torch.long, device=device)
            for i, row in zip(chunk, answer(ids)[:, length:], strict=True):
                answers[i] = tokenizer.decode(row.tolist(), skip_special_tokens=True)
    return [answers[i] for i in range(len(trials))]


@torch.no_grad()
def second_turn_passkeys(
    model: nn.Module,
    tokenizer: Any,
    trials: Sequence[PasskeyTrial],
    *,
    gap: int,
    max_new_tokens: int = 8,
    batch_tokens: int = 8192,
) -> list[str]:
    """As :func:`retrieve_passkeys`, in two turns: every prompt but its last `gap` tokens (the key inside) is
    prefilled first, as a turn that asks nothing; the last `gap` tokens (other text, then the question) follow
    from the cache as a second turn. A mechanism that chooses what to keep when a prompt is prefilled (the
    question's choice) must then have kept the key before the question came."""
    for trial in trials:
        if trial.key_position + trial.key_tokens > len(trial.input_ids) - gap:
            raise HeadkitError(
                f"a second turn of {gap} tokens must start after the key (at token {trial.key_position} of "
                f"{len(trial.input_ids)}): use shallower depths or a shorter gap"
            )
    pad = pad_token_of(tokenizer)

    def answer(ids: torch.Tensor) -> torch.Tensor:
        cache = output_cache(model(input_ids=ids[:, : ids.shape[1] - gap], use_cache=True))
        return generate_tokens(model, ids, max_new_tokens, pad, **cache_keyword(cache))

    return _answers(model, tokenizer, trials, batch_tokens, answer)


def key_beyond_window(trial: PasskeyTrial, window: int) -> bool:
    """Whether the trial's key sentence has left a `window`-token attention window by the time the answer is
    written (its last token more than `window` tokens before the prompt's end)."""
    return trial.key_position + trial.key_tokens <= len(trial.input_ids) - window


def passkey_answer(text: str) -> str:
    """The key a generated answer gives: its first run of digits ("" if none)."""
    found = re.search(r"\d+", text)
    return found.group() if found else ""


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4)."""
    if trials <= 0 or not 0 <= successes <= trials:
        raise HeadkitError(f"need 0 ≤ successes ≤ trials and trials ≥ 1, got {successes} of {trials}")
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def score_passkeys(trials: Sequence[PasskeyTrial], answers: Sequence[str]) -> dict[str, Any]:
    """Exact-match accuracy (the answer's first digits are the key) with its 95% Wilson interval, per length and
    per (length, depth)."""
    if len(trials) != len(answers) or not trials:
        raise HeadkitError(f"need as many answers as trials (≥ 1), got {len(answers)} and {len(trials)}")
    correct = [passkey_answer(a) == t.key for t, a in zip(trials, answers, strict=True)]

    def cell(members: list[int]) -> dict[str, Any]:
        hits = sum(correct[i] for i in members)
        low, high = wilson_interval(hits, len(members))
        return {"trials": len(members), "correct": hits, "accuracy": hits / len(members), "ci95": [low, high]}

    lengths = sorted({t.length for t in trials})
    by_length = [{"length": n} | cell([i for i, t in enumerate(trials) if t.length == n]) for n in lengths]
    cells = [
        {"length": n, "depth": d} | cell([i for i, t in enumerate(trials) if t.length == n and t.depth == d])
        for n in lengths
        for d in sorted({t.depth for t in trials if t.length == n})
    ]
    return {"by_length": by_length, "by_depth": cells, "correct": correct}
