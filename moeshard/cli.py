"""The ``moeshard`` command: a thin typer app over the library.

(Over 300 lines because every command's options and help texts are declared here; the logic is
in the stage folders.)

Each command parses its options, calls one library function and prints. Results (paths,
reports, ``--json``) go to stdout; progress, logs and hints to stderr. Heavy imports (torch,
flashinfer) happen inside the commands, so ``--help`` is instant, and ``verify``, ``push`` and
``inspect`` of an artifact never import torch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from moeshard import __version__
from moeshard.checkpoints.ranged import MAX_WORKERS
from moeshard.errors import MoeshardError

DEBUG_ENV = "MOESHARD_DEBUG"

app = typer.Typer(
    name="moeshard",
    help="Convert FP4 MoE checkpoints (GPT-OSS MXFP4; DeepSeek-V3/R1, Kimi-K2, Qwen3-MoE and Llama-4 in NVFP4 "
         "from ModelOpt or llm-compressor) into FlashInfer trtllm-gen rank shards, and prove every shard right.\n\n"
         f"Errors are one line on stderr (exit 1); set {DEBUG_ENV}=1 to see the traceback.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: no <bool> metavars, nothing cut at 80 columns
)
out_console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)  # one line per message, never wrapped

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout, nothing else.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]
DeviceOpt = Annotated[str, typer.Option(help="Where tensor work runs: cpu or cuda.")]
RevisionOpt = Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit).")]
TokenOpt = Annotated[str | None, typer.Option(help="Hub token (default: HF_TOKEN or the saved login).")]
RanksOpt = Annotated[str | None, typer.Option(help="Ranks, e.g. 3 or 0-3,5 (default: all).")]


def examples(*lines: str) -> str:
    """A command's epilog: its example lines, kept as they are (``\\b``: no re-wrapping)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


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
    """A rich progress bar on stderr (only on a terminal and when enabled), as (context, tick).

    ``tick(n, what)`` advances it; ``tick.total(n)`` starts it again with that total once the
    library has planned a stage (a Hub run of some ranks: the bytes to fetch, then to write).
    """
    from contextlib import nullcontext

    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    if not enabled or not err_console.is_terminal:
        tick = lambda *a: None  # noqa: E731
        tick.total = lambda n: None
        return nullcontext(), tick
    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if in_bytes else [MofNCompleteColumn()]
    columns += [TimeElapsedColumn()]
    prog = Progress(*columns, console=err_console, transient=True)
    task = prog.add_task(description, total=total)

    def tick(n: int = 0, what: str = "") -> None:
        prog.update(task, advance=n, description=f"{description} {what}".strip())

    tick.total = lambda n: prog.reset(task, total=n)
    return prog, tick


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _version(value: bool) -> None:
    if value:
        out_console.print(f"moeshard {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


@app.command(epilog=examples("moeshard fixture gpt-oss --preset tiny -o tiny-gpt-oss",
                             "moeshard fixture gpt-oss --preset gpt-oss-120b --layers 2 -o bench-120b",
                             "moeshard fixture deepseek --preset deepseek-r1 --layers 4 -o bench-r1",
                             "moeshard fixture qwen3-moe --preset tiny-ct -o tiny-qwen3-ct",
                             "moeshard fixture llama4 --preset tiny-maverick -o tiny-maverick"))
def fixture(
    family: Annotated[str, typer.Argument(help="gpt-oss, deepseek, qwen3-moe or llama4.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (must be new or empty).")],
    preset: Annotated[str, typer.Option(help="Tiny checkpoints for tests: tiny; gpt-oss tiny-uneven; deepseek "
                                             "tiny-v3-0324, tiny-kimi-k2, tiny-kimi-k25, tiny-ct, tiny-mixed; "
                                             "qwen3-moe tiny-ct, tiny-no-renorm; llama4 tiny-flat, tiny-maverick, "
                                             "tiny-ct. Real layer sizes (use --layers): gpt-oss-20b, gpt-oss-120b, "
                                             "deepseek-r1, kimi-k2, qwen3-30b-a3b, qwen3-235b-a22b, llama4-scout, "
                                             "llama4-maverick.")] = "tiny",
    layers: Annotated[int | None, typer.Option(help="Number of layers (default: the preset's; DeepSeek keeps "
                                                       "at most layers-1 dense layers).")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the generated weights.")] = 0,
) -> None:
    """Write a synthetic checkpoint in the exact on-disk format of a real model."""
    from moeshard.fixtures import fixture as make

    with err_console.status(f"writing {family} {preset} fixture"):
        path = make(family, preset, output, layers=layers, seed=seed)
    out_console.print(str(path))


@app.command(epilog=examples("moeshard convert openai/gpt-oss-120b --ep-size 8 -o out/",
                             "moeshard convert ./gpt-oss-20b --ep-size 4 -o out/ --dry-run",
                             "moeshard convert openai/gpt-oss-120b --hidden-padding trimmed -o out/",
                             "moeshard convert nvidia/DeepSeek-R1-FP4 --ep-size 8 --ranks 3 --no-common -o out/",
                             "torchrun --nproc-per-node 8 -m moeshard convert openai/gpt-oss-120b --ep-size 8 -o out/"))
def convert(
    source: Annotated[str, typer.Argument(help="Checkpoint folder or Hugging Face repo id (org/name).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Artifact folder to write.")],
    ep_size: Annotated[int, typer.Option(min=1, help="Expert-parallel ranks; must divide the expert count.")] = 1,
    tp_size: Annotated[int, typer.Option(min=1, help="Tensor-parallel ranks per EP rank: each gets a slice of every "
                                                     "expert's intermediate dimension. Ranks = ep x tp.")] = 1,
    placement: Annotated[str, typer.Option(help="Experts per EP rank: contiguous (vLLM's default, what the "
                                                "trtllm-gen kernel takes) or round-robin (expert e on rank "
                                                "e mod ep).")] = "contiguous",
    pad_multiple: Annotated[int | None, typer.Option(min=1, help="Pad hidden and per-rank intermediate sizes to "
                                                                    "a multiple of this (default: 256 for GPT-OSS, "
                                                                    "128 for NVFP4).")] = None,
    hidden_padding: Annotated[str, typer.Option(help="GEMM2 (down projection) rows: vllm = the padded hidden "
                                                     "size (3072 for GPT-OSS's 2880; what vLLM and SGLang build, "
                                                     "called without valid_hidden_size) or trimmed = "
                                                     "roundUp(hidden size, 128) (2944; called with "
                                                     "valid_hidden_size). GEMM1 and the hidden states keep the "
                                                     "padded size.")] = "vllm",
    max_shard_size: Annotated[str, typer.Option(help="Largest output safetensors file, e.g. 5GB.")] = "5GB",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a previous moeshard output in OUTPUT "
                                                                "(a folder holding anything else is refused).")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted conversion into OUTPUT, reusing "
                                                          "the files it finished (checked by sha256).")] = False,
    ranks: Annotated[str | None, typer.Option(help="Convert only these ranks, e.g. 3 or 0-3 (a repo id then "
                                                      "fetches only the byte ranges they read).")] = None,
    common: Annotated[bool, typer.Option("--common/--no-common", help="Also write common/ (every non-expert "
                                                                       "tensor).")] = True,
    revision: RevisionOpt = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Hub cache folder (default: HF_HUB_CACHE).")] = None,
    token: TokenOpt = None,
    max_workers: Annotated[int, typer.Option(min=1, help="Concurrent HTTP range requests when a repo id is read "
                                                         "by ranges (--ranks, or under torchrun).")] = MAX_WORKERS,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate headers and print the plan; write "
                                                            "nothing.")] = False,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Convert a checkpoint into trtllm-gen layout, one folder per rank."""
    from moeshard.convert.pipeline import convert as convert_checkpoint

    kw = dict(ep_size=ep_size, tp_size=tp_size, placement=placement, pad_multiple=pad_multiple,
              hidden_padding=hidden_padding, max_shard_bytes=parse_size(max_shard_size), ranks=parse_ints(ranks),
              common=common, revision=revision, cache_dir=cache_dir, token=token, max_workers=max_workers)
    if dry_run:
        plan = convert_checkpoint(source, output, dry_run=True, **kw)
        doc = plan.to_json()
        out_console.print_json(json.dumps(doc)) if as_json else out_console.print(
            f"plan: {plural(len(plan.ranks), 'rank')}, {plural(sum(len(r.files) for r in plan.ranks), 'rank file')}, "
            f"{plural(len(plan.common), 'common file')}, {fmt_bytes(plan.total_bytes)} to write (dry run: nothing "
            "written)")
        return
    ctx, tick = _progress(not (as_json or quiet), description="converting", in_bytes=True)
    with ctx:
        res = convert_checkpoint(source, output, overwrite=overwrite, resume=resume, device=device, progress=tick,
                                 **kw)
    if res.manifest is None:  # a torchrun process other than 0: process 0 reports
        return
    m = res.manifest
    rate = res.bytes_written / res.seconds if res.seconds > 0 else 0.0
    summary = {"output": str(res.out), "family": m.family, "ranks": len(m.ranks), "ep_size": m.ep_size,
               "tp_size": m.tp_size, "placement": m.placement, "moe_layers": len(m.moe_layers),
               "bytes_read": res.bytes_read, "bytes_written": res.bytes_written, "bytes_reused": res.bytes_reused,
               "files_reused": res.files_reused, "replaced": res.replaced, "seconds": round(res.seconds, 3),
               "throughput_gb_s": round(rate / 1e9, 3),
               "transfer": res.transfer.to_json() if res.transfer else None}
    if as_json:
        out_console.print_json(json.dumps(summary))
        return
    if res.replaced:
        err_console.print(f"replaced the previous moeshard output in {res.out}: {', '.join(res.replaced)}",
                          markup=False)
    err_console.print(f"converted {m.family} ({plural(len(m.moe_layers), 'MoE layer')}, "
                      f"{plural(m.num_experts, 'expert')}) into {plural(len(m.ranks), 'rank')}: wrote "
                      f"{fmt_bytes(res.bytes_written)} in {res.seconds:.2f} s ({fmt_bytes(rate)}/s)"
                      + (f"; reused {plural(res.files_reused, 'finished file')} ({fmt_bytes(res.bytes_reused)})"
                         if res.files_reused else ""), markup=False)
    if res.transfer:
        t = res.transfer.to_json()
        err_console.print(f"fetched {fmt_bytes(t['fetched'])} by HTTP range from {m.source.repo_id} in "
                          f"{plural(t['requests'], 'request')} ({t['seconds']:.2f} s, {t['rate_mb_s']:.1f} MB/s) for "
                          f"the ranks' share {fmt_bytes(t['share'])}, shared tensors (routers, activation scales, common/) "
                          f"{fmt_bytes(t['shared'])} "
                          f"and the headers {fmt_bytes(t['headers'])} (ranges in the cache are not fetched again); "
                          f"whole shards would be {fmt_bytes(t['whole'])}: saved {fmt_bytes(t['saved'])}",
                          markup=False)
    out_console.print(str(res.out), markup=False)


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if v is not None)


def _experts_text(experts: list[int]) -> str:
    """[0, 1, 2, 3] -> '0-3'; a round-robin list -> '0,4,..,28 (8)'."""
    if experts == list(range(experts[0], experts[0] + len(experts))):
        return f"{experts[0]}-{experts[-1]}" if len(experts) > 1 else str(experts[0])
    return ",".join(map(str, experts)) if len(experts) <= 3 else f"{experts[0]},{experts[1]},..,{experts[-1]}"


def _print_inspect(info: dict) -> None:
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE, show_header=False, title=f"{info['kind']}: {info['path']}", title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    if info["kind"] == "artifact":
        pad, lay = info["padding"], info["layout"]
        rows = [("family", f"{info['family']} ({info['quant_format']})"), ("source", info["source"]),
                ("layout", f"{lay['name']} v{lay['version']}, epilogue_tile_m {lay['epilogue_tile_m']}, "
                           f"{lay['scale_layout']} scales"),
                ("experts", f"{info['num_experts']} in {plural(info['moe_layers'], 'MoE layer')}"),
                ("sharding", f"ep {info['ep_size']} x tp {info['tp_size']}, {info['placement']}; "
                             f"{len(info['ranks'])} of {info['rank_count']} ranks here"),
                ("hidden size", f"{pad['hidden_size']}, padded to {pad['hidden_size_padded']}; GEMM2 rows "
                                f"{pad['gemm2_rows']} (--hidden-padding {pad['hidden_padding']})"),
                ("intermediate", f"{pad['intermediate_size']}; per rank padded to {pad['intermediate_size_padded']}"),
                ("kernel args", _kv(info["kernel_args"])),
                ("common/", fmt_bytes(info["common_bytes"]) if info["common_bytes"] is not None else "not included")]
    else:
        rows = [("family", f"{info['family']} ({info['quant_format']})"),
                ("experts", f"{info['num_experts']} in {plural(info['moe_layers'], 'MoE layer')}"),
                ("hidden size", str(info["hidden_size"])), ("intermediate", str(info["intermediate_size"])),
                ("routing", _kv(info["routing"])), ("activation", _kv(info["activation"])),
                ("files", f"{info['files']} ({fmt_bytes(info['bytes'])}, experts {fmt_bytes(info['expert_bytes'])})")]
    for k, v in rows:
        t.add_row(k, v)
    out_console.print(t)
    if info["kind"] == "artifact":
        rt = Table(box=box.SIMPLE, title="ranks (I slice and size per rank)", title_justify="left")
        for col in ("rank", "ep", "tp", "experts", "offset", "I slice", "files", "size"):
            rt.add_column(col, justify="right", no_wrap=True)
        for r in info["ranks"]:
            a, b = r["intermediate_slice"]
            rt.add_row(str(r["rank"]), str(r["ep_rank"]), str(r["tp_rank"]), _experts_text(r["experts"]),
                       "-" if r["local_expert_offset"] is None else str(r["local_expert_offset"]), f"{a}-{b}",
                       str(r["files"]), fmt_bytes(r["bytes"]))
        out_console.print(rt)
    else:
        ex = info["expert_tensors_of_layer"]
        et = Table(box=box.SIMPLE, title=f"expert tensors of layer {ex['layer']} ({ex['prefix']}.*)",
                   title_justify="left")
        for col in ("tensor", "dtype", "shape"):
            et.add_column(col, overflow="fold")
        for n, x in ex["tensors"].items():
            et.add_row(n[len(ex["prefix"]) + 1:], x["dtype"], str(x["shape"]))
        out_console.print(et)


@app.command(epilog=examples("moeshard inspect ./gpt-oss-120b", "moeshard inspect out/ --json"))
def inspect(
    path: Annotated[str, typer.Argument(help="A checkpoint folder, a Hub repo id, or a moeshard artifact.")],
    as_json: JsonOpt = False,
) -> None:
    """Show family, format, layers, experts, shapes, per-rank sizes and kernel arguments."""
    from moeshard.inspect import inspect_path

    info = inspect_path(path)
    out_console.print_json(json.dumps(info)) if as_json else _print_inspect(info)


@app.command(epilog=examples("moeshard verify out/", "moeshard verify out/ --json",
                             "moeshard verify out/ --source ./DeepSeek-R1-FP4"))
def verify(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder written by moeshard convert.")],
    source: Annotated[Path | None, typer.Option(help="A copy of the source (e.g. a whole download) to compare with "
                                                        "what a ranged Hub conversion read (default: the folder this "
                                                        "machine converted from).")] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Re-hash every file against the manifest (sha256) and say what was verified of the source; exit 1 on
    any problem."""
    from moeshard.artifact.verify import as_json as checks_json
    from moeshard.artifact.verify import check_source
    from moeshard.artifact.verify import verify as verify_artifact

    ctx, tick = _progress(not (as_json or quiet), description="verifying", in_bytes=True)
    with ctx:
        checks = verify_artifact(artifact, progress=tick)
        src = check_source(artifact, source, progress=tick)
    bad = [c for c in checks if not c.ok]
    if as_json:
        out_console.print_json(json.dumps(checks_json(checks, src)))
    else:
        for c in bad:
            err_console.print(f"FAIL: {artifact / c.path}: {c.problem}", markup=False)
        for problem in src.problems:
            err_console.print(f"FAIL: source: {problem}", markup=False)
        out_console.print(("[green]OK[/]" if not bad else "[red]FAIL[/]") +
                          f": {len(checks) - len(bad)}/{len(checks)} files match the manifest "
                          f"({fmt_bytes(sum(c.bytes for c in checks))}, sha256)")
        out_console.print(f"source: {src.summary}", markup=False)
        if src.copy:
            out_console.print(f"source: {src.checked} recorded sha256 match {src.copy}"
                              + (f", {len(src.problems)} differ" if src.problems else "")
                              + (f", {src.absent} not in that copy" if src.absent else ""), markup=False)
    if bad or src.problems:
        raise typer.Exit(1)


@app.command(epilog=examples("moeshard push out/ my-org/gpt-oss-120b-trtllm-ep8"))
def push(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder written by moeshard convert.")],
    repo_id: Annotated[str, typer.Argument(help="Hub repository to upload to (created if needed).")],
    revision: Annotated[str | None, typer.Option(help="Branch to commit to.")] = None,
    private: Annotated[bool | None, typer.Option("--private/--public", help="Visibility of a new repo.")] = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Upload the files the manifest lists, with a generated model card, in one commit."""
    from moeshard.artifact.push import push as push_artifact

    info = push_artifact(artifact, repo_id, revision=revision, private=private, token=token)
    url = getattr(info, "commit_url", None) or str(info)
    out_console.print_json(json.dumps({"repo_id": repo_id, "commit": url})) if as_json else out_console.print(url)


def _print_report(report, as_json: bool) -> None:
    from rich.table import Table

    if as_json:
        out_console.print_json(json.dumps(report.to_json()))
        return
    for note in report.notes:
        err_console.print(f"note: {note}", markup=False)
    table = Table(title=f"validate {report.artifact} against {report.source}")
    for col in ("rank", "layer", "backend", "max abs error", "rel error", "verdict"):
        table.add_column(col, justify="right")
    for r in report.rows:
        table.add_row(str(r.rank), str(r.layer), r.backend, f"{r.max_abs_error:.3g}", f"{r.rel_error:.3g}",
                      "[green]pass[/]" if r.passed else "[red]FAIL[/]")
    out_console.print(table)
    for r in report.rows:
        if not r.passed:
            err_console.print(f"FAIL: {r.detail}", markup=False)
    cov = report.coverage
    if cov:
        worst = max(report.rows, key=lambda r: r.rel_error)
        err_console.print(f"covered: {cov['experts'][0]} of {cov['experts'][1]} experts per layer, "
                          f"{cov['layers'][0]} of {cov['layers'][1]} MoE layers, {cov['ranks'][0]} of "
                          f"{cov['ranks'][1]} ranks; {sum(r.layout_checked for r in report.rows)} rank experts "
                          "rebuilt with FlashInfer's own preparation; worst relative error "
                          f"{worst.rel_error:.3g} (rank {worst.rank}, layer {worst.layer}"
                          + (f", expert {worst.worst_expert}" if worst.worst_expert is not None else "") + ")",
                          markup=False)
    out_console.print(("[green]PASS[/]" if report.passed else "[red]FAIL[/]") +
                      f": {sum(r.passed for r in report.rows)}/{len(report.rows)} checks "
                      f"(tolerance {report.tolerance:g}, {report.tokens} tokens, seed {report.seed})")


@app.command(epilog=examples("moeshard validate out/", "moeshard validate out/ --ranks 0-3 --layers 0,1 --json",
                             "moeshard validate out/ --experts 8 --tokens 8      # a quick check",
                             "moeshard validate out/ --full --device cuda        # everything"))
def validate(
    artifact: Annotated[Path, typer.Argument(help="Artifact folder written by moeshard convert.")],
    source: Annotated[Path | None, typer.Option(help="Source checkpoint (default: where this machine converted "
                                                        "it from, or its Hub snapshot in the local cache).")] = None,
    layers: Annotated[str | None, typer.Option(help="MoE layers to check, e.g. 0-3,7 (default: all).")] = None,
    ranks: RanksOpt = None,
    experts: Annotated[int | None, typer.Option(min=1, help="Check a seeded sample of this many experts per layer "
                                                            "(default: every expert).")] = None,
    full: Annotated[bool, typer.Option("--full", help="Rebuild every checked expert with FlashInfer's own "
                                                      "preparation and compare bytes (default: 2 per rank and "
                                                      "layer).")] = False,
    tokens: Annotated[int, typer.Option(min=1, help="Number of random hidden states per layer.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed of the hidden states.")] = 0,
    backend: Annotated[str, typer.Option(help="auto (trtllm-gen on Blackwell, else decode), trtllm-gen or "
                                              "decode.")] = "auto",
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the MoE on every rank shard against the source; exit 1 on any failure."""
    from moeshard.validate import validate as validate_artifact

    ctx, tick = _progress(not (as_json or quiet), description="validating", in_bytes=True)
    with ctx:
        report = validate_artifact(artifact, source=source, layers=parse_ints(layers), ranks=parse_ints(ranks),
                                   experts=experts, full=full, tokens=tokens, seed=seed, backend=backend,
                                   device=device, progress=tick)
    _print_report(report, as_json)
    if not report.passed:
        raise typer.Exit(1)


@app.command(epilog=examples("moeshard demo -o demo-out", "moeshard demo --family deepseek-r1-fp4 --ep-size 4"))
def demo(
    output: Annotated[Path, typer.Option("--output", "-o", help="Working folder (a previous demo's output in it is "
                                                                "replaced; anything else is refused).")] = Path("demo-out"),
    family: Annotated[str, typer.Option(help="gpt-oss, deepseek, qwen3-moe or llama4 (tiny preset).")] = "gpt-oss",
    ep_size: Annotated[int, typer.Option(min=1, help="Expert-parallel ranks.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Make a tiny checkpoint, convert it into EP ranks, validate, print the report."""
    from moeshard.demo import run_demo
    from moeshard.inspect import inspect_path

    d = run_demo(output, family, ep_size)
    res, report = d.convert, d.report
    if as_json:
        out_console.print_json(json.dumps({"inspect": inspect_path(res.out), "validate": report.to_json()}))
    else:
        err_console.print(f"1. fixture: tiny {family} checkpoint ({res.manifest.quant_format}) in {d.source}",
                          markup=False)
        err_console.print(f"2. convert: {plural(len(res.manifest.ranks), 'rank')} in {res.out} "
                          f"({fmt_bytes(res.bytes_written)}, {res.seconds:.2f} s)", markup=False)
        err_console.print("3. validate:")
        _print_report(report, False)
    if not report.passed:
        raise typer.Exit(1)


def main() -> None:
    """Entry point: known user errors become one stderr line and their exit status (1; 130 for
    Ctrl-C); ``MOESHARD_DEBUG=1`` shows the traceback instead."""
    try:
        app()
    except MoeshardError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"moeshard: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("moeshard: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
