//! Layout rules the compiler cannot check, checked on the source of every crate:
//!
//! 1. Only the host crate (`crates/host/`) reads or writes `/proc` and `/sys`: no string
//!    literal outside it may start with either (comments are not code and do not count).
//! 2. `unsafe` code lives in `crates/host/src/os.rs` and the runtime's code shipping
//!    (`crates/runtime/src/shipping.rs`) only: no other line of code may contain the
//!    keyword (comments and strings do not count; `unsafe_code` in a lint is a different
//!    word).
//! 3. Settings come from the one configuration: no code changes the process environment
//!    (`set_var`, `remove_var`: a test or benchmark configures a cluster through
//!    `Cluster::builder()`, and a driver hands its configuration to its nodes), and
//!    library code (`crates/*/src/`) reads environment variables only where the
//!    configuration is loaded. Tests, examples and their own knobs are free to read.
//!
//! Each exception is listed below with the reason for it. A failure names every file and
//! line that breaks a rule.

use std::path::{Path, PathBuf};

/// String literals starting with `/proc` or `/sys` allowed outside the host crate:
/// (file, literal without its leading `/`, so that this file names no such path itself).
const PATH_LITERALS_ALLOWED: &[(&str, &str)] = &[
    // Code shipping checks that a shipped offset lies in this binary's code (its own
    // mappings) and hashes the executable for the identical-binary handshake; that guard
    // stays in one module with the unsafe code it protects.
    ("crates/runtime/src/shipping.rs", "proc/self/maps"),
    ("crates/runtime/src/shipping.rs", "proc/self/exe"),
];

/// Files whose code may contain `unsafe`: (file, `None` for any line, or the one line of
/// code allowed, trimmed).
const UNSAFE_ALLOWED: &[(&str, Option<&str>)] = &[
    // The host crate's only unsafe code: requests to the OS no safe wrapper covers.
    ("crates/host/src/os.rs", None),
    // Code shipping: jumping to a trampoline by offset.
    ("crates/runtime/src/shipping.rs", None),
    // The file system's POSIX tests make the very system calls under test (flock and
    // fcntl locks, fallocate, utimensat, mmap, mknod, ioctl, statfs...) and check the
    // errno each returns; a wrapper would hide what is tested. Test code, not shipped.
    ("crates/cli/tests/fs_posix.rs", None),
    ("crates/cli/tests/common/fsmount.rs", None),
];

/// Files whose code may change the process environment: (file, reason).
const ENV_WRITES_ALLOWED: &[(&str, &str)] = &[(
    "crates/runtime/src/boot.rs",
    "a node process drops its own boot variable before any thread starts, so its children do not boot as nodes",
)];

/// Library files whose code may read environment variables: (file prefix, reason).
const ENV_READS_ALLOWED: &[(&str, &str)] = &[
    (
        "crates/config/src/",
        "the one place settings are loaded from (Config::load)",
    ),
    (
        "crates/runtime/src/cluster.rs",
        "the cluster builder hands the environment to the configuration loader",
    ),
    (
        "crates/runtime/src/boot.rs",
        "the boot payload a driver gives its node processes",
    ),
    (
        "crates/cli/src/main.rs",
        "granule node/controller/config hand the environment to the configuration loader",
    ),
    (
        "crates/cli/src/market.rs",
        "granule kv keeps its default state file under $HOME/.granule (a location, not a setting)",
    ),
    (
        "crates/report/src/meta.rs",
        "GRANULE_COMMIT: a benchmark report's provenance where git is unavailable, not a setting",
    ),
    (
        "crates/failpoints/src/lib.rs",
        "its unit test re-runs the test binary as a child that crashes",
    ),
    (
        "crates/bench/src/consumer.rs",
        "the consumer benchmark re-runs this binary as its application child and hands it its configuration file's path",
    ),
    (
        "crates/bench/src/scavenge.rs",
        "the scavenge benchmark re-runs this binary as its tenant child and hands it its work",
    ),
    (
        "crates/host/src/hierarchy.rs",
        "its unit test re-runs the test binary as user nobody",
    ),
    (
        "crates/host/src/foreign.rs",
        "its unit test re-runs the test binary as a helper process",
    ),
];

/// Whether a line of code changes the environment, or reads it.
fn env_use(code: &str) -> (bool, bool) {
    let writes = code.contains("set_var(") || code.contains("remove_var(");
    let reads = ["env::var(", "env::var_os(", "env::vars(", "env::vars_os("]
        .iter()
        .any(|p| code.contains(p));
    (writes, reads)
}

/// Library code (not tests, examples or benches).
fn is_library(file: &str) -> bool {
    file.split('/').nth(2) == Some("src")
}

/// The workspace root (two levels above this crate).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root")
}

/// Every `.rs` file under `dir`, as paths relative to `root`, sorted.
fn rust_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if name.starts_with('.') || name == "target" {
                continue;
            }
            rust_files(root, &path, out);
        } else if name.ends_with(".rs") {
            let rel = path.strip_prefix(root).expect("under the root");
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// A string literal: the line it starts on (1-based) and its text between the quotes
/// (escapes left as written).
#[derive(Debug, PartialEq)]
struct Literal {
    line: usize,
    text: String,
}

/// A source file taken apart: its string literals, and its code lines with comments
/// removed and literals emptied (`""`), 1-based line numbers.
#[derive(Debug, Default)]
struct Scanned {
    literals: Vec<Literal>,
    code: Vec<(usize, String)>,
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// A small Rust lexer: enough to tell comments, string literals (plain, byte, C, raw with
/// any number of `#`), character literals and lifetimes from code.
fn scan(src: &str) -> Scanned {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Scanned::default();
    let mut line = 1;
    let mut code = String::new();
    let mut i = 0;
    let flush = |out: &mut Scanned, code: &mut String, line: usize| {
        out.code.push((line, std::mem::take(code)));
    };
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            flush(&mut out, &mut code, line);
            line += 1;
            i += 1;
            continue;
        }
        // Comments.
        if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        flush(&mut out, &mut code, line);
                        line += 1;
                    }
                    i += 1;
                }
            }
            continue;
        }
        // Raw strings: r"..", r#".."#, br"..", cr#".."# (not raw identifiers like r#type).
        let prev = if i > 0 { chars[i - 1] } else { ' ' };
        let before_prefix = if i > 1 { chars[i - 2] } else { ' ' };
        let starts_token =
            !is_ident(prev) || (matches!(prev, 'b' | 'c') && !is_ident(before_prefix));
        if c == 'r' && starts_token {
            let mut j = i + 1;
            while at(j) == '#' {
                j += 1;
            }
            if at(j) == '"' {
                let hashes = j - i - 1;
                let start_line = line;
                let mut text = String::new();
                j += 1;
                loop {
                    if j >= chars.len() {
                        break;
                    }
                    if chars[j] == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                        j += 1 + hashes;
                        break;
                    }
                    if chars[j] == '\n' {
                        flush(&mut out, &mut code, line);
                        line += 1;
                    }
                    text.push(chars[j]);
                    j += 1;
                }
                out.literals.push(Literal {
                    line: start_line,
                    text,
                });
                code.push_str("\"\"");
                i = j;
                continue;
            }
        }
        // Plain, byte and C strings.
        if c == '"' {
            let start_line = line;
            let mut text = String::new();
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    text.push('\\');
                    i += 1;
                }
                if i < chars.len() {
                    if chars[i] == '\n' {
                        flush(&mut out, &mut code, line);
                        line += 1;
                    }
                    text.push(chars[i]);
                    i += 1;
                }
            }
            i += 1; // the closing quote
            out.literals.push(Literal {
                line: start_line,
                text,
            });
            code.push_str("\"\"");
            continue;
        }
        // Character literals ('x', '\n', '\'', '\u{..}') and lifetimes ('a, 'static).
        if c == '\'' {
            if at(i + 1) == '\\' {
                let mut j = i + 3;
                while j < chars.len() && chars[j] != '\'' && chars[j] != '\n' {
                    j += 1;
                }
                code.push_str("' '");
                i = j + 1;
                continue;
            }
            if at(i + 2) == '\'' {
                code.push_str("' '");
                i += 3;
                continue;
            }
        }
        code.push(c);
        i += 1;
    }
    flush(&mut out, &mut code, line);
    out
}

/// Whether a line of code (comments and strings removed) has the word `unsafe`.
fn has_unsafe(code: &str) -> bool {
    let chars: Vec<char> = code.chars().collect();
    let word: Vec<char> = "unsafe".chars().collect();
    (0..chars.len()).any(|i| {
        chars[i..].starts_with(&word)
            && (i == 0 || !is_ident(chars[i - 1]))
            && chars.get(i + word.len()).is_none_or(|&c| !is_ident(c))
    })
}

/// Whether a literal's text names a path under `/proc` or `/sys`.
fn is_host_path(text: &str) -> bool {
    // Spelled in pieces so that this file has no such literal itself.
    ["proc", "sys"].iter().any(|top| {
        text.strip_prefix('/')
            .and_then(|t| t.strip_prefix(top))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    })
}

#[test]
fn host_paths_unsafe_code_and_the_environment_stay_where_they_belong() {
    let root = workspace();
    let mut files = Vec::new();
    rust_files(&root, &root.join("crates"), &mut files);
    assert!(
        files.iter().any(|f| f == "crates/host/src/os.rs"),
        "the walk found the host crate: {files:?}"
    );
    let mut broken = Vec::new();
    let mut paths_used = Vec::new();
    let mut unsafe_used = Vec::new();
    for file in &files {
        let src = std::fs::read_to_string(root.join(file)).expect("readable source");
        let scanned = scan(&src);
        if !file.starts_with("crates/host/") {
            for lit in scanned.literals.iter().filter(|l| is_host_path(&l.text)) {
                let unslashed = &lit.text[1..];
                if PATH_LITERALS_ALLOWED.contains(&(file.as_str(), unslashed)) {
                    paths_used.push((file.as_str(), unslashed.to_string()));
                } else {
                    broken.push(format!(
                        "{file}:{}: the literal {:?} names a path under /proc or /sys: \
                         read it through granule_host instead",
                        lit.line, lit.text
                    ));
                }
            }
        }
        for (line, code) in &scanned.code {
            let (writes, reads) = env_use(code);
            if writes && !ENV_WRITES_ALLOWED.iter().any(|(f, _)| f == file) {
                broken.push(format!(
                    "{file}:{line}: changes the process environment ({}): configure \
                     clusters through Cluster::builder() (set, with, ...) instead",
                    code.trim()
                ));
            }
            if reads
                && is_library(file)
                && !ENV_READS_ALLOWED.iter().any(|(f, _)| file.starts_with(f))
            {
                broken.push(format!(
                    "{file}:{line}: reads an environment variable ({}): a setting belongs \
                     in granule-config (crates/config/src/settings.rs)",
                    code.trim()
                ));
            }
        }
        for (line, code) in scanned.code.iter().filter(|(_, c)| has_unsafe(c)) {
            let allowed = UNSAFE_ALLOWED
                .iter()
                .any(|(f, only)| *f == file && only.is_none_or(|l| l == code.trim()));
            if allowed {
                unsafe_used.push((file.as_str(), code.trim().to_string()));
            } else {
                broken.push(format!(
                    "{file}:{line}: `unsafe` outside crates/host/src/os.rs and \
                     crates/runtime/src/shipping.rs: {}",
                    code.trim()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "layout rules broken:\n{}",
        broken.join("\n")
    );
    // An exception nobody needs any more is stale: say so, so it gets removed.
    for (file, text) in PATH_LITERALS_ALLOWED {
        if !paths_used.iter().any(|(f, t)| f == file && t == text) {
            eprintln!("note: the allowed literal \"/{text}\" in {file} is no longer there");
        }
    }
    for (file, only) in UNSAFE_ALLOWED {
        if !unsafe_used
            .iter()
            .any(|(f, l)| f == file && only.is_none_or(|o| o == l))
        {
            eprintln!("note: the allowed `unsafe` in {file} is no longer there");
        }
    }
}

// ---- the lexer, on fixed text ----

#[test]
fn comments_are_not_code_and_strings_are_literals() {
    let src = "let a = \"x\"; // \"in a comment\"\n\
               /* \"block\" /* nested \"too\" */ still */ let b = 1;\n\
               /// doc \"also\"\n\
               let c = \"multi\nline\";\n";
    let s = scan(src);
    let texts: Vec<(usize, &str)> = s
        .literals
        .iter()
        .map(|l| (l.line, l.text.as_str()))
        .collect();
    assert_eq!(texts, vec![(1, "x"), (4, "multi\nline")]);
    assert_eq!(s.code[0], (1, "let a = \"\"; ".to_string()));
    assert_eq!(s.code[1], (2, " let b = 1;".to_string()));
    assert_eq!(s.code[2], (3, String::new()));
}

#[test]
fn escapes_raw_strings_chars_and_lifetimes() {
    let src = r###"let a = "q\"uote\\"; let b = r#"raw "with" quotes"#; let c = br"bytes";
let d = '"'; let e = '\''; let f = b'\\'; fn g<'a>(x: &'a str) -> &'static str { x }
let h = r#type; let i = c"cstr"; let j = '\u{1F600}'; let k = 'é';"###;
    let s = scan(src);
    let texts: Vec<&str> = s.literals.iter().map(|l| l.text.as_str()).collect();
    assert_eq!(
        texts,
        vec![r#"q\"uote\\"#, r#"raw "with" quotes"#, "bytes", "cstr"]
    );
    // Lifetimes and raw identifiers stay code; char literals (even of a quote) do not
    // start strings.
    assert!(s.code[1].1.contains("<'a>") && s.code[1].1.contains("&'static"));
    assert!(s.code[2].1.contains("r#type"));
}

#[test]
fn unsafe_is_a_word_outside_comments_and_strings() {
    let code = |src: &str| {
        scan(src)
            .code
            .into_iter()
            .map(|(_, c)| c)
            .collect::<Vec<_>>()
    };
    assert!(has_unsafe(&code("unsafe { x() }")[0]));
    assert!(has_unsafe(&code("pub unsafe fn f() {}")[0]));
    assert!(has_unsafe(&code("#[ctor::ctor(unsafe)]")[0]));
    assert!(!has_unsafe(&code("#![deny(unsafe_code)]")[0]));
    assert!(!has_unsafe(&code("let not_unsafe = 1;")[0]));
    assert!(!has_unsafe(&code("// unsafe in a comment")[0]));
    assert!(!has_unsafe(&code("let s = \"unsafe\";")[0]));
    assert!(!has_unsafe(&code("/* unsafe */ let x = 1;")[0]));
}

#[test]
fn environment_writes_and_reads_are_recognized() {
    assert_eq!(env_use("std::env::set_var(\"\", \"\");"), (true, false));
    assert_eq!(env_use("std::env::remove_var(BOOT_ENV);"), (true, false));
    assert_eq!(env_use("let v = std::env::var(\"\").ok();"), (false, true));
    assert_eq!(
        env_use("if std::env::var_os(X).is_some() {}"),
        (false, true)
    );
    assert_eq!(env_use("cmd.env(\"\", \"\");"), (false, false));
    assert!(is_library("crates/runtime/src/node/mod.rs"));
    assert!(!is_library("crates/granule/tests/chaos.rs"));
    assert!(!is_library("crates/bench/examples/pipeline_probe.rs"));
}

#[test]
fn host_paths_are_recognized() {
    // Built with a leading slash here, for the reason given at PATH_LITERALS_ALLOWED.
    for yes in ["proc", "proc/self/exe", "sys/fs/cgroup", "sys"] {
        assert!(is_host_path(&format!("/{yes}")), "{yes}");
    }
    for no in [
        "proc",
        "/process",
        "/system",
        "x/proc",
        "",
        " /proc",
        "/tmp/proc",
    ] {
        assert!(!is_host_path(no), "{no}");
    }
}
