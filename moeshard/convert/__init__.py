"""Checkpoint families, planning, the conversion pipeline and the artifact manifest."""
