"""The docs are code: every Python block of README.md and docs/*.md runs, and every link resolves.

Each file's ```python blocks run in order in one namespace of their own (a guide builds up; the
next file starts afresh), in a temporary folder that sees the repository's ``meshes/`` and
``examples/``, on the suite's 8 fake CPU devices. Before anything runs, pyflakes' checks (through
ruff) read each file's blocks as one module, so a name a snippet uses but never defines fails
here, even inside a function body that never runs. A block that cannot run on CPU, or would start
a cluster, carries ``<!-- not run: why -->`` on the line before its fence: it is still checked
for undefined names, not executed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import traceback
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INDEX = ROOT / "docs" / "README.md"  # the guides, the public names, where the code lives
README_LINES = 250
# what CI and users copy from the top of the README
COMMANDS = (
    "python3 -m pip install -e . && tenplex-jax demo --out out/demo",
    'python3 -m pip install -e ".[test]" && python3 -m pytest',
)
# pyflakes' undefined name, redefinition of an unused name, local assigned but never used
CHECKS = "F821,F811,F841"
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<why>\S.*?)\s*-->\s*$")
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    lang: str
    line: int  # the file's line number of the block's first line of code (1-based)
    code: str
    not_run: str | None  # why it is not executed, or None

    @property
    def python(self) -> bool:
        return self.lang in ("python", "py")


def fenced_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, each with the ``not run`` reason on the line before
    its fence. Raises ``ValueError`` for an unclosed fence or a ``not run`` comment that is not
    followed by a Python block (it would mark nothing)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            marker = NOT_RUN.match(lines[i])
            if marker is not None:
                after = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                if after is None or after["lang"].lower() not in ("python", "py"):
                    raise ValueError(
                        f"line {i + 1}: a 'not run' comment must precede a python fence"
                    )
            i += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise ValueError(f"line {i + 1}: the fence {fence} is never closed")
        body = [line[indent:] if line[:indent].isspace() else line for line in lines[i + 1 : end]]
        marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
        blocks.append(
            Block(
                match["lang"].lower(),
                i + 2,
                "\n".join(body) + "\n",
                None if marker is None else marker["why"],
            )
        )
        i = end + 1
    return blocks


def python_blocks(path: pathlib.Path) -> list[Block]:
    return [b for b in fenced_blocks(path.read_text()) if b.python]


def undefined_names(name: str, blocks: list[Block]) -> list[str]:
    """Pyflakes' findings (``CHECKS``) as ``file:line: code message`` with the Markdown file's
    line numbers: on the blocks that run, read as one module (a name defined only in a block
    that does not run is undefined where the next block uses it), and on all blocks (a block
    that does not run must make sense too)."""
    found = _ruff(name, [b for b in blocks if b.not_run is None]) + _ruff(name, blocks)
    return list(dict.fromkeys(found))  # once each, in order


def _ruff(name: str, blocks: list[Block]) -> list[str]:
    source, where = [], []  # where[k]: the doc line of the module's line k + 1
    for block in blocks:
        for offset, text in enumerate(block.code.splitlines()):
            source.append(text)
            where.append(block.line + offset)
        source.append("")  # blocks apart: a block's last line never continues into the next
        where.append(block.line)
    ruff = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select", CHECKS]
        + ["--output-format", "json", "--stdin-filename", f"{name}.py", "-"],
        input="\n".join(source) + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    if ruff.returncode not in (0, 1):  # 1: findings; anything else: ruff itself failed
        raise RuntimeError(f"ruff failed ({ruff.returncode}): {ruff.stderr}")
    return [
        f"{name}:{where[f['location']['row'] - 1]}: {f['code']} {f['message']}"
        for f in json.loads(ruff.stdout)
    ]


def _id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_every_python_block_runs(path, tmp_path, monkeypatch):
    blocks = python_blocks(path)
    found = undefined_names(_id(path), blocks)
    assert not found, "names the snippets use but never define (or never use):\n" + "\n".join(found)
    for folder in ("meshes", "examples"):  # the paths the docs use, from the repository's root
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs.{path.stem}"}  # a module of its own, never "__main__"
    for block in (b for b in blocks if b.not_run is None):
        # padded so that a traceback names the Markdown file and its own line numbers
        code = compile("\n" * (block.line - 1) + block.code, str(path), "exec")
        try:
            exec(code, namespace)
        except (Exception, SystemExit) as error:
            pytest.fail(
                f"{_id(path)}: the block at line {block.line} raised {type(error).__name__}: "
                f"{error}\n\n{traceback.format_exc()}",
                pytrace=False,
            )


def test_the_readme_is_a_door():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines, at most {README_LINES}"
    first = fenced_blocks(text)[0]  # after the pitch, before anything else: the two commands
    commands = [line for line in first.code.splitlines() if not line.lstrip().startswith("#")]
    assert first.lang == "bash" and commands == list(COMMANDS), (
        f"the README's first block must be a bash block of the two commands {COMMANDS}"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[`*]|<[^>]+>", "", text)
    keep = lambda c: c in " -_" or unicodedata.category(c)[0] in "LMN"
    return "".join(c for c in text if keep(c)).replace(" ", "-")


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown text outside its fenced blocks, fences included."""
    inside: set[int] = set()
    for block in fenced_blocks(text):
        inside.update(range(block.line - 1, block.line + block.code.count("\n") + 1))
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if n not in inside]


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one numbered, as GitHub does)."""
    seen: dict[str, int] = {}
    for _, line in prose(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match[1])
            seen[slug] = seen.get(slug, -1) + 1
    return {s if n == 0 else f"{s}-{n}" for s, count in seen.items() for n in range(count + 1)}


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code blocks and code spans."""
    found = []
    for number, line in prose(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)
        found += [(number, m["target"]) for m in LINK.finditer(line)]
    return found


@pytest.mark.parametrize("path", DOCS, ids=_id)
def test_every_relative_link_resolves(path):
    broken = []
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this repository's
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{_id(path)}:{line}: {target} (no {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{_id(path)}:{line}: {target} (no heading #{anchor})")
        elif resolved.name == "RESULTS.md" and re.search(r"issue|\d{4}-\d\d-\d\d", anchor):
            # measured history is dated there; a guide links to its topics, which stay
            broken.append(f"{_id(path)}:{line}: {target} (an issue number or a date)")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_collector_finds_undefined_names_and_marks():
    doc = (
        "text\n\n```python\nimport jax\n\n\ndef step(state):\n    return graphdef, jax\n```\n\n"
        "<!-- not run: needs a Ray cluster -->\n```python\nimport ray\n\nray.init(cluster)\n```\n"
        "\n```bash\nls\n```\n\n```python\nray.shutdown()\n```\n"
    )
    blocks = fenced_blocks(doc)
    assert [(b.lang, b.line, b.not_run) for b in blocks] == [
        ("python", 4, None),
        ("python", 13, "needs a Ray cluster"),
        ("bash", 19, None),
        ("python", 23, None),
    ]
    found = undefined_names("doc.md", [b for b in blocks if b.python])
    # graphdef inside a function body; `ray` imported only by a block that does not run; and
    # `cluster`, undefined in the block that does not run
    assert [f.split(": ", 1)[0] for f in found] == ["doc.md:8", "doc.md:23", "doc.md:15"]
    assert "graphdef" in found[0] and "ray" in found[1] and "cluster" in found[2]
    with pytest.raises(ValueError, match="not run"):
        fenced_blocks("<!-- not run: why -->\n```bash\nls\n```\n")
    assert _slug("1–4. Reshard matrix (114.5M-param GPT)") == "14-reshard-matrix-1145m-param-gpt"


def _faces() -> dict[str, set[str]]:
    """``tj`` and every face under it (``tj.data``, ``tj.multihost.store``, ...) -> ``__all__``."""
    import importlib

    package = ROOT / "tenplex_jax"
    faces = {"tj": set(importlib.import_module("tenplex_jax").__all__)}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if "_src" in parts or parts[-1] == "__main__" or parts == ("__init__",):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        faces[f"tj.{name}"] = set(importlib.import_module(f"tenplex_jax.{name}").__all__)
    return faces


def test_the_index_names_every_public_name_of_every_face():
    """docs/README.md's table of the public API has a row per face whose names are exactly its
    ``__all__``: a name added, renamed or dropped fails here until the index says so."""
    rows = {
        m["face"]: set(re.findall(r"`([A-Za-z_]\w*)`", m["names"]))
        for m in re.finditer(
            r"^\| `(?P<face>tj(?:\.[\w.]+)?)` \| (?P<names>.*) \|$", INDEX.read_text(), re.M
        )
    }
    faces = _faces()
    wrong = [f"{face}: no row" for face in faces if face not in rows]
    wrong += [f"{face}: a row, but no such face" for face in rows if face not in faces]
    for face in faces.keys() & rows.keys():
        if missing := sorted(faces[face] - rows[face]):
            wrong.append(f"{face}: the row lacks {missing}")
        if extra := sorted(rows[face] - faces[face]):
            wrong.append(f"{face}: the row names {extra}, which are not in its __all__")
    assert not wrong, "docs/README.md's public API table:\n" + "\n".join(wrong)


def test_the_code_map_lists_every_module_of_the_implementation():
    """docs/README.md's code map names every module under ``tenplex_jax/_src`` (its path from
    ``_src``, in a table row of its own) and nothing that does not exist: a module added, moved
    or removed fails here until the map says so."""
    mapped = set(re.findall(r"^\| `([\w/]+\.py)` \|", INDEX.read_text(), re.M))
    src = ROOT / "tenplex_jax" / "_src"
    modules = {  # an empty __init__.py only makes a package
        str(p.relative_to(src)) for p in src.rglob("*.py") if p.read_text().strip()
    }
    assert mapped, "docs/README.md has no code map rows (| `path.py` | what it holds |)"
    assert modules <= mapped, f"modules missing from the code map: {sorted(modules - mapped)}"
    assert mapped <= modules, (
        f"the code map names modules that do not exist: {sorted(mapped - modules)}"
    )
