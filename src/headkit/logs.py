"""Quiet two import-time warnings that are noise for every headkit command.

transformers imports torchao's quantizer whenever torchao is installed (headkit's optional ``fast`` extra), and
torchao 0.18 then warns that its CUDA-only extension libraries do not load on this Python, and torch that
torchao's enums no longer need registering. Neither says anything about the user's work, and both would break
the rule that a user error is one line. Only those exact messages are dropped; every other record passes.
"""

from __future__ import annotations

import logging

_NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_import_noise() -> None:
    """Install the filters (idempotent): on the named loggers, before transformers imports torchao."""
    for name, fragments in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropMessages) for existing in logger.filters):
            logger.addFilter(_DropMessages(fragments))


quiet_import_noise()
