"""The supported framework ranges (perseus.support): an older framework is an
ImportError naming its version and the range, a newer one than any tested one warning
per process, and the README and docs/compatibility.md state the same ranges."""

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from perseus import support

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version, parsed", [
    ("2.15.0", (2, 15, 0)), ("2.15.0+cu128", (2, 15, 0)), ("2.4.0a0+git1234", (2, 4, 0)),
    ("1.9.1", (1, 9, 1)), ("2.21.0-rc1", (2, 21, 0)), (" 3.11 ", (3, 11)),
])
def test_versions_parse_to_their_leading_numbers(version, parsed):
    assert support.parse(version) == parsed


def test_a_string_without_a_version_is_refused():
    with pytest.raises(ValueError, match="not a version: 'nightly'"):
        support.parse("nightly")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(support, "_warned", set())
    monkeypatch.setitem(support.SUPPORTED, "torch", ("2.1", "2.15"))


def test_an_older_framework_is_an_import_error_naming_version_and_range(fresh_warnings):
    for old in ("2.0.1", "1.13.1", "2.0.0+cpu"):
        with pytest.raises(ImportError) as e:
            support.check("torch", old)
        assert f"this is torch {old}" in str(e.value)
        assert "Perseus supports torch 2.1 to 2.15" in str(e.value)
        assert "pip install 'torch>=2.1'" in str(e.value)


def test_supported_releases_pass_silently(fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ok in ("2.1.0", "2.1.2", "2.4.1+cu121", "2.15.0", "2.15.3"):
            support.check("torch", ok)


def test_a_single_release_range_reads_as_that_release():
    assert support.span("mxnet") == "1.9.1"
    assert support.span("torch") == "2.1 to 2.15"


def test_a_newer_framework_warns_once_per_process(fresh_warnings):
    with pytest.warns(support.NewerThanTestedWarning,
                      match=r"torch 2\.16\.0 is newer than any release Perseus has been "
                            r"tested with \(torch 2\.1 to 2\.15\)"):
        support.check("torch", "2.16.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        support.check("torch", "3.0.0")  # already warned


def test_importing_the_front_end_over_an_old_torch_fails_naming_it(tmp_path):
    # A stand-in torch that says it is 2.0.1: perseus.torch must stop before using it.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.0.1'\n")
    code = textwrap.dedent("""
        try:
            import perseus.torch.horovod
        except ImportError as e:
            print("ImportError:", e)
        else:
            print("imported")
    """)
    env_path = f"{tmp_path}:{ROOT / 'python'}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin",
                              "PERSEUS_DDP": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: Perseus supports torch 2.1 to" in out.stdout, out.stdout
    assert "this is torch 2.0.1" in out.stdout


def test_import_perseus_over_an_old_torch_leaves_ddp_to_torch_with_a_warning(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.0.1'\n")
    code = "import warnings; warnings.simplefilter('always'); import perseus, torch; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT / 'python'}",
                              "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "DistributedDataParallel keeps torch's communication" in out.stderr, out.stderr
    assert "this is torch 2.0.1" in out.stderr, out.stderr


def test_the_readme_and_the_compatibility_doc_state_the_supported_ranges():
    readme = (ROOT / "README.md").read_text()
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    names = {"torch": "torch", "tensorflow": "TensorFlow", "mxnet": "MXNet"}
    for framework in support.SUPPORTED:
        stated = f"{names[framework]} {support.span(framework)}"
        assert stated in readme, f"README.md does not say {stated!r}"
        assert stated in doc, f"docs/compatibility.md does not say {stated!r}"
    python = f"Python {support.PYTHONS[0]} to {support.PYTHONS[1]}"
    assert python in readme and python in doc, python


def test_every_cell_of_the_matrix_has_a_row_in_the_doc():
    cells = subprocess.run(["bash", str(ROOT / "scripts" / "compat-matrix.sh"), "--list"],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    names = [line.split()[0] for line in cells.splitlines() if line.strip()]
    assert len(names) >= 10, cells
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", doc, re.MULTILINE)
    assert rows == names, (rows, names)
