"""Every file path README.md and docs/*.md name points at a file of the repository.

Why: the code moves (issue 27 found docs/service.md naming ``servers/wire.py`` after it had
moved, and ``protocols/starfish/rs_switch.json`` after it had become ``data/t_delta.json``); a
reader following a stale path finds nothing. What counts as a path: a backticked word with a
``/`` whose first part is a folder of the repository (it must exist from the root), or that
ends in a file extension (it must exist below some folder: tables name modules relative to
their package); and a backticked bare ``*.py`` or ``*.md`` name, which must exist somewhere. Not checked:
what a run writes (``out/``, a deployment's ``data/server0``, ``keys/``), placeholders, and
``papers/`` (the reference texts live beside the repository, not in it).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TICKED = re.compile(r"`([^`\s]+)`")
EXTENSIONS = (".py", ".md", ".json", ".toml", ".txt", ".png", ".npz", ".cfg", ".yaml", ".sh")
NOT_IN_REPO = ("out/", "data/server", "keys/", "papers/", "ca-offline/", "logs/")


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(out.split())
    # new files of a working tree count too (a doc written with its code, before the commit)
    files |= {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    return files


def _named(text: str) -> list[tuple[int, str]]:
    found = []
    for no, line in enumerate(text.splitlines(), 1):
        for word in TICKED.findall(line):
            word = word.rstrip(".,:;)").split("::")[0]
            if any(c in word for c in "<>*{}$|=") or word.startswith(("/", "~", ".", "-", "http")):
                continue
            found.append((no, word))
    return found


def test_every_named_path_exists():
    tracked = _tracked()
    folders = {f.split("/")[0] for f in tracked if "/" in f}
    names = {f.rsplit("/", 1)[-1] for f in tracked}
    missing = []
    for doc in DOCS:
        for no, word in _named(doc.read_text()):
            if word.startswith(NOT_IN_REPO):
                continue
            if "/" in word:
                path = word.rstrip("/")
                if path.split("/")[0] in folders:      # from the repository's root
                    ok = path in tracked or (ROOT / path).exists()
                elif path.endswith(EXTENSIONS):       # relative to a package a table is about
                    ok = any(f.endswith("/" + path) for f in tracked)
                else:
                    continue
                if not ok:
                    missing.append(f"{doc.relative_to(ROOT)}:{no}: {word}")
            elif word.endswith((".py", ".md")) and word not in names:
                missing.append(f"{doc.relative_to(ROOT)}:{no}: {word}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)

