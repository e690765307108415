"""moeshard: convert quantized MoE checkpoints into FlashInfer trtllm-gen rank shards.

Importing the package is cheap: torch and flashinfer are imported by the modules that need them.
"""

__version__ = "0.1.0"

from moeshard.errors import MoeshardError

__all__ = ["MoeshardError", "__version__"]
