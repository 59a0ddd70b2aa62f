"""Rules of the Python source that no single feature's test would notice breaking."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "perseus"


def caught_names(tree):
    """Names bound by ``except ... as NAME`` anywhere in ``tree``."""
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name}


def test_no_code_branches_on_the_text_of_an_error():
    # What an error is must come from its class (typed in src/error.rs, mapped to Python
    # in src/python/errors.rs), not from words of its message: `"..." in str(e)`,
    # `"..." not in e.message`.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        errors = caught_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                continue
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Call) and isinstance(side.func, ast.Name) \
                        and side.func.id == "str" and len(side.args) == 1:
                    side = side.args[0]  # str(e), str(e.message)
                if isinstance(side, ast.Attribute):
                    side = side.value  # e.message, e.args
                text_of_error = isinstance(side, ast.Name) and side.id in errors
                if text_of_error:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"code that matches an error's text: {found}"


def modules():
    """``{module name: path}`` of the package's Python modules, and its extension."""
    found = {"perseus._core": None}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name, path, known):
    """The package's modules ``name`` imports anywhere in it (at the top or inside a
    function): ``from pkg import sub`` counts as ``pkg.sub`` where ``sub`` is a module,
    as the package itself otherwise."""
    tree = ast.parse(path.read_text(), str(path))
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(here[:len(here) - node.level + 1] + [node.module or ""]).rstrip(".")
                    if node.level else node.module or "")
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return set(out)


def test_no_import_cycle_between_modules():
    # Imports inside functions count too: a lazy import hides a cycle, it does not
    # break it.
    known = modules()
    graph = {m: imports(m, p, known) if p else set() for m, p in known.items()}
    assert cycles(graph) == set()


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == {frozenset("abc")}


def environment_reads(tree):
    """Lines of ``tree`` that read ``os.environ`` (or call ``os.getenv``). Writing is no
    read: ``os.environ[k] = v``, ``del``, ``.update``, ``.pop``, ``.setdefault``, and a
    copy for a child's environment (``dict(os.environ, ...)``)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_os(node, attr):
        return (isinstance(node, ast.Attribute) and node.attr == attr
                and isinstance(node.value, ast.Name) and node.value.id == "os")

    lines = []
    for node in ast.walk(tree):
        if is_os(node, "getenv"):
            lines.append(node.lineno)
        if not is_os(node, "environ"):
            continue
        up = parents.get(node)
        if isinstance(up, ast.Subscript) and isinstance(up.ctx, (ast.Store, ast.Del)):
            continue
        if isinstance(up, ast.Attribute) and up.attr in ("update", "pop", "setdefault"):
            continue
        if (isinstance(up, ast.Call) and isinstance(up.func, ast.Name)
                and up.func.id == "dict" and up.args and up.args[0] is node):
            continue
        lines.append(node.lineno)
    return sorted(lines)


def test_only_knobs_reads_the_environment():
    # The one reader (perseus.common.knobs) trims, treats blank as unset and checks
    # settings; launchers and ranks still write the environment of what they start. The
    # examples are users' scripts and read what users read.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "examples" or rel == Path("common", "knobs.py"):
            continue
        found += [f"{rel}:{n}" for n in environment_reads(ast.parse(path.read_text()))]
    assert not found, f"read the environment past perseus.common.knobs: {found}"


def test_the_environment_rule_tells_reads_from_writes():
    code = ("import os\nx = os.environ.get('A')\nos.environ['B'] = '1'\ny = 'C' in os.environ\n"
            "os.environ.update(D='1')\nz = dict(os.environ, E='1')\nw = os.getenv('F')\n"
            "del os.environ['G']\nv = os.environ['H']\n")
    assert environment_reads(ast.parse(code)) == [2, 4, 7, 9]
