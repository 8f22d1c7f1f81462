//! Compiled decoder of `contracts.GpuScrape` records (one Kafka record per read of a host's GPUs,
//! JSON; the format is defined by the pydantic models `contracts.telemetry.GpuScrape`,
//! `GpuColumns` and `SeriesValue`) straight to the columns of a batch, as Arrow buffers.
//!
//! The decoder accepts a SUBSET of what the reference (`contracts.GpuScrape`) accepts, with
//! exactly the same values, and refuses everything else: the caller then has the reference decide
//! the record (`analytics.decode.decode_telemetry`). The record's text is read once, by a
//! validating scanner of RFC 8259 JSON (`Scan`), each value straight into what it becomes.
//! Refused, among others: anything that is not JSON (no `NaN`/`Infinity` literals, no trailing
//! commas, no comments, no leading zeros, no whitespace but space, tab, LF and CR, no unpaired
//! surrogate escape, no control character in a string, not UTF-8), a JSON value
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
//! `float(int)`: `-0` is `0.0`); an `int` member may be spelled `-0` (0); a `float | int` map value keeps its kind: a number without fraction or exponent
//! is an `int`, any other a `float`, as the reference's smart union decides.
//!
//! A large batch is read by several threads at once (`threads` of [`ScrapeDecoder::decode`]): cut
//! into runs of consecutive records, each read without the GIL into its own chunk of every
//! column; then the calling thread, holding the GIL, makes the Python objects in batch order.
//!
//! Shapes of one call ([`ScrapeDecoder::decode`]): per accepted record its GPU count;
//! per GPU (records in order, GPUs in column order) one
//! observation, what the idle classifier reads (an instance of the named tuple given at
//! construction: the `fields` values and `invalid` reasons of the field names given, then `ts`,
//! `host`, `gpu_uuid`, `gpu_index`, `gpu_instance_id`, `model_name`), and Arrow buffers
//! (little-endian values, LSB-first validity bitmaps, int32 string offsets), one chunk per run, of
//! `ts` (int64: Unix microseconds, the seconds times 10**6 rounded half to even), `host` /
//! `source` / `target` (utf8: the GPU's record's), `seq` (int64: the record's `seq` plus the
//! GPU's place in it, NULL past int64), `gpu_uuid` / `gpu_instance_profile` / `model_name` (utf8),
//! `gpu_index` / `gpu_instance_id` (int64), `fields` / `invalid` / `attributes` (utf8: each map's
//! JSON text exactly as the producer wrote it, validated) and one float64 or int64 column per
//! promoted field name given at construction.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple};

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

/// A `float | int` value as the reference keeps it: a JSON number without fraction or exponent
/// is an integer (`Big`: its text, past the signed 64-bit range), any other a float (finite,
/// correctly rounded).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Num<'a> {
    Int(i64),
    Big(&'a str),
    Float(f64),
}

/// A validating reader of one JSON text (RFC 8259) that reads each value once, in order:
/// whitespace is space, tab, LF and CR; strings refuse control characters, unknown escapes and
/// unpaired surrogates (`\uD800`-`\uDFFF` outside a high-low pair); numbers follow the grammar
/// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`; a byte past ASCII is taken only in
/// a string, as part of a run of such bytes that is whole UTF-8 characters. Every method returns
/// `None` where the text is not what it reads (a refusal), and never panics. So every span the
/// scanner has read (a string's bytes, a number, a whole value) is valid UTF-8.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

/// Number of bytes at the start of `b` that a string holds as they are: not `"`, `\\`, a
/// control character (below 0x20) or past ASCII. Eight bytes at a time: the lowest flagged byte
/// of each word is exact (a borrow only leaves a byte that is itself flagged).
#[inline]
fn plain_len(b: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let mut i = 0;
    while let Some(chunk) = b.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let quote = w ^ (ONES * u64::from(b'"'));
        let slash = w ^ (ONES * u64::from(b'\\'));
        let flagged = (w.wrapping_sub(ONES * 0x20)
            | w
            | (quote.wrapping_sub(ONES) & !quote)
            | (slash.wrapping_sub(ONES) & !slash))
            & HIGH;
        if flagged != 0 {
            return i + (flagged.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while let Some(&c) = b.get(i) {
        if c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c) {
            break;
        }
        i += 1;
    }
    i
}

impl<'a> Scan<'a> {
    fn new(b: &'a [u8]) -> Self {
        Scan { b, i: 0 }
    }

    /// The text of `start..end`, a span this scanner has read (valid UTF-8: type documentation).
    #[inline]
    fn text(&self, start: usize, end: usize) -> &'a str {
        let span = &self.b[start..end];
        debug_assert!(std::str::from_utf8(span).is_ok());
        // SAFETY: the scanner consumes ASCII outside strings and, in strings, ASCII or runs of
        // bytes past ASCII it has checked with `str::from_utf8` (`Scan::utf8`); a span it has
        // read is made of those, so it is valid UTF-8.
        unsafe { std::str::from_utf8_unchecked(span) }
    }

    /// Consumes the run of bytes past ASCII at `self.i`; refused unless it is whole UTF-8
    /// characters.
    #[inline]
    fn utf8(&mut self) -> Option<()> {
        let start = self.i;
        while self.b.get(self.i).map_or(false, |&c| c >= 0x80) {
            self.i += 1;
        }
        std::str::from_utf8(&self.b[start..self.i]).ok().map(drop)
    }

    /// The next byte that is not whitespace (not consumed).
    #[inline]
    fn peek(&mut self) -> Option<u8> {
        let b = self.b;
        while let Some(&c) = b.get(self.i) {
            if matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                self.i += 1;
            } else {
                return Some(c);
            }
        }
        None
    }

    /// Consumes `c` if it is the next byte after whitespace.
    #[inline]
    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    #[inline]
    fn expect(&mut self, c: u8) -> Option<()> {
        if self.eat(c) {
            Some(())
        } else {
            None
        }
    }

    /// Whether the end of the text follows (whitespace only).
    fn at_end(&mut self) -> bool {
        self.peek().is_none()
    }

    /// Consumes a `null` literal if one is next.
    #[inline]
    fn null(&mut self) -> bool {
        if self.peek() == Some(b'n') && self.b[self.i..].starts_with(b"null") {
            self.i += 4;
            true
        } else {
            false
        }
    }

    /// Four hex digits of a `\u` escape.
    fn hex4(&mut self) -> Option<u32> {
        let digits = self.b.get(self.i..self.i + 4)?;
        let mut v = 0u32;
        for &d in digits {
            v = v * 16 + (d as char).to_digit(16)?;
        }
        self.i += 4;
        Some(v)
    }

    /// A string: its value, borrowed from the text when it holds no escape.
    #[inline]
    fn string(&mut self) -> Option<Cow<'a, str>> {
        if self.peek() != Some(b'"') {
            return None;
        }
        self.i += 1;
        let start = self.i;
        loop {
            self.i += plain_len(&self.b[self.i..]);
            match *self.b.get(self.i)? {
                b'"' => {
                    let v = self.text(start, self.i);
                    self.i += 1;
                    return Some(Cow::Borrowed(v));
                }
                b'\\' => return self.escaped(start).map(Cow::Owned),
                0..=0x1f => return None,
                _ => self.utf8()?,
            }
        }
    }

    /// The rest of a string that has an escape at `self.i` (its text began at `start`).
    fn escaped(&mut self, start: usize) -> Option<String> {
        let b = self.b;
        let mut out = String::with_capacity(self.i - start + 16);
        let mut run = start;
        loop {
            self.i += plain_len(&b[self.i..]);
            match *b.get(self.i)? {
                b'"' => {
                    out.push_str(self.text(run, self.i));
                    self.i += 1;
                    return Some(out);
                }
                b'\\' => {
                    out.push_str(self.text(run, self.i));
                    let e = *b.get(self.i + 1)?;
                    self.i += 2;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let u = self.hex4()?;
                            let c = match u {
                                0xD800..=0xDBFF => {
                                    if b.get(self.i..self.i + 2)? != b"\\u" {
                                        return None;
                                    }
                                    self.i += 2;
                                    let low = self.hex4()?;
                                    if !(0xDC00..=0xDFFF).contains(&low) {
                                        return None;
                                    }
                                    char::from_u32(0x10000 + ((u - 0xD800) << 10) + (low - 0xDC00))?
                                }
                                0xDC00..=0xDFFF => return None,
                                _ => char::from_u32(u)?,
                            };
                            out.push(c);
                        }
                        _ => return None,
                    }
                    run = self.i;
                }
                0..=0x1f => return None,
                _ => self.utf8()?,
            }
        }
    }

    /// A string or `null`.
    #[inline]
    fn opt_string(&mut self) -> Option<Option<Cow<'a, str>>> {
        if self.null() {
            Some(None)
        } else {
            self.string().map(Some)
        }
    }

    /// A number: its text, and whether it has neither fraction nor exponent.
    #[inline]
    fn number(&mut self) -> Option<(&'a str, bool)> {
        self.peek();
        let b = self.b;
        let start = self.i;
        if b.get(self.i) == Some(&b'-') {
            self.i += 1;
        }
        match b.get(self.i) {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return None,
        }
        let mut integer = true;
        if b.get(self.i) == Some(&b'.') {
            integer = false;
            self.i += 1;
            if !matches!(b.get(self.i), Some(b'0'..=b'9')) {
                return None;
            }
            self.digits();
        }
        if matches!(b.get(self.i), Some(b'e' | b'E')) {
            integer = false;
            self.i += 1;
            if matches!(b.get(self.i), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if !matches!(b.get(self.i), Some(b'0'..=b'9')) {
                return None;
            }
            self.digits();
        }
        Some((self.text(start, self.i), integer))
    }

    #[inline]
    fn digits(&mut self) {
        let b = self.b;
        while matches!(b.get(self.i), Some(b'0'..=b'9')) {
            self.i += 1;
        }
    }

    /// A `float | int` map value (refused when not finite).
    #[inline]
    fn num(&mut self) -> Option<Num<'a>> {
        let (text, integer) = self.number()?;
        num_of(text, integer)
    }

    /// A `float` member: any number, as the nearest float (refused when not finite); an integer
    /// as Python's `float(int)` (`-0` is `0.0`).
    #[inline]
    fn float(&mut self) -> Option<f64> {
        let (text, integer) = self.number()?;
        if integer {
            if let Ok(v) = text.parse::<i64>() {
                return Some(v as f64);
            }
        }
        let v: f64 = text.parse().ok()?;
        if v.is_finite() {
            Some(v)
        } else {
            None
        }
    }

    /// An `int` member: a number without fraction or exponent in the signed 64-bit range.
    #[inline]
    fn int(&mut self) -> Option<i64> {
        let (text, integer) = self.number()?;
        if !integer {
            return None;
        }
        text.parse().ok()
    }

    /// An `int` member or `null`.
    #[inline]
    fn opt_int(&mut self) -> Option<Option<i64>> {
        if self.null() {
            Some(None)
        } else {
            self.int().map(Some)
        }
    }

    /// An object: `member(self, key)` reads each member's value, in order.
    #[inline]
    fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Option<()>,
    ) -> Option<()> {
        self.expect(b'{')?;
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.expect(b':')?;
            member(self, key)?;
            if !self.eat(b',') {
                return self.expect(b'}');
            }
        }
    }

    /// An array: `element(self)` reads each element, in order.
    #[inline]
    fn array(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.expect(b'[')?;
        if self.eat(b']') {
            return Some(());
        }
        loop {
            element(self)?;
            if !self.eat(b',') {
                return self.expect(b']');
            }
        }
    }

    /// An array whose every element `read` reads, appended to `out`.
    #[inline]
    fn list<T>(
        &mut self,
        out: &mut Vec<T>,
        mut read: impl FnMut(&mut Self) -> Option<T>,
    ) -> Option<()> {
        self.array(|sc| {
            out.push(read(sc)?);
            Some(())
        })
    }

    /// An object whose keys do not repeat (`keys` is scratch space): `value(self, key)` reads
    /// each value and says whether the key is to be compared with the others (`false`: the
    /// caller has checked it does not repeat). Returns the object's text.
    #[inline]
    fn map(
        &mut self,
        keys: &mut Vec<Cow<'a, str>>,
        mut value: impl FnMut(&mut Self, &str) -> Option<bool>,
    ) -> Option<&'a str> {
        self.peek();
        let start = self.i;
        keys.clear();
        self.object(|sc, key| {
            if value(sc, &key)? {
                keys.push(key);
            }
            Some(())
        })?;
        if has_duplicate(keys) {
            return None;
        }
        Some(self.text(start, self.i))
    }
}

/// The value of a number's text (`integer`: without fraction or exponent), or `None` when it is
/// not finite.
fn num_of(text: &str, integer: bool) -> Option<Num<'_>> {
    if integer {
        Some(text.parse::<i64>().map_or(Num::Big(text), Num::Int))
    } else {
        let v: f64 = text.parse().ok()?;
        if v.is_finite() {
            Some(Num::Float(v))
        } else {
            None
        }
    }
}

/// The last eight bytes of `text` (fewer, zero-padded, for a shorter one) with its length: two
/// texts that differ there differ.
#[inline]
fn tail(text: &str) -> u64 {
    let b = text.as_bytes();
    let mut word = [0u8; 8];
    let n = b.len().min(8);
    word[..n].copy_from_slice(&b[b.len() - n..]);
    u64::from_le_bytes(word) ^ (b.len() as u64).rotate_right(8)
}

/// Objects up to this many entries are checked for a repeated key pair by pair.
const PAIRWISE_KEYS: usize = 16;

fn has_duplicate(keys: &[Cow<'_, str>]) -> bool {
    if keys.len() <= PAIRWISE_KEYS {
        return keys
            .iter()
            .enumerate()
            .any(|(i, k)| keys[..i].iter().any(|seen| seen == k));
    }
    let mut sorted: Vec<&str> = keys.iter().map(|k| k.as_ref()).collect();
    sorted.sort_unstable();
    sorted.windows(2).any(|w| w[0] == w[1])
}

/// A record being read (reused from one record to the next): its members, per GPU its columns'
/// values, and of its maps their texts and the entries of the field names the decoder reads.
#[derive(Default)]
struct Checked<'a> {
    host: Cow<'a, str>,
    source: Option<Cow<'a, str>>,
    target: Option<Cow<'a, str>>,
    schema_version: Option<i64>,
    seq: Option<i64>,
    ts: Vec<f64>,
    gpu_uuid: Vec<Option<Cow<'a, str>>>,
    gpu_index: Vec<Option<i64>>,
    gpu_instance_id: Vec<Option<i64>>,
    gpu_instance_profile: Vec<Option<Cow<'a, str>>>,
    model_name: Vec<Option<Cow<'a, str>>>,
    /// Per GPU its `fields` text and the end of its entries in `field_entries`.
    fields: Vec<(&'a str, usize)>,
    /// `fields` entries of known names: index into `ScrapeDecoder::names`, value.
    field_entries: Vec<(usize, Num<'a>)>,
    field_series: usize,
    /// Per GPU its `invalid` text and the end of its entries in `invalid_entries`.
    invalid: Vec<(&'a str, usize)>,
    /// `invalid` entries of observed names: index into `observed`, reason.
    invalid_entries: Vec<(usize, Cow<'a, str>)>,
    attributes: Vec<&'a str>,
    keys: Vec<Cow<'a, str>>,
    inner_keys: Vec<Cow<'a, str>>,
}

impl<'a> Checked<'a> {
    fn clear(&mut self) {
        self.source = None;
        self.target = None;
        self.schema_version = None;
        self.seq = None;
        self.ts.clear();
        self.gpu_uuid.clear();
        self.gpu_index.clear();
        self.gpu_instance_id.clear();
        self.gpu_instance_profile.clear();
        self.model_name.clear();
        self.fields.clear();
        self.field_entries.clear();
        self.field_series = 0;
        self.invalid.clear();
        self.invalid_entries.clear();
        self.attributes.clear();
    }
}

/// LSB-first validity bitmap.
#[derive(Default)]
struct Bits {
    bytes: Vec<u8>,
    len: usize,
    nulls: usize,
}

impl Bits {
    fn reserve(&mut self, rows: usize) {
        self.bytes.reserve(rows / 8 + 1);
    }
    /// Whether value `i` (pushed before) is valid.
    fn get(&self, i: usize) -> bool {
        self.bytes[i / 8] & (1 << (i % 8)) != 0
    }
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
    /// Room for `rows` more values of `bytes` bytes in all, without regrowth.
    fn reserve(&mut self, rows: usize, bytes: usize) {
        self.offsets.reserve(4 * rows);
        self.data.reserve(bytes);
        self.valid.reserve(rows);
    }
    /// Value `i` (pushed before).
    fn get(&self, i: usize) -> Option<&str> {
        if !self.valid.get(i) {
            return None;
        }
        let at = |k: usize| {
            let mut word = [0u8; 4];
            word.copy_from_slice(&self.offsets[4 * k..4 * k + 4]);
            i32::from_le_bytes(word) as usize
        };
        // SAFETY: only `&str` values are pushed, so the bytes between two offsets are UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(&self.data[at(i)..at(i + 1)]) })
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
    /// Room for `rows` more values without regrowth.
    fn reserve(&mut self, rows: usize) {
        self.data.reserve(8 * rows);
        self.valid.reserve(rows);
    }
    fn push_f64(&mut self, v: Option<f64>) {
        self.data.extend_from_slice(&v.unwrap_or(0.0).to_le_bytes());
        self.valid.push(v.is_some());
    }
    /// Value `i` (pushed before) of an int64 column.
    fn get_i64(&self, i: usize) -> Option<i64> {
        if !self.valid.get(i) {
            return None;
        }
        let mut word = [0u8; 8];
        word.copy_from_slice(&self.data[8 * i..8 * i + 8]);
        Some(i64::from_le_bytes(word))
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
    /// Number of observed field names (`observed` given at construction).
    observed_count: usize,
    /// The tuple subclass each GPU's observation is an instance of.
    observation: Py<pyo3::types::PyType>,
    /// Python strings of the hosts and GPU UUIDs seen, kept from call to call.
    strings: Mutex<StrCache>,
    /// The last call's sizes ([`LastShape`]).
    shape: Mutex<LastShape>,
    /// Every field name given, once, with its place in each list (one lookup per map entry).
    names: Vec<FieldName>,
}

/// Python strings of texts that repeat from record to record and from call to call (hosts
/// and GPU UUIDs): one object each instead of one per use. Holds at most
/// `STR_CACHE_ENTRIES` texts of at most `STR_CACHE_BYTES` bytes (emptied when full).
#[derive(Default)]
struct StrCache {
    map: HashMap<Box<str>, Py<PyString>>,
}

const STR_CACHE_ENTRIES: usize = 1 << 16;
const STR_CACHE_BYTES: usize = 128;

impl StrCache {
    /// The Python string of `text`.
    #[inline]
    fn get(&mut self, py: Python<'_>, text: &str) -> PyObject {
        if let Some(obj) = self.map.get(text) {
            return obj.clone_ref(py).into_any();
        }
        let obj = PyString::new_bound(py, text).unbind();
        if text.len() <= STR_CACHE_BYTES {
            if self.map.len() >= STR_CACHE_ENTRIES {
                self.map.clear();
            }
            self.map.insert(text.into(), obj.clone_ref(py));
        }
        obj.into_any()
    }
}

/// The string columns of a batch: the record's own texts repeated per GPU, then the GPUs'.
struct TextCols {
    host: StrCol,
    source: StrCol,
    target: StrCol,
    uuid: StrCol,
    profile: StrCol,
    model: StrCol,
    fields: StrCol,
    invalid: StrCol,
    attributes: StrCol,
}

impl Default for TextCols {
    fn default() -> Self {
        TextCols {
            host: StrCol::new(),
            source: StrCol::new(),
            target: StrCol::new(),
            uuid: StrCol::new(),
            profile: StrCol::new(),
            model: StrCol::new(),
            fields: StrCol::new(),
            invalid: StrCol::new(),
            attributes: StrCol::new(),
        }
    }
}

impl TextCols {
    /// Every column, in the order of the fields.
    fn all(&self) -> [&StrCol; 9] {
        [
            &self.host,
            &self.source,
            &self.target,
            &self.uuid,
            &self.profile,
            &self.model,
            &self.fields,
            &self.invalid,
            &self.attributes,
        ]
    }
    fn all_mut(&mut self) -> [&mut StrCol; 9] {
        [
            &mut self.host,
            &mut self.source,
            &mut self.target,
            &mut self.uuid,
            &mut self.profile,
            &mut self.model,
            &mut self.fields,
            &mut self.invalid,
            &mut self.attributes,
        ]
    }
}

/// The sizes of the last call's output and input, from which the next call sizes its buffers
/// at once in proportion to its input (a batch's buffers then never regrow: no copy, and no
/// pages touched twice). The string columns in the order of [`TextCols::all`].
#[derive(Clone, Copy, Default)]
struct LastShape {
    input_bytes: usize,
    rows: usize,
    text_bytes: [usize; 9],
}

impl LastShape {
    /// `n` (a size of the last call) scaled to an input of `input_bytes`, at most twice that
    /// input (a reservation, not a limit: a column that needs more grows).
    fn scaled(&self, n: usize, input_bytes: usize) -> usize {
        if self.input_bytes == 0 {
            return 0;
        }
        let v = n as u128 * input_bytes as u128 / self.input_bytes as u128;
        (v + v / 16).min(2 * input_bytes as u128) as usize
    }
}

/// A batch's input per thread is cut into runs of consecutive records of at least this many
/// bytes (a smaller batch is read by the calling thread alone).
const SHARD_BYTES: usize = 1 << 20;

/// The columns of a run of records (one chunk of each Arrow column).
struct Columns {
    ts: FixedCol,
    seq: FixedCol,
    index: FixedCol,
    instance: FixedCol,
    text: TextCols,
    floats: Vec<FixedCol>,
    wholes: Vec<FixedCol>,
}

/// A `fields` value of an observed name, as a shard keeps it for the GPU's observation:
/// `kind` 0 (no entry), 1 (an `int`: `bits` its two's complement), 2 (a `float`: `bits` its IEEE
/// bits) or 3 (an `int` past int64: `bits` the index of its text in [`Shard::bigs`]).
#[derive(Clone, Copy, Default)]
struct Seen {
    bits: u64,
    kind: u8,
}

/// What [`ScrapeDecoder::read_shard`] made of a run of records, without Python objects. A GPU's
/// observation is made of its row in `cols` and of what is kept here.
struct Shard<'a> {
    /// Indexes in the batch of the records accepted, and their GPU counts.
    accepted: Vec<usize>,
    counts: Vec<usize>,
    /// Per GPU its `ts` (Unix seconds, as sent).
    ts: Vec<f64>,
    /// Per GPU, `observed_count` entries: the observed names' `fields` values.
    values: Vec<Seen>,
    bigs: Vec<&'a str>,
    /// `(GPU, observed name, reason)` of the observed names' `invalid` entries, in order.
    reasons: Vec<(usize, usize, Cow<'a, str>)>,
    cols: Columns,
}

impl<'a> Shard<'a> {
    /// An empty shard whose buffers are sized for `input_bytes` of input after `shape`.
    fn new(dec: &ScrapeDecoder, shape: &LastShape, input_bytes: usize) -> Self {
        let rows = shape.scaled(shape.rows, input_bytes);
        let fixed = |_| {
            let mut c = FixedCol::default();
            c.reserve(rows);
            c
        };
        let mut text = TextCols::default();
        for (c, &bytes) in text.all_mut().into_iter().zip(&shape.text_bytes) {
            c.reserve(rows, shape.scaled(bytes, input_bytes));
        }
        let width = dec.observed_count;
        Shard {
            accepted: Vec::new(),
            counts: Vec::new(),
            ts: Vec::with_capacity(rows),
            values: Vec::with_capacity(rows * width),
            bigs: Vec::new(),
            reasons: Vec::new(),
            cols: Columns {
                ts: fixed(()),
                seq: fixed(()),
                index: fixed(()),
                instance: fixed(()),
                text,
                floats: dec.float_fields.iter().map(|_| fixed(())).collect(),
                wholes: dec.whole_fields.iter().map(|_| fixed(())).collect(),
            },
        }
    }
}

/// A field name the decoder reads, and its index in `float_fields` / `whole_fields` / `observed`.
struct FieldName {
    name: String,
    /// `tail(name)`, compared before the name.
    tail: u64,
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
    /// Per accepted record its GPU count (int).
    #[pyo3(get)]
    counts: Py<PyList>,
    /// Per GPU one instance of the `observation` class given at construction (a tuple subclass):
    /// the observed names' `fields` values, then their `invalid` reasons, in the order the names
    /// were given (None where the GPU has no entry), then `ts` (float), `host` (str),
    /// `gpu_uuid` (str or None), `gpu_index`, `gpu_instance_id` (int or None), `model_name` (str
    /// or None).
    #[pyo3(get)]
    observations: Py<PyList>,
    /// Rows of each chunk of the columns (their sum is the number of GPUs).
    #[pyo3(get)]
    chunk_rows: Py<PyList>,
    /// Column name → per chunk `(validity or None, values, offsets or None, null count)`, each
    /// a [`Buffer`].
    #[pyo3(get)]
    arrays: Py<PyDict>,
    /// Promoted field name → per chunk buffers as in `arrays` (float64 / int64).
    #[pyo3(get)]
    float_fields: Py<PyDict>,
    #[pyo3(get)]
    whole_fields: Py<PyDict>,
}

/// `ptr`, a new list or tuple of `items.len()` empty slots (or NULL with an exception set: then
/// `MemoryError` or that exception is raised), filled with `items` by `set` (its
/// `..._SetItem`), which takes their references over (no count changes).
///
/// # Safety
/// `ptr` is NULL or a new list, tuple or tuple-subclass instance of exactly `items.len()`
/// slots, referenced only by the caller, whose reference goes to the object returned.
unsafe fn filled(
    py: Python<'_>,
    ptr: *mut pyo3::ffi::PyObject,
    items: impl Iterator<Item = PyObject>,
    set: unsafe extern "C" fn(
        *mut pyo3::ffi::PyObject,
        pyo3::ffi::Py_ssize_t,
        *mut pyo3::ffi::PyObject,
    ) -> std::os::raw::c_int,
) -> PyResult<PyObject> {
    if ptr.is_null() {
        return Err(PyErr::fetch(py));
    }
    // `set` steals each reference and cannot fail for an index below the length on a new one.
    for (i, item) in items.enumerate() {
        set(ptr, i as pyo3::ffi::Py_ssize_t, item.into_ptr());
    }
    Ok(PyObject::from_owned_ptr(py, ptr))
}

/// A Python list of `items`, taking their references over (no count changes). Raises
/// `MemoryError` when the list cannot be allocated.
fn owned_list(py: Python<'_>, items: Vec<PyObject>) -> PyResult<Py<PyList>> {
    let n = items.len() as pyo3::ffi::Py_ssize_t;
    // SAFETY: PyList_New(n) returns a new list of n empty slots, or NULL with MemoryError set.
    let list = unsafe {
        filled(py, pyo3::ffi::PyList_New(n), items.into_iter(), pyo3::ffi::PyList_SetItem)?
    };
    // SAFETY: PyList_New made a list.
    Ok(unsafe { list.downcast_bound_unchecked::<PyList>(py) }.clone().unbind())
}

/// An instance of `cls`, a tuple subclass whose instances hold no `__dict__` (a named tuple), of
/// `items`, which are numbers, strings or `None` only, taking their references over (no count
/// changes) and left out of the cyclic garbage collector's tracking (what the collector does to
/// an exact tuple of such items at its first pass over it). Raises `MemoryError` when it cannot
/// be allocated.
fn atomic_record(
    py: Python<'_>,
    cls: &Bound<'_, pyo3::types::PyType>,
    items: impl ExactSizeIterator<Item = PyObject>,
) -> PyResult<PyObject> {
    let n = items.len() as pyo3::ffi::Py_ssize_t;
    // SAFETY: PyType_GenericAlloc (a tuple subclass's tp_alloc, as tuple.__new__ calls it) returns
    // a new, tracked instance of n empty slots or NULL with MemoryError set; an instance holding
    // no container and no __dict__ cannot be part of a reference cycle, so it may be untracked
    // (PyObject_GC_UnTrack of a tracked object; its deallocation untracks only if tracked).
    unsafe {
        let ptr = pyo3::ffi::PyType_GenericAlloc(cls.as_type_ptr(), n);
        let record = filled(py, ptr, items, pyo3::ffi::PyTuple_SetItem)?;
        pyo3::ffi::PyObject_GC_UnTrack(record.as_ptr().cast());
        Ok(record)
    }
}

/// A buffer the decoder built, handed to Python as it is (read-only buffer protocol: `bytes(b)`,
/// `memoryview(b)`, `pyarrow.py_buffer(b)`), without a copy.
#[pyclass(module = "analytics_native", frozen)]
struct Buffer {
    data: Vec<u8>,
}

#[pymethods]
impl Buffer {
    /// A read-only, contiguous view of the bytes. Raises `BufferError` for a writable view.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let data = &slf.get().data;
        // SAFETY: `view` is the caller's Py_buffer; PyBuffer_FillInfo fills it with the bytes
        // of `data`, which live as long as the object (a frozen class: never changed or moved),
        // and takes a reference to the object into `view.obj`; it refuses a writable view.
        let done = pyo3::ffi::PyBuffer_FillInfo(
            view,
            slf.as_ptr(),
            data.as_ptr() as *mut std::os::raw::c_void,
            data.len() as pyo3::ffi::Py_ssize_t,
            1,
            flags,
        );
        if done == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// Nothing to release (the bytes belong to the object).
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    /// Number of bytes.
    fn __len__(&self) -> usize {
        self.data.len()
    }
}

/// A field's value last set into a GPU's observed slots: its bits and kind (`true`: an `int`), and its object.
type LastValue<'py> = ((u64, bool), Bound<'py, PyAny>);

/// `data` as a Python [`Buffer`].
fn buffer(py: Python<'_>, data: Vec<u8>) -> PyResult<PyObject> {
    Ok(Py::new(py, Buffer { data })?.into_any())
}

/// Buffers of a utf8 column as the Python side takes them.
fn str_buffers<'py>(py: Python<'py>, c: StrCol) -> PyResult<Bound<'py, PyTuple>> {
    let validity = if c.valid.nulls == 0 {
        py.None()
    } else {
        buffer(py, c.valid.bytes)?
    };
    Ok(PyTuple::new_bound(
        py,
        [
            validity,
            buffer(py, c.data)?,
            buffer(py, c.offsets)?,
            c.valid.nulls.into_py(py),
        ],
    ))
}

/// Buffers of a float64 / int64 column as the Python side takes them.
fn fixed_buffers<'py>(py: Python<'py>, c: FixedCol) -> PyResult<Bound<'py, PyTuple>> {
    let validity = if c.valid.nulls == 0 {
        py.None()
    } else {
        buffer(py, c.valid.bytes)?
    };
    Ok(PyTuple::new_bound(
        py,
        [
            validity,
            buffer(py, c.data)?,
            py.None(),
            c.valid.nulls.into_py(py),
        ],
    ))
}

/// A `field_series` element (`contracts.SeriesValue`), validated only (`keys`: scratch space).
fn series<'a>(sc: &mut Scan<'a>, keys: &mut Vec<Cow<'a, str>>) -> Option<()> {
    let mut seen = 0u32;
    sc.object(|sc, key| {
        let m = SERIES_MEMBERS.iter().position(|m| *m == key)?;
        if seen & (1 << m) != 0 {
            return None;
        }
        seen |= 1 << m;
        if m == 0 {
            sc.map(keys, |sc, _| sc.string().map(|_| true))?;
        } else {
            sc.num()?;
        }
        Some(())
    })?;
    if seen == 0b11 {
        Some(())
    } else {
        None
    }
}

impl ScrapeDecoder {
    /// The index in `names` of a field name the decoder reads.
    #[inline]
    fn name_of(&self, key: &str) -> Option<usize> {
        let t = tail(key);
        self.names
            .iter()
            .position(|n| n.tail == t && n.name.as_str() == key)
    }

    /// Reads `value` into `rec` (cleared before) and checks it: the index of its `source` in
    /// `sources`, or `None` if this decoder refuses the record.
    fn check<'a>(&self, value: &'a [u8], rec: &mut Checked<'a>) -> Option<usize> {
        let mut sc = Scan::new(value);
        let mut seen = 0u32;
        sc.object(|sc, key| {
            let m = RECORD_MEMBERS.iter().position(|m| *m == key)?;
            if seen & (1 << m) != 0 {
                return None;
            }
            seen |= 1 << m;
            match m {
                0 => rec.schema_version = Some(sc.int()?),
                1 => rec.host = sc.string()?,
                2 => rec.source = Some(sc.string()?),
                3 => rec.target = Some(sc.string()?),
                4 => rec.seq = Some(sc.int()?),
                _ => self.columns(sc, rec)?,
            }
            Some(())
        })?;
        // `host` and `gpus` are required
        if !sc.at_end() || seen & 0b10_0010 != 0b10_0010 {
            return None;
        }
        if rec.schema_version.unwrap_or(self.schema_version) != self.schema_version {
            return None;
        }
        let source = match &rec.source {
            None => self.default_source,
            Some(s) => self
                .sources
                .iter()
                .position(|known| known.as_str() == s.as_ref())?,
        };
        let n = rec.ts.len();
        if n == 0 {
            return None;
        }
        let lens = [
            rec.gpu_uuid.len(),
            rec.gpu_index.len(),
            rec.gpu_instance_id.len(),
            rec.gpu_instance_profile.len(),
            rec.model_name.len(),
            rec.fields.len(),
            rec.field_series,
            rec.invalid.len(),
            rec.attributes.len(),
        ];
        if lens.iter().any(|&l| l != 0 && l != n) {
            return None;
        }
        for i in 0..n {
            let uuid = rec
                .gpu_uuid
                .get(i)
                .map_or(false, |u| u.as_ref().map_or(false, |s| !s.is_empty()));
            let index = rec.gpu_index.get(i).map_or(false, |x| x.is_some());
            if !(uuid || index) {
                return None;
            }
        }
        if !rec.ts.iter().all(|&t| self.ts_min <= t && t < self.ts_max) {
            return None;
        }
        Some(source)
    }

    /// Reads the record's `gpus` object (`contracts.GpuColumns`) into `rec`.
    fn columns<'a>(&self, sc: &mut Scan<'a>, rec: &mut Checked<'a>) -> Option<()> {
        let mut seen = 0u32;
        sc.object(|sc, key| {
            let m = COLUMN_MEMBERS.iter().position(|m| *m == key)?;
            if seen & (1 << m) != 0 {
                return None;
            }
            seen |= 1 << m;
            match m {
                0 => sc.list(&mut rec.ts, |sc| sc.float()),
                1 => sc.list(&mut rec.gpu_uuid, |sc| sc.opt_string()),
                2 => sc.list(&mut rec.gpu_index, |sc| sc.opt_int()),
                3 => sc.list(&mut rec.gpu_instance_id, |sc| sc.opt_int()),
                4 => sc.list(&mut rec.gpu_instance_profile, |sc| sc.opt_string()),
                5 => sc.list(&mut rec.model_name, |sc| sc.opt_string()),
                6 => sc.array(|sc| {
                    let entries = &mut rec.field_entries;
                    // names the decoder reads are checked for a repeat by one bit each
                    let mut known = 0u64;
                    let text = sc.map(&mut rec.keys, |sc, key| {
                        let v = sc.num()?;
                        match self.name_of(key) {
                            Some(j) => {
                                entries.push((j, v));
                                if j >= 64 {
                                    return Some(true);
                                }
                                if known & (1 << j) != 0 {
                                    return None;
                                }
                                known |= 1 << j;
                                Some(false)
                            }
                            None => Some(true),
                        }
                    })?;
                    rec.fields.push((text, rec.field_entries.len()));
                    Some(())
                }),
                7 => sc.array(|sc| {
                    let inner = &mut rec.inner_keys;
                    sc.map(&mut rec.keys, |sc, _| {
                        sc.array(|sc| series(sc, inner)).map(|_| true)
                    })?;
                    rec.field_series += 1;
                    Some(())
                }),
                8 => sc.array(|sc| {
                    let entries = &mut rec.invalid_entries;
                    let text = sc.map(&mut rec.keys, |sc, key| {
                        let reason = sc.string()?;
                        if let Some(j) = self.name_of(key).and_then(|j| self.names[j].observed) {
                            entries.push((j, reason));
                        }
                        Some(true)
                    })?;
                    rec.invalid.push((text, rec.invalid_entries.len()));
                    Some(())
                }),
                _ => sc.array(|sc| {
                    let text = sc.map(&mut rec.keys, |sc, _| sc.string().map(|_| true))?;
                    rec.attributes.push(text);
                    Some(())
                }),
            }
        })?;
        // `ts` is required
        if seen & 1 == 0 {
            return None;
        }
        Some(())
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
    /// names whose `fields` and `invalid` entries each GPU's observation holds), `observation`
    /// (the class of the observations: a named tuple of `2 * len(observed) + 6` fields, in the
    /// order of [`DecodedScrapes`]'s `observations`).
    ///
    /// Raises `ValueError` if `default_source` is not one of `sources`, or `observation` is not
    /// a named tuple (a tuple subclass without `__dict__`, with `_fields`) of that many fields.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        _py: Python<'_>,
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
        observation: Bound<'_, pyo3::types::PyType>,
    ) -> PyResult<Self> {
        let fields = 2 * observed.len() + 6;
        let named_tuple = observation.is_subclass_of::<PyTuple>()?
            && observation.getattr("__dictoffset__")?.extract::<isize>()? == 0
            && observation
                .getattr("_fields")
                .and_then(|f| f.len())
                .map_or(false, |n| n == fields);
        if !named_tuple {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "observation {observation} is not a named tuple of {fields} fields"
            )));
        }
        let default = sources
            .iter()
            .position(|s| *s == default_source)
            .ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "default_source {default_source:?} is not in sources"
                ))
            })?;
        let observed_count = observed.len();
        let mut names: Vec<FieldName> = Vec::new();
        for name in float_fields.iter().chain(&whole_fields).chain(&observed) {
            if names.iter().all(|n| n.name != *name) {
                names.push(FieldName {
                    name: name.clone(),
                    tail: tail(name),
                    float: float_fields.iter().position(|f| f == name),
                    whole: whole_fields.iter().position(|f| f == name),
                    observed: observed.iter().position(|f| f == name),
                });
            }
        }
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
            observed_count,
            observation: observation.unbind(),
            strings: Mutex::new(StrCache::default()),
            shape: Mutex::new(LastShape::default()),
            names,
        })
    }

    /// Decode a batch: `values` holds each record's JSON (bytes, UTF-8). Returns a
    /// [`DecodedScrapes`] of the records accepted; the others are left out (their indexes are
    /// not in `accepted`) for the reference to decide. `threads` (at least 1) bounds the threads
    /// that read the records: a batch of at least [`SHARD_BYTES`] bytes a thread is cut into
    /// runs of consecutive records of about equal size, read at once without the GIL, and its
    /// columns come in one chunk a run. Raises `TypeError` if an element of `values` is not
    /// bytes; never raises for a record's content.
    #[pyo3(signature = (values, threads = 1))]
    fn decode(
        &self,
        py: Python<'_>,
        values: &Bound<'_, PyList>,
        threads: usize,
    ) -> PyResult<DecodedScrapes> {
        let items = values
            .iter()
            .map(|item| item.downcast_into::<PyBytes>().map_err(PyErr::from))
            .collect::<PyResult<Vec<_>>>()?;
        let texts: Vec<&[u8]> = items.iter().map(|b| b.as_bytes()).collect();
        let input_bytes: usize = texts.iter().map(|t| t.len()).sum();
        let shape = *self.shape.lock().unwrap_or_else(|e| e.into_inner());
        let cuts = shard_cuts(&texts, threads.min(input_bytes / SHARD_BYTES).max(1));
        // SAFETY of reading without the GIL: `items` holds a reference to every bytes object,
        // whose contents never change, until this call returns.
        let shards: Vec<Shard<'_>> = py.allow_threads(|| {
            if cuts.len() == 2 {
                return vec![self.read_shard(&texts, 0, &shape)];
            }
            std::thread::scope(|s| {
                let handles: Vec<_> = cuts
                    .windows(2)
                    .map(|w| {
                        let (first, run) = (w[0], &texts[w[0]..w[1]]);
                        s.spawn(move || self.read_shard(run, first, &shape))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                    .collect()
            })
        });
        *self.shape.lock().unwrap_or_else(|e| e.into_inner()) = LastShape {
            input_bytes,
            rows: shards.iter().map(|s| s.ts.len()).sum(),
            text_bytes: std::array::from_fn(|c| {
                shards.iter().map(|s| s.cols.text.all()[c].data.len()).sum()
            }),
        };
        let (counts, observations) = self.observe(py, &shards)?;
        let mut accepted: Vec<usize> = Vec::new();
        let arrays = PyDict::new_bound(py);
        let float_dict = PyDict::new_bound(py);
        let whole_dict = PyDict::new_bound(py);
        let mut chunk_rows: Vec<usize> = Vec::new();
        for shard in shards {
            accepted.extend(&shard.accepted);
            chunk_rows.push(shard.ts.len());
            let c = shard.cols;
            let text = c.text;
            for (name, col) in [
                ("ts", c.ts),
                ("seq", c.seq),
                ("gpu_index", c.index),
                ("gpu_instance_id", c.instance),
            ] {
                append_chunk(&arrays, name, fixed_buffers(py, col)?)?;
            }
            for (name, col) in [
                ("host", text.host),
                ("source", text.source),
                ("target", text.target),
                ("gpu_uuid", text.uuid),
                ("gpu_instance_profile", text.profile),
                ("model_name", text.model),
                ("fields", text.fields),
                ("invalid", text.invalid),
                ("attributes", text.attributes),
            ] {
                append_chunk(&arrays, name, str_buffers(py, col)?)?;
            }
            for (name, col) in self.float_fields.iter().zip(c.floats) {
                append_chunk(&float_dict, name, fixed_buffers(py, col)?)?;
            }
            for (name, col) in self.whole_fields.iter().zip(c.wholes) {
                append_chunk(&whole_dict, name, fixed_buffers(py, col)?)?;
            }
        }
        let list = |v: Vec<PyObject>| owned_list(py, v);
        Ok(DecodedScrapes {
            accepted: PyList::new_bound(py, accepted).unbind(),
            counts: list(counts)?,
            observations: list(observations)?,
            chunk_rows: PyList::new_bound(py, chunk_rows).unbind(),
            arrays: arrays.unbind(),
            float_fields: float_dict.unbind(),
            whole_fields: whole_dict.unbind(),
        })
    }
}

/// `dict[name]`, a list of chunks' buffers, with `chunk` appended (the list made on first use).
fn append_chunk(dict: &Bound<'_, PyDict>, name: &str, chunk: Bound<'_, PyTuple>) -> PyResult<()> {
    match dict.get_item(name)? {
        Some(list) => list.downcast_into::<PyList>()?.append(chunk),
        None => dict.set_item(name, PyList::new_bound(dict.py(), [chunk])),
    }
}

/// Record indexes that cut `texts` into `shards` runs of consecutive records of about equal
/// bytes: `shards + 1` ascending indexes from 0 to `texts.len()` (fewer runs when records are
/// few; never an empty run but for an empty batch).
fn shard_cuts(texts: &[&[u8]], shards: usize) -> Vec<usize> {
    let total: usize = texts.iter().map(|t| t.len()).sum();
    let mut cuts = vec![0];
    let mut seen = 0usize;
    for (k, t) in texts.iter().enumerate() {
        seen += t.len();
        let next = cuts.len();
        if next < shards && k + 1 < texts.len() && seen as u128 * shards as u128 >= total as u128 * next as u128 {
            cuts.push(k + 1);
        }
    }
    cuts.push(texts.len());
    cuts
}

impl ScrapeDecoder {
    /// Reads the records `texts` (the batch's records from index `first` on) into a [`Shard`]:
    /// their columns and, per GPU, what its observation holds. Needs no GIL.
    fn read_shard<'a>(&self, texts: &[&'a [u8]], first: usize, shape: &LastShape) -> Shard<'a> {
        let width = self.observed_count;
        let input_bytes: usize = texts.iter().map(|t| t.len()).sum();
        let mut out = Shard::new(self, shape, input_bytes);
        let cols = &mut out.cols;
        let text = &mut cols.text;
        let mut floats: Vec<Option<f64>> = vec![None; self.float_fields.len()];
        let mut wholes: Vec<Option<i64>> = vec![None; self.whole_fields.len()];
        let mut rec = Checked::default();
        for (k, &value) in texts.iter().enumerate() {
            // the columns of the GPUs' own texts (not the record's, repeated: checked below)
            let most = text.all().iter().skip(3).map(|c| c.data.len()).max().unwrap_or(0);
            // a string column's text never grows by more than the record's length: keep the
            // int32 offsets in range by leaving a record that could pass it to the reference
            if most.saturating_add(value.len()) >= i32::MAX as usize {
                continue;
            }
            rec.clear();
            let src = match self.check(value, &mut rec) {
                Some(src) => src,
                None => continue,
            };
            let n = rec.ts.len();
            let t_str = rec.target.as_deref().unwrap_or(&self.default_target);
            // the record's own texts are repeated for each of its GPUs: the same int32 limit
            let repeated = [
                (&text.host, rec.host.len()),
                (&text.source, self.sources[src].len()),
                (&text.target, t_str.len()),
            ];
            if repeated.iter().any(|(c, len)| {
                c.data.len().saturating_add(n.saturating_mul(*len)) >= i32::MAX as usize
            }) {
                continue;
            }
            out.accepted.push(first + k);
            out.counts.push(n);
            let first_seq = rec.seq.unwrap_or(self.default_seq);
            let mut field_start = 0;
            let mut invalid_start = 0;
            for i in 0..n {
                let t = rec.ts[i];
                out.ts.push(t);
                cols.ts.push_i64(Some(round_half_even(t * 1e6) as i64));
                text.host.push(Some(&rec.host));
                text.source.push(Some(&self.sources[src]));
                text.target.push(Some(t_str));
                cols.seq.push_i64(first_seq.checked_add(i as i64));
                text.uuid.push(rec.gpu_uuid.get(i).and_then(|u| u.as_deref()));
                cols.index.push_i64(rec.gpu_index.get(i).copied().flatten());
                cols.instance.push_i64(rec.gpu_instance_id.get(i).copied().flatten());
                text.profile.push(rec.gpu_instance_profile.get(i).and_then(|p| p.as_deref()));
                text.model.push(rec.model_name.get(i).and_then(|m| m.as_deref()));
                text.fields.push(Some(rec.fields.get(i).map_or("{}", |f| f.0)));
                text.invalid.push(Some(rec.invalid.get(i).map_or("{}", |f| f.0)));
                text.attributes.push(Some(rec.attributes.get(i).copied().unwrap_or("{}")));
                floats.iter_mut().for_each(|v| *v = None);
                wholes.iter_mut().for_each(|v| *v = None);
                let gpu = out.ts.len() - 1;
                let seen = out.values.len();
                out.values.resize(seen + width, Seen::default());
                if let Some(&(_, end)) = rec.fields.get(i) {
                    for (j, v) in &rec.field_entries[field_start..end] {
                        let name = &self.names[*j];
                        if let Some(j) = name.float {
                            floats[j] = as_float(*v);
                        }
                        if let Some(j) = name.whole {
                            wholes[j] = as_whole(*v);
                        }
                        if let Some(j) = name.observed {
                            out.values[seen + j] = match *v {
                                Num::Int(x) => Seen { bits: x as u64, kind: 1 },
                                Num::Float(x) => Seen { bits: x.to_bits(), kind: 2 },
                                Num::Big(text) => {
                                    out.bigs.push(text);
                                    Seen { bits: (out.bigs.len() - 1) as u64, kind: 3 }
                                }
                            };
                        }
                    }
                    field_start = end;
                }
                if let Some(&(_, end)) = rec.invalid.get(i) {
                    for (j, reason) in &rec.invalid_entries[invalid_start..end] {
                        out.reasons.push((gpu, *j, reason.clone()));
                    }
                    invalid_start = end;
                }
                for (c, v) in cols.floats.iter_mut().zip(&floats) {
                    c.push_f64(*v);
                }
                for (c, v) in cols.wholes.iter_mut().zip(&wholes) {
                    c.push_i64(*v);
                }
            }
        }
        out
    }

    /// Per record of `shards` its GPU count, and per GPU its observation (an instance of the
    /// `observation` class: [`DecodedScrapes`]), each as a Python object. A value or text repeated
    /// from the GPU before, and a host or GPU UUID seen before (kept from call to call), is one
    /// object.
    fn observe(&self, py: Python<'_>, shards: &[Shard<'_>]) -> PyResult<(Vec<PyObject>, Vec<PyObject>)> {
        let width = self.observed_count;
        let none = py.None();
        let int_type = py.get_type_bound::<pyo3::types::PyLong>();
        let observation = self.observation.bind(py);
        let rows: usize = shards.iter().map(|s| s.ts.len()).sum();
        let mut counts: Vec<PyObject> = Vec::with_capacity(shards.iter().map(|s| s.counts.len()).sum());
        let mut observations: Vec<PyObject> = Vec::with_capacity(rows);
        let mut slots: Vec<PyObject> = Vec::with_capacity(2 * width + 6);
        let mut last_host: Option<(&str, PyObject)> = None;
        let mut last_model: Option<(&str, PyObject)> = None;
        let mut last_ts: Option<(u64, PyObject)> = None;
        let mut last_values: Vec<Option<LastValue<'_>>> = (0..width).map(|_| None).collect();
        // Waits for the lock with the GIL released: a thread that holds it may need the GIL.
        let mut strings = loop {
            match self.strings.try_lock() {
                Ok(guard) => break guard,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => py.allow_threads(std::thread::yield_now),
            }
        };
        for shard in shards {
            counts.extend(shard.counts.iter().map(|n| n.into_py(py)));
            let cols = &shard.cols;
            let mut reasons = shard.reasons.iter().peekable();
            for (g, &ts) in shard.ts.iter().enumerate() {
                slots.clear();
                for (j, v) in shard.values[g * width..(g + 1) * width].iter().enumerate() {
                    if v.kind == 0 {
                        slots.push(none.clone_ref(py));
                        continue;
                    }
                    // the previous GPU's object of this field when the value is the same
                    let obj: Bound<'_, PyAny> = match &last_values[j] {
                        Some(((bits, int), obj)) if v.kind != 3 && *bits == v.bits && *int == (v.kind == 1) => obj.clone(),
                        _ => {
                            let obj: Bound<'_, PyAny> = match v.kind {
                                1 => (v.bits as i64).into_py(py).into_bound(py),
                                2 => PyFloat::new_bound(py, f64::from_bits(v.bits)).into_any(),
                                _ => int_type.call1((PyString::new_bound(py, shard.bigs[v.bits as usize]),))?,
                            };
                            last_values[j] = if v.kind == 3 { None } else { Some(((v.bits, v.kind == 1), obj.clone())) };
                            obj
                        }
                    };
                    slots.push(obj.unbind());
                }
                let first_reason = slots.len();
                slots.extend((0..width).map(|_| none.clone_ref(py)));
                while let Some((_, j, reason)) = reasons.next_if(|r| r.0 == g) {
                    slots[first_reason + *j] = PyString::new_bound(py, reason).into_any().unbind();
                }
                let ts = match &last_ts {
                    Some((prev, obj)) if *prev == ts.to_bits() => obj.clone_ref(py),
                    _ => {
                        let obj = PyFloat::new_bound(py, ts).into_any().unbind();
                        last_ts = Some((ts.to_bits(), obj.clone_ref(py)));
                        obj
                    }
                };
                let host = cols.text.host.get(g).unwrap_or_default();
                let host = match &last_host {
                    Some((text, obj)) if *text == host => obj.clone_ref(py),
                    _ => {
                        let obj = strings.get(py, host);
                        last_host = Some((host, obj.clone_ref(py)));
                        obj
                    }
                };
                let model = match cols.text.model.get(g) {
                    None => none.clone_ref(py),
                    Some(s) => match &last_model {
                        Some((text, obj)) if *text == s => obj.clone_ref(py),
                        _ => {
                            let obj = PyString::new_bound(py, s).into_any().unbind();
                            last_model = Some((s, obj.clone_ref(py)));
                            obj
                        }
                    },
                };
                let opt_int = |v: Option<i64>| v.map_or_else(|| none.clone_ref(py), |v| v.into_py(py));
                slots.extend([
                    ts,
                    host,
                    cols.text.uuid.get(g).map_or_else(|| none.clone_ref(py), |s| strings.get(py, s)),
                    opt_int(cols.index.get_i64(g)),
                    opt_int(cols.instance.get_i64(g)),
                    model,
                ]);
                observations.push(atomic_record(py, observation, slots.drain(..))?);
            }
        }
        Ok((counts, observations))
    }
}

/// The compiled decoder of `contracts.GpuScrape` records (crate documentation).
#[pymodule]
fn analytics_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ScrapeDecoder>()?;
    m.add_class::<DecodedScrapes>()?;
    m.add_class::<Buffer>()?;
    m.add("RECORD_MEMBERS", RECORD_MEMBERS.to_vec())?;
    m.add("COLUMN_MEMBERS", COLUMN_MEMBERS.to_vec())?;
    m.add("SERIES_MEMBERS", SERIES_MEMBERS.to_vec())?;
    m.add("SHARD_BYTES", SHARD_BYTES)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number's value as `Scan::num` reads it from `text` alone, or `None` when refused.
    fn num(text: &str) -> Option<Num<'_>> {
        let mut sc = Scan::new(text.as_bytes());
        let v = sc.num()?;
        if sc.at_end() {
            Some(v)
        } else {
            None
        }
    }

    #[test]
    fn numbers_keep_their_kind() {
        assert_eq!(num("5"), Some(Num::Int(5)));
        assert_eq!(num("-0"), Some(Num::Int(0)));
        assert_eq!(num("5.0"), Some(Num::Float(5.0)));
        assert_eq!(num("1e2"), Some(Num::Float(100.0)));
        assert_eq!(num("1E-7"), Some(Num::Float(1e-7)));
        assert_eq!(num("1e400"), None);
        assert_eq!(
            num("9223372036854775808"),
            Some(Num::Big("9223372036854775808"))
        );
        for refused in [
            "\"5\"", "01", "-01", "1.", ".5", "+1", "1e", "1e+", "--1", "-", "0x1",
        ] {
            assert_eq!(num(refused), None, "{}", refused);
        }
    }

    #[test]
    fn strings_unescape_exactly() {
        let read = |text: &str| Scan::new(text.as_bytes()).string().map(|s| s.into_owned());
        assert_eq!(
            read(r#""a\"\\\/\b\f\n\r\t""#).as_deref(),
            Some("a\"\\/\u{8}\u{c}\n\r\t")
        );
        assert_eq!(
            read(r#""\ud83d\ude00\u00E9""#).as_deref(),
            Some("\u{1f600}\u{e9}")
        );
        for refused in [
            r#""\ud800""#,
            r#""\udc00""#,
            r#""\ud800\u0041""#,
            r#""\x""#,
            r#""\u12""#,
            "\"\u{1}\"",
            "\"a",
        ] {
            assert_eq!(read(refused), None, "{}", refused);
        }
    }

    #[test]
    fn plain_len_stops_at_the_first_byte_a_string_does_not_hold_as_is() {
        let special = |c: u8| c == b'"' || c == b'\\' || c < 0x20 || c >= 0x80;
        for c in 0..=255u8 {
            for at in 0..20 {
                let mut b = vec![b'a'; 20];
                b[at] = c;
                assert_eq!(
                    plain_len(&b),
                    if special(c) { at } else { 20 },
                    "{} at {}",
                    c,
                    at
                );
                for d in [0u8, b'"', 0x7f, 0xff] {
                    if let Some(x) = b.get_mut(at + 1) {
                        *x = d;
                    }
                    let want = if special(c) {
                        at
                    } else if special(d) && at + 1 < 20 {
                        at + 1
                    } else {
                        20
                    };
                    assert_eq!(plain_len(&b), want, "{} at {} then {}", c, at, d);
                }
            }
        }
    }

    #[test]
    fn buffers_are_sized_in_proportion_to_the_input_at_most_twice_it() {
        let shape = LastShape { input_bytes: 1000, rows: 100, text_bytes: [0; 9] };
        assert_eq!(shape.scaled(100, 1000), 106);
        assert_eq!(shape.scaled(100, 2000), 212);
        assert_eq!(shape.scaled(100, 50), 5);
        assert_eq!(shape.scaled(1900, 1000), 2000);
        assert_eq!(shape.scaled(1880, 1000), 1997);
        assert_eq!(LastShape::default().scaled(100, 1000), 0);
    }

    #[test]
    fn runs_are_cut_at_the_record_that_reaches_their_share_of_the_bytes() {
        let cut = |sizes: &[usize], shards: usize| {
            let texts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![b' '; n]).collect();
            let slices: Vec<&[u8]> = texts.iter().map(|t| t.as_slice()).collect();
            shard_cuts(&slices, shards)
        };
        assert_eq!(cut(&[10, 10, 10, 10], 2), [0, 2, 4]);
        assert_eq!(cut(&[10, 10, 10, 10], 4), [0, 1, 2, 3, 4]);
        assert_eq!(cut(&[10, 10, 10, 11], 2), [0, 3, 4]);
        assert_eq!(cut(&[10, 10, 10, 10], 1), [0, 4]);
        assert_eq!(cut(&[100, 1, 1], 3), [0, 1, 2, 3]);
        assert_eq!(cut(&[1, 1, 100], 3), [0, 3]);
        assert_eq!(cut(&[5], 4), [0, 1]);
        assert_eq!(cut(&[], 4), [0, 0]);
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
