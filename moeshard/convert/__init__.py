"""Conversion: plan -> produce -> manifest, in one process or several (torchrun)."""
