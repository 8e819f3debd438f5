"""headkit.runtime: running a model to produce text.

- :mod:`~headkit.runtime.generation`: continuing a prompt with a saved causal LM, streamed, then its tokens per
  second and decoding-cache bytes (:func:`generate`, what ``headkit generate`` runs).
- :mod:`~headkit.runtime.fast`: fast greedy decoding on CPU, a compiled single-token step over fixed-size caches
  with bfloat16, int8 or int4 weights (:class:`FastDecoder`, :func:`fast_generate`).
"""

from headkit.runtime.fast import FastDecoder, fast_generate
from headkit.runtime.generation import GeneratedText, generate, load_generator, position_limit

__all__ = ["FastDecoder", "GeneratedText", "fast_generate", "generate", "load_generator", "position_limit"]
