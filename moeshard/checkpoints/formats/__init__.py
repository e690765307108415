"""Quantization formats of the checkpoints: the closed set, and per format its helpers
(:mod:`.fp4`: the E2M1 / MXFP4 / NVFP4 codecs; :mod:`.modelopt`: ModelOpt's NVFP4 export)."""

from __future__ import annotations

import enum


class QuantFormat(str, enum.Enum):
    MXFP4 = "mxfp4"  # E2M1 values, one UE8M0 scale per 32
    NVFP4 = "nvfp4"  # E2M1 values, one E4M3 scale per 16, and a float32 per-tensor scale

    @property
    def sf_vec_size(self) -> int:
        """Elements per block scale."""
        return 32 if self is QuantFormat.MXFP4 else 16


__all__ = ["QuantFormat"]
