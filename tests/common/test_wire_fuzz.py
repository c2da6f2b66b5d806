"""Fuzzing the client API's schema (``common.wire``): untrusted bytes never crash the parser.

Property: for *any* input, ``wire.parse_request`` either returns a Request whose fields all
satisfy the schema (checked here independently of wire's own validators: exact Python
types, ranges, full-string patterns) or raises ``wire.WireError`` with a code from
``wire.ERROR_CODES``; never another exception, and never slowly (a hypothesis deadline).
Inputs: valid requests of every operation in ``wire.REQUESTS`` with one or more fields
mutated (wrong types, floats and booleans for integers, out-of-range and huge numbers,
nested garbage, extra and missing fields, bytes field names, odd unicode, bytes for
strings, tensors of the wrong dtype/shape/byte length, seeds of the wrong length), valid
requests with bytes flipped or cut, and raw random bytes. Tensor fields of an accepted
request also go through ``wire.decode_share``, which must refuse with WireError too.
Round trip: every request built by ``wire.make_request`` from valid fields parses back to
the same fields. Plus the fixed cases of issue 14: version 1.0/True, a float or bool in any
integer field, a job id with a final newline, and the nonce window.

Budget: ``10 x`` the profile's max_examples per fuzz test (300 in the default profile,
tests/conftest.py), a few seconds in all.
"""

from __future__ import annotations

import re
from datetime import timedelta

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common import wire

MAX_BYTES = 1 << 20
DIM = 3                                  # the model dimension decode_share is asked for
FUZZ = settings(max_examples=10 * settings.default.max_examples,
                deadline=timedelta(milliseconds=500))

# ------------------------------------------------------------------ what "valid" means here
# Independent of wire's validators on purpose: a field's accepted range and exact type.
INT_RANGES = {"round": (1, 2**31 - 1), "num_samples": (1, 2**31 - 1),
              "nonce": (1, wire.MAX_NONCE), "client": (0, 10**18)}
OP_INT_RANGES = {("get_model", "round"): (0, 2**31 - 1)}     # model 0 is the initial one
STRING_RES = {"job": r"[A-Za-z0-9_.-]{1,64}", "task": r"[A-Za-z0-9_.-]{1,64}/[0-9]{1,9}/[0-9]{1,9}"}
TENSORS = ("update", "norm", "delta", "threshold")


def int_range(op: str, name: str) -> tuple[int, int]:
    return OP_INT_RANGES.get((op, name), INT_RANGES[name])


def _tensor_valid():
    vec = st.integers(0, 4).map(lambda n: {"dtype": "<i8", "shape": [n], "data": bytes(8 * n)})
    seed = st.binary(min_size=16, max_size=16).map(lambda s: {"seed": s})
    return vec | seed


VALID = {
    "round": st.integers(*INT_RANGES["round"]),
    "num_samples": st.integers(*INT_RANGES["num_samples"]),
    "nonce": st.integers(*INT_RANGES["nonce"]),
    "client": st.integers(*INT_RANGES["client"]),
    "with_model": st.booleans(),
    "job": st.from_regex(STRING_RES["job"], fullmatch=True),
    "task": st.from_regex(STRING_RES["task"], fullmatch=True),
    "targets": st.lists(st.integers(0, wire.MAX_NONCE), min_size=1, max_size=8, unique=True),
    **{t: _tensor_valid() for t in TENSORS},
}


def _fields(op: str) -> tuple[list[str], list[str]]:
    schema = wire.REQUESTS[op]
    return sorted(schema.required), sorted(schema.optional)


def valid_fields(op: str):
    req, opt = _fields(op)
    return st.fixed_dictionaries({k: VALID[k] for k in req}, optional={k: VALID[k] for k in opt})


def test_every_schema_field_has_a_generator():
    """A field added to wire.REQUESTS must be fuzzed too: this fails until VALID knows it."""
    names = {k for op in wire.REQUESTS for k in sum(_fields(op), [])}
    assert names <= set(VALID), sorted(names - set(VALID))


def assert_satisfies_schema(req: wire.Request) -> None:
    assert req.op in wire.REQUESTS and type(req.id) is bytes and len(req.id) == 16
    required, optional = _fields(req.op)
    assert set(required) <= set(req.fields) <= set(required) | set(optional)
    for k, v in req.fields.items():
        if k in INT_RANGES:
            lo, hi = int_range(req.op, k)
            assert type(v) is int and lo <= v <= hi, (k, v)
        elif k in STRING_RES:
            assert type(v) is str and re.fullmatch(STRING_RES[k], v), (k, v)
        elif k == "with_model":
            assert type(v) is bool
        elif k == "targets":
            assert type(v) is list and 1 <= len(v) <= wire.MAX_TARGETS
            assert all(type(t) is int and 0 <= t <= wire.MAX_NONCE for t in v)
            assert v == sorted(set(v))
        else:
            assert k in TENSORS and type(v) is dict, (k, v)
            _decode_or_refuse(k, v)


def _decode_or_refuse(name: str, obj: dict) -> None:
    shape = (DIM,) if name == "update" else ()
    for party in (0, 1):
        try:
            out = wire.decode_share(obj, name, shape, party)
        except wire.WireError as exc:
            assert exc.code in wire.ERROR_CODES
            continue
        assert (isinstance(out, bytes) and len(out) == 16 and party == 0) or (
            isinstance(out, np.ndarray) and out.shape == shape and out.dtype == np.int64)


def parse_outcome(buf: bytes, sent_id: object = None) -> wire.Request | None:
    """The property itself: a schema-satisfying Request, or a WireError with a known code."""
    try:
        req = wire.parse_request(buf, MAX_BYTES)
    except wire.WireError as exc:
        assert exc.code in wire.ERROR_CODES and isinstance(exc.message, str) and exc.message
        if isinstance(sent_id, bytes) and len(sent_id) == 16:
            assert exc.msg_id == sent_id    # the refusal names the request it answers
        return None
    assert_satisfies_schema(req)
    # the envelope, decoded here without wire: exactly the integer 1, string keys, same op/id
    msg = msgpack.unpackb(buf, raw=False, strict_map_key=False)
    assert type(msg["v"]) is int and msg["v"] == 1, msg["v"]
    assert all(type(k) is str for k in msg) and msg["op"] == req.op and msg["id"] == req.id
    return req


# ------------------------------------------------------------------ garbage and mutations
SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.binary(max_size=20))
GARBAGE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6) | st.binary(max_size=6), inner, max_size=4), max_leaves=12)
ODD_TEXT = st.text(st.characters(codec="utf-8"), max_size=70)   # any code point msgpack can carry


def _draw_wrong(draw, op: str, name: str, valid: object) -> object:
    """A value that must be refused for field ``name`` (whose valid value is ``valid``).

    Three times in four a near miss (one step from valid: most parser bugs live there, and
    random garbage would rarely hit them), else generic garbage."""
    near: list = [None, [], {}]
    generic = [GARBAGE, ODD_TEXT]
    if name in INT_RANGES:
        lo, hi = int_range(op, name)
        near += [lo - 1, hi + 1, -(2**63), 2**64 - 1, True, False, float(valid), str(valid)]
        generic += [st.integers(hi + 1, 2**64 - 1), st.integers(-(2**63), lo - 1)]
    if name in STRING_RES:
        near += [valid + "\n", "\n" + valid, valid.encode(), valid + "\u0000", valid + "\u00e9",
                 valid + "\u2028", "x" * 65, ""]
    if name == "with_model":
        near += [0, 1, 1.0, "true", b"\x01"]
    if name == "targets":
        near += [[True], [1.0], [1, 1], [-1], [2**64 - 1], list(range(wire.MAX_TARGETS + 1)), 5]
    if name in TENSORS:
        near += TENSOR_WRONG
    if draw(st.integers(0, 3)):
        return draw(st.sampled_from(near))
    return draw(st.one_of(generic))


_GOOD_TENSOR = {"dtype": "<i8", "shape": [2], "data": bytes(16)}
TENSOR_WRONG = [
    *({**_GOOD_TENSOR, "dtype": d} for d in ("<f8", "<f4", ">i8", "int64", "", "<i8\n", b"<i8")),
    *({**_GOOD_TENSOR, "shape": s} for s in ([3], [], [2, 1], [-2], [2.0], [True, True],
                                             [2**64 - 1], [1, 1, 1, 1, 2], "2", None)),
    *({**_GOOD_TENSOR, "data": d} for d in (bytes(15), bytes(17), b"", "x" * 16, None)),
    *({"seed": s} for s in (bytes(15), bytes(17), b"", "s" * 16, None)),
    {**_GOOD_TENSOR, "extra": 1}, {"seed": bytes(16), "dtype": "<i8"}, {"dtype": "<i8"},
    {b"seed": bytes(16)}, {"data": bytes(8)},
    {"dtype": "<f8", "shape": [3], "data": np.full(3, np.nan).tobytes()}]


@st.composite
def mutated_request(draw):
    """A valid request of some op with the envelope or fields damaged, mostly once."""
    op = draw(st.sampled_from(sorted(wire.REQUESTS)))
    msg = {"v": wire.VERSION, "op": op, "id": draw(st.binary(min_size=16, max_size=16)),
           **draw(valid_fields(op))}
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["replace"] * 4 + ["delete", "extra", "bytes_key",
                                                       "envelope", "envelope"]))
        keys = sorted(k for k in msg if isinstance(k, str))
        body = sorted(set(keys) - {"v", "op", "id"})
        if kind == "replace" and body:
            k = draw(st.sampled_from(body))
            msg[k] = _draw_wrong(draw, op, k, draw(VALID[k])) if k in VALID else draw(GARBAGE)
        elif kind == "delete" and keys:
            del msg[draw(st.sampled_from(keys))]
        elif kind == "extra":
            msg[draw(st.text(max_size=12) | st.sampled_from(sorted(VALID)))] = draw(GARBAGE)
        elif kind == "bytes_key":
            msg[draw(st.sampled_from(keys or ["v"])).encode()] = draw(GARBAGE)
        else:
            k = draw(st.sampled_from(["v", "op", "id"]))
            near = [1.0, True, 2, 0, -1, "1", b"\x01", None, 2**64 - 1, op.upper(), op + "\n",
                    op.encode(), bytes(15), bytes(17), "x" * 16]
            msg[k] = draw(st.sampled_from(near)) if draw(st.integers(0, 3)) else draw(GARBAGE)
    return msg


# ------------------------------------------------------------------ the properties
@FUZZ
@given(mutated_request())
@example({"v": 1.0, "op": "state", "id": bytes(16)})                    # issue 14, item 2
@example({"v": True, "op": "state", "id": bytes(16)})
@example({"v": 1, "op": "job_status", "id": bytes(16), "job": "job-1\n"})
@example({"v": 1, "op": "state", "id": bytes(16), "x": 1, b"y": 2})
def test_mutated_requests_are_refused_cleanly_or_satisfy_the_schema(msg):
    parse_outcome(msgpack.packb(msg, use_bin_type=True), msg.get("id"))


@FUZZ
@given(st.binary(max_size=600) | st.tuples(
    st.sampled_from([b"\x80", b"\x81", b"\x8f", b"\xde\xff\xff", b"\xdf\xff\xff\xff\xff",
                     b"\xc4\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\x7f\xff\xff\xff",
                     b"\xd4\x01", b"\xc7\x05\x01", b"\x91" * 5000]),
    st.binary(max_size=200)).map(b"".join))
def test_raw_bytes_are_refused_cleanly(buf):
    parse_outcome(buf)


@FUZZ
@given(st.data())
def test_damaged_valid_requests_are_refused_cleanly_or_satisfy_the_schema(data):
    op = data.draw(st.sampled_from(sorted(wire.REQUESTS)))
    _, buf = wire.make_request(op, **data.draw(valid_fields(op)))
    raw = bytearray(buf)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(raw)))
    parse_outcome(bytes(raw[:cut] if data.draw(st.booleans()) else raw))


@FUZZ
@given(st.data())
def test_valid_requests_round_trip(data):
    op = data.draw(st.sampled_from(sorted(wire.REQUESTS)))
    fields = data.draw(valid_fields(op))
    msg_id, buf = wire.make_request(op, **fields)
    req = parse_outcome(buf)
    assert req is not None and req.op == op and req.id == msg_id
    expected = {**fields, **({"targets": sorted(fields["targets"])} if "targets" in fields else {})}
    assert req.fields == expected


# ------------------------------------------------------------------ fixed cases (issue 14)
#: One valid value per field, for the fixed cases.
SAMPLE = {"round": 5, "num_samples": 10, "nonce": 7, "client": 3, "with_model": True,
          "job": "job-1", "task": "job-1/1/0", "targets": [3],
          **{t: {"seed": bytes(16)} for t in TENSORS}}


def _valid_example(op: str) -> dict:
    return {"v": 1, "op": op, "id": bytes(range(16)),
            **{k: SAMPLE[k] for k in sum(_fields(op), [])}}


def _code(msg: dict) -> str | None:
    try:
        wire.parse_request(msgpack.packb(msg, use_bin_type=True), MAX_BYTES)
    except wire.WireError as exc:
        return exc.code
    return None


@pytest.mark.parametrize("v", [1.0, True, 1.5, "1", b"\x01", None, 2, 0])
def test_the_version_must_be_the_integer_one(v):
    assert _code({**_valid_example("state"), "v": v}) == "version"
    assert _code(_valid_example("state")) is None


@pytest.mark.parametrize("op,name", sorted((op, k) for op in wire.REQUESTS for k in sum(_fields(op), [])
                                           if k in INT_RANGES or k in ("with_model", "targets")))
def test_no_integer_or_boolean_field_takes_a_float_or_the_other_type(op, name):
    good = _valid_example(op)
    assert _code(good) is None
    sample = good[name][0] if name == "targets" else good[name]
    wrong = [1, 0, 1.0] if name == "with_model" else [float(sample), True, False, str(sample)]
    for w in wrong:
        value = [w] if name == "targets" else w
        assert _code({**good, name: value}) == "bad_request", (name, w)


@pytest.mark.parametrize("op,name", sorted((op, k) for op in wire.REQUESTS for k in sum(_fields(op), [])
                                           if k in STRING_RES))
def test_string_fields_match_in_full(op, name):
    good = _valid_example(op)
    for w in (good[name] + "\n", good[name].encode(), " " + good[name]):
        assert _code({**good, name: w}) == "bad_request", w


def test_field_names_must_be_strings():
    assert _code({**_valid_example("job_status"), b"with_model": True}) == "bad_request"
    assert wire.client_id_of("client-1\n") is None and wire.client_id_of("client-1") == 1


def test_a_malformed_error_reply_is_still_a_refusal():
    msg_id = bytes(16)
    for err in ("boom", None, [1], {"code": ["x"]}, {"code": "no-such-code", "message": 5}):
        buf = wire.pack({"v": 1, "id": msg_id, "ok": False, "error": err})
        with pytest.raises(wire.WireError) as info:
            wire.check_reply(buf, msg_id, MAX_BYTES)
        assert info.value.code == "internal"
    with pytest.raises(wire.WireError, match="does not answer"):
        wire.check_reply(wire.pack({"v": 1.0, "id": msg_id, "ok": True}), msg_id, MAX_BYTES)


# ------------------------------------------------------------------ the nonce window
NOW = 1_700_000_000 * 10**9          # a fixed "server clock" in ns


def test_nonces_far_ahead_of_the_clock_are_refused():
    wire.check_nonce_window(NOW, NOW)
    wire.check_nonce_window(NOW + wire.NONCE_WINDOW_NS, NOW)
    for nonce in (NOW + wire.NONCE_WINDOW_NS + 1, wire.MAX_NONCE):
        with pytest.raises(wire.WireError, match="ahead of this server's clock") as info:
            wire.check_nonce_window(nonce, NOW)
        assert info.value.code == "bad_request"
    wire.check_nonce_window(NOW + 10**9, NOW, window_ns=10**9)
    with pytest.raises(wire.WireError):
        wire.check_nonce_window(wire.MAX_NONCE)          # against this host's real clock


def test_a_lockout_by_a_future_nonce_ends_within_the_window():
    """The daemon's rule (window, then strictly larger than the last accepted nonce) played
    out: the 2**63 - 1 nonce of issue 14 is never stored, and the worst nonce that can be
    stored, now + window, blocks time-based nonces only until the clock passes it."""
    last = 0

    def accept(nonce: int, now: int) -> str:
        nonlocal last
        try:
            wire.check_nonce_window(nonce, now)
        except wire.WireError as exc:
            return exc.code
        if nonce <= last:
            return "replay"
        last = nonce
        return "ok"

    assert accept(wire.MAX_NONCE, NOW) == "bad_request" and last == 0
    assert accept(NOW, NOW) == "ok"                               # max(last + 1, time_ns())
    assert accept(NOW + wire.NONCE_WINDOW_NS, NOW) == "ok"        # the worst that is stored
    later = NOW + wire.NONCE_WINDOW_NS // 2
    assert accept(later, later) == "replay"                       # locked out meanwhile
    end = NOW + wire.NONCE_WINDOW_NS + 1
    assert accept(end, end) == "ok"                               # and no longer
