//! Query parameters read into typed structs: [`Params`] refuses a
//! parameter the struct does not name, and each value type says what it
//! takes when a value does not parse. Every refusal is a 400 `bad_query`
//! whose message starts with the parameter's name.

use std::collections::BTreeMap;

use axum::extract::{FromRequestParts, Query};
use axum::http::request::Parts;
use gpuflow_api::{self as api, ApiError, JobState};
use serde::de::{self, DeserializeOwned, Deserializer, IntoDeserializer, Visitor};
use serde_json::{Value as Json, json};

use super::{Error, MAX_PAGE};

/// A handler's query parameters as `T`, a struct whose fields are the
/// parameters it takes (each optional). When a parameter is repeated, the
/// last one counts.
pub(crate) struct Params<T>(pub T);

/// A struct of query parameters.
pub(crate) trait ParamSet: DeserializeOwned {
    /// What the refusal of an unknown parameter calls it.
    const WORD: &'static str = "parameter";
    /// Notes written after a parameter's name in the list of those allowed.
    const NOTES: &'static [(&'static str, &'static str)] = &[];
}

fn bad(message: String) -> Error {
    ApiError::bad_request("bad_query", message).into()
}

impl<S: Send + Sync, T: ParamSet> FromRequestParts<S> for Params<T> {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Error> {
        let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(&parts.uri)
            .map_err(|e| bad(format!("the query string: {}", e.body_text())))?;
        let given: BTreeMap<String, String> = pairs.into_iter().collect();
        let names = fields::<T>();
        if let Some(k) = given.keys().find(|k| !names.contains(&k.as_str())) {
            let allowed: Vec<String> = names
                .iter()
                .map(|n| match T::NOTES.iter().find(|(m, _)| m == n) {
                    Some((_, note)) => format!("{n} ({note})"),
                    None => (*n).to_string(),
                })
                .collect();
            return Err(bad(format!(
                "unknown {} {k:?}; allowed: {}",
                T::WORD,
                allowed.join(", ")
            )));
        }
        let map = de::value::MapDeserializer::<_, de::value::Error>::new(
            given.into_iter().map(|(k, v)| (k, Value(v))),
        );
        serde_path_to_error::deserialize(map)
            .map(Params)
            .map_err(|e| bad(format!("{}: {}", e.path(), e.inner())))
    }
}

/// The query parameters of `T` as the OpenAPI document lists them, in
/// the struct's order: each field's name, its doc comment and the schema
/// of its value type. The document and the extractor read the same struct,
/// so they cannot drift apart.
pub(crate) fn documented<T: ParamSet + schemars::JsonSchema>() -> Vec<Json> {
    let mut settings = schemars::generate::SchemaSettings::draft2020_12();
    settings.inline_subschemas = true;
    settings.meta_schema = None;
    let root = settings.into_generator().into_root_schema_for::<T>();
    let props = root
        .as_value()
        .get("properties")
        .cloned()
        .unwrap_or_default();
    fields::<T>()
        .iter()
        .map(|name| {
            let mut schema = props.get(*name).cloned().unwrap_or_else(|| json!({}));
            let description = schema
                .as_object_mut()
                .and_then(|o| o.remove("description"))
                .unwrap_or_else(|| json!(""));
            not_null(&mut schema);
            json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
        })
        .collect()
}

/// A schema without the null an `Option` adds: a parameter is absent, never
/// null.
fn not_null(schema: &mut Json) {
    let Some(o) = schema.as_object_mut() else {
        return;
    };
    if let Some(Json::Array(types)) = o.get_mut("type") {
        types.retain(|t| t != "null");
        if let [one] = types.as_slice() {
            let one = one.clone();
            o.insert("type".into(), one);
        }
    }
    if let Some(Json::Array(any)) = o.get("anyOf") {
        let rest: Vec<Json> = any
            .iter()
            .filter(|x| **x != json!({"type": "null"}))
            .cloned()
            .collect();
        if let [Json::Object(only)] = rest.as_slice() {
            let only = only.clone();
            o.remove("anyOf");
            o.extend(only);
        }
    }
}

/// The JSON Schema of a value type, inlined where it is used.
macro_rules! schema {
    ($t:ty, $schema:tt) => {
        impl schemars::JsonSchema for $t {
            fn inline_schema() -> bool {
                true
            }
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($t).into()
            }
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!($schema)
            }
        }
    };
}
pub(crate) use schema;

/// The job states a comma separated list may name.
fn states_pattern() -> String {
    let one = api::ALL_STATES
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join("|");
    format!("^({one})(,({one}))*$")
}

/// The schema of a name (team, user, queue, project, node).
pub(crate) fn name_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "pattern": crate::openapi::NAME_PATTERN})
}

schema!(Flag, {"type": "boolean"});
schema!(Whole, {"type": "integer", "minimum": 0});
schema!(Seq, {"type": "integer", "minimum": 0});
schema!(UnixTime, {"type": "integer", "minimum": 0});
schema!(PageLimit, {"type": "integer", "minimum": 1, "maximum": MAX_PAGE});
schema!(TermSize, {"type": "integer", "minimum": 1, "maximum": 65535});
schema!(JobId, {"type": "integer", "minimum": 1});
schema!(States, {"type": "string", "pattern": states_pattern()});
schema!(When, {"type": "string", "maxLength": 40});
schema!(Age, {"type": "string", "maxLength": 40});
schema!(Percent, {"type": "number", "minimum": 0, "maximum": 100});

/// The names of a struct's fields, as serde reads them.
fn fields<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names(&'static [&'static str]);
    impl<'de> Deserializer<'de> for &mut Names {
        type Error = de::value::Error;
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(de::Error::custom("only the names were asked for"))
        }
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("parameters are a struct"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    let mut names = Names(&[]);
    let _ = T::deserialize(&mut names);
    names.0
}

/// One parameter's text: `Some` for an optional field, else the text.
struct Value(String);

impl<'de> IntoDeserializer<'de, de::value::Error> for Value {
    type Deserializer = Value;
    fn into_deserializer(self) -> Value {
        self
    }
}

impl<'de> Deserializer<'de> for Value {
    type Error = de::value::Error;
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_some(self)
    }
    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        visitor.visit_string(self.0)
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

/// A value read from a parameter's text; the error says what it takes.
pub(crate) trait FromParam: Sized {
    fn from_param(v: &str) -> Result<Self, String>;
}

/// `Deserialize` through [`FromParam`], for each value type.
macro_rules! from_param {
    ($($t:ty),*) => {$(
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let v = <String as serde::Deserialize>::deserialize(d)?;
                <$t as $crate::http::params::FromParam>::from_param(&v)
                    .map_err(serde::de::Error::custom)
            }
        }
    )*};
}
pub(crate) use from_param;
from_param!(
    Flag, Whole, Seq, UnixTime, PageLimit, TermSize, JobId, States, When, Age, Percent
);

/// `true` or `false`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Flag(pub bool);
impl FromParam for Flag {
    fn from_param(v: &str) -> Result<Self, String> {
        match v {
            "true" => Ok(Flag(true)),
            "false" => Ok(Flag(false)),
            _ => Err(format!("{v:?} is neither true nor false")),
        }
    }
}

/// A whole number, 0 or more.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Whole(pub u64);
impl FromParam for Whole {
    fn from_param(v: &str) -> Result<Self, String> {
        v.parse()
            .map(Whole)
            .map_err(|_| format!("{v:?} is not a whole number"))
    }
}

/// A position in a log (events, audit): the last sequence number seen.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seq(pub i64);
impl FromParam for Seq {
    fn from_param(v: &str) -> Result<Self, String> {
        v.parse()
            .map(Seq)
            .map_err(|_| format!("{v:?} is not a number (the last seq seen)"))
    }
}

/// A time in Unix seconds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct UnixTime(pub u64);
impl FromParam for UnixTime {
    fn from_param(v: &str) -> Result<Self, String> {
        v.parse()
            .map(UnixTime)
            .map_err(|_| format!("Unix seconds, not {v:?}"))
    }
}

/// A page size: 1 to [`MAX_PAGE`]; the most when not given.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageLimit(pub usize);
impl Default for PageLimit {
    fn default() -> Self {
        PageLimit(MAX_PAGE)
    }
}
impl FromParam for PageLimit {
    fn from_param(v: &str) -> Result<Self, String> {
        match v.parse::<usize>() {
            Ok(n @ 1..=MAX_PAGE) => Ok(PageLimit(n)),
            _ => Err(format!(
                "{v:?} is not a page size: 1 to {MAX_PAGE}; page on with `before` (jobs, the last id seen) or `after` (events, audit: the last seq seen)"
            )),
        }
    }
}

/// A terminal's rows or columns.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TermSize(pub u16);
impl FromParam for TermSize {
    fn from_param(v: &str) -> Result<Self, String> {
        v.parse::<u16>()
            .ok()
            .filter(|&n| n > 0)
            .map(TermSize)
            .ok_or_else(|| format!("{v:?} is not a number from 1 to 65535"))
    }
}

/// A job's id.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JobId(pub u64);
impl FromParam for JobId {
    fn from_param(v: &str) -> Result<Self, String> {
        v.parse()
            .map(JobId)
            .map_err(|_| format!("{v:?} is not a job id (a positive number)"))
    }
}

/// One job state or several, comma separated (`running,pending`).
#[derive(Clone, Debug)]
pub(crate) struct States(pub Vec<JobState>);
impl FromParam for States {
    fn from_param(v: &str) -> Result<Self, String> {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                JobState::parse(s).ok_or_else(|| {
                    let all: Vec<&str> = api::ALL_STATES.iter().map(|s| s.as_str()).collect();
                    format!(
                        "unknown state {s:?}; allowed: {} (several, comma separated)",
                        all.join(", ")
                    )
                })
            })
            .collect::<Result<_, _>>()
            .map(States)
    }
}

/// A time for a report's range: Unix seconds, a date, RFC 3339, or an age.
#[derive(Clone, Copy, Debug)]
pub(crate) enum When {
    At(u64),
    Ago(u64),
}
impl When {
    /// The time it names, ages counted back from `now`.
    pub(crate) fn at(self, now: u64) -> u64 {
        match self {
            When::At(t) => t,
            When::Ago(d) => now.saturating_sub(d),
        }
    }
}
impl FromParam for When {
    fn from_param(v: &str) -> Result<Self, String> {
        if let Ok(t) = v.parse::<u64>() {
            return Ok(When::At(t));
        }
        if let Ok(d) = humantime::parse_duration(v) {
            return Ok(When::Ago(d.as_secs()));
        }
        let full = if v.len() == 10 {
            format!("{v}T00:00:00Z")
        } else {
            v.to_string()
        };
        humantime::parse_rfc3339_weak(&full)
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| When::At(d.as_secs()))
            .ok_or_else(|| {
                format!("{v:?} is not a time: use Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age such as 7d")
            })
    }
}

/// How long, in seconds: `30m`, `2h`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Age(pub u64);
impl FromParam for Age {
    fn from_param(v: &str) -> Result<Self, String> {
        humantime::parse_duration(v)
            .map(|d| Age(d.as_secs()))
            .map_err(|_| format!("{v:?} is not a duration such as 30m or 2h"))
    }
}

/// A percentage from 0 to 100.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Percent(pub f64);
impl FromParam for Percent {
    fn from_param(v: &str) -> Result<Self, String> {
        v.parse()
            .ok()
            .filter(|p: &f64| (0.0..=100.0).contains(p))
            .map(Percent)
            .ok_or_else(|| "a percentage from 0 to 100".to_string())
    }
}

/// A page of a list ordered by name: `limit` items after `after`.
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(crate) struct NamePage {
    /// page size (at most 1000)
    #[serde(default)]
    pub limit: PageLimit,
    /// items after this name or id (the next page: the last one seen)
    #[schemars(length(max = 64))]
    pub after: Option<String>,
}
impl ParamSet for NamePage {
    const NOTES: &'static [(&'static str, &'static str)] = &[("after", "the last name seen")];
}

impl NamePage {
    /// The page of a map ordered by its keys.
    pub(crate) fn of<'m, V>(
        &self,
        map: &'m BTreeMap<String, V>,
    ) -> impl Iterator<Item = (&'m String, &'m V)> + use<'m, V> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = match &self.after {
            Some(a) => Excluded(a.clone()),
            None => Unbounded,
        };
        map.range((from, Unbounded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, schemars::JsonSchema, Debug)]
    struct Two {
        /// how many
        #[serde(default)]
        limit: PageLimit,
        /// from when
        since: Option<UnixTime>,
    }
    impl ParamSet for Two {}

    async fn read(uri: &str) -> Result<Two, String> {
        let (mut parts, ()) = axum::http::Request::builder()
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts();
        Params::<Two>::from_request_parts(&mut parts, &())
            .await
            .map(|Params(t)| t)
            .map_err(|Error(e)| e.message)
    }

    #[tokio::test]
    async fn parameters_are_read_checked_and_named() {
        assert_eq!(fields::<Two>(), ["limit", "since"]);
        let t = read("/x").await.unwrap();
        assert_eq!((t.limit.0, t.since.map(|s| s.0)), (MAX_PAGE, None));
        let t = read("/x?since=5&limit=2&limit=3").await.unwrap();
        assert_eq!((t.limit.0, t.since.map(|s| s.0)), (3, Some(5)));
        // Percent-decoded before it is read.
        let t = read("/x?since=%31%32").await.unwrap();
        assert_eq!(t.since.map(|s| s.0), Some(12));
        assert_eq!(
            read("/x?b=1&a=2").await.unwrap_err(),
            "unknown parameter \"a\"; allowed: limit, since"
        );
        assert_eq!(
            read("/x?since=soon").await.unwrap_err(),
            "since: Unix seconds, not \"soon\""
        );
        assert!(
            read("/x?limit=0")
                .await
                .unwrap_err()
                .starts_with("limit: \"0\" is not a page size")
        );
    }

    #[test]
    fn the_document_lists_the_structs_parameters_in_order() {
        assert_eq!(
            documented::<Two>(),
            [
                json!({"name": "limit", "in": "query", "required": false, "description": "how many",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}),
                json!({"name": "since", "in": "query", "required": false, "description": "from when",
                    "schema": {"type": "integer", "minimum": 0}}),
            ]
        );
    }
}
