"""python/perseus/_core.pyi and the compiled module name the same things."""

import ast
import pathlib

from perseus import _core

STUB = pathlib.Path(__file__).resolve().parents[2] / "python" / "perseus" / "_core.pyi"


def test_stub_matches_module():
    tree = ast.parse(STUB.read_text())
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            declared.add(node.target.id)
    public = {n for n in dir(_core) if not n.startswith("_")}
    assert declared == public, (declared - public, public - declared)
