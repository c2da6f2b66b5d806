"""The import graph keeps docs/architecture.md's layers:
starfish -> bench -> servers, lab -> protocols -> mpc -> common -> net, with clients on common/net.

Walks every import statement (module top and function bodies) of the project's packages with
``ast`` and asserts (a) package edges only point down the layer order, with ``clients`` and
``servers`` independent of each other, and (b) no cycle between files. A client process must
start without the 2PC engine or server code, which a fresh interpreter checks for real.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("net", "common", "mpc", "protocols", "servers", "clients", "lab", "bench", "starfish")

#: package -> the packages it may import (besides itself). ``clients`` stands on the two lower
#: floors only, so "a client loads no 2PC engine" holds by structure; the daemon (``servers``)
#: and the plaintext lab (``lab``) never import each other.
ALLOWED = {
    "net": set(),
    "common": {"net"},
    "mpc": {"net", "common"},
    "protocols": {"net", "common", "mpc"},
    "clients": {"net", "common"},
    "servers": {"net", "common", "mpc", "protocols"},
    "lab": {"net", "common", "mpc", "protocols", "clients"},
    "bench": {"net", "common", "mpc", "protocols", "servers", "clients", "lab"},
    "starfish": {"net", "common", "mpc", "protocols", "servers", "clients", "lab", "bench"},
}

#: sub-packages of ``servers`` -> the sub-packages they may import: the store at the bottom,
#: then what is computed on shares, then the workers that compute it shard by shard, then the daemon
SERVER_LAYERS = {
    "servers.store": set(),
    "servers.secure": {"servers.store"},
    "servers.workers": {"servers.store", "servers.secure"},
    "servers.daemon": {"servers.store", "servers.secure", "servers.workers"},
    "servers.dealer_daemon": set(),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (``from p import m`` names the module m)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t.split(".")[0] in PACKAGES:
                    r = _resolve(t, mods)
                    if r and r != mod:
                        graph[mod].add(r)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_packages_import_only_downward():
    bad = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps
                 if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]])
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_clients_import_nothing_of_the_2pc_runtime():
    bad = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps
                 if a.split(".")[0] == "clients" and b.split(".")[0] in ("mpc", "protocols", "servers", "lab"))
    assert not bad, bad


def test_the_daemon_imports_nothing_of_the_lab_and_the_lab_nothing_of_the_daemon():
    graph = import_graph()
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                 if {a.split(".")[0], b.split(".")[0]} == {"servers", "lab"})
    assert not bad, bad


def _server_wing(mod: str) -> str | None:
    return next((w for w in SERVER_LAYERS if mod == w or mod.startswith(w + ".")), None)


def test_server_wings_import_only_downward():
    """Every module of ``servers`` lives in a wing, and wings import only the wings below."""
    graph = import_graph()
    homeless = sorted(m for m in graph if m.startswith("servers.") and _server_wing(m) is None)
    assert not homeless, f"servers modules outside a wing: {homeless}"
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                 if (wa := _server_wing(a)) and (wb := _server_wing(b)) and wa != wb
                 and wb not in SERVER_LAYERS[wa])
    assert not bad, "imports against the servers' wing order:\n" + "\n".join(bad)


def test_no_import_cycle_between_files():
    assert _cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["common.encoding"].add("bench.lab")
    graph["bench.lab"].add("common.encoding")
    assert any("common.encoding" in c and "bench.lab" in c for c in _cycles(graph))


def test_a_client_process_loads_neither_server_code_nor_the_2pc_engine():
    code = ("import sys, clients.simulator, clients.service_client; "
            "print(sorted(m for m in ('servers', 'protocols', 'crypten', 'bench', 'mpc', 'lab') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _external_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_engine_seam_imports_spu_or_jax():
    users = sorted(m for m, p in _modules().items() if _external_imports(p) & {"spu", "jax", "jaxlib"})
    assert users == ["mpc.spu_process"]


def test_no_server_process_loads_spu():
    """A dealer-mode session never loads SPU or jax, and neither does a two-party session's
    server process: the engine's proxy (``mpc.spu_engine``) leaves both to its child process."""
    code = ("import sys, mpc.session, mpc.launcher, mpc.spu_engine, mpc.engine_pool, protocols, protocols.starfish.stage2; "
            "print(sorted(m for m in ('spu', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
