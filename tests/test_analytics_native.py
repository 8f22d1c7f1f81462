"""The compiled scrape decoder (:mod:`analytics.scrapes`, crate ``analytics/native``) against the
reference (:class:`contracts.GpuScrape`, pydantic): on generated valid records it accepts every
one, and on generated near-valid records (lax spellings, wrong types, big and non-finite numbers,
unknown members, duplicate keys, misaligned columns, GPUs without identity, times out of range,
other spellings of the same JSON) every record is either refused or decoded to the reference's
rows and classifier observations exactly (integers stay integers). Fuzzed bytes never raise."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any, cast

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analytics.classify import READ_FIELDS
from analytics.decode import RejectedRecord, decode_batch, decode_telemetry
from analytics.rows import gpu_samples_table, gpu_scrapes_table
from analytics.scrapes import DECODER, GpuObservation, decode_scrapes
from analytics.timestamps import TS_MAX_S, TS_MIN_S, storable_ts
from contracts import GpuSample, GpuScrape, encode, gpu_scrapes
from tests.test_analytics_ingest_batch import TOPICS, msg
from tests.test_analytics_observations import _VALUES
from tests.test_analytics_scrapes import _outcome

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
_BIG = st.sampled_from([2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**70, 10**400])
_NUMBERS = st.one_of(
    st.sampled_from(sorted(_VALUES)).flatmap(lambda k: _VALUES[k]),
    st.integers(-(2**40), 2**40),
    _BIG,
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, 1.5, 2.5, -2.5, 1e21, 1e300, -0.0, 9.3e18, 9.2233720368547758e18]),
)
_FIELD_NAMES = st.one_of(
    st.sampled_from([*READ_FIELDS, "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP"]), _TEXT
)
_FIELDS = st.dictionaries(_FIELD_NAMES, _NUMBERS, max_size=6)
_INVALID = st.dictionaries(
    _FIELD_NAMES, st.sampled_from(["sentinel", "out_of_range", "", 'é\n"},{']), max_size=2
)
_ATTRS = st.dictionaries(_TEXT, _TEXT, max_size=3)
_SERIES = st.dictionaries(
    _FIELD_NAMES,
    st.lists(st.fixed_dictionaries({"labels": _ATTRS, "value": _NUMBERS}), min_size=1, max_size=2),
    max_size=2,
)
_TS = st.one_of(
    st.floats(1.5e9, 2e9),
    st.sampled_from(
        [TS_MIN_S, TS_MAX_S, math.nextafter(TS_MAX_S, 0), math.nextafter(TS_MIN_S, -math.inf), 0.0, -0.0]
    ),
    st.integers(0, 2 * 10**9),
)


@st.composite
def _samples(draw: st.DrawFn) -> list[GpuSample]:
    """Valid GPU samples of one read of one host (one scrape record once encoded)."""
    n = draw(st.integers(1, 5))
    ts = draw(_TS)
    seq = draw(st.integers(-(2**40), 2**40))
    out = []
    for i in range(n):
        uuid = draw(st.one_of(st.none(), st.just(""), st.just(f"GPU-{i}"), _TEXT))
        index = draw(
            st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([0, 2**31, -(2**31) - 1, 2**63 - 1]))
        )
        out.append(
            GpuSample(
                ts=ts if draw(st.booleans()) else draw(_TS),
                host=draw(st.sampled_from(["h", "edge-é", 'a"b'])),
                gpu_uuid=uuid,
                gpu_index=index if (not uuid or draw(st.booleans())) else None,
                gpu_instance_id=draw(st.one_of(st.none(), st.integers(0, 7), st.just(2**40))),
                gpu_instance_profile=draw(st.one_of(st.none(), st.just("1g.10gb"))),
                model_name=draw(st.one_of(st.none(), st.just("NVIDIA H100 80GB HBM3"), _TEXT)),
                fields=draw(_FIELDS),
                field_series=draw(_SERIES),
                invalid=draw(_INVALID),
                attributes=draw(_ATTRS),
                source=draw(st.sampled_from(["dcgm-exporter", "nvml", "nvidia-smi", "dcgmi"])),
                target=draw(st.sampled_from(["", "http://n:9400/metrics"])),
                seq=seq + i,
            )
        )
    host, source, target = out[0].host, out[0].source, out[0].target
    return [s.model_copy(update={"host": host, "source": source, "target": target}) for s in out]


def _record_bytes(samples: list[GpuSample]) -> bytes:
    (record,) = gpu_scrapes(samples)
    return encode(record)


def _mutated(draw: st.DrawFn, value: bytes) -> bytes:
    """``value`` (one record's JSON) changed the way near-valid producers change it."""
    obj = json.loads(value)
    kind = draw(st.integers(0, 9))
    if kind == 0:  # another spelling of the same JSON: spaces, newlines, key order, escapes
        return json.dumps(obj, indent=draw(st.sampled_from([None, 1])), ensure_ascii=draw(st.booleans()),
                          sort_keys=draw(st.booleans())).encode()  # fmt: skip
    if kind == 1:  # a member changed to another type or value
        key = draw(st.sampled_from(["schema_version", "host", "source", "target", "seq", "extra"]))
        obj[key] = draw(
            st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXT, st.just("7"), st.just([]), st.just({}))
        )
        return json.dumps(obj, allow_nan=True).encode()
    if kind == 2:  # a column element changed to another type or value
        gpus = obj["gpus"]
        col = draw(st.sampled_from(sorted(GpuScrape.model_fields["gpus"].annotation.model_fields)))  # type: ignore[union-attr]
        column = list(gpus.get(col) or [None] * len(gpus["ts"]))
        column[draw(st.integers(0, len(column) - 1))] = draw(
            st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXT, st.just("1"), st.just(float("nan")),
                      st.just(float("inf")), _FIELDS, _INVALID, _SERIES, st.just({"a": None}), st.just([1])))  # fmt: skip
        gpus[col] = column
        return json.dumps(obj, allow_nan=True).encode()
    if kind == 3:  # a column of another length, or a new member of gpus
        gpus = obj["gpus"]
        col = draw(st.sampled_from([*gpus, "extra"]))
        gpus[col] = (gpus.get(col) or [None]) + [None] if draw(st.booleans()) else []
        return json.dumps(obj).encode()
    if kind == 4:  # a duplicate key (the first one's value differs)
        text = value.decode()
        key = draw(
            st.sampled_from(
                ['"host":', '"seq":', '"ts":', '"DCGM_FI_DEV_GPU_UTIL":', '"labels":', '"value":']
            )
        )
        return text.replace(key, key + "0," + key, 1).encode() if key in text else value
    if kind == 5:  # a number spelled another way (float for int, exponent, big)
        text = value.decode()
        return text.replace(draw(st.sampled_from([":0", ",0", ".0", "1", "9"])),
                            draw(st.sampled_from([":0.0", ",0e0", "", "1.0", "9e400", "99999999999999999999"])), 1).encode()  # fmt: skip
    if kind == 6:  # a series element with a member the model lacks
        text = value.decode()
        return text.replace('"labels":', '"x":1,"labels":', 1).encode()
    if kind == 7:  # JSON5 / non-JSON spellings
        text = value.decode()
        return text.replace(draw(st.sampled_from(["]", "}", "0", "\"h\""])),
                            draw(st.sampled_from([",]", ",}", "NaN", "Infinity", "'h'"])), 1).encode()  # fmt: skip
    if kind == 8:  # the top level or gpus as an array of the values
        if draw(st.booleans()):
            return json.dumps(list(obj.values())).encode()
        obj["gpus"] = list(obj["gpus"].values())
        return json.dumps(obj).encode()
    return value


def _observed(sample: Any) -> tuple[Any, ...]:
    """What the classifier reads of a sample, the kind of every number included."""
    fields = {k: (type(v), v) for k, v in sample.fields.items() if k in READ_FIELDS}
    invalid = {k: v for k, v in sample.invalid.items() if k in READ_FIELDS}
    return (type(sample.ts), sample.ts, sample.host, sample.gpu_uuid, sample.gpu_index, sample.gpu_instance_id,
            sample.model_name, fields, invalid)  # fmt: skip


def _check_same(value: bytes) -> bool:
    """Whether the compiled decoder accepted ``value``; if it did, asserts that the reference
    accepts it with the same rows and the same classifier observations."""
    cols, refused = decode_scrapes([msg(value)])
    if refused:
        assert not cols.msgs and len(cols) == 0
        return False
    ref = decode_telemetry(msg(value), TOPICS)  # raises RejectedRecord: the decoder accepted too much
    assert isinstance(ref, GpuScrape)
    samples = ref.samples()
    assert [_observed(o) for o in cols.observations()] == [_observed(s) for s in samples]
    n = len(samples)
    assert _outcome(gpu_scrapes_table, cols, [0], [5]) == _outcome(
        gpu_samples_table, samples, [0] * n, [5] * n
    )
    # the maps' texts are the producer's own, byte for byte
    texts = cols.arrays["fields"].to_pylist()
    assert all(t == "{}" or t.encode() in value for t in texts)
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_samples())
def test_every_valid_record_is_decoded_as_the_reference_decodes_it(samples: list[GpuSample]) -> None:
    value = _record_bytes(samples)
    try:
        decode_telemetry(msg(value), TOPICS)
    except RejectedRecord:  # a valid record with a time the stage cannot store
        assert not all(storable_ts(s.ts) for s in samples)
        assert not _check_same(value)
        return
    past_int64 = any(v is not None and not -(2**63) <= v < 2**63
                     for s in samples for v in (s.gpu_index, s.gpu_instance_id, s.seq))  # fmt: skip
    assert _check_same(value) is not past_int64  # every one, but integers a column cannot hold


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_near_valid_records_are_refused_or_decoded_as_the_reference_decodes_them(data: st.DataObject) -> None:
    value = _mutated(data.draw, _record_bytes(data.draw(_samples())))
    try:
        accepted = _check_same(value)
    except RejectedRecord as exc:  # pragma: no cover - the failure this test looks for
        pytest.fail(f"accepted a record the reference rejects ({exc.reason}): {value!r}")
    if not accepted:  # the reference decides, and the batch says so
        got = decode_batch([msg(value)], TOPICS)
        assert got.fallbacks == 1 and not got.scrapes.msgs


_WS = st.text(st.sampled_from(" \t\n\r"), max_size=2)
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "/": "\\/",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
}


def _spell_string(draw: st.DrawFn, text: str) -> str:
    """``text`` as a JSON string, each character as is, by its short escape or by ``\\u`` (a
    surrogate pair past U+FFFF), hex digits in either case."""
    out = ['"']
    for ch in text:
        how = draw(st.integers(0, 2))
        if how == 0 and ch not in '"\\' and ord(ch) >= 0x20:
            out.append(ch)
        elif how == 1 and ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        else:
            code = ord(ch)
            units = (
                [code]
                if code < 0x10000
                else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)]
            )
            form = "\\u%04x" if draw(st.booleans()) else "\\u%04X"
            out.extend(form % u for u in units)
    return "".join([*out, '"'])


def _spell_float(draw: st.DrawFn, x: float) -> str:
    """Another JSON spelling of the float ``x`` that is still a float (a fraction or an exponent):
    Python's repr, digits with an exponent (``e``/``E``, ``+`` or not, trailing zeros), one digit
    before the point, or 17 significant digits."""
    sign, digit_tuple, exp = Decimal(repr(x)).as_tuple()
    assert isinstance(exp, int)
    digits = "".join(map(str, digit_tuple)).lstrip("0") or "0"
    pad = 0 if digits == "0" else draw(st.integers(0, 2))
    digits, exp = digits + "0" * pad, exp - pad
    minus = "-" if sign else ""
    form = draw(st.integers(0, 3))
    if form == 0:
        return repr(x)
    if form == 1:
        plus = draw(st.sampled_from(["", "+"])) if exp >= 0 else ""
        return f"{minus}{digits}{draw(st.sampled_from('eE'))}{plus}{exp}"
    if form == 2:
        return f"{minus}{digits[0]}.{digits[1:] or '0'}e{exp + len(digits) - 1}"
    return f"{x:.17e}"


def _spell(draw: st.DrawFn, obj: Any) -> str:
    """``obj`` (decoded JSON) spelled another way: whitespace (space, tab, LF, CR) between every
    token, members in another order, strings escaped (:func:`_spell_string`), floats as
    :func:`_spell_float`, zero as ``-0`` -- the same JSON value."""
    if obj is None:
        return "null"
    if isinstance(obj, int):
        return draw(st.sampled_from(["0", "-0"])) if obj == 0 else str(obj)
    if isinstance(obj, float):
        return _spell_float(draw, obj)
    if isinstance(obj, str):
        return _spell_string(draw, obj)
    ws = _WS
    if isinstance(obj, list):
        inner = ",".join(draw(ws) + _spell(draw, v) + draw(ws) for v in obj)
        return "[" + (inner or draw(ws)) + "]"
    items = draw(st.permutations(list(obj.items())))
    inner = ",".join(draw(ws) + _spell_string(draw, k) + draw(ws) + ":" + draw(ws) + _spell(draw, v) + draw(ws)
                     for k, v in items)  # fmt: skip
    return "{" + (inner or draw(ws)) + "}"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_spelling_of_a_record_is_decoded_as_the_compact_one(data: st.DataObject) -> None:
    """The same JSON value spelled any way RFC 8259 allows is accepted exactly when its compact
    encoding is, with the reference's values."""
    compact = _record_bytes(data.draw(_samples()))
    spelled = (data.draw(_WS) + _spell(data.draw, json.loads(compact)) + data.draw(_WS)).encode()
    try:
        assert _check_same(spelled) is bool(DECODER.decode([compact]).accepted), spelled
    except RejectedRecord as exc:  # pragma: no cover - the failure this test looks for
        pytest.fail(f"accepted a record the reference rejects ({exc.reason}): {spelled!r}")


def _gpu0(fields: bytes = b"{}", host: bytes = b'"h"', ts: bytes = b"1.7e9", index: bytes = b"0") -> bytes:
    """A one-GPU record with these texts of its ``host``, ``ts``, ``gpu_index`` and ``fields``."""
    return (
        b'{"host":'
        + host
        + b',"gpus":{"ts":['
        + ts
        + b'],"gpu_index":['
        + index
        + b'],"fields":['
        + fields
        + b"]}}"
    )


_STRINGS_REFUSED = [b'"h\x01"', b'"h\n"', b'"h\x1f"', b'"h\\x"', b'"\\u12"', b'"\\uZZZZ"', b'"\\ud800"', b'"\\udc00"',
                    b'"\\ud800\\u0041"', b'"\\ud800\\n"', b'"\\ud83d"', b'"\\U0041"', b"'h'", b'"h',
                    b'"\xc0\xaf"', b'"\xed\xa0\x80"', b'"h\xc3"', b'"\xf4\x90\x80\x80"', b'"\x80"', b'"\\\xc3\xa9"']  # fmt: skip
_NUMBERS_REFUSED = [b"01", b"-01", b"00", b"1.", b".5", b"-.5", b"-", b"+1", b"1e", b"1e+", b"1.e5", b"--1", b"0x10",
                    b"1e400", b"-1e400", b"Infinity", b"NaN", b"true", b"false", b"null", b'"1"', b"1 2"]  # fmt: skip


@pytest.mark.parametrize(
    "value",
    [
        *[_gpu0(host=s) for s in _STRINGS_REFUSED],
        *[_gpu0(fields=b'{"DCGM_FI_DEV_GPU_UTIL":' + n + b"}") for n in _NUMBERS_REFUSED],
        *[_gpu0(ts=n) for n in _NUMBERS_REFUSED],
        *[
            _gpu0(index=n)
            for n in [*_NUMBERS_REFUSED[:-4], b"1.0", b"1e2", b"9223372036854775808", b"-9223372036854775809"]
        ],
        *[_gpu0(fields=b'{"a":1' + ws + b"}") for ws in [b"\f", b"\v", b"\xc2\xa0", b"\x00"]],
        _gpu0(fields=b'{"a":1,"\\u0061":2}'),  # the same key, escaped
        _gpu0(
            fields=b'{"DCGM_FI_DEV_GPU_UTIL":1,"a":1,"DCGM_FI_DEV_GPU_UTIL":1}'
        ),  # a name the decoder reads
        _gpu0(fields=b'{"DCGM_FI_DEV_FB_USED":1,"DCGM_FI_DEV_FB_USE\\u0044":2}'),
        _gpu0(fields=b'{"DCGM_FI_DEV_GPU_TEMP":1,"DCGM_FI_DEV_GPU_UTIL":1,"DCGM_FI_DEV_GPU_TEMP":1}'),
        b'{"host":"h","h\\u006fst":"h","gpus":{"ts":[1.7e9],"gpu_index":[0]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"field_series":[{"f":[{"labels":{"a":"1","a":"2"},"value":1}]}]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"field_series":[{"f":[{"labels":{},"labels":{},"value":1}]}]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"field_series":[{"f":[{"labels":{}}]}]}}',  # no value
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"attributes":[{"a":"1","a":"1"}]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"invalid":[{"a":1}]}}',
        _gpu0(fields=b'{"a":1,}'),
        _gpu0(fields=b'{"a" 1}'),
        _gpu0(fields=b'{"a":1 "b":2}'),
        _gpu0(ts=b"1.7e9,"),
        _gpu0(index=b"nul"),
        _gpu0(index=b"Null"),
        _gpu0() + b" x",
        _gpu0() + b" \xc3\xa9",  # UTF-8, but outside a string
        b"\xef\xbb\xbf" + _gpu0(),  # a byte order mark
        _gpu0() + _gpu0(),
        b"",
        b" \n",
    ],
)
def test_what_the_scanner_refuses(value: bytes) -> None:
    """Texts that are not JSON, or JSON the decoder does not take (duplicate keys, a number
    where a string belongs), are refused; the reference decides them."""
    assert DECODER.decode([value]).accepted == []


def test_the_spellings_the_scanner_accepts() -> None:
    """Every escape, whitespace everywhere, and number spellings: accepted, with the reference's
    values (integers stay integers, an integer ``-0`` is ``0``)."""
    numbers = [b"-0", b"-0.0", b"0e0", b"1E5", b"1e+5", b"1e-7", b"0.1e1", b"2.5", b"1E-400", b"1e-99999999999",
               b"123456789012345678901234567890", b"-9223372036854775809", b"17976931348623157e292"]  # fmt: skip
    for n in numbers:
        assert _check_same(
            _gpu0(fields=b'{"DCGM_FI_DEV_GPU_UTIL":' + n + b',"DCGM_FI_DEV_FB_USED":' + n + b"}")
        ), n
    for ts in [b"-0", b"17e8", b"1.7E+9", b"1700000000", b"-62135596800"]:
        assert _check_same(_gpu0(ts=ts)), ts
    got = DECODER.decode([_gpu0(ts=b"-0"), _gpu0(ts=b"-0.0")])
    ts = [o.ts for o in cast("list[GpuObservation]", got.observations)]
    assert [math.copysign(1.0, t) for t in ts] == [1.0, -1.0]  # float(int) of -0, and -0.0
    assert _check_same(_gpu0(index=b"-0"))
    for host in [b'"\\ud83d\\ude00\\u00E9\\u0000"', b'"\\"\\\\\\/\\b\\f\\n\\r\\t"', '"é😀\x7f"'.encode()]:
        assert _check_same(_gpu0(host=host)), host
    escaped_name = (
        b'{"DCGM_FI_DEV_GPU_UTI\\u004c":5,"DCGM_FI_DEV_FB_USED":1}'  # the names the classifier reads
    )
    assert _check_same(_gpu0(fields=escaped_name))
    util = READ_FIELDS.index("DCGM_FI_DEV_GPU_UTIL")
    assert DECODER.decode([_gpu0(fields=escaped_name)]).observations[0][util] == 5
    spaced = b'\t\n\r {\t"host"\n:\r"h" , "gpus" : { "ts" : [ 1.7e9 ] ,"gpu_index":[ 0 ],"fields":[ { "a" : 1 , "b" : [] } ] } }\r\n'
    assert not _check_same(spaced)  # a list is not a number
    spaced = spaced.replace(b"[] ", b"2.5 ")
    assert _check_same(spaced)
    assert bytes(DECODER.decode([spaced]).arrays["fields"][0][1]) == b'{ "a" : 1 , "b" : 2.5 }'


@pytest.mark.parametrize(
    "value",
    [
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"fields":[{"a":1,"a":2}]}}',  # duplicate key
        b'{"host":"h","host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0]},"x":1}',  # unknown member
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0.0]}}',  # float for int
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"fields":[{"a":"1"}]}}',  # string for number
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"fields":[{"a":1e400}]}}',  # not finite
        b'{"host":"h","gpus":{"ts":[NaN],"gpu_index":[0]}}',
        b'{"host":"h","gpus":{"ts":[253402300800.0],"gpu_index":[0]}}',  # TS_MAX_S: not storable
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_uuid":[""]}}',  # no identity
        b'{"host":"h","gpus":{"ts":[1.7e9,1.7e9],"gpu_index":[0]}}',  # misaligned
        b'{"host":"h","gpus":{"ts":[],"gpu_index":[]}}',  # no GPU
        b'{"host":"h","schema_version":2,"gpus":{"ts":[1.7e9],"gpu_index":[0]}}',
        b'{"host":"h","source":"prometheus","gpus":{"ts":[1.7e9],"gpu_index":[0]}}',
        b'["h",{"ts":[1.7e9],"gpu_index":[0]}]',  # an array for the record
        b'{"host":"h","gpus":[[1.7e9],[],[0]]}',  # an array for gpus
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0]},}',  # trailing comma
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"field_series":[{"f":[{"labels":{},"value":1,"x":0}]}]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[9223372036854775808]}}',  # past int64
        b'{"host":"h\xff","gpus":{"ts":[1.7e9],"gpu_index":[0]}}',  # not UTF-8
    ],
)
def test_what_the_decoder_refuses(value: bytes) -> None:
    assert DECODER.decode([value]).accepted == []


def test_the_boundaries_it_accepts() -> None:
    """Just inside each boundary of the refusals above: accepted, with the reference's values."""
    for value in [
        b'{"host":"h","gpus":{"ts":[253402300799.99997],"gpu_index":[0]}}',  # just below TS_MAX_S
        b'{"host":"h","gpus":{"ts":[-62135596800],"gpu_index":[0]}}',  # TS_MIN_S, an integer
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_uuid":["G"],"gpu_index":[null]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[9223372036854775807],"gpu_instance_id":[-1]}}',
        b'{"host":"h","gpus":{"ts":[1.7e9],"gpu_index":[0],"fields":[{"DCGM_FI_DEV_FB_USED":2.5,"DCGM_FI_DEV_GPU_UTIL":5,'
        b'"DCGM_FI_DEV_FB_FREE":99999999999999999999,"DCGM_FI_DEV_POWER_USAGE":18446744073709551617}]}}',
        b' {"host" : "h\\u00e9", "gpus" : {"ts" : [ 1.7e9 ], "gpu_index" : [0], "fields" : [ {"a" : 1} ] } } ',
    ]:
        assert _check_same(value), value


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_without_error(value: bytes) -> None:
    got = DECODER.decode([value, b"", b"{", value + value])
    assert set(got.accepted) <= {0, 3}
    for k in got.accepted:  # only a real record gets through
        _check_same([value, b"", b"{", value + value][k])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_bytes_never_raise_and_never_pass_a_bad_record(data: st.DataObject) -> None:
    value = bytearray(_record_bytes(data.draw(_samples())))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(value) - 1))
        op = data.draw(st.integers(0, 2))
        if op == 0:
            value[at] = data.draw(st.integers(0, 255))
        elif op == 1:
            del value[at:]
            if not value:
                break
        else:
            value[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    try:
        _check_same(bytes(value))
    except RejectedRecord as exc:  # pragma: no cover - the failure this test looks for
        pytest.fail(f"accepted a record the reference rejects ({exc.reason}): {bytes(value)!r}")


def _big_batch(records: int, refused_every: int) -> list[bytes]:
    """``records`` scrape records of 1-8 GPUs each, with values, hosts, UUIDs and escapes that vary
    from record to record, and a record the decoder refuses every ``refused_every``."""
    out = []
    for k in range(records):
        if k % refused_every == refused_every - 1:
            out.append(b'{"host":"h","gpus":{"ts":[]}}' if k % 2 else b"{")
            continue
        n = 1 + k % 8
        samples = [
            GpuSample(
                ts=1.7e9 + k // 3, host=f"node-{k % 37}\u00e9", gpu_uuid=None if (k + i) % 5 == 0 else f"GPU-{k % 37}-{i}",
                gpu_index=i, gpu_instance_id=i if k % 4 == 0 else None, model_name="H100" if i % 3 else None,
                fields={"DCGM_FI_DEV_GPU_UTIL": (k * i) % 101, "DCGM_FI_PROF_SM_ACTIVE": (k % 7) / 7,
                        "DCGM_FI_DEV_FB_USED": k * 10**15, "DCGM_FI_DEV_POWER_USAGE": 123.5},
                invalid={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": "sentinel"} if k % 6 == 0 else {},
                attributes={"pod": f"p{k}"}, source="dcgm-exporter", target="http://n:9400/metrics", seq=k * 8 + i,
            )  # fmt: skip
            for i in range(n)
        ]
        out.append(_record_bytes(samples))
    return out


def _as_read(got: Any) -> tuple[Any, ...]:
    """Everything a decode call returned, the kind of every observed value included, its columns
    as Python values (the chunks joined)."""
    from analytics.scrapes import _ARRAY_TYPES, _array

    rows = got.chunk_rows
    columns = {name: _array(_ARRAY_TYPES[name], rows, bufs).to_pylist() for name, bufs in got.arrays.items()}
    for arrow_type, group in ((pa.float64(), got.float_fields), (pa.int64(), got.whole_fields)):
        for name, bufs in group.items():
            columns[name] = _array(arrow_type, rows, bufs).to_pylist()
    observed = [tuple((type(v), v) for v in o) for o in got.observations]
    return got.accepted, got.counts, observed, columns, sum(rows)


def test_a_batch_read_by_several_threads_is_decoded_as_by_one() -> None:
    """Runs of records read in parallel give, chunk by chunk, what one thread reads: the same
    records accepted (refused ones at and around the cuts), observations, columns and rows."""
    from analytics_native import SHARD_BYTES

    values = _big_batch(9000, refused_every=97)
    assert sum(map(len, values)) > 3 * SHARD_BYTES
    one = DECODER.decode(values, 1)
    assert one.chunk_rows == [len(one.observations)]
    for threads in (2, 3):
        got = DECODER.decode(values, threads)
        assert len(got.chunk_rows) == threads and min(got.chunk_rows) > 0
        assert _as_read(got) == _as_read(one)
    msgs = [msg(v, offset=k) for k, v in enumerate(values)]
    tables = [gpu_scrapes_table(cols, [0] * len(cols.msgs), [m.offset for m in cols.msgs])
              for cols in (decode_scrapes(msgs, threads)[0] for threads in (1, 3))]  # fmt: skip
    assert tables[0].num_rows == len(one.observations) and tables[0].equals(tables[1].combine_chunks())


def test_a_run_is_cut_for_every_shard_bytes_of_input_up_to_the_threads_given() -> None:
    from analytics_native import SHARD_BYTES

    record = _big_batch(1, refused_every=10)[0]
    for runs in (1, 2):
        total = runs * SHARD_BYTES
        values = [record] * (total // len(record))
        values[-1] += b" " * (total - sum(map(len, values)))  # trailing whitespace: the same record
        assert sum(map(len, values)) == total
        assert len(DECODER.decode(values, 4).chunk_rows) == runs
        values[-1] = values[-1][:-1]
        assert len(DECODER.decode(values, 4).chunk_rows) == max(1, runs - 1)
        assert len(DECODER.decode(values, 1).chunk_rows) == 1
        assert len(DECODER.decode(values, 0).chunk_rows) == 1


def test_a_value_that_is_not_bytes_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        DECODER.decode(["{}"])  # type: ignore[list-item]


def test_a_stage_without_the_compiled_decoder_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import sys

    from typer.testing import CliRunner

    from gpupool.cli import app

    real_import = builtins.__import__

    def without_decoder(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "analytics_native":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    for module in [m for m in sys.modules if m == "analytics" or m.startswith("analytics.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(builtins, "__import__", without_decoder)
    got = CliRunner().invoke(app, ["analytics", "--help"])
    assert got.exit_code == 2
    assert "pip install 'gpupool[server]'" in got.output and "pip install ./analytics/native" in got.output


def test_the_observation_class_must_be_a_named_tuple_of_the_right_size() -> None:
    """The decoder fills each observation in place: a class that is not a named tuple with two
    slots per observed name and six more is refused at construction."""
    from collections import namedtuple

    from analytics_native import ScrapeDecoder

    def decoder(observation: Any, observed: list[str]) -> ScrapeDecoder:
        return ScrapeDecoder(
            schema_version=1, sources=["s"], default_source="s", default_target="", default_seq=0,
            ts_min=0.0, ts_max=1e10, float_fields=[], whole_fields=[], observed=observed,
            observation=observation,
        )  # fmt: skip

    decoder(namedtuple("Eight", list("abcdefgh")), ["x"])
    for bad in (namedtuple("Seven", list("abcdefg")), namedtuple("Nine", list("abcdefghi")), tuple, GpuSample):
        with pytest.raises(ValueError, match="named tuple"):
            decoder(bad, ["x"])
