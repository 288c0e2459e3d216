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
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
