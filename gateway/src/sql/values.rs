//! JSON values <-> Postgres values, for the parameters and result columns of fenced
//! SQL transactions.
//!
//! # Behavior
//!
//! The Postgres type decides: a parameter's type is the one the database reports for
//! the prepared statement, a column's is the one it reports for the result. Values are
//! converted by tokio-postgres's `ToSql`/`FromSql` implementations of the Rust type
//! in the table below; nothing here reads or writes the wire format itself.
//!
//! | Postgres                      | JSON                                  | Rust           |
//! |-------------------------------|---------------------------------------|----------------|
//! | `bool`                        | boolean                               | `bool`         |
//! | `int2`, `int4`, `int8`        | integer                               | `i16/i32/i64`  |
//! | `float4`, `float8`            | number, or `"NaN"`, `"Infinity"`, `"-Infinity"` | `f32/f64` |
//! | `numeric`                     | string (a number is accepted as input)| `Decimal`      |
//! | `text`, `varchar`, `bpchar`, `name` | string                          | `String`       |
//! | `json`, `jsonb`               | any JSON value                        | `Value`        |
//! | `uuid`                        | string                                | `Uuid`         |
//! | `timestamptz`                 | RFC 3339 string; answered in UTC (`Z`)| `DateTime<Utc>`|
//! | `timestamp`                   | RFC 3339 date-time without offset     | `NaiveDateTime`|
//! | `date`                        | `YYYY-MM-DD`                          | `NaiveDate`    |
//! | `bytea`                       | base64 string (standard alphabet)     | `Vec<u8>`      |
//! | one-dimensional arrays of these | array; elements may be `null`       | `Vec<Option<T>>` |
//!
//! Fractional seconds are answered in groups of three digits (`.250`, `.123456`).
//! JSON `null` is SQL NULL for every type — for `json`/`jsonb` too, so a JSON `null`
//! document cannot be bound. `numeric` values are limited to what `Decimal` holds: 28
//! significant digits, no `NaN` or infinities.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use chrono::{DateTime, NaiveDate, NaiveDateTime, SecondsFormat, Utc};
use rust_decimal::Decimal;
use serde_json::{Number, Value};
use tokio_postgres::types::{FromSql, Kind, ToSql, Type};
use tokio_postgres::Row;
use uuid::Uuid;

/// A parameter ready to bind.
pub type Param = Box<dyn ToSql + Sync + Send>;

/// Why a JSON value cannot be bound to a parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParamError {
    /// The parameter's type is not in the table.
    Unsupported,
    /// The value does not fit the type; the reason is safe to show the writer.
    Invalid(String),
}

#[derive(Debug, Clone, Copy)]
enum Scalar {
    Bool,
    Int2,
    Int4,
    Int8,
    Float4,
    Float8,
    Numeric,
    Text,
    Json,
    Uuid,
    Timestamptz,
    Timestamp,
    Date,
    Bytea,
}

impl Scalar {
    fn of(ty: &Type) -> Option<Scalar> {
        Some(match *ty {
            Type::BOOL => Scalar::Bool,
            Type::INT2 => Scalar::Int2,
            Type::INT4 => Scalar::Int4,
            Type::INT8 => Scalar::Int8,
            Type::FLOAT4 => Scalar::Float4,
            Type::FLOAT8 => Scalar::Float8,
            Type::NUMERIC => Scalar::Numeric,
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => Scalar::Text,
            Type::JSON | Type::JSONB => Scalar::Json,
            Type::UUID => Scalar::Uuid,
            Type::TIMESTAMPTZ => Scalar::Timestamptz,
            Type::TIMESTAMP => Scalar::Timestamp,
            Type::DATE => Scalar::Date,
            Type::BYTEA => Scalar::Bytea,
            _ => return None,
        })
    }
}

/// A supported type: a scalar, or a one-dimensional array of one.
fn shape(ty: &Type) -> Option<(Scalar, bool)> {
    match ty.kind() {
        Kind::Array(element) => Scalar::of(element).map(|scalar| (scalar, true)),
        _ => Scalar::of(ty).map(|scalar| (scalar, false)),
    }
}

/// Whether a result column of type `ty` can be converted. `void` (the result of
/// functions such as `pg_sleep`) is answered as `null`.
pub fn supported(ty: &Type) -> bool {
    shape(ty).is_some() || *ty == Type::VOID
}

/// `int8`, `text[]`: how types are named in answers and messages.
pub fn type_name(ty: &Type) -> String {
    match ty.kind() {
        Kind::Array(element) => format!("{}[]", element.name()),
        _ => ty.name().to_owned(),
    }
}

/// Converts `value` into a parameter of type `ty`.
pub fn to_param(value: &Value, ty: &Type) -> Result<Param, ParamError> {
    let (scalar, array) = shape(ty).ok_or(ParamError::Unsupported)?;
    let bind = match scalar {
        Scalar::Bool => bind(value, array, bool_of),
        Scalar::Int2 => bind(value, array, |v| narrow::<i16>(v, "int2")),
        Scalar::Int4 => bind(value, array, |v| narrow::<i32>(v, "int4")),
        Scalar::Int8 => bind(value, array, int_of),
        Scalar::Float4 => bind(value, array, float4_of),
        Scalar::Float8 => bind(value, array, float_of),
        Scalar::Numeric => bind(value, array, numeric_of),
        Scalar::Text => bind(value, array, |v| str_of(v).map(str::to_owned)),
        Scalar::Json => bind(value, array, |v| Ok(v.clone())),
        Scalar::Uuid => bind(value, array, uuid_of),
        Scalar::Timestamptz => bind(value, array, timestamptz_of),
        Scalar::Timestamp => bind(value, array, timestamp_of),
        Scalar::Date => bind(value, array, date_of),
        Scalar::Bytea => bind(value, array, bytea_of),
    };
    bind.map_err(ParamError::Invalid)
}

/// Converts column `index` of `row`, of type `ty` (checked with [`supported`]), to JSON.
pub fn column_value(row: &Row, index: usize, ty: &Type) -> Result<Value, String> {
    if *ty == Type::VOID {
        return Ok(Value::Null);
    }
    let Some((scalar, array)) = shape(ty) else {
        return Err(format!("type {} is not supported", type_name(ty)));
    };
    match scalar {
        Scalar::Bool => read(row, index, array, Value::Bool),
        Scalar::Int2 => read(row, index, array, |v: i16| Value::from(v)),
        Scalar::Int4 => read(row, index, array, |v: i32| Value::from(v)),
        Scalar::Int8 => read(row, index, array, |v: i64| Value::from(v)),
        Scalar::Float4 => read(row, index, array, |v: f32| float_json(f64::from(v))),
        Scalar::Float8 => read(row, index, array, float_json),
        Scalar::Numeric => read(row, index, array, |v: Decimal| Value::String(v.to_string())),
        Scalar::Text => read(row, index, array, Value::String),
        Scalar::Json => read(row, index, array, |v: Value| v),
        Scalar::Uuid => read(row, index, array, |v: Uuid| Value::String(v.to_string())),
        Scalar::Timestamptz => read(row, index, array, |v: DateTime<Utc>| {
            Value::String(v.to_rfc3339_opts(SecondsFormat::AutoSi, true))
        }),
        Scalar::Timestamp => read(row, index, array, |v: NaiveDateTime| {
            Value::String(v.format("%Y-%m-%dT%H:%M:%S%.f").to_string())
        }),
        Scalar::Date => read(row, index, array, |v: NaiveDate| {
            Value::String(v.format("%Y-%m-%d").to_string())
        }),
        Scalar::Bytea => read(row, index, array, |v: Vec<u8>| {
            Value::String(BASE64.encode(v))
        }),
    }
}

/// Binds a scalar or an array; `null` (also as an element) is SQL NULL.
fn bind<T: ToSql + Sync + Send + 'static>(
    value: &Value,
    array: bool,
    parse: impl Fn(&Value) -> Result<T, String>,
) -> Result<Param, String> {
    let element = |value: &Value| match value {
        Value::Null => Ok(None),
        value => parse(value).map(Some),
    };
    if !array {
        return Ok(Box::new(element(value)?));
    }
    match value {
        Value::Null => Ok(Box::new(None::<Vec<Option<T>>>)),
        Value::Array(items) => {
            let items = items
                .iter()
                .enumerate()
                .map(|(i, item)| element(item).map_err(|e| format!("element {i}: {e}")))
                .collect::<Result<Vec<Option<T>>, String>>()?;
            Ok(Box::new(Some(items)))
        }
        _ => Err("expected a JSON array".to_owned()),
    }
}

fn read<'a, T: FromSql<'a>>(
    row: &'a Row,
    index: usize,
    array: bool,
    json: impl Fn(T) -> Value,
) -> Result<Value, String> {
    let element = |value: Option<T>| value.map_or(Value::Null, &json);
    if array {
        let values: Option<Vec<Option<T>>> = row.try_get(index).map_err(|e| e.to_string())?;
        Ok(values.map_or(Value::Null, |values| {
            Value::Array(values.into_iter().map(element).collect())
        }))
    } else {
        let value: Option<T> = row.try_get(index).map_err(|e| e.to_string())?;
        Ok(element(value))
    }
}

fn bool_of(value: &Value) -> Result<bool, String> {
    value
        .as_bool()
        .ok_or_else(|| "expected true or false".to_owned())
}

fn int_of(value: &Value) -> Result<i64, String> {
    value
        .as_i64()
        .ok_or_else(|| "expected an integer in the range of int8".to_owned())
}

fn narrow<T: TryFrom<i64>>(value: &Value, name: &str) -> Result<T, String> {
    value
        .as_i64()
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| format!("expected an integer in the range of {name}"))
}

fn float_of(value: &Value) -> Result<f64, String> {
    match value {
        Value::Number(number) => number.as_f64(),
        Value::String(text) => match text.as_str() {
            "NaN" => Some(f64::NAN),
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        _ => None,
    }
    .ok_or_else(|| "expected a number, \"NaN\", \"Infinity\" or \"-Infinity\"".to_owned())
}

fn float4_of(value: &Value) -> Result<f32, String> {
    let wide = float_of(value)?;
    let narrow = wide as f32;
    if wide.is_finite() && !narrow.is_finite() {
        return Err("the number is out of the range of float4".to_owned());
    }
    Ok(narrow)
}

/// JSON has no NaN or infinities: those are answered as strings.
fn float_json(value: f64) -> Value {
    match Number::from_f64(value) {
        Some(number) => Value::Number(number),
        None if value.is_nan() => Value::String("NaN".to_owned()),
        None if value > 0.0 => Value::String("Infinity".to_owned()),
        None => Value::String("-Infinity".to_owned()),
    }
}

fn numeric_of(value: &Value) -> Result<Decimal, String> {
    let text = match value {
        Value::String(text) => text.clone(),
        Value::Number(number) => number.to_string(),
        _ => return Err("expected a decimal number as a string, e.g. \"12.50\"".to_owned()),
    };
    Decimal::from_str_exact(text.trim())
        .or_else(|_| Decimal::from_scientific(text.trim()))
        .map_err(|e| format!("not a numeric value this gateway can hold ({e})"))
}

fn str_of(value: &Value) -> Result<&str, String> {
    value.as_str().ok_or_else(|| "expected a string".to_owned())
}

fn uuid_of(value: &Value) -> Result<Uuid, String> {
    Uuid::parse_str(str_of(value)?).map_err(|e| format!("not a UUID ({e})"))
}

fn timestamptz_of(value: &Value) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(str_of(value)?)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            format!(
                "expected an RFC 3339 timestamp with offset, e.g. \"2026-01-31T12:00:00Z\" ({e})"
            )
        })
}

fn timestamp_of(value: &Value) -> Result<NaiveDateTime, String> {
    let text = str_of(value)?;
    NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S%.f")
        .or_else(|_| NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f"))
        .map_err(|e| {
            format!("expected a date-time without offset, e.g. \"2026-01-31T12:00:00\" ({e})")
        })
}

fn date_of(value: &Value) -> Result<NaiveDate, String> {
    NaiveDate::parse_from_str(str_of(value)?, "%Y-%m-%d")
        .map_err(|e| format!("expected a date, e.g. \"2026-01-31\" ({e})"))
}

fn bytea_of(value: &Value) -> Result<Vec<u8>, String> {
    BASE64
        .decode(str_of(value)?)
        .map_err(|e| format!("expected base64 ({e})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn invalid(value: Value, ty: Type) -> String {
        match to_param(&value, &ty) {
            Err(ParamError::Invalid(reason)) => reason,
            Err(ParamError::Unsupported) => panic!("{ty} unsupported"),
            Ok(_) => panic!("{value} was accepted as {ty}"),
        }
    }

    #[test]
    fn values_that_do_not_fit_are_refused() {
        assert!(invalid(json!(70000), Type::INT2).contains("int2"));
        assert!(invalid(json!(1.5), Type::INT4).contains("int4"));
        assert!(invalid(json!("1"), Type::INT8).contains("int8"));
        assert!(invalid(json!("yes"), Type::BOOL).contains("true or false"));
        assert!(invalid(json!(1e300), Type::FLOAT4).contains("float4"));
        assert!(invalid(json!("12,5"), Type::NUMERIC).contains("numeric"));
        assert!(invalid(json!("not-a-uuid"), Type::UUID).contains("UUID"));
        assert!(invalid(json!("2026-01-31 12:00"), Type::TIMESTAMPTZ).contains("RFC 3339"));
        assert!(invalid(json!("31/01/2026"), Type::DATE).contains("date"));
        assert!(invalid(json!("***"), Type::BYTEA).contains("base64"));
        assert!(invalid(json!(5), Type::TEXT).contains("string"));
        assert!(invalid(json!(5), Type::INT4_ARRAY).contains("array"));
        assert!(invalid(json!([1, "x"]), Type::INT4_ARRAY).contains("element 1"));
    }

    #[test]
    fn supported_types() {
        for ty in [
            Type::INT8,
            Type::TEXT_ARRAY,
            Type::JSONB,
            Type::TIMESTAMPTZ_ARRAY,
        ] {
            assert!(supported(&ty), "{ty}");
            assert!(to_param(&Value::Null, &ty).is_ok());
        }
        for ty in [Type::INTERVAL, Type::INET, Type::MONEY, Type::POINT] {
            assert!(!supported(&ty), "{ty}");
            assert_eq!(
                to_param(&json!("x"), &ty).err(),
                Some(ParamError::Unsupported)
            );
        }
        assert_eq!(type_name(&Type::UUID_ARRAY), "uuid[]");
    }

    #[test]
    fn floats_that_json_cannot_hold() {
        assert_eq!(float_json(f64::NAN), json!("NaN"));
        assert_eq!(float_json(f64::NEG_INFINITY), json!("-Infinity"));
        assert_eq!(float_json(1.5), json!(1.5));
        assert!(float_of(&json!("Infinity")).unwrap().is_infinite());
    }
}
