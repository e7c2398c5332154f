"""Loading a file never executes code: no ``pickle``/``marshal``/``yaml.load``/``eval`` on data,
and every ``torch.load`` passes ``weights_only=True`` (checked on the source's syntax tree).
The two allowed exceptions are not files: the launcher reading results from its own child
processes over a pipe, and a ``.py`` DSL program, which is code the user asks to run."""

from __future__ import annotations

import ast
from pathlib import Path

import flexpipe

SRC = Path(flexpipe.__file__).parent
UNSAFE = {"pickle.load", "pickle.loads", "marshal.load", "marshal.loads", "yaml.load",
          "yaml.unsafe_load", "eval", "exec", "shelve.open", "dill.load", "dill.loads"}
ALLOWED = {("runtime/supervise.py", "pickle.loads"), ("dsl/loader.py", "exec")}


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _calls(path: Path) -> list[tuple[str, ast.Call]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(_name(n.func), n) for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _weights_only(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
               and k.value.value is True for k in call.keywords)


def test_no_loader_executes_code() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for name, call in _calls(path):
            if name in UNSAFE and (rel, name) not in ALLOWED:
                bad.append(f"{rel}:{call.lineno}: {name}")
            if name == "torch.load" and not _weights_only(call):
                bad.append(f"{rel}:{call.lineno}: torch.load without weights_only=True")
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_unsafe_load(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import torch, pickle\ntorch.load('x')\npickle.load(open('y', 'rb'))\n"
                      "torch.load('z', weights_only=True)\n")
    found = [(name, _weights_only(call)) for name, call in _calls(sample)]
    assert ("torch.load", False) in found and ("torch.load", True) in found
    assert ("pickle.load", False) in found
