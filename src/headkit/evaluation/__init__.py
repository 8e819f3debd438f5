"""headkit.evaluation: every measurement headkit reports about a model, each defined once, which the recipes'
reports, the benchmarks and ``headkit eval`` call — one module per measure:

- :mod:`~headkit.evaluation.quality`: the next-token loss behind held-out perplexity and bits per byte; top-1
  agreement and KL against a reference; for encoders, the cosine of mean-pooled embeddings;
- :mod:`~headkit.evaluation.timing`: the one clock and timer of calls, CUDA-synchronised; greedy decoding steps,
  decode profiles, prefill against decode of two models, taken in alternation;
- :mod:`~headkit.evaluation.memory`: the bytes of the decoding cache (and their growth per token), peak resident
  memory while decoding;
- :mod:`~headkit.evaluation.sampling`: greedy samples for reports;
- :mod:`~headkit.evaluation.retrieval`: passkey prompts, greedy answers, exact-match scores with Wilson 95%
  intervals;
- :mod:`~headkit.evaluation.tasks`: lm-evaluation-harness task scores;
- :mod:`~headkit.evaluation.report`: all of them on one model (and its reference), what ``headkit eval`` runs
  (:func:`evaluate`).
"""

import importlib
from collections.abc import Callable
from types import ModuleType

from headkit.lazy import lazy_names

# Where each name lives, imported when first used (PEP 562): importing one module of the package (a config, a
# settings class) loads no more than it needs. A literal import per module, so that the import graph
# (tests/test_layout.py) sees every edge.
_MODULES: dict[tuple[str, ...], Callable[[], ModuleType]] = {
    (
        "cache_bytes",
        "decode_peak_bytes",
        "filled_cache",
        "kv_cache_bytes_per_token",
        "peak_resident_bytes",
    ): lambda: importlib.import_module("headkit.evaluation.memory"),
    (
        "Agreement",
        "agreement",
        "continuation_perplexity",
        "embedding_cosine",
        "held_out_bits_per_byte",
        "last_hidden_states",
        "next_token_nats",
        "perplexity",
        "summed_nats",
    ): lambda: importlib.import_module("headkit.evaluation.quality"),
    ("EvalSettings", "check_eval_settings", "evaluate", "format_eval_table"): lambda: importlib.import_module(
        "headkit.evaluation.report"
    ),
    (
        "INSTRUCTION_FORMAT",
        "PasskeyFormat",
        "PasskeyTrial",
        "min_passkey_length",
        "passkey_answer",
        "passkey_trials",
        "prose_sentences",
        "python_prose",
        "retrieve_passkeys",
        "score_passkeys",
        "wilson_interval",
    ): lambda: importlib.import_module("headkit.evaluation.retrieval"),
    ("generate_tokens", "greedy_sample", "pad_token_of"): lambda: importlib.import_module(
        "headkit.evaluation.sampling"
    ),
    ("LoadedTasks", "TaskSettings", "load_tasks", "measure_tasks", "run_tasks", "task_names"): lambda: (
        importlib.import_module("headkit.evaluation.tasks")
    ),
    (
        "Timing",
        "compare_speed",
        "decode_profile",
        "decode_seconds_per_token",
        "decode_step_seconds",
        "forward_times",
        "interleaved_times",
        "interleaved_values",
        "thread_limit",
        "time_call",
        "time_greedy_decoding",
        "timed_call",
    ): lambda: importlib.import_module("headkit.evaluation.timing"),
}
_WHERE = {name: load for names, load in _MODULES.items() for name in names}

__all__ = [
    "INSTRUCTION_FORMAT",
    "Agreement",
    "EvalSettings",
    "LoadedTasks",
    "PasskeyFormat",
    "PasskeyTrial",
    "TaskSettings",
    "Timing",
    "agreement",
    "continuation_perplexity",
    "cache_bytes",
    "check_eval_settings",
    "compare_speed",
    "decode_peak_bytes",
    "decode_profile",
    "decode_seconds_per_token",
    "decode_step_seconds",
    "embedding_cosine",
    "evaluate",
    "filled_cache",
    "format_eval_table",
    "forward_times",
    "generate_tokens",
    "greedy_sample",
    "held_out_bits_per_byte",
    "interleaved_times",
    "interleaved_values",
    "kv_cache_bytes_per_token",
    "last_hidden_states",
    "load_tasks",
    "measure_tasks",
    "min_passkey_length",
    "next_token_nats",
    "pad_token_of",
    "passkey_answer",
    "passkey_trials",
    "peak_resident_bytes",
    "perplexity",
    "prose_sentences",
    "python_prose",
    "retrieve_passkeys",
    "run_tasks",
    "score_passkeys",
    "summed_nats",
    "task_names",
    "thread_limit",
    "time_call",
    "time_greedy_decoding",
    "timed_call",
    "wilson_interval",
]


__getattr__, __dir__ = lazy_names(globals(), _WHERE)
