//! The floors of `src/lib.rs` ("# Floors"): every module imports only from
//! modules on lower floors. Read from the source as text: each `crate::`
//! path of a module's files (comments and test modules aside), a name the
//! crate root re-exports (`crate::Limit`) counted as the module it comes
//! from.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// The floor of each module, from the table in the crate docs.
fn floors(lib: &str) -> BTreeMap<String, u32> {
    let mut floors = BTreeMap::new();
    let mut in_section = false;
    for line in lib.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            continue;
        };
        let doc = doc.trim();
        if doc.starts_with('#') {
            in_section = doc == "# Floors";
            continue;
        }
        let cells: Vec<&str> = doc.split('|').map(str::trim).collect();
        let (true, [_, floor, modules, ..]) = (in_section, cells.as_slice()) else {
            continue;
        };
        let Ok(floor) = floor.parse::<u32>() else {
            continue;
        };
        for module in modules.split(',') {
            floors.insert(module.trim().trim_matches('`').to_owned(), floor);
        }
    }
    floors
}

/// The module each name the crate root re-exports comes from
/// (`pub use limit::Limit;` makes `Limit` the module `limit`'s).
fn re_exports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in lib.split(';') {
        let Some(at) = statement.rfind("pub use ") else {
            continue;
        };
        let rest = &statement[at + "pub use ".len()..];
        let Some((module, items)) = rest.split_once("::") else {
            continue;
        };
        for item in items
            .trim_matches(|c: char| c == '{' || c == '}' || c.is_whitespace())
            .split(',')
        {
            let name = item.trim().rsplit("::").next().unwrap_or_default();
            if !name.is_empty() {
                names.insert(name.to_owned(), module.trim().to_owned());
            }
        }
    }
    names
}

/// The files under `dir`, recursively.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("a readable folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its test module.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first segments of the paths a file names from the crate root:
/// `crate::store::Check` names `store`, `use crate::{Decision, key::Key}`
/// names `Decision` and `key`.
fn named(code: &str) -> Vec<String> {
    let mut named = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].ends_with('$') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // the top-level items of the group, up to its closing brace
            let (mut depth, mut item, mut items) = (0, String::new(), Vec::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => items.push(std::mem::take(&mut item)),
                    _ if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            items.push(item);
            named.extend(items.iter().map(|i| first_segment(i)));
        } else {
            named.push(first_segment(rest));
        }
    }
    named.retain(|n| !n.is_empty());
    named
}

fn first_segment(path: &str) -> String {
    path.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

#[test]
fn every_module_imports_only_from_lower_floors() {
    let lib = fs::read_to_string(format!("{SRC}/lib.rs")).expect("src/lib.rs");
    let floors = floors(&lib);
    assert!(
        floors.len() > 10,
        "the floors table of src/lib.rs: {floors:?}"
    );
    let names = re_exports(&lib);
    let mut paths = Vec::new();
    files(Path::new(SRC), &mut paths);
    let mut upward = Vec::new();
    for path in paths {
        let relative = path.strip_prefix(SRC).expect("under src");
        let module = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|c| c.trim_end_matches(".rs").to_owned())
            .expect("a module");
        if module == "lib" {
            continue;
        }
        let Some(&floor) = floors.get(&module) else {
            panic!("src/{module} has no floor: add it to the table of src/lib.rs");
        };
        let text = fs::read_to_string(&path).expect("a source file");
        for name in named(&code(&text)) {
            let target = names.get(&name).cloned().unwrap_or(name);
            if target == module {
                continue;
            }
            match floors.get(&target) {
                Some(&to) if to < floor => {}
                Some(&to) => upward.push(format!(
                    "{} (floor {floor}) imports {target} (floor {to})",
                    relative.display()
                )),
                None => upward.push(format!(
                    "{} names crate::{target}, which is no module of the table \
                     nor a name the crate root re-exports",
                    relative.display()
                )),
            }
        }
    }
    upward.sort();
    upward.dedup();
    assert!(
        upward.is_empty(),
        "imports that do not go down:\n{}",
        upward.join("\n")
    );
}
