"""Every command and Python block of README.md and docs/*.md runs as written, from the repository
root of a fresh clone (the sample files ship in examples/); the README's commands run twice in
one folder, as a user repeating the tour would.

Fenced blocks carry a language: ``sh`` (commands, one a line, run here: ``flexpipe ...`` in
process through ``main``, anything else as a subprocess), ``python`` (the blocks of one page run
in turn in one fresh interpreter, so a later block may use what an earlier one defined), ``json``
and ``toml`` (must parse) and ``text`` (output, not run). A command's expected exit code is 0
unless its comment says ``(exit N)``. Lines the test cannot run here are skipped with the reason
(``make`` targets are CI's own entry points; NCCL needs a GPU). The ``flexpipe run`` lines of
the docs pages (all but the README's tour) run in CI as dry runs, the whole job checked and no
process started (``dry_in_ci``), and train as written in the ``slow`` run; CI's runtime tests
train the layouts they show."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flexpipe.cli.config import config_path
from flexpipe.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\n(.*?)^```\s*$", re.S | re.M)
LANGS = {"sh", "python", "json", "toml", "text"}
EXIT = re.compile(r"\(exit (\d+)\)")
TREE = ("examples", "tests")  # what the commands read from the repository root


@dataclass(frozen=True)
class Block:
    """One fenced block: the page, the line of its opening fence, its language, its text."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in FENCE.finditer(text)]


ALL = [b for page in PAGES for b in blocks(page)]
README = ROOT / "README.md"
PASSES = {README: 2}
"""How many times each page's commands run, in turn, in one folder: the README's tour runs
twice, so that a second run (files already written by the first) works as written too. In the
second run CI repeats the commands that write files (``writes``); the others find nothing of
theirs there and repeat the first run, so their second run is ``slow``."""
VENV_FLEXPIPE = ".venv/bin/flexpipe"
WRITING = ("-o", "--out", "--output", "--force", "--trace-out", "--cost-out", "--checkpoint-dir",
           "--run-dir")
"""Options after which a command writes a file (also by their long names in a job file)."""
COMMAND_TABLES = ("run", "search", "plan")
"""The tables of a job file (``--config``) that take a command's options by their long names."""


def writes(line: str) -> bool:
    """Whether the command writes a file (an option of ``WRITING``, also as ``--opt=value``, or
    in the command tables of its ``--config`` job file; ``demo``, which writes its report
    folder by default), or is not a ``flexpipe`` command (what a script writes is not known
    here)."""
    argv = shlex.split(line, comments=True)
    if Path(argv[0]).name != "flexpipe" or "demo" in argv[1:2]:
        return True
    config = config_path(argv[1:])
    return (any(arg.split("=", 1)[0] in WRITING for arg in argv[1:])
            or (config is not None and _job_file_writes(config)))


def _job_file_writes(path: str) -> bool:
    """Whether the job file (read from the repository root) names a ``WRITING`` option in a
    command table; a file that is not there or does not parse may write anything."""
    try:
        tables = tomllib.loads((ROOT / path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return "dump_folder" in tables.get("job", {}) or any(  # torchtitan's run folder
        not isinstance(options, dict) or any(f"--{key}" in WRITING for key in options)
        for name, options in tables.items() if name in COMMAND_TABLES)


ELSEWHERE = {
    "python examples/train_3d.py":
        ("tests/runtime/test_mesh3d.py", "test_the_3d_example_trains_like_one_process"),
    "torchrun --nproc-per-node 2 examples/train_my_model.py":
        ("tests/runtime/test_user_models.py", "test_the_example_runs_under_torchrun"),
}
"""Commands CI runs elsewhere, in a test that checks more than the exit code, so that here they
are ``slow``: the command -> (the test file, the test)."""


def _lines(block: Block) -> list[str]:
    return [line for line in block.text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _command(line: str) -> str:
    return line.split("#")[0].strip()


FIRST: dict[str, str] = {}
"""Each command -> the block that shows it first; a later block showing the very same command
runs it in CI only there (``slow`` in the later block)."""
for _b in ALL:
    for _line in _lines(_b) if _b.lang == "sh" else []:
        FIRST.setdefault(_command(_line), _b.where)


def in_ci(block: Block, line: str, run: int) -> bool:
    """Whether CI runs ``line`` of ``block`` in run ``run`` (0: first) of its page: not when
    it runs elsewhere (``ELSEWHERE``) or in an earlier block (``FIRST``), unless a later
    command of its block may read what it writes; nor when it repeats a command that writes
    nothing (``writes``)."""
    command = _command(line)
    feeds_the_block = writes(line) and _lines(block)[-1] != line
    if not feeds_the_block and (command in ELSEWHERE or FIRST[command] != block.where):
        return False
    return run == 0 or writes(line)


def run_options(line: str) -> list[str] | None:
    """The options of a ``flexpipe run`` line (also ``torchrun ... -m flexpipe run ...``);
    None for any other command."""
    argv = shlex.split(line, comments=True)
    if Path(argv[0]).name == "flexpipe" and argv[1:2] == ["run"]:
        return argv[2:]
    if argv[0] == "torchrun" and "-m" in argv:
        at = argv.index("-m")
        if argv[at + 1:at + 3] == ["flexpipe", "run"]:
            return argv[at + 3:]
    return None


def dry_in_ci(block: Block, line: str, run: int) -> bool:
    """Whether CI checks ``line`` as a dry run (``flexpipe run ... --dry-run``: the whole job
    checked, no process started) and leaves the training itself to the ``slow`` run: every
    ``flexpipe run`` of the docs that CI runs, but the README's tour on its first pass, a run
    whose files a later command of its block reads, and a run expected to fail. CI trains
    each layout they show in the runtime tests."""
    options = run_options(line)
    return (options is not None and in_ci(block, line, run)
            and not (block.page == README and run == 0) and EXIT.search(line) is None
            and not _feeds(block, line, options))


def _feeds(block: Block, line: str, options: list[str]) -> bool:
    """Whether a later command of ``block`` may read what the run ``line`` writes: one naming
    a file it writes (any later command, where its job file may write)."""
    if not writes(shlex.join(["flexpipe", "run", *options])):
        return False
    later = _lines(block)[_lines(block).index(line) + 1:]
    named = [value for key, value in zip(options, options[1:], strict=False) if key in WRITING]
    named += [arg.split("=", 1)[1] for arg in options if arg.split("=", 1)[0] in WRITING
              and "=" in arg]
    if not named:  # its job file writes: what, is not known here
        return bool(later)
    return any(Path(path).name in text for path in named for text in later)


def _param(block: Block, line: str, run: int, dry: bool) -> Any:
    ci = dry_in_ci(block, line, run)
    what = f"{block.where}:{line.split('#')[0].strip()[:60]}" + (f" (run {run + 1})" if run
                                                                   else "")
    slow = () if (in_ci(block, line, run) and ci == dry) else pytest.mark.slow
    return pytest.param(block, line, dry, id=what + (" (dry run)" if dry else ""), marks=slow)


COMMANDS = [_param(b, line, k, dry)
            for page in PAGES for k in range(PASSES.get(page, 1))
            for b in ALL if b.page == page and b.lang == "sh" for line in _lines(b)
            for dry in ((False, True) if dry_in_ci(b, line, k) else (False,))]


FOLDERS: dict[str, Path] = {}


def folder(key: str, factory: pytest.TempPathFactory) -> Path:
    """One working folder per block (its commands run in turn, a later one may read what an
    earlier one wrote), laid out like the repository root (examples/, tests/ linked)."""
    if key not in FOLDERS:
        path = factory.mktemp("docs")
        for name in TREE:
            (path / name).symlink_to(ROOT / name)
        FOLDERS[key] = path
    return FOLDERS[key]


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "100")


def test_the_second_tour_repeats_every_command_that_writes() -> None:
    assert writes("flexpipe draw 1f1b -p 4 -m 8 -o cmp.html --force")
    assert writes("flexpipe run zb-v -p 2 --trace-out=trace.json")
    assert writes("torchrun --nproc-per-node 2 examples/train_my_model.py")
    assert writes("flexpipe demo --steps 6")
    assert writes("flexpipe run --config no-such-job.toml")  # unknown: may write
    assert not writes("flexpipe run --config examples/job.toml")  # names no output
    assert writes("flexpipe run --config examples/llama_job.toml")  # torchtitan's dump_folder
    assert writes("flexpipe run 1f1b -p 2 --run-dir out/x")
    assert not writes("flexpipe simulate zb-v -p 8 -m 24 --json  # -o in a comment")
    again = [p for p in COMMANDS if p.id.endswith("(run 2)")]
    assert again and any(not p.marks for p in again) and any(p.marks for p in again)


def test_what_runs_elsewhere_is_documented_and_run_there() -> None:
    shown = [(b, line) for b in ALL if b.lang == "sh" for line in _lines(b)
             if _command(line) in ELSEWHERE]
    assert {_command(line) for _, line in shown} == set(ELSEWHERE), "no longer in the docs"
    assert not any(in_ci(b, line, 0) for b, line in shown)  # slow here: run there
    for command, (path, test) in ELSEWHERE.items():
        text = (ROOT / path).read_text(encoding="utf-8")
        assert f"def {test}(" in text, (command, path, test)
        script = next(w for w in command.split() if w.startswith("examples/"))
        assert Path(script).name in text, command  # the test runs that very example


def test_every_block_says_its_language() -> None:
    bad = [f"{b.where}: ```{b.lang}" for b in ALL if b.lang not in LANGS]
    assert not bad, f"fenced blocks need one of {sorted(LANGS)}: {bad}"
    assert len([b for b in ALL if b.lang == "sh"]) >= 8


def test_data_blocks_parse() -> None:
    loaders = {"json": json.loads, "toml": tomllib.loads}
    for b in ALL:
        if b.lang in loaders:
            try:
                loaders[b.lang](b.text)
            except ValueError as exc:
                pytest.fail(f"{b.where}: {b.lang} does not parse: {exc}")


@pytest.mark.parametrize("block, line, dry", COMMANDS)
def test_command_runs_as_written(block: Block, line: str, dry: bool, plain: None,
                                 tmp_path_factory: pytest.TempPathFactory,
                                 monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    root_copy = folder(block.where, tmp_path_factory)
    monkeypatch.chdir(root_copy)
    argv = shlex.split(line, comments=True)
    if dry:
        argv = ["flexpipe", "run", *(run_options(line) or []), "--dry-run"]
    found = EXIT.search(line)
    expected = int(found.group(1)) if found else 0
    skip = _skip_reason(argv)
    if skip:
        pytest.skip(f"{block.where}: {skip}")
    if argv[0] == VENV_FLEXPIPE:  # the README's way to reach the command: the venv's script
        assert (Path(sys.executable).parent / "flexpipe").is_file(), "no flexpipe in the venv"
        argv[0] = "flexpipe"
    if argv[0] == "flexpipe":
        code = main(argv[1:])
        out, err = capsys.readouterr()
    else:
        done = _subprocess(argv, root_copy)
        code, out, err = done.returncode, done.stdout, done.stderr
    assert code == expected, f"{block.where}: `{line}` exited {code}\n{out[-2000:]}\n{err}"


def _skip_reason(argv: list[str]) -> str:
    """Why a command cannot run inside the test suite ("" when it can)."""
    if argv[0] == "make":
        return "make targets are CI's entry points (make test runs this test)"
    if "nccl" in argv and not _has_cuda():
        return "--backend nccl needs one GPU per rank"
    return ""


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _subprocess(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a non-flexpipe command (torchrun) with this interpreter's scripts on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    exe = shutil.which(argv[0], path=env["PATH"])
    assert exe is not None, f"{argv[0]} is not installed"
    return subprocess.run([exe, *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)


PYTHON_PAGES = [pytest.param(page, id=str(page.relative_to(ROOT))) for page in PAGES
                if any(b.lang == "python" for b in blocks(page))]


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The page's Python blocks in turn, as one script run as ``__main__``."""
    root_copy = folder(str(page), tmp_path_factory)
    parts = [f"exec(compile({b.text!r}, {b.where!r}, 'exec'))" for b in blocks(page)
             if b.lang == "python"]
    script = root_copy / "page.py"
    script.write_text("\n".join(parts) + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=root_copy, capture_output=True,
                          text=True, timeout=600, check=False, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0, f"{page.name}: a Python block failed\n{done.stderr[-3000:]}"


LINK = re.compile(r"\]\(([^)#\s]+)\)")


def test_readme_is_a_map() -> None:
    """The README stays a map: short, its links resolve, five headline results that point to
    docs/results.md, and the docs folder has an index naming every page."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    for target in LINK.findall(text):
        assert (ROOT / target).exists(), f"README links to missing {target}"
    headline = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in headline.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(rows) == 1 + 5 and "docs/results.md" in headline
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.name == "README.md" or f"({page.name})" in index, f"index misses {page.name}"


CITED = re.compile(r"\bdocs/([\w-]+\.md)\b|\]\(([\w-]+\.md)\)")
ABSENT = ("FACTS.md", "DESIGN.md", "../shared")
"""Files the project once cited that it does not ship (its facts live in docs/facts.md)."""


def test_every_cited_page_ships() -> None:
    """Code, tests, benchmarks and docs cite only pages the repository holds: every
    ``docs/NAME.md`` and every ``](NAME.md)`` link names a page of docs/, and nothing names a
    file outside the repository."""
    this = Path(__file__).resolve()
    sources = [*PAGES, *(p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
                         if p.resolve() != this)]
    missing, outside = [], []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        here = path.relative_to(ROOT)
        missing += [f"{here}: {name}" for found in CITED.findall(text) for name in found
                    if name and not (ROOT / "docs" / name).is_file()]
        outside += [f"{here}: {name}" for name in ABSENT if name in text]
    assert not missing, f"cited pages that do not exist: {missing}"
    assert not outside, f"citations of files the repository lacks: {outside}"
