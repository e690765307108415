"""``moeshard push``: upload an artifact to the Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path

from moeshard.artifact.manifest import MANIFEST_NAME, Manifest, artifact_file
from moeshard.errors import MoeshardError


def model_card(m: Manifest, repo_id: str) -> str:
    """README.md of a pushed artifact: source, layout, ranks, how to load."""
    src = m.source
    origin = (f"[{src.repo_id}](https://huggingface.co/{src.repo_id}) at commit `{src.commit}`"
              if src.repo_id else f"a local checkpoint (`{src.name}`)")
    pad, lay = m.padding, m.layout
    ranks = "\n".join(f"| {r.rank} | {r.ep_rank} | {r.tp_rank} | {r.experts[0]}..{r.experts[-1]} "
                      f"({len(r.experts)}) | {r.intermediate_slice[0]}..{r.intermediate_slice[1]} |"
                      for r in m.ranks)
    return f"""---
tags:
- moeshard
- flashinfer
- trtllm-gen
- {m.quant_format}
---

# {repo_id}

FlashInfer trtllm-gen rank shards of {origin}, made by moeshard {m.tool.version}
(for flashinfer-python {m.tool.flashinfer}).

- family: `{m.family}`, quantization: `{m.quant_format}`
- layout: `{lay.name}` version {lay.version} (epilogue_tile_m {lay.epilogue_tile_m},
  128x4 scale interleave, scales stored as float8_e4m3fn)
- hidden size {pad.hidden_size} padded to {pad.hidden_size_padded}; intermediate size
  {pad.intermediate_size}, per rank padded to {pad.intermediate_size_padded}
- {m.rank_count} ranks: expert parallel {m.ep_size} x tensor parallel {m.tp_size}, placement
  `{m.placement}`; this repository holds {len(m.ranks)} of them{'' if m.common else ' (no common/)'}

| rank | ep_rank | tp_rank | experts | intermediate slice |
|---|---|---|---|---|
{ranks}

`moeshard.json` lists every file with its size and SHA-256 and, per MoE layer, the kernel
arguments; `common/` holds every non-expert tensor unchanged; `rank-0000k/` holds rank k's experts.

## Load

```python
import moeshard
from huggingface_hub import snapshot_download

out = snapshot_download("{repo_id}", allow_patterns=["moeshard.json", "*.json", "common/*", "rank-00003/*"])
rank = moeshard.load_rank(out, 3, device="cuda")  # this process is rank 3
layer = rank.layers[{m.moe_layers[0].layer}]
# flashinfer.fused_moe.trtllm_fp4_block_scale_moe(**layer.kernel_kwargs(routing_logits, hidden_states))
```

Check it before serving: `moeshard verify <folder>` (hashes) and `moeshard validate <folder>` (MoE outputs
against the source checkpoint).
"""


def upload_list(out: Path, m: Manifest) -> list[tuple[str, Path]]:
    """``(path in repo, local path)`` of every file the manifest lists, plus the manifest, each a
    regular file inside the artifact (no symlink) of the size the manifest records."""
    files = [(f.path, f.bytes) for f in m.files()] + [(MANIFEST_NAME, None)]
    out_list = []
    for rel, size in files:
        p = artifact_file(out, rel)
        if p.is_symlink() or not p.is_file():
            raise MoeshardError(f"{p}: expected a regular file of the artifact, found "
                                f"{'a symlink' if p.is_symlink() else 'none'}; run moeshard verify")
        if size is not None and p.stat().st_size != size:
            raise MoeshardError(f"{p}: changed since the manifest: expected {size} bytes, found {p.stat().st_size}; "
                                "run moeshard verify")
        out_list.append((rel, p))
    return out_list


def push(out: Path, repo_id: str, *, revision: str | None = None, private: bool | None = None,
         token: str | None = None, commit_message: str | None = None):
    """Upload artifact ``out`` to ``repo_id`` (created if needed): exactly the files its manifest
    lists, the manifest, and a model card (README.md) made in memory, in one commit
    (``HfApi.create_commit``; large files go through the Hub's LFS / xet upload).

    Nothing else in the folder is uploaded (no stray files, no symlinks) and nothing is written
    into it. Files that are no longer what the manifest says (size, symlink) are refused first.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    from moeshard.checkpoints.hub import hub_error, hub_errors

    out = Path(out)
    m = Manifest.read(out)
    files = upload_list(out, m)
    ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p)) for rel, p in files]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=model_card(m, repo_id).encode()))
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.create_commit(repo_id, operations=ops, revision=revision,
                                 commit_message=commit_message or f"moeshard {m.family} artifact: "
                                 f"{m.rank_count} ranks (ep {m.ep_size} x tp {m.tp_size})",
                                 commit_description=f"Converted from {m.source.label()} by moeshard.")
    except hub_errors() as e:
        raise hub_error(repo_id, e) from None
