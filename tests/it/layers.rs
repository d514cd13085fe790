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
