"""moeshard: convert quantized MoE checkpoints into FlashInfer trtllm-gen rank shards.

Importing the package is cheap: torch and flashinfer are imported by the modules that need them.
"""

__version__ = "0.1.0"

from moeshard.errors import MoeshardError

__all__ = ["MoeshardError", "__version__", "load_rank"]


def load_rank(*args, **kwargs):
    """See :func:`moeshard.artifact.load.load_rank` (imported lazily: torch loads only when used)."""
    from moeshard.artifact.load import load_rank as _load_rank

    return _load_rank(*args, **kwargs)
