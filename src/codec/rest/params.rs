//! JSON form of parameters: `{"name": value, ...}` with bool, integer, float or string values.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};

use super::data::{WriteSpecial, write_json_string};
use crate::protocol::{ParamValue, Parameters};

/// Parameters as read from JSON. `null` values are dropped (they mean "not given" to MLServer's models); arrays and
/// objects are rejected because no protocol form can carry them; a name given twice is rejected.
#[derive(Debug, Default)]
pub struct JsonParameters(pub Parameters);

impl<'de> Deserialize<'de> for JsonParameters {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ParametersVisitor)
    }
}

struct ParametersVisitor;

impl<'de> Visitor<'de> for ParametersVisitor {
    type Value = JsonParameters;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of parameters")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonParameters, A::Error> {
        let mut parameters = Parameters::new();
        while let Some(name) = map.next_key::<String>()? {
            let OptionalValue(value) = map.next_value()?;
            if parameters.contains_key(&name) {
                return Err(de::Error::custom(format_args!("parameter \"{name}\" is given twice")));
            }
            if let Some(value) = value {
                parameters.insert(name, value);
            }
        }
        Ok(JsonParameters(parameters))
    }
}

struct OptionalValue(Option<ParamValue>);

impl<'de> Deserialize<'de> for OptionalValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = OptionalValue;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a parameter value (bool, number or string)")
    }

    fn visit_bool<E>(self, v: bool) -> Result<OptionalValue, E> {
        Ok(OptionalValue(Some(ParamValue::Bool(v))))
    }

    fn visit_i64<E>(self, v: i64) -> Result<OptionalValue, E> {
        Ok(OptionalValue(Some(ParamValue::Int64(v))))
    }

    fn visit_u64<E>(self, v: u64) -> Result<OptionalValue, E> {
        Ok(OptionalValue(Some(match i64::try_from(v) {
            Ok(v) => ParamValue::Int64(v),
            Err(_) => ParamValue::Uint64(v),
        })))
    }

    fn visit_f64<E>(self, v: f64) -> Result<OptionalValue, E> {
        Ok(OptionalValue(Some(ParamValue::Double(v))))
    }

    fn visit_str<E>(self, v: &str) -> Result<OptionalValue, E> {
        Ok(OptionalValue(Some(ParamValue::String(v.to_owned()))))
    }

    fn visit_string<E>(self, v: String) -> Result<OptionalValue, E> {
        Ok(OptionalValue(Some(ParamValue::String(v))))
    }

    fn visit_unit<E>(self) -> Result<OptionalValue, E> {
        Ok(OptionalValue(None))
    }

    fn visit_none<E>(self) -> Result<OptionalValue, E> {
        Ok(OptionalValue(None))
    }
}

/// Appends `"parameters":{...}` preceded by a comma, or nothing when there are none.
pub fn write_parameters_field(out: &mut Vec<u8>, parameters: &Parameters) {
    if parameters.is_empty() {
        return;
    }
    out.extend_from_slice(b",\"parameters\":");
    write_parameters(out, parameters);
}

/// Appends a parameters object.
pub fn write_parameters(out: &mut Vec<u8>, parameters: &Parameters) {
    out.push(b'{');
    for (index, (name, value)) in parameters.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        write_json_string(out, name);
        out.push(b':');
        match value {
            ParamValue::Bool(v) => out.extend_from_slice(if *v { b"true" } else { b"false" }),
            ParamValue::Int64(v) => out.extend_from_slice(itoa::Buffer::new().format(*v).as_bytes()),
            ParamValue::Uint64(v) => out.extend_from_slice(itoa::Buffer::new().format(*v).as_bytes()),
            ParamValue::Double(v) => match v.special() {
                None => out.extend_from_slice(zmij::Buffer::new().format_finite(*v).as_bytes()),
                Some(text) => out.extend_from_slice(text),
            },
            ParamValue::String(v) => write_json_string(out, v),
        }
    }
    out.push(b'}');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Parameters, serde_json::Error> {
        serde_json::from_str::<JsonParameters>(text).map(|p| p.0)
    }

    #[test]
    fn every_value_type_round_trips_in_order() {
        let text = r#"{"z":true,"a":-3,"big":18446744073709551615,"d":0.5,"s":"x\"y"}"#;
        let parameters = parse(text).unwrap();
        assert_eq!(parameters.keys().collect::<Vec<_>>(), ["z", "a", "big", "d", "s"]);
        assert_eq!(parameters["big"], ParamValue::Uint64(u64::MAX));
        let mut out = Vec::new();
        write_parameters(&mut out, &parameters);
        assert_eq!(String::from_utf8(out).unwrap(), text);
    }

    #[test]
    fn rejects_nested_values_and_duplicates_and_drops_null() {
        assert!(
            parse(r#"{"a":[1]}"#)
                .unwrap_err()
                .to_string()
                .contains("bool, number or string")
        );
        assert!(parse(r#"{"a":{"b":1}}"#).is_err());
        assert!(
            parse(r#"{"a":1,"a":2}"#)
                .unwrap_err()
                .to_string()
                .contains("given twice")
        );
        assert!(parse(r#"{"a":null}"#).unwrap().is_empty());
    }
}
