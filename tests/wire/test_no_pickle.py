"""No wire path pickles: not in its source, and not at run time."""

from __future__ import annotations

import io
import pickle
import tokenize
from pathlib import Path

import pytest

from mmserve.wire import decode, encode
from tests.wire.samples import all_messages, assert_same

SRC = Path(__file__).resolve().parents[2] / "src" / "mmserve"
# Names that serialize Python objects by class (pyzmq's *_pyobj pickle too).
FORBIDDEN_NAMES = frozenset(
    {
        "pickle",
        "cPickle",
        "_pickle",
        "cloudpickle",
        "dill",
        "jsonpickle",
        "marshal",
        "shelve",
        "copyreg",
        "Pickler",
        "Unpickler",
        "send_pyobj",
        "recv_pyobj",
        "allow_pickle",
    }
)
# multiprocessing's Connection.send/recv pickle their argument (send_bytes/recv_bytes do not).
CONNECTION_OBJECT_METHODS = frozenset({"send", "recv"})


def wire_paths() -> list[Path]:
    """The wire package, and every module that talks to another process."""
    paths = set((SRC / "wire").rglob("*.py"))
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if any(m in text for m in ("import zmq", "mmserve.wire", "multiprocessing")):
            paths.add(path)
    return sorted(paths)


def pickle_uses(source: str) -> list[str]:
    """Code (not comments or strings) that would serialize objects by pickling them."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)]
    is_multiprocessing = any(
        t.type == tokenize.NAME and t.string == "multiprocessing" for t in tokens
    )
    found = []
    for prev, tok in zip([None, *tokens], tokens, strict=False):
        if tok.type != tokenize.NAME:
            continue
        is_connection_call = (
            is_multiprocessing
            and tok.string in CONNECTION_OBJECT_METHODS
            and prev is not None
            and prev.string == "."
        )
        if tok.string in FORBIDDEN_NAMES or is_connection_call:
            found.append(f"line {tok.start[0]}: {tok.line.strip()}")
    return found


def test_the_scanner_finds_what_it_looks_for():
    bad = (
        "import pickle\n"
        "from multiprocessing.connection import Connection\n"
        "def f(conn, sock, x):\n"
        "    conn.send(x)\n"
        "    sock.send_pyobj(x)\n"
        "    return np.load(x, allow_pickle=True)\n"
    )
    assert len(pickle_uses(bad)) == 4
    good = '"""Never pickle: raw frames only."""\n# no pickle here\nconn.send_bytes(b"x")\n'
    assert pickle_uses(good) == []


def test_wire_paths_include_the_wire_package_and_the_decode_workers():
    names = {p.relative_to(SRC).as_posix() for p in wire_paths()}
    assert {"wire/codec.py", "wire/engine_core.py", "processing/decode_workers.py"} <= names


@pytest.mark.parametrize("path", wire_paths(), ids=lambda p: p.relative_to(SRC).as_posix())
def test_no_wire_path_pickles(path):
    assert pickle_uses(path.read_text()) == []


def test_round_trips_never_call_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was called on a wire path")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    for _, msg in all_messages():
        assert_same(decode(encode(msg)), msg)
