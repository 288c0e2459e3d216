//! Compiles proto/grpc_predict_v2.proto with protox (no system protoc) into OUT_DIR.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/grpc_predict_v2.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Served by gRPC server reflection, so grpcurl needs no proto file.
    std::fs::write(
        out_dir.join("inference_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
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
    Ok(())
}
