//! The engine's modules form layers, as `src/lib.rs` lists them: each top-level module uses only
//! the ones listed below it, so no two modules import each other, directly or around a circle.
//! And within a folder no two files name each other through `super::`. Reads the source, needs
//! no service.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its unit tests (a `tests` module may use
/// anything).
fn code(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first path segments after `prefix::` in `code`: `crate::store::offsets` gives `store`,
/// and `use crate::{a::X, b}` gives `a` and `b`.
fn names_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let needle = format!("{prefix}::");
    let mut rest = code;
    while let Some(i) = rest.find(&needle) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + needle.len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group: after `{` and after each `,` at depth 0.
            let (mut depth, mut start) = (0, true);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if c.is_whitespace() => {}
                    _ if start => {
                        out.insert(ident_at(&group[j..]).to_string());
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident_at(rest).to_string());
        }
    }
    out
}

/// The top-level modules in the order `src/lib.rs`'s layout lists them (`//! - [`name`]`).
fn layout() -> Vec<String> {
    fs::read_to_string(src().join("lib.rs"))
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("//! - [`"))
        .map(|l| ident_at(l).to_string())
        .collect()
}

/// The top-level module a file belongs to (`src/store/inbox/claim.rs`: `store`).
fn top(path: &Path) -> String {
    let rel = path.strip_prefix(src()).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_str()
        .unwrap();
    first.trim_end_matches(".rs").to_string()
}

#[test]
fn each_module_uses_only_the_ones_listed_below_it() {
    let order = layout();
    let position: BTreeMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut modules = BTreeSet::new();
    let mut wrong = Vec::new();
    for file in &files {
        let module = top(file);
        if module == "lib" || module == "main" {
            continue;
        }
        modules.insert(module.clone());
        for used in names_after(&code(file), "crate") {
            let (Some(&from), Some(&to)) = (position.get(module.as_str()), position.get(&*used))
            else {
                continue;
            };
            if to <= from && used != module {
                wrong.push(format!(
                    "{} uses {used}, listed above {module}",
                    file.strip_prefix(src()).unwrap().display()
                ));
            }
        }
    }
    let unlisted: Vec<_> = modules
        .iter()
        .filter(|m| !position.contains_key(m.as_str()))
        .collect();
    assert!(
        unlisted.is_empty(),
        "modules missing from src/lib.rs's layout: {unlisted:?}"
    );
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn no_two_files_of_a_folder_use_each_other() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    // For each folder: which sibling names each file uses through `super::`.
    let mut uses: BTreeMap<(PathBuf, String), BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let name = file.file_stem().unwrap().to_str().unwrap().to_string();
        if name == "mod" || name == "lib" || name == "main" {
            continue;
        }
        let folder = file.parent().unwrap().to_path_buf();
        let siblings = names_after(&code(file), "super");
        uses.insert((folder, name), siblings);
    }
    let mut mutual = Vec::new();
    for ((folder, name), siblings) in &uses {
        for other in siblings {
            let back = uses.get(&(folder.clone(), other.clone()));
            if name < other && back.is_some_and(|b| b.contains(name)) {
                mutual.push(format!("{}: {name} <-> {other}", folder.display()));
            }
        }
    }
    assert!(
        mutual.is_empty(),
        "files that use each other:\n{}",
        mutual.join("\n")
    );
}

/// The reader takes a path's first segment and a group's top-level names, and not `notcrate::`.
#[test]
fn the_reader_finds_paths_and_groups() {
    let code = "use crate::{store::offsets::{self, Claim}, metrics};\nlet x = crate::batch::Outcome::default();\nnotcrate::skip;";
    let found = names_after(code, "crate");
    let expected: BTreeSet<String> = ["store", "metrics", "batch"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, expected);
    assert_eq!(
        names_after("use super::{context::RebalanceContext, range};", "super"),
        ["context", "range"].into_iter().map(String::from).collect()
    );
}
