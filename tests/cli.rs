//! The built binary, run as a user would.

use std::io::Write;
use std::process::{Command, Stdio};

fn oipgate(args: &[&str], stdin: &[u8]) -> (bool, Vec<u8>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_oipgate"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("oipgate starts");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let output = child.wait_with_output().unwrap();
    (
        output.status.success(),
        output.stdout,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn demo_converts_every_form_back() {
    let (ok, stdout, stderr) = oipgate(&["demo"], b"");
    let stdout = String::from_utf8(stdout).unwrap();
    assert!(ok, "{stderr}");
    for form in ["Json", "Binary", "Protobuf"] {
        assert!(stdout.contains(&format!("{form}: ")), "{stdout}");
    }
    assert!(!stdout.contains("NO"), "{stdout}");
}

#[test]
fn convert_json_to_protobuf_and_back() {
    let json = br#"{"inputs":[{"name":"x","datatype":"UINT8","shape":[3],"data":[1,2,3]}]}"#;
    let (ok, proto, stderr) = oipgate(&["convert", "--from", "json", "--to", "protobuf"], json);
    assert!(ok, "{stderr}");
    let (ok, back, stderr) = oipgate(&["convert", "--from", "protobuf", "--to", "json"], &proto);
    assert!(ok, "{stderr}");
    assert_eq!(back, json);
}

#[test]
fn bad_input_is_a_clear_error() {
    let (ok, _, stderr) = oipgate(
        &["convert", "--from", "json", "--to", "protobuf"],
        b"{\"inputs\": [{\"name\": 1}]}",
    );
    assert!(!ok);
    assert!(
        stderr.contains("invalid JSON") && stderr.contains("expected a string"),
        "{stderr}"
    );
}
