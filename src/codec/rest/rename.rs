//! Restoring public names in a REST answer that passes through: the top-level `model_name` and `model_version` of
//! the JSON header are replaced without reading any tensor. Because HTTP headers leave before the body, the new
//! header's length is fixed in advance ([`renamed_length`]) and the rewritten JSON is padded with trailing spaces,
//! which JSON allows, to exactly that length.

use super::format::write_json_string;
use super::reader::JsonReader;
use crate::error::{Error, Result};

/// Length of a string written as a JSON string literal.
fn literal_len(text: &str) -> usize {
    let mut out = Vec::with_capacity(text.len() + 2);
    write_json_string(&mut out, text);
    out.len()
}

/// The length a JSON header of `original` bytes will have once renamed to `name` / `version`: large enough for any
/// header that names the backend's model and version (or leaves the version out). `None` when the length would
/// not fit in a `usize` (a backend's claim, not a real header).
pub fn renamed_length(original: usize, name: &str, version: &str) -> Option<usize> {
    // Worst cases: the old name was empty (`""`), and the version member is added whole.
    original.checked_add(literal_len(name) + r#","model_version":"#.len() + literal_len(version))
}

/// Rewrites `header` (the complete JSON header) with the public names, padded with spaces to `length` bytes.
pub fn rename_header(header: &[u8], name: &str, version: &str, length: usize) -> Result<Vec<u8>> {
    let mut reader = JsonReader::new(header);
    let mut name_span = None;
    let mut version_span = None;
    let mut members = reader.object()?;
    let mut last_member_end = None;
    while let Some(key) = members.next(&mut reader)? {
        reader.skip_ws();
        let start = reader.pos;
        match key.as_ref() {
            "model_name" => {
                reader.string()?;
                name_span = Some((start, reader.pos));
            }
            "model_version" => {
                // KServe answers `"model_version": null` for a model without versions.
                if !reader.null() {
                    reader.string()?;
                }
                version_span = Some((start, reader.pos));
            }
            _ => reader.skip_value()?,
        }
        last_member_end = Some(reader.pos);
    }
    reader.end()?;
    let mut replacements: Vec<((usize, usize), Vec<u8>)> = Vec::new();
    let literal = |text: &str| {
        let mut out = Vec::new();
        write_json_string(&mut out, text);
        out
    };
    match name_span {
        Some(span) => replacements.push((span, literal(name))),
        None => return Err(Error::invalid("the answer has no model_name")),
    }
    match version_span {
        Some(span) => replacements.push((span, literal(version))),
        None if !version.is_empty() => {
            let end = last_member_end.unwrap_or(1);
            let mut member = b",\"model_version\":".to_vec();
            member.extend_from_slice(&literal(version));
            replacements.push(((end, end), member));
        }
        None => {}
    }
    replacements.sort_by_key(|((start, _), _)| *start);
    let mut out = Vec::with_capacity(length);
    let mut at = 0;
    for ((start, end), text) in replacements {
        out.extend_from_slice(&header[at..start]);
        out.extend_from_slice(&text);
        at = end;
    }
    out.extend_from_slice(&header[at..]);
    if out.len() > length {
        return Err(Error::internal(format!(
            "renamed header of {} bytes exceeds the {length} announced",
            out.len()
        )));
    }
    out.resize(length, b' ');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_null_version_is_replaced() {
        let header = br#"{"model_name":"echo","model_version":null,"id":"r1","outputs":[]}"#;
        let length = renamed_length(header.len(), "public", "1").unwrap();
        let renamed = rename_header(header, "public", "1", length).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&renamed).unwrap();
        assert_eq!(
            value,
            serde_json::json!({"model_name":"public","model_version":"1","id":"r1","outputs":[]})
        );
    }

    #[test]
    fn renames_in_place_and_pads() {
        let header = br#"{"model_name":"distilbert","model_version":"7","outputs":[{"name":"o","datatype":"INT8","shape":[1],"data":[1]}]}"#;
        let length = renamed_length(header.len(), "classifier", "3").unwrap();
        let renamed = rename_header(header, "classifier", "3", length).unwrap();
        assert_eq!(renamed.len(), length);
        let value: serde_json::Value = serde_json::from_slice(&renamed).unwrap();
        assert_eq!(
            (value["model_name"].as_str(), value["model_version"].as_str()),
            (Some("classifier"), Some("3"))
        );
        assert_eq!(value["outputs"][0]["data"][0], 1);
    }

    #[test]
    fn adds_a_missing_version_and_handles_escapes() {
        let header = br#"{"model_name":"","outputs":[]}"#;
        let length = renamed_length(header.len(), "a\"b", "v\\1").unwrap();
        let renamed = rename_header(header, "a\"b", "v\\1", length).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&renamed).unwrap();
        assert_eq!(
            (value["model_name"].as_str(), value["model_version"].as_str()),
            (Some("a\"b"), Some("v\\1"))
        );
        assert!(rename_header(b"{\"outputs\":[]}", "m", "1", 100).is_err());
        assert!(rename_header(b"{\"model_name\":", "m", "1", 100).is_err());
    }
}
