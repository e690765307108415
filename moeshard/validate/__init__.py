"""Validation: route seeded hidden states, run the MoE on each rank's converted tensors and on the
source checkpoint, and compare (DESIGN.md, "Validation")."""

from moeshard.validate.run import ValidationReport, validate

__all__ = ["ValidationReport", "validate"]
