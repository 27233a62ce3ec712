"""Bounded fuzzing of what the rendezvous store reads from the network (issue 17 item 5): the
collective decoder and the store's request decoder take any bytes and either return a value
or raise their own error (``WireError``, ``BadRequest``), never another exception; a value
that round-trips through the codec comes back equal. Cases found once are ``@example``s."""

from __future__ import annotations

import contextlib

import pytest

hypothesis = pytest.importorskip("hypothesis")
msgpack = pytest.importorskip("msgpack")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dwdp.worker.transport.codec import EXT_RECORD, EXT_TUPLE, WireError, decode, encode  # noqa: E402
from dwdp.worker.transport.store import BadRequest, Table, apply_request  # noqa: E402

FUZZ = settings(max_examples=400, deadline=None, database=None)

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=16) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
# msgpack documents made of anything, ext types included, to reach the decoders' branches
frames = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.sampled_from([EXT_TUPLE, EXT_RECORD, 0, 7, 127]),
                st.binary(max_size=16)),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(-(2**63), 2**63 - 1), inner, max_size=3),
    max_leaves=12,
).map(lambda v: msgpack.packb(v, use_bin_type=True))


@FUZZ
@given(value=plain)
def test_plain_values_round_trip(value):
    assert decode(encode(value)) == value


@FUZZ
@given(blob=st.binary(max_size=64) | frames)
@example(blob=msgpack.packb(msgpack.ExtType(EXT_RECORD, b"\x92\xa3Nope\x90")))
@example(blob=msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\xc1")))
@example(blob=b"\x91" * 5000 + b"\xc0")  # nesting deeper than the recursion limit
@example(blob=b"\x80\x95(cos\nsystem\n")  # pickle-like bytes
def test_the_collective_decoder_refuses_what_it_cannot_read(blob):
    with contextlib.suppress(WireError):
        decode(blob)


@FUZZ
@given(frame=st.binary(max_size=64) | frames)
@example(frame=msgpack.packb(["set", "k"]))
@example(frame=msgpack.packb(["set", "k" * 2000, b"v"]))
@example(frame=msgpack.packb(["compare_set", "k", "not bytes", b""]))
@example(frame=msgpack.packb(["multi_get", {"a": 1}]))
def test_the_store_refuses_bad_requests_with_bad_request(frame):
    table = Table()
    with contextlib.suppress(BadRequest):
        apply_request(table, frame)
