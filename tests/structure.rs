//! The structure rules of `src/`, checked on the source text (no tool to install):
//!
//! - no import cycle between files: a file's paths (`use` trees and `crate::`, `super::`,
//!   `self::` and child-module paths in code) are resolved to the file of the module they name,
//!   following `pub use` re-exports to the file that defines the name;
//! - no file over [`MAX_FILE_LINES`] lines unless it is a declared table (listed below, with why);
//! - no function over [`MAX_FN_LINES`] lines unless it is listed below with why.
//!
//! A re-export (`pub use`) only hands a name on, so it is no edge of its own; a `mod` line is
//! none either. `nvmf_rdma::` paths in the binary name the library, which never names the
//! binary, so they cannot close a cycle and are not followed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 800;
const MAX_FN_LINES: usize = 100;

/// Files allowed past [`MAX_FILE_LINES`]: declared tables and generated text, one reason each.
const LONG_FILES: &[(&str, &str)] = &[];

/// Functions allowed past [`MAX_FN_LINES`] (`file: Type::name` or `file: name`), one reason
/// each: a declared table or a dispatch with one short arm per case reads best whole.
const LONG_FNS: &[(&str, &str)] = &[
    (
        "src/driver/mod.rs: drive",
        "the soft-HCA's per-turn loop (receive, timers, transmit, publish, wake) holds the \
         device lock across steps and its busy-poll state across turns; read whole, the \
         order of one turn is the point",
    ),
    (
        "src/hca/qp/requester.rs: Qp::emit_request",
        "builds one request packet in one pass on the hot path: the headers its opcode and \
         place in the message carry, its payload, and the retry and RTT bookkeeping",
    ),
    (
        "src/transport/queue/handle.rs: run",
        "the queue task's select loop (timer, requests, wake-ups) with its stash, timer and \
         channel state carried across turns; each arm calls into QueueCore",
    ),
];

// ---------------------------------------------------------------------------------------------
// Source text without comments and literals

/// `src` with comments and the insides of string and char literals blanked (newlines kept, so
/// line numbers still hold): what is left is code.
fn strip(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(k).copied().unwrap_or('\0');
        if c[i] == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                    out.push_str("  ");
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    out.push_str("  ");
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
        } else if (c[i] == 'r' || (c[i] == 'b' && at(i + 1) == 'r'))
            && !prev_is_ident(&c, i)
            && raw_string_hashes(&c, i + if c[i] == 'b' { 1 } else { 0 }).is_some()
        {
            let start = i + if c[i] == 'b' { 1 } else { 0 };
            let hashes = raw_string_hashes(&c, start).unwrap_or(0);
            i = start + 1 + hashes + 1;
            out.push('"');
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '"' && (0..hashes).all(|h| at(i + 1 + h) == '#') {
                    i += 1 + hashes;
                    out.push('"');
                    break;
                }
                blank(&mut out, c[i]);
                i += 1;
            }
        } else if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    blank(&mut out, c[i]);
                    i += 1;
                }
                if i < c.len() {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c[i] == '\'' && (at(i + 1) == '\\' || (at(i + 2) == '\'' && at(i + 1) != '\'')) {
            // A char literal; a lifetime ('a) has no closing quote right after one char.
            out.push('0');
            i += 1;
            if c[i] == '\\' {
                i += 1;
            }
            i += 1;
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn prev_is_ident(c: &[char], i: usize) -> bool {
    i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_')
}

/// At `c[i] == 'r'`: the number of `#` of a raw string opening there.
fn raw_string_hashes(c: &[char], i: usize) -> Option<usize> {
    if c.get(i) != Some(&'r') {
        return None;
    }
    let mut k = i + 1;
    while c.get(k) == Some(&'#') {
        k += 1;
    }
    (c.get(k) == Some(&'"')).then_some(k - i - 1)
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Path, // ::
    Punct(char),
}

/// Tokens of stripped code with their line numbers (1-based).
fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphabetic() || ch == '_' || ch == '$' {
            let s = i;
            i += 1;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let w: String = c[s..i].iter().collect();
            out.push((Tok::Ident(w.trim_start_matches('$').to_string()), line));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::Path, line));
            i += 2;
        } else if ch == '\'' {
            // A lifetime (char literals are gone): not a path.
            i += 1;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Module tree

#[derive(Default)]
struct Module {
    file: PathBuf,
    parent: Option<usize>,
    children: BTreeMap<String, usize>,
    /// `pub use` re-exports: the name handed on, the module it was written in and the path.
    reexports: Vec<(String, Vec<String>)>,
}

/// A path met in a file: the module it was written in, its segments, whether it came from a
/// `use` (which may start at a child module's name) and whether it is a re-export.
struct PathUse {
    module: usize,
    segs: Vec<String>,
    line: usize,
}

#[derive(Default)]
struct Crate {
    mods: Vec<Module>,
    uses: Vec<(PathBuf, PathUse)>,
    fns: Vec<(PathBuf, String, usize, usize)>,
}

impl Crate {
    fn load(root: &Path) -> Crate {
        let mut k = Crate::default();
        k.mods.push(Module {
            file: root.to_path_buf(),
            ..Default::default()
        });
        k.parse_file(0, root, true);
        k
    }

    fn new_mod(&mut self, parent: usize, name: &str, file: PathBuf) -> usize {
        let id = self.mods.len();
        self.mods.push(Module {
            file,
            parent: Some(parent),
            ..Default::default()
        });
        self.mods[parent].children.insert(name.to_string(), id);
        id
    }

    /// Parse `file`, the body of module `m`. `owns_dir`: its child modules live in its own
    /// directory (lib.rs, main.rs, mod.rs) rather than in one named after it.
    fn parse_file(&mut self, m: usize, file: &Path, owns_dir: bool) {
        let src = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        let toks = tokens(&strip(&src));
        let dir = if owns_dir {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        // (module, brace depth at which its body closes, inline-module dir)
        let mut scopes: Vec<(usize, usize, PathBuf)> = vec![(m, 0, dir)];
        // (impl type, depth at which the impl body closes)
        let mut impls: Vec<(String, usize)> = Vec::new();
        let mut depth = 0usize;
        let mut i = 0;
        let ident = |k: usize| match toks.get(k) {
            Some((Tok::Ident(s), _)) => Some(s.as_str()),
            _ => None,
        };
        let punct = |k: usize, p: char| matches!(toks.get(k), Some((Tok::Punct(q), _)) if *q == p);
        let is_path = |k: usize| matches!(toks.get(k), Some((Tok::Path, _)));
        while i < toks.len() {
            let (cur, _, cur_dir) = scopes.last().cloned().unwrap();
            let line = toks[i].1;
            match &toks[i].0 {
                Tok::Punct('{') => {
                    depth += 1;
                    i += 1;
                }
                Tok::Punct('}') => {
                    depth = depth.saturating_sub(1);
                    if scopes.len() > 1 && scopes.last().unwrap().1 == depth {
                        scopes.pop();
                    }
                    if impls.last().is_some_and(|(_, d)| *d == depth) {
                        impls.pop();
                    }
                    i += 1;
                }
                Tok::Ident(w) if w == "mod" && ident(i + 1).is_some() => {
                    let name = ident(i + 1).unwrap().to_string();
                    if punct(i + 2, ';') {
                        let a = cur_dir.join(format!("{name}.rs"));
                        let b = cur_dir.join(&name).join("mod.rs");
                        let (f, owns) = if a.exists() { (a, false) } else { (b, true) };
                        if f.exists() {
                            let id = self.new_mod(cur, &name, f.clone());
                            self.parse_file(id, &f, owns);
                        }
                        i += 3;
                    } else if punct(i + 2, '{') {
                        let file = self.mods[cur].file.clone();
                        let id = self.new_mod(cur, &name, file);
                        scopes.push((id, depth, cur_dir.join(&name)));
                        depth += 1;
                        i += 3;
                    } else {
                        i += 1;
                    }
                }
                Tok::Ident(w) if w == "use" => {
                    let public = i > 0 && visibility_before(&toks, i);
                    let mut k = i + 1;
                    let mut leaves = Vec::new();
                    use_tree(&toks, &mut k, Vec::new(), &mut leaves);
                    for (segs, name) in leaves {
                        if public && name != "_" {
                            self.mods[cur].reexports.push((name, segs));
                        } else {
                            let p = PathUse {
                                module: cur,
                                segs,
                                line,
                            };
                            self.uses.push((file.to_path_buf(), p));
                        }
                    }
                    i = k;
                }
                Tok::Ident(w) if w == "impl" => {
                    // The implementing type: after `for` if there is one, else the first name.
                    let mut k = i + 1;
                    let mut angle = 0i32;
                    let mut first = None;
                    let mut after_for = None;
                    while k < toks.len() && !(angle == 0 && (punct(k, '{') || punct(k, ';'))) {
                        match &toks[k].0 {
                            Tok::Punct('<') => angle += 1,
                            Tok::Punct('>') => angle -= 1,
                            Tok::Ident(s) if angle == 0 && s == "for" => after_for = Some(None),
                            Tok::Ident(s) if angle == 0 && s == "where" => break,
                            Tok::Ident(s) if angle == 0 && !is_path(k + 1) => {
                                if let Some(None) = after_for {
                                    after_for = Some(Some(s.clone()));
                                } else if first.is_none() && after_for.is_none() {
                                    first = Some(s.clone());
                                }
                            }
                            _ => {}
                        }
                        k += 1;
                    }
                    let ty = after_for.flatten().or(first).unwrap_or_default();
                    impls.push((ty, depth));
                    i += 1;
                }
                Tok::Ident(w) if w == "fn" && ident(i + 1).is_some() => {
                    let name = ident(i + 1).unwrap().to_string();
                    // The body opens at the first `{` outside parentheses; `;` ends a
                    // declaration without one.
                    let mut k = i + 2;
                    let mut paren = 0i32;
                    while k < toks.len() {
                        match toks[k].0 {
                            Tok::Punct('(') | Tok::Punct('[') => paren += 1,
                            Tok::Punct(')') | Tok::Punct(']') => paren -= 1,
                            Tok::Punct('{') | Tok::Punct(';') if paren == 0 => break,
                            _ => {}
                        }
                        k += 1;
                    }
                    if punct(k, '{') {
                        let mut d = 0;
                        let mut e = k;
                        while e < toks.len() {
                            match toks[e].0 {
                                Tok::Punct('{') => d += 1,
                                Tok::Punct('}') => {
                                    d -= 1;
                                    if d == 0 {
                                        break;
                                    }
                                }
                                _ => {}
                            }
                            e += 1;
                        }
                        let end = toks.get(e).map_or(line, |t| t.1);
                        let qual = match impls.last() {
                            Some((ty, d)) if *d + 1 == depth && !ty.is_empty() => {
                                format!("{ty}::{name}")
                            }
                            _ => name,
                        };
                        self.fns
                            .push((file.to_path_buf(), qual, line, end - line + 1));
                    }
                    i += 2;
                }
                Tok::Ident(w) if is_path(i + 1) && !(i > 0 && is_path(i - 1)) => {
                    let starts = matches!(w.as_str(), "crate" | "super" | "self")
                        || self.mods[cur].children.contains_key(w);
                    let mut k = i;
                    let mut segs = Vec::new();
                    while let Some(s) = ident(k) {
                        segs.push(s.to_string());
                        if !is_path(k + 1) {
                            break;
                        }
                        k += 2;
                    }
                    if starts {
                        let p = PathUse {
                            module: cur,
                            segs,
                            line,
                        };
                        self.uses.push((file.to_path_buf(), p));
                    }
                    i = k + 1;
                }
                _ => i += 1,
            }
        }
    }

    /// The module and the item path left after walking `segs` from module `m`: `None` for a
    /// path that leaves the crate (std, a dependency).
    fn walk(&self, m: usize, segs: &[String]) -> Option<(usize, Vec<String>)> {
        let mut cur = match segs.first().map(String::as_str) {
            Some("crate") => 0,
            Some("super") => self.mods[m].parent?,
            Some("self") => m,
            Some(s) if self.mods[m].children.contains_key(s) => self.mods[m].children[s],
            _ => return None,
        };
        let mut rest = &segs[1..];
        while let Some(s) = rest.first() {
            if s == "super" {
                cur = self.mods[cur].parent?;
            } else if let Some(&c) = self.mods[cur].children.get(s) {
                cur = c;
            } else {
                break;
            }
            rest = &rest[1..];
        }
        Some((cur, rest.to_vec()))
    }

    /// The file that defines what `segs` names when written in module `m`, following
    /// re-exports.
    fn resolve(&self, m: usize, segs: &[String], hops: u32) -> Option<PathBuf> {
        let (md, rest) = self.walk(m, segs)?;
        if let (Some(name), true) = (rest.first(), hops < 16) {
            let found = self.mods[md].reexports.iter().find(|(n, _)| n == name);
            if let Some((_, target)) = found {
                let mut t = target.clone();
                if t.last().is_some_and(|l| l == "self") {
                    t.pop();
                }
                t.extend(rest[1..].iter().cloned());
                if let Some(f) = self.resolve(md, &t, hops + 1) {
                    return Some(f);
                }
            }
        }
        Some(self.mods[md].file.clone())
    }
}

/// `use` at `toks[i]` follows a visibility (`pub`, `pub(crate)`, `pub(super)`, `pub(in ...)`).
fn visibility_before(toks: &[(Tok, usize)], i: usize) -> bool {
    let mut k = i;
    if k >= 1 && toks[k - 1].0 == Tok::Punct(')') {
        while k > 0 && toks[k - 1].0 != Tok::Punct('(') {
            k -= 1;
        }
        k = k.saturating_sub(1);
    }
    k >= 1 && toks[k - 1].0 == Tok::Ident("pub".into())
}

/// Parse a use tree at `toks[*k]` (up to its `;`, `,` or `}`), pushing each leaf's full path
/// and the name it binds (`*` for a glob, `_` for `as _`).
fn use_tree(
    toks: &[(Tok, usize)],
    k: &mut usize,
    mut prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, String)>,
) {
    if toks.get(*k).map(|t| &t.0) == Some(&Tok::Path) {
        *k += 1;
    }
    while *k < toks.len() {
        match &toks[*k].0 {
            Tok::Ident(s) => {
                prefix.push(s.clone());
                *k += 1;
                if toks.get(*k).map(|t| &t.0) == Some(&Tok::Path) {
                    *k += 1;
                    continue;
                }
                let mut name = prefix.last().cloned().unwrap_or_default();
                if name == "self" && prefix.len() > 1 {
                    name = prefix[prefix.len() - 2].clone();
                }
                if matches!(toks.get(*k).map(|t| &t.0), Some(Tok::Ident(a)) if a == "as") {
                    if let Some((Tok::Ident(n), _)) = toks.get(*k + 1) {
                        name = n.clone();
                    }
                    *k += 2;
                }
                out.push((prefix, name));
                break;
            }
            Tok::Punct('*') => {
                *k += 1;
                out.push((prefix, "*".into()));
                break;
            }
            Tok::Punct('{') => {
                *k += 1;
                loop {
                    match toks.get(*k).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *k += 1;
                            break;
                        }
                        Some(Tok::Punct(',')) => *k += 1,
                        None => break,
                        _ => use_tree(toks, k, prefix.clone(), out),
                    }
                }
                break;
            }
            _ => break,
        }
    }
    if toks.get(*k).map(|t| &t.0) == Some(&Tok::Punct(';')) {
        *k += 1;
    }
}

// ---------------------------------------------------------------------------------------------
// The checks

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rel(p: &Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}

/// The crate roots under src/: the library and each binary.
fn crates() -> Vec<Crate> {
    let src = root().join("src");
    let mut roots = vec![src.join("lib.rs")];
    if src.join("main.rs").exists() {
        roots.push(src.join("main.rs"));
    }
    if let Ok(rd) = std::fs::read_dir(src.join("bin")) {
        let mut bins: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter_map(|p| {
                if p.is_dir() {
                    Some(p.join("main.rs")).filter(|m| m.exists())
                } else {
                    (p.extension().is_some_and(|e| e == "rs")).then_some(p)
                }
            })
            .collect();
        bins.sort();
        roots.extend(bins);
    }
    roots.iter().map(|r| Crate::load(r)).collect()
}

/// Edges between files (`from -> to: the names used, with a line`) of every crate.
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn graph(crates: &[Crate]) -> Graph {
    let mut g = Graph::new();
    for k in crates {
        for (file, p) in &k.uses {
            let Some(to) = k.resolve(p.module, &p.segs, 0) else {
                continue;
            };
            if &to != file {
                let name = format!("{} (line {})", p.segs.join("::"), p.line);
                g.entry(rel(file))
                    .or_default()
                    .entry(rel(&to))
                    .or_default()
                    .insert(name);
            }
        }
    }
    g
}

/// Strongly connected components of more than one file (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
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
        if let Some(es) = t.g.get(v) {
            for w in es.keys() {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let l = t.low[w].min(t.low[v]);
                    t.low.insert(v, l);
                } else if t.on.contains(w) {
                    let l = t.index[w].min(t.low[v]);
                    t.low.insert(v, l);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.to_string());
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
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out.sort();
    t.out
}

#[test]
fn no_import_cycle_between_files() {
    let g = graph(&crates());
    let mut msg = String::new();
    for c in cycles(&g) {
        let _ = writeln!(msg, "cycle: {}", c.join(", "));
        for a in &c {
            for (b, names) in g.get(a).into_iter().flatten() {
                if c.contains(b) {
                    let names: Vec<_> = names.iter().cloned().collect();
                    let _ = writeln!(msg, "  {a} -> {b}: {}", names.join(", "));
                }
            }
        }
    }
    assert!(
        msg.is_empty(),
        "import cycles between files in src/ (move the shared piece into a file both can \
         import, or turn the upward edge around):\n{msg}"
    );
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_file_over_the_limit_unless_a_declared_table() {
    let mut files = Vec::new();
    rs_files(&root().join("src"), &mut files);
    files.sort();
    let mut msg = String::new();
    for f in &files {
        let lines = std::fs::read_to_string(f).unwrap().lines().count();
        let name = rel(f);
        let listed = LONG_FILES.iter().any(|(n, _)| *n == name);
        if lines > MAX_FILE_LINES && !listed {
            let _ = writeln!(msg, "  {name}: {lines} lines");
        }
    }
    for (n, why) in LONG_FILES {
        assert!(!why.is_empty(), "{n}: say why it is allowed to be long");
        assert!(
            root().join(n).exists(),
            "{n} is listed in LONG_FILES but does not exist"
        );
    }
    assert!(
        msg.is_empty(),
        "files in src/ over {MAX_FILE_LINES} lines (split by concern, or list a declared \
         table in LONG_FILES with why):\n{msg}"
    );
}

#[test]
fn no_function_over_the_limit_unless_listed() {
    let mut long = Vec::new();
    for k in crates() {
        for (file, name, line, len) in &k.fns {
            if *len > MAX_FN_LINES {
                long.push((rel(file), name.clone(), *line, *len));
            }
        }
    }
    long.sort();
    long.dedup();
    let mut msg = String::new();
    println!("functions over {MAX_FN_LINES} lines:");
    for (file, name, line, len) in &long {
        let key = format!("{file}: {name}");
        let why = LONG_FNS.iter().find(|(n, _)| *n == key).map(|(_, w)| *w);
        println!(
            "  {key} (line {line}): {len} lines{}",
            why.map_or(String::new(), |w| format!(" ({w})"))
        );
        if why.is_none() {
            let _ = writeln!(msg, "  {key} (line {line}): {len} lines");
        }
    }
    assert!(
        msg.is_empty(),
        "functions over {MAX_FN_LINES} lines (split them where it reads better, or list one in \
         LONG_FNS with why):\n{msg}"
    );
}

/// The parser the checks stand on: comments and literals are not code, `use` trees and
/// re-exports resolve to the defining file, and a cycle is found and named.
#[test]
fn the_checker_resolves_uses_and_finds_a_cycle() {
    let code = strip("a // crate::x\n/* crate::y */ \"crate::z\" r#\"crate::w\"# 'c' 'a b");
    assert!(!code.contains("crate"), "{code}");
    assert_eq!(code.lines().count(), 2);

    let dir = std::env::temp_dir().join(format!("structure-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("d")).unwrap();
    let w = |p: &str, s: &str| std::fs::write(dir.join(p), s).unwrap();
    w("lib.rs", "pub mod d;\npub mod top;\n");
    w(
        "d/mod.rs",
        "mod a;\nmod b;\npub use a::A;\npub use self::b::{B as Bee};\n",
    );
    w("d/a.rs", "use super::b::B;\npub struct A;\n");
    w("d/b.rs", "pub struct B;\nfn f() { let _ = crate::d::A; }\n");
    w(
        "top.rs",
        "use crate::d::Bee;\nfn g() {\n    super::d::A;\n}\n",
    );
    let k = Crate::load(&dir.join("lib.rs"));
    let g = graph(&[k]);
    let _ = std::fs::remove_dir_all(&dir);
    let edges: Vec<(String, String)> = g
        .iter()
        .flat_map(|(a, bs)| bs.keys().map(move |b| (file_name(a), file_name(b))))
        .collect();
    let want = [
        ("a.rs", "b.rs"),
        ("b.rs", "a.rs"),
        ("top.rs", "a.rs"),
        ("top.rs", "b.rs"),
    ];
    let want: Vec<_> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(edges, want);
    let c = cycles(&g);
    assert_eq!(c.len(), 1);
    assert_eq!(
        c[0].iter().map(|f| file_name(f)).collect::<Vec<_>>(),
        ["a.rs", "b.rs"]
    );
}

fn file_name(p: &str) -> String {
    Path::new(p)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}
