//! The `demo` command: one request shown in every wire form, each converted back and compared.

use std::io::Write;

use bytes::Bytes;

use crate::convert::{Form, read_request, write_request};

const SAMPLE: &str = r#"{"id":"demo-1","inputs":[{"name":"INPUT0","datatype":"FP32","shape":[2,3],"data":[[1.5,-2.25,3.0],[0.1,null,1e999]]},{"name":"TEXT","datatype":"BYTES","shape":[2],"parameters":{"content_type":"str"},"data":["hello",", world!"]}],"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}}]}"#;

/// Prints the sample request in each form and checks that each converts back to the same request.
pub fn run(out: &mut dyn Write) -> Result<(), Box<dyn std::error::Error>> {
    let original = read_request(Bytes::from_static(SAMPLE.as_bytes()), Form::Json, None)?;
    writeln!(out, "REST JSON request ({} bytes):\n  {SAMPLE}\n", SAMPLE.len())?;
    for form in [Form::Json, Form::Binary, Form::Protobuf] {
        let converted = write_request(original.clone(), form)?;
        let back = read_request(converted.body.clone(), form, converted.header_length.map(|l| l as u64))?;
        let same = back.inputs.len() == original.inputs.len()
            && back.inputs.iter().zip(&original.inputs).all(|(a, b)| {
                a.name == b.name && a.shape == b.shape && a.datatype == b.datatype && same_bits(&a.data, &b.data)
            });
        let header = converted
            .header_length
            .map_or(String::new(), |l| format!(", JSON header {l} bytes"));
        writeln!(
            out,
            "{form:?}: {} bytes{header}; converts back to the same tensors: {}",
            converted.body.len(),
            if same { "yes" } else { "NO" }
        )?;
        if !same {
            return Err(format!("{form:?} round trip changed the request").into());
        }
    }
    let decthings = write_request(original, Form::Decthings)?;
    writeln!(
        out,
        "Decthings tensors: {} bytes: {:02x?}",
        decthings.body.len(),
        &decthings.body[..]
    )?;
    writeln!(
        out,
        "\nThe gateway itself (oipgate serve / demo with built-in backends) comes with the data plane."
    )?;
    Ok(())
}

/// Byte equality, except that any NaN matches any NaN (JSON carries NaN as `null`, without payload).
fn same_bits(a: &[u8], b: &[u8]) -> bool {
    a == b
        || (a.len() == b.len()
            && a.chunks_exact(4).zip(b.chunks_exact(4)).all(|(x, y)| {
                let (x, y) = (
                    f32::from_le_bytes(x.try_into().unwrap_or_default()),
                    f32::from_le_bytes(y.try_into().unwrap_or_default()),
                );
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())
            }))
}
