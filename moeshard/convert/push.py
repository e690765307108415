"""``moeshard push``: upload an artifact to the Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path

from moeshard.convert.manifest import read_manifest
from moeshard.convert.verify import manifest_files
from moeshard.errors import MoeshardError

#: Never uploaded: the lock, an unfinished conversion's journal, temporary files.
IGNORE = [".moeshard.lock", ".moeshard-incomplete/**", "**/*.tmp", ".cache/**"]


def model_card(m: dict, repo_id: str) -> str:
    """README.md of a pushed artifact: source, layout, ranks, how to load."""
    src = m["source"]
    origin = (f"[{src['repo_id']}](https://huggingface.co/{src['repo_id']}) at commit `{src['commit']}`"
              if src.get("repo_id") else f"a local checkpoint (`{Path(src['path']).name}`)")
    pad = m["padding"]
    ranks = "\n".join(f"| {r['rank']} | {r['ep_rank']} | {r['tp_rank']} | {r['experts'][0]}..{r['experts'][-1]} "
                      f"({len(r['experts'])}) | {r['intermediate_slice'][0]}..{r['intermediate_slice'][1]} |"
                      for r in m["ranks"])
    return f"""---
tags:
- moeshard
- flashinfer
- trtllm-gen
- {m['quant_format']}
---

# {repo_id}

FlashInfer trtllm-gen rank shards of {origin}, made by moeshard {m['tool']['version']}
(for flashinfer-python {m['tool']['flashinfer']}).

- family: `{m['family']}`, quantization: `{m['quant_format']}`
- layout: `{m['layout']['name']}` version {m['layout']['version']} (epilogue_tile_m {m['layout']['epilogue_tile_m']},
  128x4 scale interleave, scales stored as float8_e4m3fn)
- hidden size {pad['hidden_size']} padded to {pad['hidden_size_padded']}; intermediate size
  {pad['intermediate_size']}, per rank padded to {pad['intermediate_size_padded']}
- {m['rank_count']} ranks: expert parallel {m['ep_size']} x tensor parallel {m['tp_size']}, placement
  `{m['placement']}`; this repository holds {len(m['ranks'])} of them{'' if m['common'] else ' (no common/)'}

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
layer = rank.layers[{m['moe_layers'][0]['layer']}]
# flashinfer.fused_moe.trtllm_fp4_block_scale_moe(**layer.kernel_kwargs(routing_logits, hidden_states))
```

Check it before serving: `moeshard verify <folder>` (hashes) and `moeshard validate <folder>` (MoE outputs
against the source checkpoint).
"""


def push(out: Path, repo_id: str, *, revision: str | None = None, private: bool | None = None,
         token: str | None = None, commit_message: str | None = None):
    """Upload artifact ``out`` to ``repo_id`` (created if needed) with a generated README.md.

    Uses ``HfApi.upload_folder``, which in huggingface_hub 2.x commits large folders in several
    batches (and resumes) when ``hf_xet`` is installed, and in one commit otherwise.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from moeshard.convert.hub import _hub_error

    out = Path(out)
    m = read_manifest(out)
    for f in manifest_files(m):
        p = out / f["path"]
        if not p.is_file() or p.stat().st_size != f["bytes"]:
            raise MoeshardError(f"{p}: missing or of the wrong size (expected {f['bytes']} bytes); run moeshard verify")
    (out / "README.md").write_text(model_card(m, repo_id))
    api = HfApi(token=token)
    src = m["source"]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(repo_id=repo_id, folder_path=out, revision=revision, ignore_patterns=list(IGNORE),
                                 commit_message=commit_message or f"moeshard {m['family']} artifact: {m['rank_count']} "
                                 f"ranks (ep {m['ep_size']} x tp {m['tp_size']})",
                                 commit_description=f"Converted from {src.get('repo_id') or src['path']}"
                                 + (f" at {src['commit']}" if src.get("commit") else "") + " by moeshard.")
    except (HfHubHTTPError, OSError) as e:
        raise _hub_error(repo_id, e) from None
