"""No import circles among dsv4's modules, and every package imports only downwards (cli > http > daemon > engine > model).

The graph has an edge A -> B for every `import` of B in A's source, wherever it stands:
at the top, inside a function (a deferred import is still a dependency) or under
`if TYPE_CHECKING:` (a type is one too). `from P import name` is an edge to the
submodule P.name when there is one, else to P. A package's `__init__` running before
its submodules is not counted as an edge (every package would then be a circle with
any submodule its `__init__` re-exports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import dsv4

ROOT = Path(dsv4.__file__).parent


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["dsv4", *p.relative_to(ROOT).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        package = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name) if name.split(".")[0] == "dsv4" else None
                if target is not None and target != m:
                    graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
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


def test_the_graph_sees_every_kind_of_import():
    g = import_graph()
    assert "dsv4.engine.engine" in g["dsv4.engine.llm"]  # relative, at the top
    assert "dsv4.engine.llm" in g["dsv4"]  # inside a function (the lazy `dsv4.LLM`)
    assert "dsv4.model.loader" in g["dsv4.model"]  # a package's own submodule


def test_no_import_cycles():
    g = import_graph()
    found = cycles(g)
    lines = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {', '.join(sorted(g[a] & set(c)))}" for a in c)
             for c in found]
    assert not found, "import cycles among dsv4 modules:\n" + "\n".join(lines)


# Each package imports only the packages below it: cli > http > daemon > engine > model, with
# the agents layer (prompt encoding, DSML), the config and the leaves below them all. The model
# knows nothing of the engine, the engine nothing of the daemon, the daemon nothing of HTTP (it
# serves a front end through `dsv4.daemon.contract.FrontEnd`; `dsv4 serve` assembles the two),
# and nothing imports the CLI. The draft vocabulary file's format (`dsv4.draft_vocab`, a
# checkpoint file like config.json) and the hub cache (`dsv4.hub`: the engine turns a
# --model ORG/NAME into a snapshot's directory there) sit below the engine. `dsv4.machine`
# (memory available) and `dsv4.safetensors_header` (a checkpoint file's header) are leaves
# that the model, the engine and the hub cache read alike. The package root (`dsv4`: its
# version, and the lazy `dsv4.LLM`) is read only by the daemon, HTTP and the CLI.
LEAVES = {"dsv4.machine", "dsv4.safetensors_header", "dsv4.private_paths", "dsv4.assets"}
CONFIG = {"dsv4.config", "dsv4.config_values"}
MODEL = {"dsv4.model"} | CONFIG | LEAVES
ENGINE = {"dsv4.engine", "dsv4.agents", "dsv4.draft_vocab", "dsv4.hub"} | MODEL
DAEMON = {"dsv4.daemon", "dsv4"} | ENGINE
HTTP = {"dsv4.http"} | DAEMON
BELOW = {
    "dsv4.model": MODEL,
    "dsv4.engine": ENGINE,
    "dsv4.daemon": DAEMON,
    "dsv4.http": HTTP,
    "dsv4.cli": HTTP,
    "dsv4.agents": set(),
    "dsv4.draft_vocab": CONFIG,
    "dsv4.hub": set(LEAVES),
    "dsv4.config": {"dsv4.config_values"},
    **{leaf: set() for leaf in LEAVES | {"dsv4.config_values"}},
}


def test_every_module_is_in_a_layer():
    """A new package or top-level module must be placed in BELOW (else the layering test
    would not see it)."""
    loose = [m for m in import_graph() if m != "dsv4" and not any(m == p or m.startswith(p + ".") for p in BELOW)]
    assert not loose, f"modules in no layer of BELOW: {loose}"


def test_layers_import_only_downwards():
    g = import_graph()
    wrong = []
    for package, allowed in BELOW.items():
        for a in sorted(m for m in g if m == package or m.startswith(package + ".")):
            for b in sorted(g[a]):
                if not any(b == p or (p != "dsv4" and b.startswith(p + ".")) for p in allowed | {package}):
                    wrong.append(f"{a} -> {b}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
