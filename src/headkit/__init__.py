"""headkit: engineering attention heads on PyTorch and 🤗 Transformers.

Efficient attention you can train and decode with (softmax, linear, additive, CoCA, collaborative), and
surgery on pretrained models (collaborative heads, head gates and pruning).
"""

from headkit.errors import HeadkitError

__version__ = "0.1.0"

__all__ = ["HeadkitError", "__version__"]
