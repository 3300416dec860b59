"""The docs' commands run, and print what the docs say they print.

Every ```sh block in README.md and docs/*.md carries a marker on the line before it:

    <!-- test: run -->                 its commands run as written
    <!-- test: run with: ARGS -->      ... with ARGS appended to each python command (a short variant of
                                       a run that takes minutes); where both the command and ARGS hold a
                                       "--" (a benchmark's options, then the trainer's), ARGS's part before
                                       its "--" goes before the command's and the rest at the end
    <!-- test: skip: REASON -->        not run here (it installs packages, needs Slurm or a GPU, or
                                       takes far too long: REASON says which, and which test covers it)

A ```python block may carry one too (unmarked ones are not run: a fragment of your own loop, say):

    <!-- test: exec -->                it runs as a script, from the repository root
    <!-- test: exec then: CODE -->     ... followed by CODE (a check the page need not show), in the same
                                       script

In a block, a line starting with "$ " is a command and the lines after it, up to the next command, are
what its output must contain (each line a substring); other lines that start with python, mpiexec or
bash (after any VAR=value words, which set its environment) are commands whose output is not checked.
Lines starting with # are comments; a command ending in "# exit N" must exit with N (0 otherwise). A
block without a marker fails the test, and so does a block marked to run in which no command is found,
so no command can go untested silently.

A benchmark's ``--max-others CORES`` (measure a launch again, up to three times, while other processes
keep more than CORES cores busy) runs here with a bound no machine reaches: the suite checks that the
command works and measures its load, not its figures, and on a shared machine the repeats would make the
suite's time depend on the other users.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import ONE_THREAD, ROOT, mpiexec_cmd, serial_only

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*test:\s*(run with:\s*(?P<args>.*?)|run|skip:\s*(?P<why>.*?))\s*-->")
EXEC = re.compile(r"<!--\s*test:\s*exec(?:\s+then:\s*(?P<then>.*?))?\s*-->")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(python3?|mpiexec|bash)\b")  # after VAR=value words
pytestmark = serial_only
NO_RETRY_CORES = 1000  # a --max-others bound no machine's other load reaches


def blocks() -> list[tuple[str, str | None, str]]:
    """(where, marker line or None, block text) for every ```sh block."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "```sh":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                marker = lines[i - 1] if i and MARK.search(lines[i - 1]) else None
                found.append((f"{doc.relative_to(ROOT)}:{i + 1}", marker, "\n".join(lines[i + 1:end])))
    return found


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) in a block. After a "$ " command, the lines up to the next one
    are its expected output; elsewhere a line starting with python, mpiexec or bash is a command."""
    out: list[tuple[str, list[str]]] = []
    expecting = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("$ "):
            out.append((line[2:], []))
            expecting = True
        elif expecting:
            out[-1][1].append(line)
        elif COMMAND.match(line):
            out.append((line, []))
    return out


def runnable(cmd: str, extra: str) -> tuple[dict[str, str], list[str]]:
    """The environment its leading VAR=value words set, and the command with this interpreter for python,
    this launcher for mpiexec, and ``extra`` appended to a python command."""
    words = shlex.split(cmd.split(" #", maxsplit=1)[0])
    env = {}
    while ENV_ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "mpiexec":
        n = int(words[words.index("-n") + 1])
        rest = words[words.index("-n") + 2:]
        words = mpiexec_cmd(n, *rest[1:]) if rest[0].startswith("python") else [*mpiexec_cmd(n)[:-1], *rest]
    elif words[0].startswith("python"):
        words = [sys.executable, *words[1:]]
    if "--max-others" in words:  # measured once, whatever the machine's other load (see the docstring)
        words[words.index("--max-others") + 1] = str(NO_RETRY_CORES)
    if not (extra and sys.executable in words):
        return env, words
    more = shlex.split(extra)
    if "--" in words and "--" in more:  # the benchmark's options before its "--", the trainer's after
        cut, split = words.index("--"), more.index("--")
        return env, [*words[:cut], *more[:split], *words[cut:], *more[split + 1:]]
    return env, words + more


def python_blocks() -> list[tuple[str, str, str]]:
    """(where, the code to run after it, block text) for every ```python block marked exec."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            m = EXEC.search(lines[i - 1]) if i else None
            if line.strip() == "```python" and m:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                found.append((f"{doc.relative_to(ROOT)}:{i + 1}", m.group("then") or "", "\n".join(lines[i + 1:end])))
    return found


ALL = blocks()
PYTHON = python_blocks()


def test_every_command_block_says_how_it_is_tested():
    unmarked = [where for where, marker, _ in ALL if marker is None]
    assert not unmarked, f"```sh blocks with no <!-- test: ... --> marker: {unmarked}"


@pytest.mark.parametrize("where,marker,text", [b for b in ALL if b[1] and "skip:" not in b[1]],
                         ids=[b[0] for b in ALL if b[1] and "skip:" not in b[1]])
def test_doc_commands_run_and_print_what_the_doc_shows(where, marker, text, tmp_path):
    m = MARK.search(marker)
    extra = (m.group("args") or "") if m else ""
    env = {**os.environ, **ONE_THREAD, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PYTHONPATH": str(ROOT)}
    found = commands(text)
    assert found, f"{where}: a block marked to run holds no command this test recognises"
    for cmd, expected in found:
        code = re.search(r"#\s*exit (\d+)", cmd)  # a command the doc shows failing: "... # exit 1"
        own_env, argv = runnable(cmd, extra)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**env, **own_env})
        shown = r.stdout + r.stderr
        want = int(code.group(1)) if code else 0
        assert r.returncode == want, f"{where}: {cmd!r} exit {r.returncode}, not {want}\n{shown[-3000:]}"
        missing = [line for line in expected if line not in shown]
        assert not missing, f"{where}: {cmd!r} did not print {missing}\n{shown[-3000:]}"


def test_some_python_block_runs():
    assert any("docs/data.md" in where for where, _, _ in PYTHON), "docs/data.md's model factory is not run"


@pytest.mark.parametrize("where,then,code", PYTHON, ids=[b[0] for b in PYTHON])
def test_python_blocks_run(where, then, code):
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", f"{code}\n{then}\n"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=env)
    assert r.returncode == 0, f"{where}: the block (then {then!r}) failed:\n{(r.stdout + r.stderr)[-3000:]}"


def toml_texts() -> list[tuple[str, str]]:
    """(where, text) of every ```toml block in the docs and every examples/*.toml."""
    found = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "examples").glob("*.toml"))]
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "```toml":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                found.append((f"{doc.relative_to(ROOT)}:{i + 1}", "\n".join(lines[i + 1:end])))
    return found


@pytest.mark.parametrize("where,text", toml_texts(), ids=[w for w, _ in toml_texts()])
def test_config_files_in_the_docs_are_ones_config_reads(where, text):
    import tomllib

    from mpisgd.app.options import values

    assert values(tomllib.loads(text), where)  # raises UsageError naming a bad key or type


def test_skipped_blocks_say_why():
    vague = [where for where, marker, _ in ALL if marker and "skip:" in marker and len(MARK.search(marker)
                                                                                         .group("why")) < 15]
    assert not vague, f"skipped blocks need a reason (and the test that covers them): {vague}"


LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [*DOCS, *sorted((ROOT / "results").rglob("*.md"))]


def anchors(page) -> set[str]:
    """The #fragments of a page's headings, as GitHub makes them (lower case, punctuation dropped,
    spaces to hyphens)."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def test_links_between_pages_resolve():
    """Every relative link in README.md, docs/ and results/ names a file that exists, and a #fragment
    into a page names one of its headings (files move: docs must follow)."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
