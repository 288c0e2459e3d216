//! JSON form of parameters: `{"name": value, ...}` with bool, integer, float or string values.

use super::format::{WriteSpecial, write_json_string};
use super::reader::JsonReader;
use crate::error::{Error, Result};
use crate::protocol::{ParamValue, Parameters};

/// Reads a parameters object (or `null`, meaning none). `null` values are dropped (they mean "not given" to
/// MLServer's models); arrays and objects are rejected because no protocol form can carry them; a name given twice is
/// rejected.
pub fn read_parameters(reader: &mut JsonReader<'_>) -> Result<Parameters> {
    let mut parameters = Parameters::new();
    if reader.null() {
        return Ok(parameters);
    }
    let mut members = reader.object()?;
    while let Some(name) = members.next(reader)? {
        let value = match reader.peek() {
            Some(b'"') => Some(ParamValue::String(reader.string()?.into_owned())),
            Some(b't' | b'f') => Some(ParamValue::Bool(reader.bool()?)),
            Some(b'n') if reader.null() => None,
            Some(b'[' | b'{') => {
                return Err(Error::invalid(format!(
                    "parameter \"{name}\" must be a bool, number or string"
                )));
            }
            _ => Some(number_value(reader.number_token()?)),
        };
        if parameters.contains_key(name.as_ref()) {
            return Err(Error::invalid(format!("parameter \"{name}\" is given twice")));
        }
        if let Some(value) = value {
            parameters.insert(name.into_owned(), value);
        }
    }
    Ok(parameters)
}

/// An integer token becomes int64 (or uint64 beyond int64's range); anything else becomes a double.
fn number_value(token: &[u8]) -> ParamValue {
    let integral = !token.iter().any(|c| matches!(c, b'.' | b'e' | b'E'));
    let text = std::str::from_utf8(token).unwrap_or("0");
    if integral {
        if let Ok(v) = text.parse::<i64>() {
            return ParamValue::Int64(v);
        }
        if let Ok(v) = text.parse::<u64>() {
            return ParamValue::Uint64(v);
        }
    }
    ParamValue::Double(fast_float2::parse(token).unwrap_or(f64::NAN))
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

    fn parse(text: &str) -> Result<Parameters> {
        let mut reader = JsonReader::new(text.as_bytes());
        let parameters = read_parameters(&mut reader)?;
        reader.end()?;
        Ok(parameters)
    }

    #[test]
    fn every_value_type_round_trips_in_order() {
        let text = r#"{"z":true,"a":-3,"big":18446744073709551615,"d":0.5,"s":"x\"y"}"#;
        let parameters = parse(text).unwrap();
        assert_eq!(parameters.keys().collect::<Vec<_>>(), ["z", "a", "big", "d", "s"]);
        assert_eq!(parameters["big"], ParamValue::Uint64(u64::MAX));
        assert_eq!(parameters["d"], ParamValue::Double(0.5));
        let mut out = Vec::new();
        write_parameters(&mut out, &parameters);
        assert_eq!(String::from_utf8(out).unwrap(), text);
        assert_eq!(parse("{\"x\": 1e2}").unwrap()["x"], ParamValue::Double(100.0));
        assert_eq!(
            parse("{\"x\": 1e999999}").unwrap()["x"],
            ParamValue::Double(f64::INFINITY)
        );
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
        assert!(parse("null").unwrap().is_empty());
        assert!(parse("[]").is_err());
    }
}
