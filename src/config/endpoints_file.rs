//! An endpoints file, the shape llm-d's file discovery reads (YAML or JSON: `endpoints: [{ name, namespace,
//! address, port, labels }]`): a backend's replicas listed by whatever keeps the file, with no Kubernetes API.

use serde::Deserialize;

use super::endpoint::Endpoint;

/// The largest file read: a list of endpoints, not a data set.
pub const MOST_ENDPOINTS_FILE_BYTES: u64 = 1 << 20;

/// `endpoints` is required: a file caught empty while it is rewritten in place, or a misspelt key, is refused (and
/// the endpoints read before kept), not read as an empty fleet; `endpoints: []` empties it.
#[derive(Debug, Deserialize)]
struct EndpointsFile {
    endpoints: Vec<Entry>,
}

/// One entry; `namespace` and `labels` are llm-d's and read by nothing here.
#[derive(Debug, Deserialize)]
struct Entry {
    #[serde(default)]
    name: String,
    #[serde(default)]
    address: String,
    /// A string in llm-d's files; a number is taken too.
    #[serde(default)]
    port: String,
}

/// The endpoints a file's `text` lists, in order without repeats, and a problem for each entry left out (a bad
/// address or port: the others are still served); `Err` when the file is not a list of endpoints at all.
pub fn parse(text: &str) -> Result<(Vec<Endpoint>, Vec<String>), String> {
    // JSON is YAML: one reader takes both.
    let source = config::File::from_str(text, config::FileFormat::Yaml);
    let file: EndpointsFile = config::Config::builder()
        .add_source(source)
        .build()
        .and_then(config::Config::try_deserialize)
        .map_err(|error| format!("not an endpoints file: {error}"))?;
    let mut endpoints: Vec<Endpoint> = Vec::with_capacity(file.endpoints.len());
    let mut skipped = Vec::new();
    for (index, entry) in file.endpoints.iter().enumerate() {
        let named = if entry.name.is_empty() {
            format!("endpoints[{index}]")
        } else {
            format!("endpoints[{index}] ({})", entry.name)
        };
        let Ok(ip) = entry.address.trim().parse::<std::net::IpAddr>() else {
            skipped.push(format!("{named}: address '{}' is not an IP address", entry.address));
            continue;
        };
        let port = match entry.port.trim().parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => {
                skipped.push(format!("{named}: port '{}' is not a port (1-65535)", entry.port));
                continue;
            }
        };
        let endpoint = Endpoint {
            host: ip.to_string(),
            port,
        };
        if !endpoints.contains(&endpoint) {
            endpoints.push(endpoint);
        }
    }
    Ok((endpoints, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llm_d_files_in_yaml_and_json_are_read_and_bad_entries_left_out() {
        let yaml = "endpoints:\n  - name: vllm-0\n    namespace: default\n    address: \"10.0.0.1\"\n    port: \"8000\"\n    \
                    labels: {app: x}\n  - name: bad\n    address: \"model.example\"\n    port: \"8000\"\n  - name: vllm-1\n    \
                    address: \"10.0.0.2\"\n    port: 8001\n  - name: zero\n    address: \"10.0.0.3\"\n    port: \"0\"\n";
        let (endpoints, skipped) = parse(yaml).unwrap();
        let shown: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["10.0.0.1:8000", "10.0.0.2:8001"]);
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(skipped[0].contains("bad") && skipped[1].contains("zero"), "{skipped:?}");
        let json = r#"{"endpoints": [{"name": "a", "address": "::1", "port": "9000"}]}"#;
        let (endpoints, _) = parse(json).unwrap();
        assert_eq!(endpoints[0].to_string(), "[::1]:9000");
        assert!(parse("endpoints: 7").is_err());
        assert!(parse("").is_err(), "an empty file is not an empty fleet");
        assert!(parse("endpoint:\n  - {address: \"10.0.0.1\", port: \"1\"}\n").is_err());
        assert_eq!(parse("endpoints: []").unwrap().0, []);
    }
}
