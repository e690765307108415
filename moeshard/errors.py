"""The one user-facing error type of moeshard."""

from __future__ import annotations


class MoeshardError(Exception):
    """A problem the user can fix: bad input, bad flags, an existing output.

    The message is printed as one line by the CLI. It names the file and tensor involved,
    what was expected and what was found, e.g.
    ``model-00000-of-00002.safetensors: model.layers.0.mlp.experts.gate_up_proj_scales:
    expected dtype U8, found BF16``.
    """

    exit_code = 1


class Interrupted(MoeshardError):
    """Ctrl-C (SIGINT) during a run; the message says what was kept and how to continue."""

    exit_code = 130
