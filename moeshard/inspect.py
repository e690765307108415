"""``moeshard inspect``: what a source checkpoint or an artifact holds, as a plain dict.

An artifact is described from its manifest alone (no torch import); a checkpoint from its
config and tensor headers.
"""

from __future__ import annotations

from pathlib import Path

from moeshard.artifact.manifest import Manifest, is_artifact


def _artifact(path: Path) -> dict:
    from dataclasses import asdict

    m = Manifest.read(path)
    return {
        "kind": "artifact",
        "path": str(path),
        "family": m.family,
        "quant_format": m.quant_format,
        "layout": asdict(m.layout),
        "padding": asdict(m.padding),
        "num_experts": m.num_experts,
        "moe_layers": len(m.moe_layers),
        "ep_size": m.ep_size,
        "tp_size": m.tp_size,
        "placement": m.placement,
        "source": m.source.label(),
        "kernel_args": m.moe_layers[0].kernel_args,
        "ranks": [{"rank": r.rank, "ep_rank": r.ep_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                   "local_expert_offset": r.local_expert_offset, "intermediate_slice": list(r.intermediate_slice),
                   "files": len(r.files), "bytes": sum(f.bytes for f in r.files)} for r in m.ranks],
        "common_bytes": sum(f.bytes for f in m.common.files) if m.common else None,
        "rank_count": m.rank_count,
    }


def _checkpoint(path: Path) -> dict:
    from moeshard.checkpoints.families import detect, expert_index
    from moeshard.checkpoints.source import Checkpoint

    with Checkpoint(path) as ckpt:
        adapter = detect(ckpt)
        spec = adapter.spec(ckpt)
        layer = spec.moe_layers[0]
        prefix = spec.prefix(layer)
        # Per-expert families (DeepSeek) list expert 0 only.
        experts = {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in sorted(ckpt.tensors.items())
                   if n in spec.expert_tensors and n.startswith(prefix + ".") and expert_index(n, prefix) in (None, 0)}
        return {
            "kind": "checkpoint",
            "path": str(path),
            "family": spec.family.value,
            "quant_format": spec.quant_format.value,
            "num_experts": spec.num_experts,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "moe_layers": len(spec.moe_layers),
            "routing": spec.routing,
            "activation": spec.activation,
            "files": len(ckpt.files),
            "bytes": sum(t.nbytes for t in ckpt.tensors.values()),
            "expert_bytes": sum(ckpt.tensors[n].nbytes for n in spec.expert_tensors),
            "expert_tensors_of_layer": {"layer": layer, "prefix": prefix, "tensors": experts},
        }


def inspect_path(path: Path | str) -> dict:
    """Summary of a checkpoint folder, a Hub repo id, or an artifact (it has moeshard.json)."""
    from moeshard.checkpoints.hub import looks_like_repo_id, resolve
    from moeshard.errors import MoeshardError

    if looks_like_repo_id(str(path)):
        path, _ = resolve(str(path))
    path = Path(path)
    if is_artifact(path):
        return _artifact(path)
    if not path.exists():
        raise MoeshardError(f"{path}: does not exist (expected a checkpoint folder, a Hub repo id or an artifact)")
    from moeshard.artifact.output import STATE_DIR

    if (path / STATE_DIR).exists() or (path / "rank-00000").is_dir():
        raise MoeshardError(f"{path}: not a moeshard artifact: moeshard.json is missing (an interrupted or unfinished "
                            "conversion; finish it with moeshard convert --resume)")
    return _checkpoint(path)
