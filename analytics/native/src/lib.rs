//! Compiled decoder of `contracts.GpuScrape` records (one Kafka record per read of a host's GPUs,
//! JSON; the format is defined by the pydantic models `contracts.telemetry.GpuScrape`,
//! `GpuColumns` and `SeriesValue`) straight to the columns of a batch, as Arrow buffers.
//!
//! The decoder accepts a SUBSET of what the reference (`contracts.GpuScrape`) accepts, with
//! exactly the same values, and refuses everything else: the caller then has the reference decide
//! the record (`analytics.decode.decode_telemetry`). Refused, among others: anything that is not
//! JSON (serde_json: no `NaN`/`Infinity` literals, no trailing commas, no comments), a JSON value
//! that is not an object where the model has a model or a map, an unknown member, a duplicate key
//! in any object, a number where a string is expected and the reverse, a float where an integer
//! is expected, an integer member or column element (`schema_version`, `seq`, `gpu_index`,
//! `gpu_instance_id`) outside the signed 64-bit range (a map value of any size is taken, as
//! Python's `int`), a non-finite number (`1e400`), a
//! `schema_version` other than the one given at construction, a `source` the model does not list,
//! columns of a length other than `len(ts)` or zero, no GPU at all, a GPU with neither a
//! non-empty `gpu_uuid` nor a `gpu_index`, and a `ts` outside `[ts_min, ts_max)` (the stage's
//! storable times, `analytics.timestamps`), and a record that would take a string column's text
//! past 2**31 bytes (int32 offsets). Nothing panics on input: every error is a refusal. A
//! `float` is the correctly rounded value of the number's text (integers too, as Python's
//! `float(int)`); a `float | int` map value keeps its kind: a number without fraction or exponent
//! is an `int`, any other a `float`, as the reference's smart union decides.
//!
//! Shapes of one call ([`ScrapeDecoder::decode`]): per accepted record its `host`, `source`,
//! `target`, `seq` and GPU count; per GPU (records in order, GPUs in column order) Python lists
//! of what the idle classifier reads (`ts`, `gpu_uuid`, `gpu_index`, `gpu_instance_id`,
//! `model_name`, and the `fields` / `invalid` entries of the field names given at construction),
//! and Arrow buffers (little-endian values, LSB-first validity bitmaps, int32 string offsets) of
//! `ts` (float64, Unix seconds), `gpu_uuid` / `gpu_instance_profile` / `model_name` (utf8),
//! `gpu_index` / `gpu_instance_id` (int64), `fields` / `invalid` / `attributes` (utf8: each map's
//! JSON text exactly as the producer wrote it, validated) and one float64 or int64 column per
//! promoted field name given at construction.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple};
use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// Members of a `GpuScrape` record this decoder knows (checked against the model by the caller).
const RECORD_MEMBERS: [&str; 6] = ["schema_version", "host", "source", "target", "seq", "gpus"];
/// Members of `GpuColumns` (the record's `gpus`), in the model's order.
const COLUMN_MEMBERS: [&str; 10] = [
    "ts",
    "gpu_uuid",
    "gpu_index",
    "gpu_instance_id",
    "gpu_instance_profile",
    "model_name",
    "fields",
    "field_series",
    "invalid",
    "attributes",
];
/// Members of `SeriesValue` (an element of a `field_series` list).
const SERIES_MEMBERS: [&str; 2] = ["labels", "value"];

/// A JSON string; borrowed from the record when it holds no escape.
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(PhantomData))
    }
}

/// A `float | int` value as the reference keeps it: a JSON number without fraction or exponent
/// is an integer (`Big`: its text, past the signed 64-bit range), any other a float (finite,
/// correctly rounded).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Num<'a> {
    Int(i64),
    Big(&'a str),
    Float(f64),
}

/// The value of a JSON number's text (validated by serde_json), or `None` when this decoder
/// refuses it.
fn num_of(text: &str) -> Option<Num<'_>> {
    let bytes = text.as_bytes();
    let first = *bytes.first()?;
    if !(first == b'-' || first.is_ascii_digit()) {
        return None;
    }
    if bytes.iter().any(|c| matches!(c, b'.' | b'e' | b'E')) {
        let v: f64 = text.parse().ok()?;
        if v.is_finite() {
            Some(Num::Float(v))
        } else {
            None
        }
    } else {
        Some(text.parse::<i64>().map_or(Num::Big(text), Num::Int))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Num<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&'a RawValue>::deserialize(d)?;
        num_of(raw.get()).ok_or_else(|| de::Error::custom("a number this decoder does not take"))
    }
}

/// A `float` member: any JSON number, as the nearest float (Rust's correctly rounded parse of
/// its text, as Python's `float()` of the number the reference reads); `None` when it is not
/// finite.
struct Float(f64);

impl<'de> Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&RawValue>::deserialize(d)?;
        let text = raw.get();
        let first = text.as_bytes().first().copied().unwrap_or(b'"');
        let v: Option<f64> = if first == b'-' || first.is_ascii_digit() {
            text.parse().ok()
        } else {
            None
        };
        match v {
            Some(v) if v.is_finite() => Ok(Float(v)),
            _ => Err(de::Error::custom("not a finite number")),
        }
    }
}

/// A JSON object's entries in order, refused when a key repeats.
struct Entries<'a, V>(Vec<(Str<'a>, V)>);

/// Objects up to this many entries are checked for a repeated key pair by pair.
const PAIRWISE_KEYS: usize = 16;

fn has_duplicate<V>(entries: &[(Str<'_>, V)]) -> bool {
    if entries.len() <= PAIRWISE_KEYS {
        return entries
            .iter()
            .enumerate()
            .any(|(i, (k, _))| entries[..i].iter().any(|(seen, _)| seen.0 == k.0));
    }
    let mut keys: Vec<&str> = entries.iter().map(|(k, _)| k.0.as_ref()).collect();
    keys.sort_unstable();
    keys.windows(2).any(|w| w[0] == w[1])
}

impl<'de: 'a, 'a, V: Deserialize<'de>> Deserialize<'de> for Entries<'a, V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis<'a, V>(PhantomData<(&'a (), V)>);
        impl<'de: 'a, 'a, V: Deserialize<'de>> Visitor<'de> for Vis<'a, V> {
            type Value = Entries<'a, V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(Str<'a>, V)> = Vec::new();
                while let Some(k) = map.next_key::<Str<'a>>()? {
                    let v = map.next_value::<V>()?;
                    out.push((k, v));
                }
                if has_duplicate(&out) {
                    return Err(de::Error::custom("duplicate key"));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Vis(PhantomData))
    }
}

/// A struct read from a JSON object only (serde's derived structs would also take an array).
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Vis<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Vis<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(Vis(PhantomData)).map(Obj)
    }
}

/// A member that may be absent (its default) but not `null`.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// `contracts.SeriesValue`, validated only.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct Series<'a> {
    #[serde(borrow)]
    labels: Entries<'a, Str<'a>>,
    #[serde(borrow)]
    value: Num<'a>,
}

/// `contracts.GpuColumns` with its maps as their raw JSON text (parsed after).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Columns<'a> {
    ts: Vec<Float>,
    #[serde(default, borrow)]
    gpu_uuid: Vec<Option<Str<'a>>>,
    #[serde(default)]
    gpu_index: Vec<Option<i64>>,
    #[serde(default)]
    gpu_instance_id: Vec<Option<i64>>,
    #[serde(default, borrow)]
    gpu_instance_profile: Vec<Option<Str<'a>>>,
    #[serde(default, borrow)]
    model_name: Vec<Option<Str<'a>>>,
    #[serde(default, borrow)]
    fields: Vec<&'a RawValue>,
    #[serde(default, borrow)]
    field_series: Vec<&'a RawValue>,
    #[serde(default, borrow)]
    invalid: Vec<&'a RawValue>,
    #[serde(default, borrow)]
    attributes: Vec<&'a RawValue>,
}

/// `contracts.GpuScrape`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Scrape<'a> {
    #[serde(default, deserialize_with = "present")]
    schema_version: Option<i64>,
    #[serde(borrow)]
    host: Str<'a>,
    #[serde(default, borrow, deserialize_with = "present")]
    source: Option<Str<'a>>,
    #[serde(default, borrow, deserialize_with = "present")]
    target: Option<Str<'a>>,
    #[serde(default, deserialize_with = "present")]
    seq: Option<i64>,
    #[serde(borrow)]
    gpus: Obj<Columns<'a>>,
}

/// A record that passed every check, with its maps parsed.
struct Checked<'a> {
    host: Cow<'a, str>,
    source: usize,
    target: Cow<'a, str>,
    seq: i64,
    cols: Columns<'a>,
    fields: Vec<Entries<'a, Num<'a>>>,
    invalid: Vec<Entries<'a, Str<'a>>>,
}

/// LSB-first validity bitmap.
#[derive(Default)]
struct Bits {
    bytes: Vec<u8>,
    len: usize,
    nulls: usize,
}

impl Bits {
    fn push(&mut self, valid: bool) {
        if self.len % 8 == 0 {
            self.bytes.push(0);
        }
        if valid {
            self.bytes[self.len / 8] |= 1 << (self.len % 8);
        } else {
            self.nulls += 1;
        }
        self.len += 1;
    }
}

/// An Arrow utf8 column being built.
struct StrCol {
    offsets: Vec<u8>,
    data: Vec<u8>,
    valid: Bits,
}

impl StrCol {
    fn new() -> Self {
        StrCol {
            offsets: 0i32.to_le_bytes().to_vec(),
            data: Vec::new(),
            valid: Bits::default(),
        }
    }
    fn push(&mut self, v: Option<&str>) {
        if let Some(s) = v {
            self.data.extend_from_slice(s.as_bytes());
        }
        self.valid.push(v.is_some());
        // the caller keeps data under i32::MAX (ScrapeDecoder::decode)
        self.offsets
            .extend_from_slice(&(self.data.len() as i32).to_le_bytes());
    }
}

/// An Arrow float64 or int64 column being built (8 bytes a value).
#[derive(Default)]
struct FixedCol {
    data: Vec<u8>,
    valid: Bits,
}

impl FixedCol {
    fn push_f64(&mut self, v: Option<f64>) {
        self.data.extend_from_slice(&v.unwrap_or(0.0).to_le_bytes());
        self.valid.push(v.is_some());
    }
    fn push_i64(&mut self, v: Option<i64>) {
        self.data.extend_from_slice(&v.unwrap_or(0).to_le_bytes());
        self.valid.push(v.is_some());
    }
}

/// `round(v)` of Python: to the nearest integer, halves to even.
fn round_half_even(v: f64) -> f64 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 {
        2.0 * (v / 2.0).round()
    } else {
        r
    }
}

/// A field's value as a float64 column holds it: an integer rounded to the nearest float, as
/// Python's `float(int)`; `None` for an integer past the float range (Python raises there).
fn as_float(v: Num<'_>) -> Option<f64> {
    match v {
        Num::Int(i) => Some(i as f64),
        Num::Big(text) => text.parse::<f64>().ok().filter(|f| f.is_finite()),
        Num::Float(f) => Some(f),
    }
}

/// A field's value as an int64 column of whole MiB holds it: an integer as is, a float rounded
/// half to even; `None` past the int64 range.
fn as_whole(v: Num<'_>) -> Option<i64> {
    match v {
        Num::Int(i) => Some(i),
        Num::Big(_) => None,
        Num::Float(f) => {
            let r = round_half_even(f);
            if (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&r) {
                Some(r as i64)
            } else {
                None
            }
        }
    }
}

/// Compiled decoder of `contracts.GpuScrape` records (module documentation). Built once with the
/// model's constants, so nothing the Python side defines is written twice.
#[pyclass(module = "analytics_native", frozen)]
struct ScrapeDecoder {
    schema_version: i64,
    sources: Vec<String>,
    default_source: usize,
    default_target: String,
    default_seq: i64,
    ts_min: f64,
    ts_max: f64,
    float_fields: Vec<String>,
    whole_fields: Vec<String>,
    observed_keys: Vec<Py<PyString>>,
    source_strs: Vec<Py<PyString>>,
    /// Every field name given, once, with its place in each list (one lookup per map entry).
    names: Vec<FieldName>,
}

/// A field name the decoder reads, and its index in `float_fields` / `whole_fields` / `observed`.
struct FieldName {
    name: String,
    float: Option<usize>,
    whole: Option<usize>,
    observed: Option<usize>,
}

/// What one [`ScrapeDecoder::decode`] call made of a batch (module documentation for shapes).
#[pyclass(module = "analytics_native", frozen)]
struct DecodedScrapes {
    /// Indexes (into the values given) of the records accepted, in order.
    #[pyo3(get)]
    accepted: Py<PyList>,
    /// Per accepted record: `host`, `source`, `target` (str), `seq` and GPU count (int).
    #[pyo3(get)]
    host: Py<PyList>,
    #[pyo3(get)]
    source: Py<PyList>,
    #[pyo3(get)]
    target: Py<PyList>,
    #[pyo3(get)]
    seq: Py<PyList>,
    #[pyo3(get)]
    counts: Py<PyList>,
    /// Per GPU: `ts` (float), `gpu_uuid` / `model_name` (str or None), `gpu_index` /
    /// `gpu_instance_id` (int or None), and the observed entries of `fields` / `invalid` (dict).
    #[pyo3(get)]
    ts: Py<PyList>,
    #[pyo3(get)]
    gpu_uuid: Py<PyList>,
    #[pyo3(get)]
    gpu_index: Py<PyList>,
    #[pyo3(get)]
    gpu_instance_id: Py<PyList>,
    #[pyo3(get)]
    model_name: Py<PyList>,
    #[pyo3(get)]
    observed_fields: Py<PyList>,
    #[pyo3(get)]
    observed_invalid: Py<PyList>,
    /// Column name → `(validity bytes or None, values bytes, offsets bytes or None, null count)`.
    #[pyo3(get)]
    arrays: Py<PyDict>,
    /// Promoted field name → buffers as in `arrays` (float64 / int64).
    #[pyo3(get)]
    float_fields: Py<PyDict>,
    #[pyo3(get)]
    whole_fields: Py<PyDict>,
}

/// A Python list of `items`, taking their references over (no count changes). Raises
/// `MemoryError` when the list cannot be allocated.
fn owned_list(py: Python<'_>, items: Vec<PyObject>) -> PyResult<Py<PyList>> {
    let n = items.len() as pyo3::ffi::Py_ssize_t;
    // SAFETY: PyList_New(n) returns a new list of n empty slots, or NULL with MemoryError set;
    // PyList_SetItem steals each reference and cannot fail for an index below n on a list; the
    // list's one reference goes to the Py returned.
    unsafe {
        let ptr = pyo3::ffi::PyList_New(n);
        if ptr.is_null() {
            return Err(PyErr::fetch(py));
        }
        for (i, item) in items.into_iter().enumerate() {
            pyo3::ffi::PyList_SetItem(ptr, i as pyo3::ffi::Py_ssize_t, item.into_ptr());
        }
        Ok(Py::from_owned_ptr(py, ptr))
    }
}

/// Buffers of a utf8 column as the Python side takes them.
fn str_buffers<'py>(py: Python<'py>, c: &StrCol) -> Bound<'py, PyTuple> {
    let validity = if c.valid.nulls == 0 {
        py.None()
    } else {
        PyBytes::new_bound(py, &c.valid.bytes).into_py(py)
    };
    PyTuple::new_bound(
        py,
        [
            validity,
            PyBytes::new_bound(py, &c.data).into_py(py),
            PyBytes::new_bound(py, &c.offsets).into_py(py),
            c.valid.nulls.into_py(py),
        ],
    )
}

/// Buffers of a float64 / int64 column as the Python side takes them.
fn fixed_buffers<'py>(py: Python<'py>, c: &FixedCol) -> Bound<'py, PyTuple> {
    let validity = if c.valid.nulls == 0 {
        py.None()
    } else {
        PyBytes::new_bound(py, &c.valid.bytes).into_py(py)
    };
    PyTuple::new_bound(
        py,
        [
            validity,
            PyBytes::new_bound(py, &c.data).into_py(py),
            py.None(),
            c.valid.nulls.into_py(py),
        ],
    )
}

impl ScrapeDecoder {
    /// `value` decoded and checked, or `None` if this decoder refuses it.
    fn check<'a>(&self, value: &'a [u8]) -> Option<Checked<'a>> {
        let Obj(rec) = serde_json::from_slice::<Obj<Scrape<'a>>>(value).ok()?;
        if rec.schema_version.unwrap_or(self.schema_version) != self.schema_version {
            return None;
        }
        let source = match &rec.source {
            None => self.default_source,
            Some(s) => self
                .sources
                .iter()
                .position(|known| known.as_str() == s.0.as_ref())?,
        };
        let cols = rec.gpus.0;
        let n = cols.ts.len();
        if n == 0 {
            return None;
        }
        let lens = [
            cols.gpu_uuid.len(),
            cols.gpu_index.len(),
            cols.gpu_instance_id.len(),
            cols.gpu_instance_profile.len(),
            cols.model_name.len(),
            cols.fields.len(),
            cols.field_series.len(),
            cols.invalid.len(),
            cols.attributes.len(),
        ];
        if lens.iter().any(|&l| l != 0 && l != n) {
            return None;
        }
        for i in 0..n {
            let uuid = cols
                .gpu_uuid
                .get(i)
                .map_or(false, |u| u.as_ref().map_or(false, |s| !s.0.is_empty()));
            let index = cols.gpu_index.get(i).map_or(false, |x| x.is_some());
            if !(uuid || index) {
                return None;
            }
        }
        if !cols
            .ts
            .iter()
            .all(|t| self.ts_min <= t.0 && t.0 < self.ts_max)
        {
            return None;
        }
        let mut fields = Vec::with_capacity(cols.fields.len());
        for raw in &cols.fields {
            fields.push(serde_json::from_str::<Entries<'a, Num<'a>>>(raw.get()).ok()?);
        }
        for raw in &cols.field_series {
            serde_json::from_str::<Entries<'a, Vec<Obj<Series<'a>>>>>(raw.get()).ok()?;
        }
        let mut invalid = Vec::with_capacity(cols.invalid.len());
        for raw in &cols.invalid {
            invalid.push(serde_json::from_str::<Entries<'a, Str<'a>>>(raw.get()).ok()?);
        }
        for raw in &cols.attributes {
            serde_json::from_str::<Entries<'a, Str<'a>>>(raw.get()).ok()?;
        }
        Some(Checked {
            host: rec.host.0,
            source,
            target: rec
                .target
                .map_or_else(|| Cow::Owned(self.default_target.clone()), |t| t.0),
            seq: rec.seq.unwrap_or(self.default_seq),
            cols,
            fields,
            invalid,
        })
    }
}

#[pymethods]
impl ScrapeDecoder {
    /// Build a decoder.
    ///
    /// Args: `schema_version` (the one accepted), `sources` (the values `source` may take),
    /// `default_source` / `default_target` / `default_seq` (the model's defaults), `ts_min` /
    /// `ts_max` (Unix seconds: a `ts` is accepted when `ts_min <= ts < ts_max`), `float_fields`
    /// and `whole_fields` (field names given a float64 / int64 column each), `observed` (field
    /// names whose `fields` and `invalid` entries are returned per GPU as dicts).
    ///
    /// Raises `ValueError` if `default_source` is not one of `sources`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        schema_version: i64,
        sources: Vec<String>,
        default_source: String,
        default_target: String,
        default_seq: i64,
        ts_min: f64,
        ts_max: f64,
        float_fields: Vec<String>,
        whole_fields: Vec<String>,
        observed: Vec<String>,
    ) -> PyResult<Self> {
        let default = sources
            .iter()
            .position(|s| *s == default_source)
            .ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "default_source {default_source:?} is not in sources"
                ))
            })?;
        let observed_keys = observed
            .iter()
            .map(|s| PyString::intern_bound(py, s).unbind())
            .collect();
        let mut names: Vec<FieldName> = Vec::new();
        for name in float_fields.iter().chain(&whole_fields).chain(&observed) {
            if names.iter().all(|n| n.name != *name) {
                names.push(FieldName {
                    name: name.clone(),
                    float: float_fields.iter().position(|f| f == name),
                    whole: whole_fields.iter().position(|f| f == name),
                    observed: observed.iter().position(|f| f == name),
                });
            }
        }
        let source_strs = sources
            .iter()
            .map(|s| PyString::intern_bound(py, s).unbind())
            .collect();
        Ok(ScrapeDecoder {
            schema_version,
            sources,
            default_source: default,
            default_target,
            default_seq,
            ts_min,
            ts_max,
            float_fields,
            whole_fields,
            observed_keys,
            source_strs,
            names,
        })
    }

    /// Decode a batch: `values` holds each record's JSON (bytes, UTF-8). Returns a
    /// [`DecodedScrapes`] of the records accepted; the others are left out (their indexes are
    /// not in `accepted`) for the reference to decide. Raises `TypeError` if an element of
    /// `values` is not bytes; never raises for a record's content.
    fn decode(&self, py: Python<'_>, values: &Bound<'_, PyList>) -> PyResult<DecodedScrapes> {
        let mut accepted: Vec<usize> = Vec::new();
        let mut host: Vec<PyObject> = Vec::new();
        let mut source: Vec<PyObject> = Vec::new();
        let mut target: Vec<PyObject> = Vec::new();
        let mut seq: Vec<PyObject> = Vec::new();
        let mut counts: Vec<PyObject> = Vec::new();
        let mut ts: Vec<PyObject> = Vec::new();
        let mut uuid: Vec<PyObject> = Vec::new();
        let mut index: Vec<PyObject> = Vec::new();
        let mut instance: Vec<PyObject> = Vec::new();
        let mut model: Vec<PyObject> = Vec::new();
        let mut obs_fields: Vec<PyObject> = Vec::new();
        let mut obs_invalid: Vec<PyObject> = Vec::new();
        let mut ts_col = FixedCol::default();
        let mut uuid_col = StrCol::new();
        let mut index_col = FixedCol::default();
        let mut instance_col = FixedCol::default();
        let mut profile_col = StrCol::new();
        let mut model_col = StrCol::new();
        let mut fields_col = StrCol::new();
        let mut invalid_col = StrCol::new();
        let mut attributes_col = StrCol::new();
        let mut float_cols: Vec<FixedCol> = self
            .float_fields
            .iter()
            .map(|_| FixedCol::default())
            .collect();
        let mut whole_cols: Vec<FixedCol> = self
            .whole_fields
            .iter()
            .map(|_| FixedCol::default())
            .collect();
        let none = py.None();
        let int_type = py.get_type_bound::<pyo3::types::PyLong>();
        let empty = PyDict::new_bound(py).into_any().unbind();
        let mut last_model: Option<(String, PyObject)> = None;
        let mut last_ts: Option<(f64, PyObject)> = None;
        let mut floats: Vec<Option<f64>> = vec![None; self.float_fields.len()];
        let mut wholes: Vec<Option<i64>> = vec![None; self.whole_fields.len()];
        for (k, item) in values.iter().enumerate() {
            let bytes = item.downcast::<PyBytes>()?;
            let value = bytes.as_bytes();
            let most = [
                &uuid_col,
                &profile_col,
                &model_col,
                &fields_col,
                &invalid_col,
                &attributes_col,
            ]
            .iter()
            .map(|c| c.data.len())
            .max()
            .unwrap_or(0);
            // a string column's text never grows by more than the record's length: keep the
            // int32 offsets in range by leaving a record that could pass it to the reference
            if most.saturating_add(value.len()) >= i32::MAX as usize {
                continue;
            }
            let rec = match self.check(value) {
                Some(rec) => rec,
                None => continue,
            };
            accepted.push(k);
            let cols = &rec.cols;
            let n = cols.ts.len();
            host.push(PyString::new_bound(py, &rec.host).into_any().unbind());
            source.push(self.source_strs[rec.source].clone_ref(py).into_any());
            target.push(PyString::new_bound(py, &rec.target).into_any().unbind());
            seq.push(rec.seq.into_py(py));
            counts.push(n.into_py(py));
            for i in 0..n {
                let t = cols.ts[i].0;
                ts.push(match &last_ts {
                    Some((prev, obj)) if prev.to_bits() == t.to_bits() => obj.clone_ref(py),
                    _ => {
                        let obj = PyFloat::new_bound(py, t).into_any().unbind();
                        last_ts = Some((t, obj.clone_ref(py)));
                        obj
                    }
                });
                ts_col.push_f64(Some(t));
                let u = cols
                    .gpu_uuid
                    .get(i)
                    .and_then(|u| u.as_ref())
                    .map(|s| s.0.as_ref());
                uuid.push(u.map_or_else(
                    || none.clone_ref(py),
                    |s| PyString::new_bound(py, s).into_any().unbind(),
                ));
                uuid_col.push(u);
                let x = cols.gpu_index.get(i).copied().flatten();
                index.push(x.map_or_else(|| none.clone_ref(py), |v| v.into_py(py)));
                index_col.push_i64(x);
                let g = cols.gpu_instance_id.get(i).copied().flatten();
                instance.push(g.map_or_else(|| none.clone_ref(py), |v| v.into_py(py)));
                instance_col.push_i64(g);
                profile_col.push(
                    cols.gpu_instance_profile
                        .get(i)
                        .and_then(|p| p.as_ref())
                        .map(|s| s.0.as_ref()),
                );
                let m = cols
                    .model_name
                    .get(i)
                    .and_then(|m| m.as_ref())
                    .map(|s| s.0.as_ref());
                model_col.push(m);
                model.push(match m {
                    None => none.clone_ref(py),
                    Some(s) => match &last_model {
                        Some((text, obj)) if text.as_str() == s => obj.clone_ref(py),
                        _ => {
                            let obj = PyString::new_bound(py, s).into_any().unbind();
                            last_model = Some((s.to_owned(), obj.clone_ref(py)));
                            obj
                        }
                    },
                });
                fields_col.push(Some(cols.fields.get(i).map_or("{}", |r| r.get())));
                invalid_col.push(Some(cols.invalid.get(i).map_or("{}", |r| r.get())));
                attributes_col.push(Some(cols.attributes.get(i).map_or("{}", |r| r.get())));
                floats.iter_mut().for_each(|v| *v = None);
                wholes.iter_mut().for_each(|v| *v = None);
                let mut observed: Option<Bound<'_, PyDict>> = None;
                if let Some(entries) = rec.fields.get(i) {
                    for (key, v) in &entries.0 {
                        let key = key.0.as_ref();
                        let name = match self.names.iter().find(|n| n.name.as_str() == key) {
                            Some(name) => name,
                            None => continue,
                        };
                        if let Some(j) = name.float {
                            floats[j] = as_float(*v);
                        }
                        if let Some(j) = name.whole {
                            wholes[j] = as_whole(*v);
                        }
                        if let Some(j) = name.observed {
                            let d = observed.get_or_insert_with(|| PyDict::new_bound(py));
                            let obj: PyObject = match v {
                                Num::Int(x) => x.into_py(py),
                                Num::Big(text) => {
                                    int_type.call1((PyString::new_bound(py, text),))?.unbind()
                                }
                                Num::Float(x) => PyFloat::new_bound(py, *x).into_any().unbind(),
                            };
                            d.set_item(self.observed_keys[j].bind(py), obj)?;
                        }
                    }
                }
                obs_fields
                    .push(observed.map_or_else(|| empty.clone_ref(py), |d| d.into_any().unbind()));
                let mut bad: Option<Bound<'_, PyDict>> = None;
                if let Some(entries) = rec.invalid.get(i) {
                    for (key, reason) in &entries.0 {
                        let key = key.0.as_ref();
                        if let Some(j) = self
                            .names
                            .iter()
                            .find(|n| n.name.as_str() == key)
                            .and_then(|n| n.observed)
                        {
                            let d = bad.get_or_insert_with(|| PyDict::new_bound(py));
                            d.set_item(self.observed_keys[j].bind(py), reason.0.as_ref())?;
                        }
                    }
                }
                obs_invalid
                    .push(bad.map_or_else(|| empty.clone_ref(py), |d| d.into_any().unbind()));
                for (c, v) in float_cols.iter_mut().zip(&floats) {
                    c.push_f64(*v);
                }
                for (c, v) in whole_cols.iter_mut().zip(&wholes) {
                    c.push_i64(*v);
                }
            }
        }
        let arrays = PyDict::new_bound(py);
        arrays.set_item("ts", fixed_buffers(py, &ts_col))?;
        arrays.set_item("gpu_uuid", str_buffers(py, &uuid_col))?;
        arrays.set_item("gpu_index", fixed_buffers(py, &index_col))?;
        arrays.set_item("gpu_instance_id", fixed_buffers(py, &instance_col))?;
        arrays.set_item("gpu_instance_profile", str_buffers(py, &profile_col))?;
        arrays.set_item("model_name", str_buffers(py, &model_col))?;
        arrays.set_item("fields", str_buffers(py, &fields_col))?;
        arrays.set_item("invalid", str_buffers(py, &invalid_col))?;
        arrays.set_item("attributes", str_buffers(py, &attributes_col))?;
        let float_dict = PyDict::new_bound(py);
        for (name, c) in self.float_fields.iter().zip(&float_cols) {
            float_dict.set_item(name, fixed_buffers(py, c))?;
        }
        let whole_dict = PyDict::new_bound(py);
        for (name, c) in self.whole_fields.iter().zip(&whole_cols) {
            whole_dict.set_item(name, fixed_buffers(py, c))?;
        }
        let list = |v: Vec<PyObject>| owned_list(py, v);
        Ok(DecodedScrapes {
            accepted: PyList::new_bound(py, accepted).unbind(),
            host: list(host)?,
            source: list(source)?,
            target: list(target)?,
            seq: list(seq)?,
            counts: list(counts)?,
            ts: list(ts)?,
            gpu_uuid: list(uuid)?,
            gpu_index: list(index)?,
            gpu_instance_id: list(instance)?,
            model_name: list(model)?,
            observed_fields: list(obs_fields)?,
            observed_invalid: list(obs_invalid)?,
            arrays: arrays.unbind(),
            float_fields: float_dict.unbind(),
            whole_fields: whole_dict.unbind(),
        })
    }
}

/// The compiled decoder of `contracts.GpuScrape` records (crate documentation).
#[pymodule]
fn analytics_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ScrapeDecoder>()?;
    m.add_class::<DecodedScrapes>()?;
    m.add("RECORD_MEMBERS", RECORD_MEMBERS.to_vec())?;
    m.add("COLUMN_MEMBERS", COLUMN_MEMBERS.to_vec())?;
    m.add("SERIES_MEMBERS", SERIES_MEMBERS.to_vec())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_their_kind() {
        assert_eq!(num_of("5"), Some(Num::Int(5)));
        assert_eq!(num_of("-0"), Some(Num::Int(0)));
        assert_eq!(num_of("5.0"), Some(Num::Float(5.0)));
        assert_eq!(num_of("1e2"), Some(Num::Float(100.0)));
        assert_eq!(num_of("1e400"), None);
        assert_eq!(
            num_of("9223372036854775808"),
            Some(Num::Big("9223372036854775808"))
        );
        assert_eq!(num_of("\"5\""), None);
    }

    #[test]
    fn halves_round_to_even() {
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(3.5), 4.0);
        assert_eq!(round_half_even(-2.5), -2.0);
        assert_eq!(round_half_even(2.4999), 2.0);
        assert_eq!(as_whole(Num::Float(1e19)), None);
    }
}
