//! Triton's model configuration between its two forms: the encoded `inference.ModelConfig` a gRPC server answers
//! with, and the JSON Triton's REST API writes (the protobuf JSON mapping with the schema's field names, every
//! scalar, list and map printed even when empty, enums by name, 64-bit integers as numbers). Both are read and
//! written from the schema in proto/model_config.proto alone; fields newer than that schema are dropped in
//! translation (a configuration passed through in its own form keeps everything).

use std::sync::LazyLock;

use bytes::Bytes;
use prost::Message;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions, Value};

use crate::error::{Error, Result};

const MODEL_CONFIG: &str = "inference.ModelConfig";

/// The schema of `inference.ModelConfig`, read once from the descriptors compiled into the binary.
static SCHEMA: LazyLock<MessageDescriptor> = LazyLock::new(|| {
    DescriptorPool::decode(crate::proto::FILE_DESCRIPTOR_SET)
        .ok()
        .and_then(|pool| pool.get_message_by_name(MODEL_CONFIG))
        .unwrap_or_else(|| unreachable!("the build compiles {MODEL_CONFIG} into the descriptors"))
});

/// How Triton prints a configuration: `ModelConfigToJson` keeps the field names, prints default scalars and
/// empty lists and maps, and turns protobuf's string-quoted 64-bit integers back into numbers.
const TRITON_JSON: SerializeOptions = SerializeOptions::new()
    .use_proto_field_name(true)
    .skip_default_fields(false)
    .stringify_64_bit_integers(false);

/// An encoded configuration as Triton's REST API writes it, named `name`.
pub fn json_from_protobuf(encoded: &[u8], name: &str) -> Result<Vec<u8>> {
    let mut config = DynamicMessage::decode(SCHEMA.clone(), encoded)
        .map_err(|e| Error::invalid(format!("invalid model configuration: {e}")))?;
    config.set_field_by_name("name", Value::String(name.to_owned()));
    let mut json = Vec::with_capacity(encoded.len() * 4);
    let mut serializer = serde_json::Serializer::new(&mut json);
    config
        .serialize_with_options(&mut serializer, &TRITON_JSON)
        .map_err(|e| Error::internal(format!("cannot write a model configuration as JSON: {e}")))?;
    Ok(json)
}

/// A configuration in Triton's REST JSON, encoded as the protobuf message and named `name`. Both the numbers
/// Triton prints and protobuf's quoted 64-bit integers are read; members the schema does not know are dropped.
pub fn protobuf_from_json(json: &[u8], name: &str) -> Result<Bytes> {
    let mut deserializer = serde_json::Deserializer::from_slice(json);
    let options = DeserializeOptions::new().deny_unknown_fields(false);
    let mut config = DynamicMessage::deserialize_with_options(SCHEMA.clone(), &mut deserializer, &options)
        .and_then(|config| deserializer.end().map(|()| config))
        .map_err(|e| Error::invalid(format!("invalid model configuration: {e}")))?;
    config.set_field_by_name("name", Value::String(name.to_owned()));
    Ok(Bytes::from(config.encode_to_vec()))
}

/// A configuration the gateway builds itself (the built-in model server's), as Triton's REST API writes it.
pub fn json(config: &crate::proto::ModelConfig) -> Vec<u8> {
    json_from_protobuf(&config.encode_to_vec(), &config.name)
        .unwrap_or_else(|_| unreachable!("a configuration encoded from the schema's own type decodes with it"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{DataType, ModelConfig, ModelInput};

    #[test]
    fn both_forms_round_trip_every_field() {
        let config = ModelConfig {
            name: "m".into(),
            backend: "python".into(),
            max_batch_size: 8,
            input: vec![ModelInput {
                name: "x".into(),
                data_type: DataType::TypeUint64 as i32,
                dims: vec![-1, 9_000_000_000],
                ..Default::default()
            }],
            ..Default::default()
        };
        let json = json_from_protobuf(&config.encode_to_vec(), "public").unwrap();
        let document: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(document["name"], "public");
        assert_eq!(document["input"][0]["data_type"], "TYPE_UINT64");
        assert_eq!(document["input"][0]["dims"], serde_json::json!([-1, 9_000_000_000i64]));
        assert_eq!(document["input"][0]["format"], "FORMAT_NONE", "defaults are printed");
        assert_eq!(document["output"], serde_json::json!([]), "and empty lists");
        assert!(document.get("dynamic_batching").is_none(), "unset messages are not");
        let back = ModelConfig::decode(protobuf_from_json(&json, "m").unwrap()).unwrap();
        assert_eq!(back, config);
    }

    /// Two configurations as a real Triton (2.51) answered them over gRPC and over REST: a sequence-batched model
    /// and one with dynamic batching, priority queues, warmup, parameters, a reshape and a specific version policy.
    const TRITON: [(&str, &[u8], &[u8]); 2] = [
        (
            "accumulate",
            include_bytes!("../../tests/data/triton_accumulate_config.pb"),
            include_bytes!("../../tests/data/triton_accumulate_config.json"),
        ),
        (
            "rich",
            include_bytes!("../../tests/data/triton_dynamic_batching_config.pb"),
            include_bytes!("../../tests/data/triton_dynamic_batching_config.json"),
        ),
    ];

    #[test]
    fn tritons_two_forms_translate_into_each_other() {
        let parsed = |json: &[u8]| serde_json::from_slice::<serde_json::Value>(json).unwrap();
        for (name, encoded, json) in TRITON {
            let translated = json_from_protobuf(encoded, name).unwrap();
            assert_eq!(parsed(&translated), parsed(json), "{name}: protobuf to JSON");
            let back = protobuf_from_json(json, name).unwrap();
            let expected = DynamicMessage::decode(SCHEMA.clone(), encoded).unwrap();
            assert_eq!(
                DynamicMessage::decode(SCHEMA.clone(), back).unwrap(),
                expected,
                "{name}: JSON to protobuf"
            );
        }
    }

    #[test]
    fn quoted_integers_and_unknown_members_are_read() {
        let json = br#"{"name":"x","max_batch_size":4,"input":[{"name":"a","dims":["-1","3"]}],"newer":{"a":1}}"#;
        let config = ModelConfig::decode(protobuf_from_json(json, "y").unwrap()).unwrap();
        assert_eq!((config.name.as_str(), config.max_batch_size), ("y", 4));
        assert_eq!(config.input[0].dims, [-1, 3]);
    }

    #[test]
    fn what_is_not_a_configuration_is_named() {
        for json in [
            &b"[]"[..],
            b"{\"max_batch_size\":\"many\"}",
            b"{} trailing",
            b"{\"input\":[{\"dims\":[1.5]}]}",
        ] {
            let error = protobuf_from_json(json, "m").unwrap_err();
            assert!(
                error.message().starts_with("invalid model configuration"),
                "{}",
                error.message()
            );
        }
        let error = json_from_protobuf(b"\x0a\xff", "m").unwrap_err();
        assert!(
            error.message().starts_with("invalid model configuration"),
            "{}",
            error.message()
        );
    }
}
