"""The library's size and shape, read from its source: modules and lines, the largest modules, functions over
a length, import arrows between the package's modules and the import cycles among them.

    python scripts/house_stats.py [--top 8] [--long 80]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "opendiloco"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports at run time (``from pkg import module`` counts as the
    module; imports under ``if TYPE_CHECKING:`` do not count)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:  # names for annotations: no import at run time
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            names = [f"{stem}.{a.name}" for a in node.names] + [stem]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
                break
    return out - {module_name(path)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def measure(long_over: int = 80) -> tuple[dict[Path, int], list[tuple[int, str]], dict[str, set[str]]]:
    """Lines per module, the functions over ``long_over`` lines (longest first), and the import graph."""
    files = sorted(PACKAGE.rglob("*.py"))
    trees = {f: ast.parse(f.read_text()) for f in files}
    known = {module_name(f) for f in files}
    graph = {module_name(f): {m for m in imported(f, trees[f], known) if not m.startswith(module_name(f) + ".")}
             for f in files}
    lines = {f: len(f.read_text().splitlines()) for f in files}
    long = sorted(((n.end_lineno - n.lineno + 1, f"{f.relative_to(PACKAGE.parent)}:{n.name}") for f in files
                   for n in ast.walk(trees[f]) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and n.end_lineno - n.lineno + 1 > long_over), reverse=True)
    return lines, long, graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=8, help="how many of the largest modules to list")
    p.add_argument("--long", type=int, default=80, help="list functions longer than this many lines")
    args = p.parse_args()
    lines, long, graph = measure(args.long)
    files = list(lines)
    loops = cycles(graph)
    print(f"modules {len(files)}, lines {sum(lines.values())}, import arrows {sum(map(len, graph.values()))}, "
          f"cycles {len(loops)}, functions over {args.long} lines {len(long)}")
    for f in sorted(files, key=lines.get, reverse=True)[: args.top]:
        print(f"  {lines[f]:5d}  {f.relative_to(PACKAGE.parent)}")
    for n, name in long:
        print(f"  {n:5d}  {name}")
    for loop in loops:
        print("  cycle: " + " -> ".join(loop))


if __name__ == "__main__":
    main()
