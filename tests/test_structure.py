"""The package's shape: every module imports on its own, no import circle, the README's
architecture section drawn from the real tree, and no family named outside checkpoints/."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "moeshard"


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "__main__.py":  # runs the CLI
            continue
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def module_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The moeshard modules ``name`` imports at module level (function-level imports are lazy)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def test_no_import_circle():
    mods = modules()
    graph = {m: module_imports(m, p, set(mods)) for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_every_module_imports_in_a_fresh_interpreter():
    code = ("import importlib, sys\n"
            f"for name in {sorted(modules())!r}:\n"
            "    for k in [k for k in sys.modules if k == 'moeshard' or k.startswith('moeshard.')]:\n"
            "        del sys.modules[k]\n"
            "    importlib.import_module(name)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def readme_tree() -> set[str]:
    """The files the README's architecture block lists (indentation gives the folders)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Architecture", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or not m.group(2).endswith(("/", ".py")):
            continue
        depth = len(m.group(1)) // 2
        stack = stack[:depth] + [m.group(2).rstrip("/")]
        if m.group(2).endswith(".py"):
            paths.add("/".join(stack))
    return paths


def test_readme_architecture_is_the_tree():
    real = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert readme_tree() == real


def test_no_family_named_outside_checkpoints():
    names = re.compile(r"""["'](gpt-oss|gpt_oss|deepseek[a-z_0-9]*|llama4[a-z_]*|kimi[a-z_0-9]*|qwen3[a-z_]*)["']""")
    hits = []
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).parts
        if rel[0] in ("checkpoints", "fixtures") or p.name in ("cli.py", "demo.py"):  # the CLI's fixture names
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if names.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, hits
