"""The Python side's settings (perseus.common.knobs): every one takes any value without
an exception other than a ValueError that names it, and its readers refuse what it
refuses. (The core's own variables are fuzzed in Rust: tests/fuzz_corpus.rs and the
fuzz target ``config``.)"""

import math
import random
from pathlib import Path

import pytest
from perseus.common import knobs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "environment.md"

HOSTILE = ["", " ", "1", "0", "-0", "-1", "0.5", "1e300", "-1e300", "1e-320", "nan", "NaN",
           "inf", "-inf", str(2**64), str(-2**64), "9" * 65, "1" * 100_000, "0x10", "1_000",
           "１", "٣", "true", "TRUE", "yes", "no", "off", "abc", "\x00", "1 2", "1,2", "0.5 0.5",
           ",", "norm", "VALUE", "1e", "--1", "+1", " 7 "]


def random_values(n, seed):
    rng = random.Random(seed)
    alphabet = "0123456789+-.eE ,_xabcnfiNI١２\x00\t"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def check(knob, value):
    """``knob``'s answer to ``value``: a value of its kind within its range, or a
    ValueError that names it; anything else fails."""
    try:
        got = knob.parse(value.strip()) if value.strip() else knob.default
    except ValueError as e:
        assert str(e).startswith(f"{knob.name} must be {knob.must()}, got "), str(e)
        return None
    if got is None:
        return None
    values = got if knob.kind == "ratios" else [got]
    kind = {"bool": bool, "int": int, "float": float, "ratios": float, "str": str,
            "text": str}[knob.kind]
    for v in values:
        assert type(v) is kind, (knob.name, value, got)
        if kind in (int, float):
            assert math.isfinite(v) and v <= knob.high, (knob.name, value, got)
            assert v > knob.low if knob.low_open else v >= knob.low, (knob.name, value, got)
        if knob.kind == "str":
            assert v in knob.choices
    return got


@pytest.mark.parametrize("knob", knobs.KNOBS, ids=lambda k: k.name)
def test_every_setting_takes_any_value_without_an_exception_but_one_naming_it(knob):
    for value in HOSTILE + random_values(2000, knob.name):
        check(knob, value)
    assert check(knob, "") == knob.default


def test_defaults_lie_in_their_ranges_and_every_setting_is_documented():
    text = DOCS.read_text()
    for knob in knobs.KNOBS:
        if knob.default is not None:
            assert check(knob, str(int(knob.default)) if knob.kind == "bool"
                         else " ".join(map(str, knob.default)) if knob.kind == "ratios"
                         else str(knob.default)) == knob.default, knob.name
        assert f"`{knob.name}`" in text, f"{knob.name} is not in docs/environment.md"


def test_values_are_read_as_typed_and_an_alias_is_named_in_its_error():
    env = {"PERSEUS_DGC": "TRUE", "PERSEUS_DGC_COMPRESS_RATIO": " 0.25 ",
           "PERSEUS_DGC_WARMUP_COEFF": "0.5,0.25 0.125", "PERSEUS_CLIP_GRAD_FUNC": "Norm"}
    assert knobs.get("PERSEUS_DGC", env) is True
    assert knobs.get("PERSEUS_DGC_COMPRESS_RATIO", env) == 0.25
    assert knobs.get("PERSEUS_DGC_WARMUP_COEFF", env) == [0.5, 0.25, 0.125]
    assert knobs.get("PERSEUS_CLIP_GRAD_FUNC", env) == "norm"
    assert knobs.get("PERSEUS_DGC_MAX_ADAPTATION_ITERS", env) == 10
    lone = knobs.Knob("X_NEW", "int", 3, 0, 9, aliases=("X_OLD",),
                      allowed="an integer from 0 to 9")
    knobs._TABLE["X_NEW"] = lone
    try:
        assert knobs.get("X_NEW", {"X_OLD": "4"}) == 4
        assert knobs.get("X_NEW", {"X_OLD": "4", "X_NEW": "5"}) == 5
        with pytest.raises(ValueError, match=r"^X_OLD must be an integer from 0 to 9, got '10'$"):
            knobs.get("X_NEW", {"X_OLD": "10"})
    finally:
        del knobs._TABLE["X_NEW"]


@pytest.mark.parametrize("name, value, reader", [
    ("PERSEUS_DGC_COMPRESS_RATIO", "nan", "dgc"),
    ("PERSEUS_DGC_WARMUP_COEFF", "0.5 inf", "dgc"),
    ("PERSEUS_CLIP_GRAD_FUNC_PARAMS", "1e400", "dgc"),
    ("AIAK_MATRIX_APPROXIMATION_RANK", "1e3", "powersgd"),
    ("PERSEUS_DDP", "2", "ddp"),
    ("PERSEUS_USE_DDP_LAUNCHER", "maybe", "ddp_launcher"),
    ("PERSEUS_ELASTIC_TIMEOUT", "nan", "elastic"),
    ("PERSEUS_ELASTIC_TIMEOUT", "1e300", "elastic"),
])
def test_each_reader_refuses_a_bad_value_by_name(monkeypatch, name, value, reader):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name} must be "):
        if reader == "dgc":
            from perseus.common import dgc

            dgc.Settings.from_env()
        elif reader == "powersgd":
            pytest.importorskip("torch")
            from perseus import powersgd

            powersgd.settings()
        elif reader.startswith("ddp"):
            pytest.importorskip("torch")
            from perseus import ddp
            from perseus.torch import startup

            if reader == "ddp":
                ddp.enabled()
            else:  # read where torchrun gave the ranks and no other launcher did
                for var in startup._LAUNCHER_RANKS:
                    monkeypatch.delenv(var, raising=False)
                monkeypatch.setenv("RANK", "0")
                monkeypatch.setenv("WORLD_SIZE", "1")
                startup._launcher_gives_ranks()
        else:
            from perseus.common import elastic

            elastic._timeout()


def test_the_reader_trims_treats_blank_as_unset_and_checks_the_rendezvous_port():
    env = {"A": "  x ", "B": "   ", "PERSEUS_RENDEZVOUS_ADDR": "10.0.0.1",
           "PERSEUS_RENDEZVOUS_PORT": "29500", "PERSEUS_SECRET": " s "}
    assert (knobs.text("A", env), knobs.text("B", env), knobs.text("C", env)) == ("x", None, None)
    assert (knobs.given("B", env), knobs.given("C", env)) == (True, False)
    assert knobs.rendezvous(env) == ("10.0.0.1", 29500, "s")
    assert knobs.rendezvous({"PERSEUS_RENDEZVOUS_ADDR": "h"}) is None
    for port in ("0", "65536", "http", "٣", "9" * 5000, "-1"):
        with pytest.raises(ValueError, match="^PERSEUS_RENDEZVOUS_PORT must be a TCP port "):
            knobs.rendezvous(dict(env, PERSEUS_RENDEZVOUS_PORT=port))
    assert knobs.environment(env) is env
