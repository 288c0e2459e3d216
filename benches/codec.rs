//! Codec benchmarks, each beside its baseline measured in the same run (see docs/BENCHMARKS.md, "Codec benchmarks").

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use oipgate::codec::protobuf::{self, request_to_proto, response_from_proto};
use oipgate::codec::rest::{self, BinaryOutputs, RestRequest, data, format, parallel};
use oipgate::proto::ModelInferResponse;
use oipgate::proto::model_infer_response::InferOutputTensor;
use oipgate::protocol::DataType;
use prost::Message;

/// The allocator the oipgate binary uses, so buffers behave as they do in production.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ELEMENTS: usize = 1 << 20;
const LARGE: usize = 64 << 20;

/// Deterministic pseudo-random floats with the spread of real activations.
fn floats(n: usize) -> Vec<f32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 200.0
        })
        .collect()
}

fn json_fp32_parse(c: &mut Criterion) {
    let values = floats(ELEMENTS);
    let text = serde_json::to_vec(&values).unwrap();
    let request = [
        br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1048576],"data":"#.as_slice(),
        &text,
        b"}]}",
    ]
    .concat();
    let request = Bytes::from(request);
    let mut group = c.benchmark_group("json_fp32_1M_parse");
    group
        .throughput(Throughput::Bytes(text.len() as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(8));
    group.bench_function("baseline serde_json Vec<f32>", |b| {
        b.iter(|| black_box(serde_json::from_slice::<Vec<f32>>(black_box(&text)).unwrap()))
    });
    for (label, threads) in [("1 thread", 1), ("all cores", 0)] {
        parallel::set_max_workers(threads);
        group.bench_function(format!("oipgate data -> LE bytes, {label}"), |b| {
            b.iter(|| black_box(data::parse_data(black_box(&text), DataType::Fp32, ELEMENTS as u64).unwrap()))
        });
        group.bench_function(format!("oipgate whole request, {label}"), |b| {
            b.iter(|| black_box(rest::decode_request(black_box(request.clone()), None).unwrap()))
        });
    }
    parallel::set_max_workers(0);
    group.finish();
}

fn json_fp32_write(c: &mut Criterion) {
    let values = floats(ELEMENTS);
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut group = c.benchmark_group("json_fp32_1M_write");
    group
        .throughput(Throughput::Elements(ELEMENTS as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(8));
    group.bench_function("baseline serde_json to_vec Vec<f32>", |b| {
        b.iter(|| black_box(serde_json::to_vec(black_box(&values)).unwrap()))
    });
    // The floor of any writer built on the fastest shortest-round-trip formatter (serde_json uses it too).
    group.bench_function("reference: zmij formatting alone, no output", |b| {
        b.iter(|| {
            let mut buffer = zmij::Buffer::new();
            black_box(
                values
                    .iter()
                    .map(|&v| buffer.format_finite(black_box(v)).len())
                    .sum::<usize>(),
            )
        })
    });
    for (label, threads) in [("1 thread", 1), ("all cores", 0)] {
        parallel::set_max_workers(threads);
        group.bench_function(format!("oipgate LE bytes -> data, {label}"), |b| {
            b.iter(|| {
                let mut out = Vec::new();
                format::write_data(&mut out, DataType::Fp32, black_box(&raw)).unwrap();
                black_box(out)
            })
        });
    }
    parallel::set_max_workers(0);
    group.finish();
}

fn binary_to_protobuf(c: &mut Criterion) {
    let header = format!(
        r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{}],"parameters":{{"binary_data_size":{LARGE}}}}}]}}"#,
        LARGE / 4
    );
    let mut body = header.clone().into_bytes();
    body.resize(header.len() + LARGE, 1);
    let body = Bytes::from(body);
    let source = vec![1u8; LARGE];
    let mut destination = vec![0u8; LARGE];
    let mut group = c.benchmark_group("binary_64MiB_to_protobuf");
    group
        .throughput(Throughput::Bytes(LARGE as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(10));
    group.bench_function("baseline memcpy 64 MiB", |b| {
        b.iter(|| {
            destination.copy_from_slice(black_box(&source));
            black_box(&destination);
        })
    });
    group.bench_function("baseline memcpy 64 MiB into a new buffer", |b| {
        b.iter(|| black_box(black_box(&source[..]).to_vec()))
    });
    let decode = |body: &Bytes| match rest::decode_request(body.clone(), Some(header.len() as u64)).unwrap() {
        RestRequest::Request { request, .. } => request,
        RestRequest::RawBinary(_) => unreachable!(),
    };
    group.bench_with_input(
        BenchmarkId::new("oipgate", "ModelInferRequest as chunks, zero copy"),
        &body,
        |b, body| b.iter(|| black_box(protobuf::encode_request(decode(body)))),
    );
    group.bench_with_input(
        BenchmarkId::new("oipgate", "ModelInferRequest in one buffer, one copy"),
        &body,
        |b, body| b.iter(|| black_box(request_to_proto(decode(body)).encode_to_vec())),
    );
    group.finish();
}

fn protobuf_to_binary(c: &mut Criterion) {
    let payload = Bytes::from(vec![1u8; LARGE]);
    let mut group = c.benchmark_group("protobuf_64MiB_to_binary");
    group.throughput(Throughput::Bytes(LARGE as u64)).sample_size(50);
    group.bench_function("oipgate ModelInferResponse -> chunks", |b| {
        b.iter(|| {
            let message = ModelInferResponse {
                model_name: "m".into(),
                outputs: vec![InferOutputTensor {
                    name: "o".into(),
                    datatype: "FP32".into(),
                    shape: vec![(LARGE / 4) as i64],
                    ..Default::default()
                }],
                raw_output_contents: vec![payload.clone()],
                ..Default::default()
            };
            let response = response_from_proto(message).unwrap();
            black_box(rest::encode_response(&response, &BinaryOutputs::all_binary()).unwrap())
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    json_fp32_parse,
    json_fp32_write,
    binary_to_protobuf,
    protobuf_to_binary
);
criterion_main!(benches);
