"""The import rules of docs/architecture.md, checked on the source (AST, every import including
those inside functions): a package imports only packages of lower layers (the numbered list in
the docs is the one source of the order), only ``flexpipe.runtime`` imports torch, and only
the transport room ``runtime/transport/`` (``comm.py``, the mesh, torch's FSDP2 and tensor
parallelism in ``engines.py``) imports ``torch.distributed`` (``torch.distributed.pipelining``,
torch's schedule classes, is interop, not communication). The checker is shown to catch a
deliberately added upward import, torch outside the runtime and a second owner of
torch.distributed."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "flexpipe"
DOCS = ROOT / "docs" / "architecture.md"
COMM_OWNER = "runtime/transport/"
INTEROP = "torch.distributed.pipelining"


def numbered(doc: str, indent: str, prefix: str) -> dict[str, int]:
    """Name -> number, from the numbered items under ``## Layers`` starting after ``indent``
    (a regex), each with its names in backticks (``PREFIX.X``) before the dash."""
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out: dict[str, int] = {}
    for number, head in re.findall(rf"^{indent}(\d+)\. (.*?) —", section, flags=re.M):
        for name in re.findall(rf"`{re.escape(prefix)}\.(\w+)`", head):
            out[name] = int(number)
    return out


def layers(doc: str) -> dict[str, int]:
    """Package -> layer number: the top-level numbered list (``flexpipe.X``)."""
    return numbered(doc, "", "flexpipe")


def package_of(rel: str) -> str:
    """``ir/kinds.py`` -> ``ir``; ``specs.py`` -> ``specs``; ``__init__.py`` -> ``__init__``."""
    first = rel.split("/")[0]
    return first[:-3] if first.endswith(".py") else first


def imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every absolute import; ``from a import b`` gives ``a.b``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"line {node.lineno}: relative import; write it absolute")


def target(name: str, packages: Iterable[str]) -> str | None:
    """The flexpipe package an import reaches (the root package counts as ``__init__``)."""
    parts = name.split(".")
    if parts[0] != "flexpipe":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in packages else "__init__"


def violations(files: dict[str, str], order: dict[str, int]) -> list[str]:
    """Every broken rule in ``files`` (path relative to src/flexpipe -> source)."""
    out = []
    for rel, source in sorted(files.items()):
        pkg = package_of(rel)
        if pkg not in order:
            out.append(f"{rel}: package {pkg!r} is not in docs/architecture.md's layer list")
            continue
        for line, name in imports(source):
            where = f"{rel}:{line}: imports {name}"
            tgt = target(name, order)
            if tgt is not None and tgt != pkg and order[tgt] >= order[pkg]:
                out.append(f"{where} (layer {order[tgt]} {tgt}, not below {order[pkg]} {pkg})")
            if name.split(".")[0] == "torch" and pkg != "runtime":
                out.append(f"{where}: only flexpipe.runtime imports torch")
            if (name.startswith("torch.distributed") and not name.startswith(INTEROP)
                    and not rel.startswith(COMM_OWNER)):
                out.append(f"{where}: only {COMM_OWNER} uses torch.distributed")
    return out


def tree() -> dict[str, str]:
    """Every module of the package, by path relative to src/flexpipe."""
    return {p.relative_to(SRC).as_posix(): p.read_text(encoding="utf-8")
            for p in SRC.rglob("*.py")}


ORDER = layers(DOCS.read_text(encoding="utf-8"))


def test_the_docs_give_an_order() -> None:
    assert ORDER["errors"] < ORDER["ir"] < ORDER["cost"] < ORDER["sim"] < ORDER["runtime"]
    assert ORDER["runtime"] < ORDER["cli"]


def test_the_tree_keeps_the_layer_rules() -> None:
    assert violations(tree(), ORDER) == []


@pytest.mark.parametrize(("rel", "source", "expected"), [
    ("ir/upward.py", "from flexpipe.search import search\n", "layer 9 search, not below 3 ir"),
    ("schedules/lazy.py", "def f():\n    from flexpipe.runtime.transport.comm import init\n",
     "schedules/lazy.py:2: imports flexpipe.runtime.transport.comm.init"),
    ("sim/fast.py", "import torch\n", "only flexpipe.runtime imports torch"),
    ("runtime/measurement/profile.py", "import torch.distributed as dist\n",
     f"only {COMM_OWNER} uses"),
    ("runtime/x.py", "from torch.distributed import barrier\n", f"only {COMM_OWNER} uses"),
    ("toolbox/new.py", "x = 1\n", "not in docs/architecture.md's layer list"),
])
def test_a_broken_rule_is_reported(rel: str, source: str, expected: str) -> None:
    files = {**tree(), rel: source}
    found = violations(files, ORDER)
    assert len(found) == 1 and expected in found[0], found


def test_allowed_imports_are_not_reported() -> None:
    files = {"runtime/interop/x.py": "from torch.distributed.pipelining import schedules\n",
             "cli/x.py": "from flexpipe import __version__\nfrom flexpipe.runtime import comm\n",
             "search/x.py": "import flexpipe.sim.engine\nfrom flexpipe.search import ranking\n"}
    assert violations(files, ORDER) == []


# --- inside the runtime: rooms on floors --------------------------------------------------------

def rooms(doc: str) -> dict[str, int]:
    """Runtime room -> floor: the indented numbered list under the runtime's item
    (``runtime.X``)."""
    return numbered(doc, " +", "runtime")


ROOMS = rooms(DOCS.read_text(encoding="utf-8"))


def room_of(rel: str) -> str | None:
    """``runtime/execution/executor.py`` -> ``execution``; None outside a runtime room."""
    parts = rel.split("/")
    return parts[1] if parts[0] == "runtime" and len(parts) > 2 else None


def room_violations(files: dict[str, str], floors: dict[str, int]) -> list[str]:
    """Every import inside the runtime that reaches a room on the same or a higher floor."""
    out = []
    for rel, source in sorted(files.items()):
        room = room_of(rel)
        if room is None:
            continue
        if room not in floors:
            out.append(f"{rel}: room {room!r} is not in docs/architecture.md's runtime list")
            continue
        for line, name in imports(source):
            parts = name.split(".")
            if parts[:2] != ["flexpipe", "runtime"] or len(parts) < 3 or parts[2] == room:
                continue
            other = parts[2]
            if floors.get(other, 10**6) >= floors[room]:
                out.append(f"{rel}:{line}: imports {name} (floor {floors.get(other, '?')} "
                           f"{other}, not below {floors[room]} {room})")
    return out


def module_name(rel: str) -> str:
    """``runtime/execution/executor.py`` -> ``flexpipe.runtime.execution.executor``."""
    return "flexpipe." + rel[:-3].replace("/", ".").removesuffix(".__init__")


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """The module-level import circles (strongly connected groups of two or more modules;
    an import names its module, or the package whose attribute it takes)."""
    modules = {module_name(rel): source for rel, source in files.items()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {t for _, n in imports(src) if (t := resolve(n)) and t != m}
             for m, src in modules.items()}
    return strongly_connected(graph)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more nodes that reach each other (Kosaraju, iterative)."""
    order: list[str] = []
    seen: set[str] = set()
    for root in graph:
        stack = [(root, iter(sorted(graph[root])))] if root not in seen else []
        seen.add(root)
        while stack:
            node, nexts = stack[-1]
            nxt = next((n for n in nexts if n not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    reverse: dict[str, set[str]] = {m: set() for m in graph}
    for m, targets in graph.items():
        for t in targets:
            reverse.setdefault(t, set()).add(m)
    done: set[str] = set()
    groups = []
    for node in reversed(order):
        if node in done:
            continue
        group, todo = [], [node]
        done.add(node)
        while todo:
            cur = todo.pop()
            group.append(cur)
            for prev in reverse.get(cur, ()):
                if prev not in done:
                    done.add(prev)
                    todo.append(prev)
        if len(group) > 1:
            groups.append(sorted(group))
    return groups


ALLOWED_CYCLE = ["flexpipe.ir.schedule", "flexpipe.ir.text"]
"""The one circle the house keeps: a schedule prints and parses itself through ``ir.text``."""


def test_the_runtime_rooms_stand_on_floors() -> None:
    assert ROOMS["transport"] < ROOMS["split"] < ROOMS["execution"] < ROOMS["user"] \
        < ROOMS["models"] \
        < ROOMS["processes"] < ROOMS["measurement"] < ROOMS["pipeline"]
    assert room_violations(tree(), ROOMS) == []


def test_no_import_circle_but_the_schedule_text_one() -> None:
    assert [c for c in import_cycles(tree()) if c != ALLOWED_CYCLE] == []


@pytest.mark.parametrize(("rel", "source", "expected"), [
    ("runtime/user/up.py", "from flexpipe.runtime.models.kinds import build_model\n",
     "floor 5 models, not below 4 user"),
    ("runtime/transport/lazy.py", "def f():\n    import flexpipe.runtime.execution.worker\n",
     "runtime/transport/lazy.py:2: imports flexpipe.runtime.execution.worker"),
    ("runtime/attic/x.py", "x = 1\n", "room 'attic' is not in docs/architecture.md"),
])
def test_an_upward_room_import_is_reported(rel: str, source: str, expected: str) -> None:
    found = room_violations({**tree(), rel: source}, ROOMS)
    assert len(found) == 1 and expected in found[0], found


def test_a_new_circle_is_reported() -> None:
    files = {**tree(), "runtime/execution/stage.py":
             tree()["runtime/execution/stage.py"] + "\nfrom flexpipe.runtime.execution import "
                                                    "segments\n"}
    cycles = [c for c in import_cycles(files) if c != ALLOWED_CYCLE]
    assert cycles == [["flexpipe.runtime.execution.segments", "flexpipe.runtime.execution.stage"]]
