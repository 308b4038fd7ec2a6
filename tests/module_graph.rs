//! The module graph has no circles (docs/architecture.md, "Layers"): every `crate::`,
//! `super::` and `self::` path under src/ (use trees expanded, re-exports followed to the
//! module that defines the item, comments and string literals skipped) is an edge from the
//! module that names it to the module it names, and no two top-level modules, no two
//! submodules of `proxy` and no two submodules of `core` may reach each other. The load
//! generator (src/bin/fulcrum-load) takes nothing from `proxy`. A module split into files
//! (`proxy::sip_stream`, `core::sip`, ...) counts as one, as the architecture page says.
//!
//! A failure prints each circle with one place per edge (FILE:LINE: path), so the import to
//! move down is named.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// A token of Rust source: an identifier, `::`, or one other punctuation character.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Path,
    Punct(char),
}

/// The tokens of `text` with their line numbers, without comments, string, char and number
/// literals (a path inside a doc comment or a message is no dependency).
fn tokens(text: &str) -> Vec<(Tok, u32)> {
    let c: Vec<char> = text.chars().collect();
    let (mut i, mut line, mut out) = (0, 1u32, Vec::new());
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += u32::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == '"' || ((ch == 'b' || ch == 'r') && is_raw_or_byte_string(&c, i)) {
            // "…", b"…", r"…", r#"…"#, br#"…"#: skip to the matching end.
            let mut j = i;
            while c[j] != '"' && c[j] != '#' {
                j += 1;
            }
            let raw = c[i..j].contains(&'r');
            let mut hashes = 0;
            while c[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            while j < c.len() {
                if c[j] == '\n' {
                    line += 1;
                }
                if !raw && c[j] == '\\' {
                    line += u32::from(at(j + 1) == '\n');
                    j += 2;
                    continue;
                }
                if c[j] == '"' && (0..hashes).all(|k| at(j + 1 + k) == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            i = j;
        } else if ch == '\'' {
            // A char literal ('a', '\n', '\u{..}', b'x' went through the ident arm's `b`
            // then here), else a lifetime or label ('a, 'static): keep it as punctuation.
            if at(i + 1) == '\\' {
                let mut j = i + 2;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                out.push((Tok::Punct('\''), line));
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            // r#ident: the identifier.
            if word == "r" && at(i) == '#' && (at(i + 1).is_alphabetic() || at(i + 1) == '_') {
                continue;
            }
            out.push((Tok::Ident(word), line));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                if c[i] == '.' && !at(i + 1).is_ascii_digit() {
                    break;
                }
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// Whether `c[i..]` opens a byte or raw string (`b"`, `r"`, `r#"`, `br"`, `br#"`).
fn is_raw_or_byte_string(c: &[char], i: usize) -> bool {
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return false;
    }
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) == Some(&'r') {
        j += 1;
        while c.get(j) == Some(&'#') {
            j += 1;
        }
    }
    j > i && c.get(j) == Some(&'"')
}

/// A path as written: its segments (the first may be `crate`, `super`, `self`) and the name
/// it is imported as (the last segment, or `as NAME`; `None` for a glob).
#[derive(Debug, Clone)]
struct Written {
    segs: Vec<String>,
    name: Option<String>,
    line: u32,
}

/// Expand the use tree (or plain path) starting at `toks[i]` after `prefix`; returns the
/// index after it.
fn tree(toks: &[(Tok, u32)], mut i: usize, prefix: &[String], out: &mut Vec<Written>) -> usize {
    let mut segs = prefix.to_vec();
    let line = toks.get(i).map_or(0, |t| t.1);
    loop {
        match toks.get(i).map(|t| &t.0) {
            Some(Tok::Ident(w)) => {
                segs.push(w.clone());
                i += 1;
                if toks.get(i).map(|t| &t.0) == Some(&Tok::Path) {
                    i += 1;
                    continue;
                }
                let mut name = segs.last().cloned();
                if name.as_deref() == Some("self") {
                    segs.pop();
                    name = segs.last().cloned();
                }
                if toks.get(i).map(|t| &t.0) == Some(&Tok::Ident("as".into())) {
                    if let Some((Tok::Ident(alias), _)) = toks.get(i + 1) {
                        name = Some(alias.clone());
                    }
                    i += 2;
                }
                out.push(Written { segs, name, line });
                return i;
            }
            Some(Tok::Punct('{')) => {
                i += 1;
                loop {
                    match toks.get(i).map(|t| &t.0) {
                        None => return i,
                        Some(Tok::Punct('}')) => return i + 1,
                        Some(Tok::Punct(',')) => i += 1,
                        Some(_) => {
                            let next = tree(toks, i, &segs, out);
                            i = next.max(i + 1);
                        }
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                out.push(Written {
                    segs,
                    name: None,
                    line,
                });
                return i + 1;
            }
            _ => {
                if !segs.is_empty() {
                    let name = segs.last().cloned();
                    out.push(Written { segs, name, line });
                }
                return i;
            }
        }
    }
}

/// What one file says: its `use` trees (and whether each is re-exported) and every other
/// `crate::` / `super::` / `self::` path, each with the inline module it stands in.
struct FileRefs {
    uses: Vec<(Vec<String>, Written, bool)>,
    paths: Vec<(Vec<String>, Written)>,
}

fn refs(toks: &[(Tok, u32)], root_alias: &str) -> FileRefs {
    let ident = |i: usize| match toks.get(i) {
        Some((Tok::Ident(w), _)) => Some(w.as_str()),
        _ => None,
    };
    let punct = |i: usize, p: char| toks.get(i).map(|t| &t.0) == Some(&Tok::Punct(p));
    let mut r = FileRefs {
        uses: Vec::new(),
        paths: Vec::new(),
    };
    // Inline modules (`mod tests { .. }`) open at a brace depth; their `super` is the file.
    let (mut inline, mut depth): (Vec<(String, usize)>, usize) = (Vec::new(), 0);
    let mut i = 0;
    while i < toks.len() {
        let here: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
        if punct(i, '{') {
            depth += 1;
        } else if punct(i, '}') {
            depth = depth.saturating_sub(1);
            if inline.last().is_some_and(|(_, d)| *d == depth) {
                inline.pop();
            }
        } else if ident(i) == Some("mod") && punct(i + 2, '{') {
            if let Some(name) = ident(i + 1) {
                inline.push((name.to_owned(), depth));
            }
        } else if ident(i) == Some("use") {
            let public = ident(i.wrapping_sub(1)) == Some("pub") || punct(i.wrapping_sub(1), ')');
            let mut out = Vec::new();
            let mut j = i + 1;
            if toks.get(j).map(|t| &t.0) == Some(&Tok::Path) {
                j += 1;
            }
            j = tree(toks, j, &[], &mut out);
            for w in out {
                r.uses.push((here.clone(), w, public));
            }
            i = j;
            continue;
        } else if let Some(w @ ("crate" | "super" | "self")) = ident(i)
            && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
            && !(w == "self" && ident(i.wrapping_sub(1)).is_some())
        {
            let mut out = Vec::new();
            let j = tree(toks, i, &[], &mut out);
            for w in out {
                r.paths.push((here.clone(), w));
            }
            i = j.max(i + 1);
            continue;
        } else if ident(i) == Some(root_alias) && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
        {
            let mut out = Vec::new();
            let j = tree(toks, i + 2, &["crate".to_owned()], &mut out);
            for w in out {
                r.paths.push((here.clone(), w));
            }
            i = j.max(i + 1);
            continue;
        }
        i += 1;
    }
    r
}

/// The module of a file under src/: `a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut m: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if m.last().is_some_and(|l| l == "mod" || l == "lib") {
        m.pop();
    }
    m
}

/// Resolve a written path, seen in module `at`, to a crate path, or `None` when it names
/// another crate. `modules` are the crate's modules, to read a 2018-style relative `use`.
fn resolve(at: &[String], segs: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    let mut segs = segs.iter().peekable();
    let mut path: Vec<String> = match segs.peek().map(|s| s.as_str()) {
        Some("crate") => {
            segs.next();
            Vec::new()
        }
        Some("self") => {
            segs.next();
            at.to_vec()
        }
        Some("super") => {
            let mut p = at.to_vec();
            while segs.peek().map(|s| s.as_str()) == Some("super") {
                segs.next();
                p.pop();
            }
            p
        }
        Some(first) => {
            let mut child = at.to_vec();
            child.push(first.to_owned());
            if !modules.contains(&child) {
                return None;
            }
            at.to_vec()
        }
        None => return None,
    };
    path.extend(segs.cloned());
    Some(path)
}

/// Follow re-exports (`pub use x::Y` in module `m` makes `m::Y` mean `x::Y`) and cut the
/// path to the longest module it names.
fn target(
    mut path: Vec<String>,
    exports: &HashMap<(Vec<String>, String), Vec<String>>,
    modules: &BTreeSet<Vec<String>>,
) -> Vec<String> {
    for _ in 0..8 {
        let mut moved = false;
        for k in 0..path.len() {
            if let Some(to) = exports.get(&(path[..k].to_vec(), path[k].clone())) {
                let mut p = to.clone();
                p.extend(path[k + 1..].iter().cloned());
                if p != path {
                    path = p;
                    moved = true;
                }
                break;
            }
        }
        if !moved {
            break;
        }
    }
    while !path.is_empty() && !modules.contains(&path) {
        path.pop();
    }
    path
}

/// An edge between two units and one place that makes it.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The strongly connected components of more than one unit (Tarjan).
fn circles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: HashMap<&'a str, usize>,
        low: HashMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        let g = t.g;
        for w in g.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every edge of the library's module tree: (from, to, FILE:LINE: path).
fn edges(src: &Path) -> Vec<(Vec<String>, Vec<String>, String)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.retain(|f| !f.starts_with(src.join("bin")) && f != &src.join("main.rs"));
    files.sort();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(src, f)).collect();
    let parsed: Vec<(PathBuf, Vec<String>, FileRefs)> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).expect("read source");
            (f.clone(), module_of(src, f), refs(&tokens(&text), "crate"))
        })
        .collect();
    // Inline modules are modules too (their `super` is the file's).
    let mut modules = modules;
    for (_, m, r) in &parsed {
        let inlines = r.paths.iter().map(|(i, _)| i);
        for inline in inlines.chain(r.uses.iter().map(|(i, _, _)| i)) {
            let mut p = m.clone();
            p.extend(inline.iter().cloned());
            modules.insert(p);
        }
    }
    let mut exports = HashMap::new();
    for (_, m, r) in &parsed {
        for (inline, w, public) in &r.uses {
            let mut at = m.clone();
            at.extend(inline.iter().cloned());
            if let (true, Some(name), Some(to)) =
                (*public, &w.name, resolve(&at, &w.segs, &modules))
            {
                exports.insert((at, name.clone()), to);
            }
        }
    }
    let mut out = Vec::new();
    for (f, m, r) in &parsed {
        let all = r
            .uses
            .iter()
            .map(|(i, w, _)| (i, w))
            .chain(r.paths.iter().map(|(i, w)| (i, w)));
        for (inline, w) in all {
            let mut at = m.clone();
            at.extend(inline.iter().cloned());
            let Some(to) = resolve(&at, &w.segs, &modules) else {
                continue;
            };
            let to = target(to, &exports, &modules);
            let rel = f.strip_prefix(src.parent().unwrap_or(src)).unwrap_or(f);
            out.push((
                m.clone(),
                to,
                format!("{}:{}: {}", rel.display(), w.line, w.segs.join("::")),
            ));
        }
    }
    out
}

/// The graph among the children of `parent` (`[]`: the top-level modules).
fn graph_below(edges: &[(Vec<String>, Vec<String>, String)], parent: &[String]) -> Graph {
    let n = parent.len();
    let mut g = Graph::new();
    for (from, to, place) in edges {
        if from.len() > n
            && to.len() > n
            && from[..n] == *parent
            && to[..n] == *parent
            && from[n] != to[n]
        {
            g.entry(from[n].clone())
                .or_default()
                .entry(to[n].clone())
                .or_insert_with(|| place.clone());
        }
    }
    g
}

/// Each circle, with one place per edge inside it.
fn report(g: &Graph) -> Vec<String> {
    circles(g)
        .into_iter()
        .map(|c| {
            let mut s = format!("circle {}:", c.join(" <-> "));
            for a in &c {
                for (b, place) in g.get(a).into_iter().flatten() {
                    if c.contains(b) {
                        s.push_str(&format!("\n  {a} -> {b}  ({place})"));
                    }
                }
            }
            s
        })
        .collect()
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_circle_between_top_level_modules_nor_inside_proxy_or_core() {
    let edges = edges(&src());
    assert!(edges.len() > 500, "read the sources: {} edges", edges.len());
    let mut found = Vec::new();
    // (`core`'s parts hardly import each other: its graph may be near empty, but must stay
    // without circles.)
    for (parent, least) in [
        (&[][..], 20),
        (&["proxy".to_owned()][..], 5),
        (&["core".to_owned()][..], 0),
    ] {
        let g = graph_below(&edges, parent);
        assert!(
            g.len() >= least,
            "{parent:?}: {} modules with imports",
            g.len()
        );
        found.extend(report(&g));
    }
    assert!(found.is_empty(), "module circles:\n{}", found.join("\n"));
}

#[test]
fn the_load_generator_takes_nothing_from_proxy() {
    let dir = src().join("bin");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    assert!(!files.is_empty(), "src/bin holds the load generator");
    let mut used = BTreeSet::new();
    for f in &files {
        let text = std::fs::read_to_string(f).expect("read source");
        let r = refs(&tokens(&text), "fulcrum");
        for (_, w) in &r.paths {
            if w.segs.first().is_some_and(|s| s == "crate")
                && let Some(m) = w.segs.get(1)
            {
                used.insert((m.clone(), format!("{}:{}", f.display(), w.line)));
            }
        }
    }
    assert!(used.iter().any(|(m, _)| m == "fd_limit"), "{used:?}");
    let from_proxy: Vec<_> = used.iter().filter(|(m, _)| m == "proxy").collect();
    assert!(from_proxy.is_empty(), "{from_proxy:?}");
}

/// The reader itself: a circle through a use group, a re-export and `super` is found, and
/// paths in comments and strings are not edges.
#[test]
fn the_reader_finds_a_circle_through_groups_reexports_and_super() {
    let dir = std::env::temp_dir().join(format!("module-graph-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("a")).expect("mkdir");
    let files = [
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        ("a/mod.rs", "mod inner;\npub use inner::Thing;\n"),
        (
            "a/inner.rs",
            "use crate::{c::{self, Other}};\npub struct Thing;\n",
        ),
        (
            "b.rs",
            "// crate::c::Other in a comment\nconst S: &str = \"crate::c::x\";\nconst R: &str = r#\"crate::c::y\"#;\npub fn f<'a>(x: &'a u8) -> char { let _ = x; 'c' }\n",
        ),
        (
            "c.rs",
            "pub struct Other;\nmod tests { use super::super::a::Thing; }\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(src.join(name), text).expect("write");
    }
    let e = edges(&src);
    let g = graph_below(&e, &[]);
    let found = circles(&g);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(found, vec![vec!["a".to_owned(), "c".to_owned()]], "{g:?}");
    assert!(
        !g.contains_key("b"),
        "b names c only in a comment and strings: {g:?}"
    );
    assert!(g["c"]["a"].contains("c.rs:2"), "{g:?}");
}
