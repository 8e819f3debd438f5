"""headkit.export: models out of PyTorch, and measured where they run.

- :mod:`~headkit.export.gguf`: a causal LM — stock, or after headkit's head pruning — written as a GGUF file that
  llama.cpp runs (:func:`export_gguf`, ``headkit export``).
- :mod:`~headkit.export.llamacpp`: a GGUF file measured in llama.cpp itself (llama-cpp-python), each measurement
  in a child process that runs that module (``python -m headkit.export.llamacpp``): so this package does not
  import it, which would leave the module imported twice in the child.
"""

from headkit.export.gguf import EXPORT_TYPES, ExportReport, export_gguf

__all__ = ["EXPORT_TYPES", "ExportReport", "export_gguf"]
