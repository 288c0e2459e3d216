//! Compiles proto/grpc_predict_v2.proto and the model_config.proto it imports, and Envoy's external processing
//! service (proto/envoy-api) for `oipgate epp`, with protox (no system protoc) into OUT_DIR.

use prost_types::field_descriptor_proto::Type;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/grpc_predict_v2.proto";
    println!("cargo:rerun-if-changed={proto}");
    println!("cargo:rerun-if-changed=proto/model_config.proto");
    let descriptors = protox::compile([proto], ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Served by gRPC server reflection, so grpcurl needs no proto file, and read by the model configuration's
    // translation between its protobuf and JSON forms. The generated code carries a configuration as bytes, so it
    // passes through unread; described as the message here, grpcurl shows it field by field.
    let mut described = descriptors.clone();
    let config = described
        .file
        .iter_mut()
        .flat_map(|file| file.message_type.iter_mut())
        .filter(|message| message.name() == "ModelConfigResponse")
        .flat_map(|message| message.field.iter_mut())
        .find(|field| field.name() == "config")
        .ok_or("ModelConfigResponse.config is missing from the proto")?;
    config.set_type(Type::Message);
    config.type_name = Some(".inference.ModelConfig".to_owned());
    std::fs::write(
        out_dir.join("inference_descriptor.bin"),
        prost::Message::encode_to_vec(&described),
    )?;
    tonic_prost_build::configure()
        // Tensor payloads stay `bytes::Bytes`, so decoding from a received buffer slices instead of copying.
        .bytes(".inference")
        // Ordered maps make encoding deterministic: the same request always gives the same bytes.
        .btree_map(".inference")
        // Statistics cross the REST door as JSON with the messages' own field names, as Triton writes them.
        .type_attribute(
            ".inference.ModelStatisticsResponse",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .type_attribute(
            ".inference.ModelStatistics",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .type_attribute(
            ".inference.InferStatistics",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .type_attribute(
            ".inference.InferResponseStatistics",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .type_attribute(
            ".inference.InferBatchStatistics",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .type_attribute(
            ".inference.StatisticDuration",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .type_attribute(
            ".inference.MemoryUsage",
            "#[derive(serde::Serialize, serde::Deserialize)] #[serde(default)]",
        )
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    envoy_ext_proc()?;
    Ok(())
}

/// Envoy's `ExternalProcessor` service and the messages it carries, as one module tree (`envoy_api.rs`) mirroring
/// the packages. The annotation packages (validation rules, API status) only decorate the API and generate nothing
/// the service needs, so they are compiled for the imports to resolve and left out of the generated code.
fn envoy_ext_proc() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "envoy/service/ext_proc/v3/external_processor.proto";
    println!("cargo:rerun-if-changed=proto/envoy-api");
    let mut descriptors = protox::compile([proto], ["proto/envoy-api"])?;
    descriptors.file.retain(|file| {
        let package = file.package();
        !(package == "validate" || package.split('.').any(|part| part == "annotations"))
    });
    tonic_prost_build::configure()
        .include_file("envoy_api.rs")
        // Body chunks are relayed as they came: sliced from the received buffer, not copied.
        .bytes(".envoy.service.ext_proc.v3")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
