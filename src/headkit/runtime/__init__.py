"""headkit.runtime: running a model to produce text.

- :mod:`~headkit.runtime.fast`: fast greedy decoding on CPU, a compiled single-token step over fixed-size caches
  with bfloat16, int8 or int4 weights (:class:`FastDecoder`, :func:`fast_generate`).
"""

from headkit.runtime.fast import FastDecoder, fast_generate

__all__ = ["FastDecoder", "fast_generate"]
