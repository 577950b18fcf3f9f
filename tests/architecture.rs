//! The tree's architecture, checked: no import cycle between the files of a crate. A file A
//! depends on B when A names `crate::...` (or `super::...`) resolving to B's module. Types that
//! several modules share belong in a leaf module that imports none of them (docs/architecture in
//! README, "The tree"); a cycle means one of two files holds a type that belongs to neither.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Every crate of the workspace (the root Cargo.toml's `members`), so that a new crate is checked
/// from its first commit.
fn crates(root: &Path) -> Vec<String> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members = manifest
        .lines()
        .find_map(|line| line.strip_prefix("members = ["))
        .unwrap_or_else(|| panic!("no `members = [...]` line in Cargo.toml"));
    let members: Vec<String> = members
        .trim_end_matches(']')
        .split(',')
        .map(|member| member.trim().trim_matches('"').to_string())
        .filter(|member| !member.is_empty())
        .collect();
    assert!(members.iter().any(|member| member == "sink"), "Cargo.toml's members, read as {members:?}");
    members
}

/// A module as its path below `src/` (`["relay", "round"]`; the crate root is empty).
type Module = Vec<String>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// The module a file defines: `src/relay/mod.rs` and `src/relay.rs` are `relay`, `src/lib.rs`
/// and `src/main.rs` the root.
fn module_of(src: &Path, file: &Path) -> Module {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = relative.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

/// The text without `#[cfg(test)] mod ... { ... }` blocks and line comments: tests may reach
/// anywhere.
fn without_tests_and_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let is_module = after["#[cfg(test)]".len()..].trim_start().trim_start_matches("pub ").starts_with("mod ");
        match (is_module, after.find('{')) {
            (true, Some(open)) => {
                let mut depth = 0usize;
                let mut end = after.len();
                for (i, c) in after[open..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = open + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                rest = &after[end..];
            }
            _ => {
                out.push_str("#[cfg(test)]");
                rest = &after["#[cfg(test)]".len()..];
            }
        }
    }
    out.push_str(rest);
    out.lines().map(|line| line.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The longest prefix of `path` that is a module of the crate.
fn resolve(modules: &BTreeSet<Module>, path: &[String]) -> Option<Module> {
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|prefix| modules.contains(prefix))
}

fn identifier_path(text: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut rest = text;
    loop {
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            break;
        }
        rest = &rest[name.len()..];
        parts.push(name);
        match rest.strip_prefix("::") {
            Some(next) if next.starts_with(|c: char| c.is_alphanumeric() || c == '_') => rest = next,
            _ => break,
        }
    }
    parts
}

/// The files each file depends on, within one crate's `src/`.
fn dependencies(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let files: Vec<(Module, PathBuf)> = files
        .into_iter()
        .filter(|f| !f.strip_prefix(src).unwrap().starts_with("tests") && !f.starts_with(src.join("bin")))
        .map(|f| (module_of(src, &f), f))
        .collect();
    let modules: BTreeSet<Module> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, file) in &files {
        let text = without_tests_and_comments(&fs::read_to_string(file).unwrap());
        let mut targets: Vec<Vec<String>> = Vec::new();
        for (at, _) in text.match_indices("crate::") {
            let after = &text[at + "crate::".len()..];
            let base = identifier_path(after);
            // `crate::a::{b, c}`: the path stops before `::{`; `crate::{a, b}`: it is empty.
            let consumed = base.iter().map(String::len).sum::<usize>() + 2 * base.len().saturating_sub(1);
            let tail = &after[consumed..];
            let group = if base.is_empty() { tail.strip_prefix('{') } else { tail.strip_prefix("::{") };
            match group {
                Some(group) => {
                    for item in group.split('}').next().unwrap_or("").split(',') {
                        let mut path = base.clone();
                        path.extend(identifier_path(item.trim()));
                        targets.push(path);
                    }
                }
                None => targets.push(base),
            }
        }
        for (at, _) in text.match_indices("super::") {
            // `super` of `a/b.rs` and of `a/b/mod.rs` alike is `a`.
            let mut path: Vec<String> = module.clone();
            path.pop();
            path.extend(identifier_path(&text[at + "super::".len()..]));
            targets.push(path);
        }
        for target in targets {
            if let Some(target) = resolve(&modules, &target) {
                if &target != module && !target.is_empty() {
                    edges.entry(module.clone()).or_default().insert(target);
                }
            }
        }
        edges.entry(module.clone()).or_default();
    }
    edges
}

/// Strongly connected components of two or more modules (Tarjan).
fn cycles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Tarjan<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<Module, usize>,
        low: BTreeMap<Module, usize>,
        stack: Vec<Module>,
        found: Vec<Vec<Module>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: &Module) {
            let n = self.index.len();
            self.index.insert(v.clone(), n);
            self.low.insert(v.clone(), n);
            self.stack.push(v.clone());
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v.clone(), low);
                } else if self.stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v.clone(), low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    let done = &w == v;
                    component.push(w);
                    if done {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut tarjan =
        Tarjan { edges, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), found: Vec::new() };
    for v in edges.keys() {
        if !tarjan.index.contains_key(v) {
            tarjan.visit(v);
        }
    }
    tarjan.found
}

#[test]
fn no_crate_has_an_import_cycle_between_its_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for krate in crates(root) {
        let src = root.join(&krate).join("src");
        if !src.is_dir() {
            continue;
        }
        for cycle in cycles(&dependencies(&src)) {
            let names: Vec<String> =
                cycle.iter().map(|m| if m.is_empty() { "lib".into() } else { m.join("/") }).collect();
            found.push(format!("{krate}/src: {}", names.join(", ")));
        }
    }
    assert!(
        found.is_empty(),
        "import cycles between files (move the types they share into a leaf module):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_cycle_check_finds_a_cycle() {
    let dir = std::env::temp_dir().join(format!("opg-architecture-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("a")).unwrap();
    fs::write(dir.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    fs::write(dir.join("a/mod.rs"), "pub mod inner;\nuse crate::b::Thing;\n").unwrap();
    fs::write(dir.join("a/inner.rs"), "use super::Other;\n").unwrap();
    fs::write(dir.join("b.rs"), "use crate::{a::inner::X, c};\n// use crate::nothing;\n").unwrap();
    let found = cycles(&dependencies(&dir));
    let _ = fs::remove_dir_all(&dir);
    assert_eq!(found, vec![vec![vec!["a".to_string()], vec!["a".into(), "inner".into()], vec!["b".into()]]]);
}
