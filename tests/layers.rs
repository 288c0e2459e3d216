//! The layers of src/ as docs/ARCHITECTURE.md draws them: every module's `crate::` paths (the binary's `oipgate::`
//! ones) name only modules of lower layers, so no import circle can form between modules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The layers, top first, as the ```layers block of docs/ARCHITECTURE.md lists them: one line a layer, its modules
/// separated by spaces.
fn layers() -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(Path::new(ROOT).join("docs/ARCHITECTURE.md")).unwrap();
    let block = text
        .split("```layers\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/ARCHITECTURE.md has a ```layers block");
    block
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .map(|line| line.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .filter(|layer| !layer.is_empty())
        .collect()
}

fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, into);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            into.push(path);
        }
    }
}

/// The top-level module a file of src/ belongs to: `dispatch` for src/dispatch/fleet.rs, `tls` for src/tls.rs,
/// `main` for the binary; none for lib.rs, which only declares them.
fn module_of(file: &Path) -> Option<String> {
    let relative = file.strip_prefix(Path::new(ROOT).join("src")).unwrap();
    let first = relative.components().next()?.as_os_str().to_str()?;
    match first.strip_suffix(".rs") {
        Some("lib") => None,
        Some(stem) => Some(stem.to_owned()),
        None => Some(first.to_owned()),
    }
}

/// The top-level modules a line of code names through `crate::` (or the binary's `oipgate::`), comments, string
/// literals and exported macros (which live at the crate's root) left out.
fn named_modules(line: &str) -> Vec<String> {
    let code: String = line
        .split("//")
        .next()
        .unwrap_or_default()
        .split('"')
        .step_by(2)
        .collect::<Vec<_>>()
        .join(" ");
    let code = code.as_str();
    let mut named = Vec::new();
    for prefix in ["crate::", "oipgate::"] {
        let mut rest = code;
        while let Some(at) = rest.find(prefix) {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + prefix.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && !rest[name.len()..].starts_with('!') {
                named.push(name);
            }
        }
    }
    named
}

/// Each module's layer, counted from the top (0).
fn ranks(layers: &[Vec<String>]) -> BTreeMap<String, usize> {
    let mut ranks = BTreeMap::new();
    for (rank, layer) in layers.iter().enumerate() {
        for module in layer {
            assert!(
                ranks.insert(module.clone(), rank).is_none(),
                "{module} is in two layers"
            );
        }
    }
    ranks
}

#[test]
fn every_module_imports_only_lower_layers() {
    let layers = layers();
    let ranks = ranks(&layers);
    let mut files = Vec::new();
    rust_files(&Path::new(ROOT).join("src"), &mut files);
    files.sort();
    let mut unplaced = Vec::new();
    let mut upward = Vec::new();
    let mut crossings = 0;
    for file in &files {
        let Some(module) = module_of(file) else { continue };
        let Some(&rank) = ranks.get(&module) else {
            unplaced.push(module);
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for named in named_modules(line) {
                if named == module {
                    continue;
                }
                let Some(&named_rank) = ranks.get(&named) else {
                    upward.push(format!(
                        "{}:{}: names `{named}`, in no layer",
                        file.display(),
                        number + 1
                    ));
                    continue;
                };
                crossings += 1;
                if named_rank <= rank {
                    upward.push(format!(
                        "{}:{}: `{module}` names `{named}`, of {} layer: {}",
                        file.display(),
                        number + 1,
                        if named_rank == rank { "its own" } else { "a higher" },
                        line.trim()
                    ));
                }
            }
        }
    }
    unplaced.sort();
    unplaced.dedup();
    assert!(
        unplaced.is_empty(),
        "modules in no layer of docs/ARCHITECTURE.md: {unplaced:?}"
    );
    assert!(upward.is_empty(), "imports against the layers:\n{}", upward.join("\n"));
    // The scan saw the crate's imports: a reader that found none would pass any tree.
    assert!(crossings > 500, "only {crossings} imports between modules found");
}

#[test]
fn the_scan_sees_an_upward_import() {
    let layers = layers();
    let ranks = ranks(&layers);
    assert!(ranks["frontend"] < ranks["dispatch"] && ranks["dispatch"] < ranks["error"]);
    assert_eq!(
        named_modules("use crate::frontend::rest::RestDoor; // crate::app"),
        vec!["frontend".to_owned()]
    );
    assert_eq!(
        named_modules("let x = oipgate::live::Gateway::new(crate::config::load(a), b);"),
        vec!["config".to_owned(), "live".to_owned()]
    );
    assert!(named_modules("use tokio_rustls::rustls::crate_name;").is_empty());
    assert!(named_modules("my_crate::dispatch::call()").is_empty());
    assert!(named_modules("$crate::no_shared_memory_rpcs!(@ok status);").is_empty());
    assert!(named_modules(r#"const TARGET: &str = "oipgate::access";"#).is_empty());
}
