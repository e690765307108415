"""The ``moeshard`` command: a thin typer app over the library.

Results (paths, reports, ``--json``) go to stdout; progress, logs and hints to stderr.
Heavy imports (torch, flashinfer) happen inside the commands, so ``--help`` is instant.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from moeshard.errors import MoeshardError

app = typer.Typer(
    name="moeshard",
    help="Convert quantized MoE checkpoints (GPT-OSS MXFP4, DeepSeek-R1-FP4 and Llama-4-Scout-FP4 NVFP4) "
    "into FlashInfer trtllm-gen expert-parallel rank shards, and prove every shard right.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out_console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)  # one line per message, never wrapped

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout, nothing else.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
DeviceOpt = Annotated[str, typer.Option(help="Where tensor work runs: cpu or cuda.")]


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000; units B, KB, MB, GB, TB (powers of 1000, as the Hub counts)."""
    t = text.strip().upper()
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for u, mult in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * mult)
            except ValueError:
                break
    raise typer.BadParameter(f"expected a size like 5GB or 500MB, found {text!r}")


def parse_ints(text: str | None) -> list[int] | None:
    """'0-3,5' -> [0, 1, 2, 3, 5]."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            a, _, b = part.partition("-")
            out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    except ValueError:
        raise typer.BadParameter(f"expected numbers and ranges like 0-3,5, found {text!r}") from None
    return out


def _progress(enabled: bool, total: int | None = None, description: str = "", in_bytes: bool = False):
    """A rich progress bar on stderr (only on a terminal and when enabled), as (context, tick)."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

    if not enabled or not err_console.is_terminal:
        return nullcontext(), (lambda *a: None)
    columns = [TextColumn("{task.description}"), BarColumn()]
    if total is not None or in_bytes:
        columns += [DownloadColumn(), TransferSpeedColumn()]
    columns += [TimeElapsedColumn()]
    prog = Progress(*columns, console=err_console, transient=True)
    task = prog.add_task(description, total=total)

    def tick(n: int = 0, what: str = "") -> None:
        prog.update(task, advance=n, description=f"{description} {what}".strip())

    tick.total = lambda n: prog.update(task, total=n)  # known once the library has planned
    return prog, tick


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


@app.command(epilog="Examples:\n\n  moeshard fixture gpt-oss --preset tiny -o tiny-gpt-oss\n\n"
             "  moeshard fixture gpt-oss --preset gpt-oss-120b --layers 2 -o bench-120b\n\n"
             "  moeshard fixture deepseek-r1-fp4 --preset deepseek-r1 --layers 4 -o bench-r1\n\n"
             "  moeshard fixture llama4-scout-fp4 -o tiny-scout")
def fixture(
    family: Annotated[str, typer.Argument(help="gpt-oss, deepseek-r1-fp4 or llama4-scout-fp4.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (must be new or empty).")],
    preset: Annotated[str, typer.Option(help="tiny (tests) or real layer sizes: gpt-oss-20b, gpt-oss-120b, "
                                             "deepseek-r1, llama4-scout.")] = "tiny",
    layers: Annotated[Optional[int], typer.Option(help="Number of layers (default: the preset's; DeepSeek keeps "
                                                       "at most layers-1 dense layers).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the generated weights.")] = 0,
) -> None:
    """Write a synthetic checkpoint in the exact on-disk format of the real model."""
    from moeshard.fixtures import fixture as make

    with err_console.status(f"writing {family} {preset} fixture"):
        path = make(family, preset, output, layers=layers, seed=seed)
    out_console.print(str(path))


@app.command(epilog="Examples:\n\n  moeshard convert openai/gpt-oss-120b --ep-size 8 -o out/\n\n"
             "  moeshard convert ./gpt-oss-20b --ep-size 4 -o out/ --dry-run\n\n"
             "  moeshard convert nvidia/DeepSeek-R1-FP4 --ep-size 8 --ranks 3 --no-common -o out/")
def convert(
    source: Annotated[str, typer.Argument(help="Checkpoint folder or Hugging Face repo id (org/name).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Artifact folder to write.")],
    ep_size: Annotated[int, typer.Option(help="Expert-parallel ranks; must divide the expert count.")] = 1,
    tp_size: Annotated[int, typer.Option(help="Tensor-parallel ranks per EP rank: each gets a slice of every "
                                              "expert's intermediate dimension. Ranks = ep x tp.")] = 1,
    placement: Annotated[str, typer.Option(help="Experts per EP rank: contiguous (vLLM's default, what the "
                                                "trtllm-gen kernel takes) or round-robin (expert e on rank "
                                                "e mod ep).")] = "contiguous",
    pad_multiple: Annotated[Optional[int], typer.Option(help="Pad hidden and per-rank intermediate sizes to a "
                                                             "multiple of this (default: 256 for GPT-OSS, 128 "
                                                             "for NVFP4).")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest output safetensors file, e.g. 5GB.")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing artifact or non-empty folder.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted conversion into OUTPUT, reusing the files "
                                              "it finished (checked by sha256).")] = False,
    ranks: Annotated[Optional[str], typer.Option(help="Convert only these ranks, e.g. 3 or 0-3 (a repo id then "
                                                      "downloads only the shards they need).")] = None,
    common: Annotated[bool, typer.Option("--common/--no-common", help="Also write common/ (every non-expert "
                                                                       "tensor).")] = True,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(help="Hub cache folder (default: HF_HUB_CACHE).")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or the saved login).")] = None,
    dry_run: Annotated[bool, typer.Option(help="Validate headers and print the plan; write nothing.")] = False,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint into trtllm-gen layout, one folder per expert-parallel rank."""
    from moeshard.convert.pipeline import convert as run

    if dry_run:
        plan = run(source, output, ep_size=ep_size, tp_size=tp_size, placement=placement, pad_multiple=pad_multiple,
                   max_shard_bytes=parse_size(max_shard_size), dry_run=True, ranks=parse_ints(ranks), common=common,
                   revision=revision, cache_dir=cache_dir, token=token)
        doc = {"ranks": [{"rank": r.rank, "ep_rank": r.ep_rank, "tp_rank": r.tp_rank, "experts": list(r.experts),
                          "intermediate_slice": [r.i_start, r.i_stop],
                          "files": [{"path": f.path, "layers": list(f.layers), "bytes": f.nbytes} for f in r.files]}
                         for r in plan.ranks],
               "common_files": [{"path": f.path, "tensors": len(f.sources), "bytes": f.nbytes} for f in plan.common],
               "hidden_size_padded": plan.hidden_size_padded,
               "intermediate_size_padded": plan.intermediate_size_padded, "bytes": plan.total_bytes}
        out_console.print_json(json.dumps(doc)) if as_json else out_console.print(
            f"plan: {len(plan.ranks)} ranks, {sum(len(r.files) for r in plan.ranks)} rank files, "
            f"{len(plan.common)} common files, {_fmt_bytes(plan.total_bytes)} to write (dry run: nothing written)")
        return
    ctx, tick = _progress(not (as_json or quiet), description="converting", in_bytes=True)
    with ctx:
        res = run(source, output, ep_size=ep_size, tp_size=tp_size, placement=placement, pad_multiple=pad_multiple,
                  max_shard_bytes=parse_size(max_shard_size), overwrite=overwrite, resume=resume, device=device,
                  progress=tick, ranks=parse_ints(ranks), common=common, revision=revision, cache_dir=cache_dir,
                  token=token)
    if res.manifest is None:  # a torchrun process other than 0: process 0 reports
        return
    m = res.manifest
    summary = {"output": str(res.out), "family": m["family"], "ranks": len(m["ranks"]), "ep_size": m["ep_size"],
               "tp_size": m["tp_size"], "placement": m["placement"],
               "moe_layers": len(m["moe_layers"]), "bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
               "files_reused": res.files_reused,
               "seconds": round(res.seconds, 3), "throughput_gb_s": round(res.bytes_written / res.seconds / 1e9, 3)}
    if as_json:
        out_console.print_json(json.dumps(summary))
        return
    err_console.print(f"converted {m['family']} ({len(m['moe_layers'])} MoE layers, {m['num_experts']} experts) into "
                      f"{len(m['ranks'])} ranks: wrote {_fmt_bytes(res.bytes_written)} in {res.seconds:.2f} s "
                      f"({res.bytes_written / res.seconds / 1e9:.2f} GB/s)"
                      + (f"; reused {res.files_reused} finished files" if res.files_reused else ""))
    out_console.print(str(res.out))


@app.command(epilog="Examples:\n\n  moeshard inspect ./gpt-oss-120b\n\n  moeshard inspect out/ --json")
def inspect(
    path: Annotated[str, typer.Argument(help="A checkpoint folder, a Hub repo id, or a moeshard artifact.")],
    as_json: JsonOpt = False,
) -> None:
    """Show family, quant format, layers, experts, shapes, per-rank sizes and kernel arguments."""
    from rich.markup import escape
    from rich.table import Table

    from moeshard.inspect import inspect_path

    info = inspect_path(path)
    if as_json:
        out_console.print_json(json.dumps(info))
        return
    table = Table(title=escape(f"{info['kind']}: {info['path']}"), show_header=False)
    for k, v in info.items():
        if k in ("ranks", "kind", "path", "expert_tensors_of_layer"):
            continue
        table.add_row(k, escape(", ".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v)))
    out_console.print(table)
    if "ranks" in info:
        rt = Table(title="ranks")
        cols = ("rank", "ep_rank", "tp_rank", "experts", "local_expert_offset", "intermediate_slice", "files", "bytes")
        for col in cols:
            rt.add_column(col, justify="right")
        for r in info["ranks"]:
            rt.add_row(*(escape(str(r[c])) if c != "bytes" else _fmt_bytes(r[c]) for c in cols))
        out_console.print(rt)
    else:
        ex = info["expert_tensors_of_layer"]
        et = Table(title=escape(f"expert tensors of layer {ex['layer']} ({ex['prefix']}.*)"))
        for col in ("tensor", "dtype", "shape"):
            et.add_column(col)
        for n, t in ex["tensors"].items():
            et.add_row(n[len(ex["prefix"]) + 1:], t["dtype"], str(t["shape"]))
        out_console.print(et)


@app.command(epilog="Examples:\n\n  moeshard verify out/\n\n  moeshard verify out/ --json")
def verify(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder written by moeshard convert.")],
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Re-hash every file against the manifest (sha256); exit 1 on any missing or changed file."""
    from moeshard.convert.manifest import read_manifest
    from moeshard.convert.verify import as_json as to_json
    from moeshard.convert.verify import manifest_files
    from moeshard.convert.verify import verify as run

    total = sum(f["bytes"] for f in manifest_files(read_manifest(artifact)))
    ctx, tick = _progress(not (as_json or quiet), total, "verifying")
    with ctx:
        checks = run(artifact, progress=tick)
    bad = [c for c in checks if not c.ok]
    if as_json:
        out_console.print_json(json.dumps(to_json(checks)))
    else:
        for c in bad:
            err_console.print(f"FAIL: {artifact / c.path}: {c.problem}")
        out_console.print(("[green]OK[/]" if not bad else "[red]FAIL[/]") +
                          f": {len(checks) - len(bad)}/{len(checks)} files match the manifest "
                          f"({_fmt_bytes(sum(c.bytes for c in checks))}, sha256)")
    if bad:
        raise typer.Exit(1)


@app.command(epilog="Example:\n\n  moeshard push out/ my-org/gpt-oss-120b-trtllm-ep8")
def push(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder written by moeshard convert.")],
    repo_id: Annotated[str, typer.Argument(help="Hub repository to upload to (created if needed).")],
    revision: Annotated[Optional[str], typer.Option(help="Branch to commit to.")] = None,
    private: Annotated[Optional[bool], typer.Option("--private/--public", help="Visibility of a new repo.")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or the saved login).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Upload an artifact to the Hugging Face Hub with a generated model card (README.md)."""
    from moeshard.convert.push import push as run

    info = run(artifact, repo_id, revision=revision, private=private, token=token)
    url = getattr(info, "commit_url", None) or str(info)
    out_console.print_json(json.dumps({"repo_id": repo_id, "commit": url})) if as_json else out_console.print(url)


def _print_report(report, as_json: bool) -> None:
    from rich.table import Table

    if as_json:
        out_console.print_json(json.dumps(report.to_json()))
        return
    for note in report.notes:
        err_console.print(f"note: {note}")
    table = Table(title=f"validate {report.artifact} against {report.source}")
    for col in ("rank", "layer", "backend", "max abs error", "rel error", "verdict"):
        table.add_column(col, justify="right")
    for r in report.rows:
        table.add_row(str(r.rank), str(r.layer), r.backend, f"{r.max_abs_error:.3g}", f"{r.rel_error:.3g}",
                      "[green]pass[/]" if r.passed else "[red]FAIL[/]")
    out_console.print(table)
    for r in report.rows:
        if not r.passed:
            err_console.print(f"FAIL: {r.detail}")
    out_console.print(("[green]PASS[/]" if report.passed else "[red]FAIL[/]") +
                      f": {sum(r.passed for r in report.rows)}/{len(report.rows)} checks "
                      f"(tolerance {report.tolerance:g}, {report.tokens} tokens, seed {report.seed})")


@app.command(epilog="Examples:\n\n  moeshard validate out/\n\n  moeshard validate out/ --ranks 0-3 --layers 0,1 --json")
def validate(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder written by moeshard convert.")],
    source: Annotated[Optional[Path], typer.Option(help="Source checkpoint (default: the one in the manifest).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="MoE layers to check, e.g. 0-3,7 (default: all).")] = None,
    ranks: Annotated[Optional[str], typer.Option(help="Ranks to check, e.g. 0-3 (default: all).")] = None,
    tokens: Annotated[int, typer.Option(help="Number of random hidden states per layer.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed of the hidden states.")] = 0,
    backend: Annotated[str, typer.Option(help="auto (trtllm-gen on Blackwell, else decode), trtllm-gen or decode.")] = "auto",
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the MoE on every rank shard and compare with the source checkpoint; exit 1 on any failure."""
    from moeshard.validate import validate as run

    ctx, tick = _progress(not (as_json or quiet), description="validating")
    with ctx:
        report = run(artifact, source=source, layers=parse_ints(layers), ranks=parse_ints(ranks), tokens=tokens,
                     seed=seed, backend=backend, device=device, progress=lambda what: tick(0, what))
    _print_report(report, as_json)
    if not report.passed:
        raise typer.Exit(1)


@app.command(epilog="Examples:\n\n  moeshard demo -o demo-out\n\n  moeshard demo --family deepseek-r1-fp4 --ep-size 4")
def demo(
    output: Annotated[Path, typer.Option("--output", "-o", help="Working folder (replaced).")] = Path("demo-out"),
    family: Annotated[str, typer.Option(help="gpt-oss, deepseek-r1-fp4 or llama4-scout-fp4.")] = "gpt-oss",
    ep_size: Annotated[int, typer.Option(help="Expert-parallel ranks.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Generate a tiny checkpoint (GPT-OSS by default), convert it with --ep-size 2, validate, print the report."""
    import shutil

    from moeshard.convert.pipeline import convert as run_convert
    from moeshard.fixtures import fixture as make
    from moeshard.inspect import inspect_path
    from moeshard.validate import validate as run_validate

    if output.exists():
        shutil.rmtree(output)
    src = make(family, "tiny", output / "source")
    res = run_convert(src, output / "artifact", ep_size=ep_size)
    report = run_validate(res.out)
    if as_json:
        out_console.print_json(json.dumps({"inspect": inspect_path(res.out), "validate": report.to_json()}))
    else:
        err_console.print(f"1. fixture: tiny {family} checkpoint ({res.manifest['quant_format']}) in {src}")
        err_console.print(f"2. convert: {len(res.manifest['ranks'])} ranks in {res.out} "
                          f"({_fmt_bytes(res.bytes_written)}, {res.seconds:.2f} s)")
        err_console.print("3. validate:")
        _print_report(report, False)
    if not report.passed:
        raise typer.Exit(1)


def main() -> None:
    """Entry point: known user errors become one stderr line and exit status 1."""
    try:
        app()
    except KeyboardInterrupt:
        print("moeshard: interrupted; nothing that looks finished was left (no manifest); "
              "convert --resume continues a conversion", file=sys.stderr)
        sys.exit(130)
    except MoeshardError as e:
        if os.environ.get("MOESHARD_DEBUG"):
            raise
        print(f"moeshard: error: {e}", file=sys.stderr)
        print("hint: set MOESHARD_DEBUG=1 to see the traceback", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
