//! JSON integers as JSON Schema defines them: `39` and `39.0` are the same
//! integer. serde rejects `39.0` for an integer field, so a client (or a
//! contract tester) sending a schema-valid body got a 400. These accept any
//! non-negative number with no fractional part within the documented format
//! (`int32`, `int64`: the signed ranges OpenAPI means), and nothing else.

use serde::de::{Deserializer, Error};
use serde::Deserialize;

fn integral<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let n = serde_json::Number::deserialize(d)?;
    if let Some(v) = n.as_u64() {
        return Ok(v);
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f >= 0.0 && f <= u64::MAX as f64 => Ok(f as u64),
        _ => Err(D::Error::custom(format!("expected a non-negative integer, got {n}"))),
    }
}

fn fit<T: TryFrom<u64>, E: Error>(v: u64) -> Result<T, E> {
    T::try_from(v).map_err(|_| E::custom(format!("{v} is out of range")))
}

fn int64<E: Error>(v: u64) -> Result<u64, E> {
    if v > i64::MAX as u64 {
        return Err(E::custom(format!("{v} is out of range")));
    }
    Ok(v)
}

fn int32<E: Error>(v: u64) -> Result<u32, E> {
    if v > i32::MAX as u64 {
        return Err(E::custom(format!("{v} is out of range")));
    }
    fit(v)
}

/// A non-negative `int64`.
pub fn usize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    fit(int64(integral(d)?)?)
}

/// An optional non-negative `int64`.
pub fn opt_int64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<serde_json::Number>::deserialize(d)?
        .map(|n| integral(serde_json::Value::Number(n)).map_err(D::Error::custom).and_then(int64))
        .transpose()
}

/// An optional non-negative `int32`.
pub fn opt_int32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    opt_int64(d)?.map(int32).transpose()
}

#[cfg(test)]
mod tests {
    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct T {
        #[serde(default, deserialize_with = "super::opt_int32")]
        a: Option<u32>,
        #[serde(deserialize_with = "super::usize")]
        b: usize,
    }

    #[test]
    fn integral_floats_are_integers_and_nothing_else_is() {
        let t: T = serde_json::from_str(r#"{"a": 39.0, "b": 7}"#).unwrap();
        assert_eq!(t, T { a: Some(39), b: 7 });
        let t: T = serde_json::from_str(r#"{"a": null, "b": 1e3}"#).unwrap();
        assert_eq!(t, T { a: None, b: 1000 });
        for bad in [r#"{"b": 1.5}"#, r#"{"b": -1}"#, r#"{"b": "1"}"#, r#"{"a": 2147483648, "b": 1}"#] {
            assert!(serde_json::from_str::<T>(bad).is_err(), "{bad}");
        }
    }
}
