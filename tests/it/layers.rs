//! The layering drawn in `src/lib.rs` and `docs/DESIGN.md`, checked against the code: every
//! top-level module may use only the modules of the layers below its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layer table of `src/lib.rs`'s documentation, top to bottom: each row's modules (the
/// ``[`name`]`` links of its second column). The table is the one place a module's layer is
/// written; these tests hold the code to it.
fn layers() -> Vec<Vec<String>> {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let rows: Vec<Vec<String>> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//! |"))
        .filter_map(|row| row.split('|').nth(1))
        .map(|modules| {
            modules
                .split("[`")
                .skip(1)
                .filter_map(|m| m.split_once("`]").map(|(name, _)| name.to_string()))
                .collect()
        })
        .filter(|row: &Vec<String>| !row.is_empty())
        .collect();
    assert!(rows.len() >= 5, "src/lib.rs has no layer table: {rows:?}");
    rows
}

/// Uses within the pure layer that the table allows.
const PURE_USES: &[(&str, &str)] = &[("schedule", "calendar")];

fn layer_of(layers: &[Vec<String>], module: &str) -> usize {
    layers
        .iter()
        .position(|l| l.iter().any(|m| m == module))
        .unwrap_or_else(|| panic!("module {module} is in no layer of src/lib.rs"))
}

/// `crate::X` paths used by the code of each top-level module (doc comments and unit tests excluded).
fn uses() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(&src)
                .unwrap()
                .to_string_lossy()
                .to_string();
            let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
            // `bin/`: other binaries of the package (the fault campaign), not modules of the crate.
            if top == "lib" || top == "main" || top == "bin" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            let used = out.entry(top.to_string()).or_default();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                let mut rest = line;
                while let Some(i) = rest.find("crate::") {
                    rest = &rest[i + "crate::".len()..];
                    if let Some(group) = rest.strip_prefix('{') {
                        // `use crate::{a, b::c}` on one line.
                        let group = group.split('}').next().unwrap();
                        used.extend(
                            group
                                .split(',')
                                .map(|p| p.trim().split("::").next().unwrap().to_string()),
                        );
                    } else {
                        let name: String = rest
                            .chars()
                            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                            .collect();
                        used.insert(name);
                    }
                }
            }
            used.remove(top);
            used.remove("");
        }
    }
    out
}

#[test]
fn every_module_uses_only_the_layers_below_its_own() {
    let layers = layers();
    let mut wrong = Vec::new();
    for (module, used) in uses() {
        let mine = layer_of(&layers, &module);
        for other in used {
            let allowed = layer_of(&layers, &other) > mine
                || PURE_USES.contains(&(module.as_str(), other.as_str()));
            if !allowed {
                wrong.push(format!("{module} uses {other}"));
            }
        }
    }
    assert!(wrong.is_empty(), "uses against the layering: {wrong:?}");
}

#[test]
fn every_module_of_the_crate_is_in_the_layer_table() {
    let all: BTreeSet<String> = uses().into_keys().collect();
    let drawn: BTreeSet<String> = layers().into_iter().flatten().collect();
    assert_eq!(all, drawn);
}
