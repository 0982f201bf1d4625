//! Every crate's modules form layers: drawn from the `crate::` and `super::` paths in each crate's
//! own code (tests left out), the graph of its top-level modules has no cycle. A module that two
//! others share lives below both; a policy depends on its inputs, not on the fleet that owns it; a
//! background task takes the narrow context it uses, not the whole gateway state.
//!
//! A top-level module is a file `src/NAME.rs` or a folder `src/NAME/` with all it contains; the
//! crate root (`lib.rs`, `main.rs`) is the façade above them all and is not a node.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One dependency of a module on another, with the first place it shows.
type Edges = BTreeMap<String, BTreeMap<String, String>>;

/// The workspace's crates folder.
fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a source file relative to `src` (`policy/cache_aware.rs` → `[policy,
/// cache_aware]`; `lib.rs` → `[]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("file under src").with_extension("");
    let mut parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("lib" | "main" | "mod")) {
        parts.pop();
    }
    parts
}

/// The code that builds into the crate: test modules (by this workspace's convention, a
/// `#[cfg(test)] mod` at the end of a file, or a `tests.rs` file) and comments left out.
fn production_code(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") && lines.peek().is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            break;
        }
        let without_comment = match trimmed.find("//") {
            Some(at) => &trimmed[..at],
            None => trimmed,
        };
        code.push_str(without_comment);
        code.push('\n');
    }
    code
}

/// The first path segment of each item of a `use` group starting at `text` (just after its `{`),
/// and where the group ends.
fn group_heads(text: &str) -> (Vec<String>, usize) {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut at_item_start = true;
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return (heads, i + 1),
            '}' => depth -= 1,
            ',' if depth == 0 => at_item_start = true,
            c if at_item_start && (c.is_alphanumeric() || c == '_') => {
                let mut word = String::from(c);
                while let Some(&(_, n)) = chars.peek() {
                    if n.is_alphanumeric() || n == '_' {
                        word.push(n);
                        chars.next();
                    } else {
                        break;
                    }
                }
                heads.push(word);
                at_item_start = false;
            }
            _ => {}
        }
    }
    (heads, text.len())
}

/// The identifiers of a path after `crate::`: `a::b` gives `[a, b]`; `{a::b, c}` gives `[a]` and
/// `[c]`.
fn paths_after(text: &str) -> Vec<Vec<String>> {
    if let Some(group) = text.strip_prefix('{') {
        return group_heads(group).0.into_iter().map(|h| vec![h]).collect();
    }
    let mut segments = Vec::new();
    let mut rest = text;
    loop {
        let len = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if len == 0 {
            if let Some(group) = rest.strip_prefix('{') {
                let (heads, _) = group_heads(group);
                return heads
                    .into_iter()
                    .map(|h| {
                        let mut p = segments.clone();
                        p.push(h);
                        p
                    })
                    .collect();
            }
            break;
        }
        segments.push(rest[..len].to_owned());
        match rest[len..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    vec![segments]
}

/// The top-level modules the code of the file at `module` refers to, each with the line it first
/// does on.
fn references(module: &[String], code: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for (line_no, line) in code.lines().enumerate() {
        let mut rest = line;
        loop {
            let at = match (rest.find("crate::"), rest.find("super::")) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => break,
            };
            let start = rest[..at].rfind(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).map_or(0, |p| p + 1);
            let path_text = &rest[start..];
            // Past the path's leading `crate::` or `super::`s, so each path is read once.
            let mut after_prefix = &rest[at..];
            while let Some(next) = after_prefix.strip_prefix("crate::").or_else(|| after_prefix.strip_prefix("super::"))
            {
                after_prefix = next;
            }
            rest = after_prefix;
            let absolute: Vec<Vec<String>> = if let Some(after) = path_text.strip_prefix("crate::") {
                paths_after(after)
            } else if path_text.starts_with("super::") {
                // `super` counts from the file's own module: one level up per `super`.
                let mut base = module.to_vec();
                let mut after = path_text;
                while let Some(next) = after.strip_prefix("super::") {
                    base.pop();
                    after = next;
                }
                paths_after(after)
                    .into_iter()
                    .map(|p| {
                        let mut full = base.clone();
                        full.extend(p);
                        full
                    })
                    .collect()
            } else {
                // `foo::crate::` or `self::super::` do not occur; an identifier ending in `crate`
                // or `super` (`kvgate_crate::`) is not a crate path.
                continue;
            };
            for path in absolute {
                if let Some(top) = path.first() {
                    found.push((top.clone(), line_no + 1));
                }
            }
        }
    }
    found
}

/// The dependency graph of the top-level modules of the crate whose sources are under `src`.
fn module_graph(src: &Path) -> Edges {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_path(src, f).first().cloned()).collect();
    let mut edges: Edges = modules.iter().map(|m| (m.clone(), BTreeMap::new())).collect();
    for file in &files {
        let module = module_path(src, file);
        let Some(top) = module.first().cloned() else { continue };
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("readable source");
        for (target, line) in references(&module, &production_code(&text)) {
            if target != top && modules.contains(&target) {
                let place = format!("{}:{line}", file.strip_prefix(crates_dir()).unwrap_or(file).display());
                edges.get_mut(&top).expect("known module").entry(target).or_insert(place);
            }
        }
    }
    edges
}

/// The strongly connected components with more than one module (Tarjan's algorithm).
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a str) {
        let n = w.index.len();
        w.index.insert(v, n);
        w.low.insert(v, n);
        w.stack.push(v);
        w.on_stack.insert(v);
        for next in w.edges[v].keys() {
            let next = next.as_str();
            if !w.index.contains_key(next) {
                visit(w, next);
                let low = w.low[v].min(w.low[next]);
                w.low.insert(v, low);
            } else if w.on_stack.contains(next) {
                let low = w.low[v].min(w.index[next]);
                w.low.insert(v, low);
            }
        }
        if w.low[v] == w.index[v] {
            let mut component = Vec::new();
            while let Some(m) = w.stack.pop() {
                w.on_stack.remove(m);
                component.push(m.to_owned());
                if m == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                w.found.push(component);
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            visit(&mut walk, v);
        }
    }
    walk.found
}

/// What a cycle consists of: each edge inside it and where it shows.
fn describe(edges: &Edges, component: &[String]) -> String {
    let mut out = format!("cycle among {}:\n", component.join(", "));
    for from in component {
        for (to, place) in &edges[from] {
            if component.contains(to) {
                out.push_str(&format!("  {from} -> {to}  ({place})\n"));
            }
        }
    }
    out
}

#[test]
fn no_crate_has_a_module_cycle() {
    let mut crates: Vec<PathBuf> = std::fs::read_dir(crates_dir())
        .expect("the crates folder")
        .flatten()
        .map(|e| e.path().join("src"))
        .filter(|src| src.is_dir())
        .collect();
    crates.sort();
    assert!(crates.len() >= 10, "expected the workspace's crates under {}, found {crates:?}", crates_dir().display());
    let mut report = String::new();
    for src in &crates {
        let edges = module_graph(src);
        for component in cycles(&edges) {
            report.push_str(&format!("{}: {}", src.display(), describe(&edges, &component)));
        }
    }
    assert!(report.is_empty(), "module cycles (layers must depend only downward):\n{report}");
}

#[test]
fn the_checker_finds_a_cycle_through_use_groups_super_and_folders() {
    let dir = std::env::temp_dir().join(format!("kvgate-module-layers-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("policy")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod fleet;\npub mod policy;\npub mod ids;\n").unwrap();
    std::fs::write(src.join("ids.rs"), "pub struct Id;\n").unwrap();
    std::fs::write(src.join("fleet.rs"), "use crate::{ids::Id, policy::Knob};\n").unwrap();
    std::fs::write(src.join("policy/mod.rs"), "pub mod cache;\npub struct Knob;\n").unwrap();
    // A child module reaching the fleet two levels up closes the cycle; its test module does not count.
    std::fs::write(
        src.join("policy/cache.rs"),
        "use super::super::fleet::Fleet;\n// crate::ids in a comment\n#[cfg(test)]\nmod tests {\n    use crate::ids::Id;\n}\n",
    )
    .unwrap();
    let edges = module_graph(&src);
    let found = cycles(&edges);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, vec![vec!["fleet".to_owned(), "policy".to_owned()]], "{edges:?}");
    assert!(!edges["policy"].contains_key("ids"), "test modules and comments are not dependencies: {edges:?}");
    assert!(edges["fleet"].contains_key("ids"), "use groups are read: {edges:?}");
}
