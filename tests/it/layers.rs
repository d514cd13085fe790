//! Arrows one way (docs/architecture.md, "Layers"): no two top-level
//! modules of `src/` may reach each other through their non-test code. A
//! module that reaches back up is a boundary in the wrong place: neither
//! side can then be read, changed or tested without the other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of `src/` and the top-level modules its non-test
/// code names through `crate::` paths (`crate::a::b`, `crate::{a, b::c}`).
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut files = Vec::new();
        collect_rs(&path, &mut files);
        let text: String = files.iter().map(|f| non_test_code(&std::fs::read_to_string(f).unwrap())).collect();
        modules.insert(name, text);
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    modules
        .into_iter()
        .map(|(name, text)| {
            let used = crate_paths(&text).into_iter().filter(|m| *m != name && names.contains(m)).collect();
            (name, used)
        })
        .collect()
}

fn collect_rs(path: &Path, out: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        for entry in std::fs::read_dir(path).unwrap() {
            collect_rs(&entry.unwrap().path(), out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}

/// The file without its test module (`#[cfg(test)] mod tests`, by this
/// codebase's habit the last item of a file).
fn non_test_code(text: &str) -> String {
    let cut = regex::Regex::new(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))? )?mod ").unwrap();
    match cut.find(text) {
        Some(m) => text[..m.start()].to_string(),
        None => text.to_string(),
    }
}

/// The first segment of every `crate::` path, groups included.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let single = regex::Regex::new(r"crate::([a-z_][a-z0-9_]*)").unwrap();
    let group = regex::Regex::new(r"crate::\{([^}]*)\}").unwrap();
    let mut found: BTreeSet<String> = single.captures_iter(text).map(|c| c[1].to_string()).collect();
    for g in group.captures_iter(text) {
        for item in g[1].split(',') {
            let first = item.trim().split("::").next().unwrap_or("").trim();
            if !first.is_empty() {
                found.insert(first.to_string());
            }
        }
    }
    found
}

/// The modules that reach themselves again, each with the path it takes.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut loops = Vec::new();
    for start in graph.keys() {
        // Breadth-first from `start`, remembering how each module was reached.
        let mut came_from: BTreeMap<&String, &String> = BTreeMap::new();
        let mut todo = std::collections::VecDeque::from([start]);
        while let Some(m) = todo.pop_front() {
            for next in graph.get(m).into_iter().flatten() {
                if next == start {
                    let mut path = vec![m.clone()];
                    let mut at = m;
                    while at != start {
                        at = came_from[at];
                        path.push(at.clone());
                    }
                    path.reverse();
                    path.push(start.clone());
                    loops.push(path);
                    todo.clear();
                    break;
                }
                if !came_from.contains_key(next) && next != start {
                    came_from.insert(next, m);
                    todo.push_back(next);
                }
            }
        }
    }
    loops
}

#[test]
fn no_two_top_level_modules_import_each_other() {
    let graph = module_graph();
    assert!(graph.len() > 20, "read the modules of src/: {:?}", graph.keys());
    let loops = cycles(&graph);
    let shown: Vec<String> = loops.iter().map(|l| l.join(" -> ")).collect();
    assert!(loops.is_empty(), "modules that reach themselves again:\n{}", shown.join("\n"));
}

#[test]
fn the_cycle_finder_finds_a_loop_through_grouped_imports() {
    let text = "use crate::{b::Thing, c};\nfn f() { crate::d::g() }\n#[cfg(test)]\nmod tests { use crate::e; }";
    assert_eq!(crate_paths(&non_test_code(text)), ["b", "c", "d"].map(String::from).into());
    let graph: BTreeMap<String, BTreeSet<String>> =
        [("a", vec!["b"]), ("b", vec!["c"]), ("c", vec!["a"]), ("d", vec!["a"])]
            .into_iter()
            .map(|(m, to)| (m.to_string(), to.into_iter().map(String::from).collect()))
            .collect();
    let loops = cycles(&graph);
    assert_eq!(loops.len(), 3, "{loops:?}");
    assert_eq!(loops[0], ["a", "b", "c", "a"]);
}

/// A function of `text` (its name, arguments besides `self`, lines from
/// its signature to its closing brace). Declarations without a body
/// (trait methods) are skipped. Good enough for this codebase's style
/// (rustfmt'd, no braces inside string literals of signatures).
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let start = regex::Regex::new(r"\bfn\s+([a-z_][a-z0-9_]*)\s*(<[^(]*>)?\s*\(").unwrap();
    let is_self = regex::Regex::new(r"^\s*(&\s*('\w+\s+)?)?(mut\s+)?self\b").unwrap();
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for m in start.captures_iter(text) {
        let whole = m.get(0).unwrap();
        // The arguments: to the matching parenthesis, split at top-level commas.
        let (mut depth, mut i, mut args, mut current) = (1i32, whole.end(), Vec::new(), String::new());
        while depth > 0 && i < bytes.len() {
            let c = bytes[i] as char;
            match c {
                '(' | '[' | '{' | '<' => depth += 1,
                ')' | ']' | '}' => depth -= 1,
                '>' if bytes[i - 1] != b'-' => depth -= 1,
                _ => {}
            }
            if (c == ',' && depth == 1) || depth == 0 {
                args.push(std::mem::take(&mut current));
            } else {
                current.push(c);
            }
            i += 1;
        }
        let n = args.iter().filter(|a| !a.trim().is_empty() && !is_self.is_match(a)).count();
        // The body: from the next `{` (unless a `;` comes first) to its match.
        let (Some(open), semi) = (text[i..].find('{'), text[i..].find(';')) else { continue };
        if semi.is_some_and(|s| s < open) {
            continue;
        }
        let (mut depth, mut j) = (0i32, i + open);
        loop {
            match bytes[j] {
                b'{' => depth += 1,
                b'}' => depth -= 1,
                // A string's braces are text: skipped to its closing quote.
                b'"' => {
                    j += 1;
                    while j < bytes.len() && bytes[j] != b'"' {
                        j += if bytes[j] == b'\\' { 2 } else { 1 };
                    }
                }
                // A character literal (`'{'`), not a lifetime.
                b'\'' if bytes.get(j + 2) == Some(&b'\'') => j += 2,
                _ => {}
            }
            j += 1;
            if depth == 0 || j == bytes.len() {
                break;
            }
        }
        out.push((m[1].to_string(), n, text[whole.start()..j].lines().count()));
    }
    out
}

/// The request path stays readable (docs/architecture.md, "A request"): no
/// function in `src/proxy/` is longer than 80 lines or takes more than 5
/// arguments; what a step needs travels in a named struct.
#[test]
fn no_function_on_the_request_path_is_longer_than_80_lines_or_takes_more_than_5_arguments() {
    let mut files = Vec::new();
    collect_rs(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src/proxy"), &mut files);
    assert!(files.len() > 10, "read src/proxy: {files:?}");
    let mut over = Vec::new();
    for f in &files {
        for (name, args, lines) in functions(&non_test_code(&std::fs::read_to_string(f).unwrap())) {
            if args > 5 || lines > 80 {
                over.push(format!("{}: {name}: {args} arguments, {lines} lines", f.display()));
            }
        }
    }
    assert!(over.is_empty(), "{}", over.join("\n"));
}

#[test]
fn the_function_reader_counts_arguments_and_lines() {
    let text = "impl X {\n    pub fn a<'r>(&'r self, b: Vec<(u8, u8)>, c: impl Fn(u8) -> u8) -> u8 {\n        1\n    }\n}\nfn d() {}\ntrait T { fn e(&self, x: u8); }\n";
    assert_eq!(functions(text), vec![("a".to_string(), 2, 3), ("d".to_string(), 0, 1)]);
    let braces = "fn f(b: &[u8]) -> bool {\n    b[0] == b'{' && b != b\"{\\\"{\"\n}\nfn g() {}\n";
    assert_eq!(functions(braces), vec![("f".to_string(), 1, 3), ("g".to_string(), 0, 1)]);
}
