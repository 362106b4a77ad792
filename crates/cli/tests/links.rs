//! The documentation's links against the repository.
//!
//! Every Markdown link and image in `README.md` and in every `.md` file under `docs/`
//! must point at a file or directory inside the repository that exists (and, for an
//! anchor into a Markdown file, at one of its headings), or at an `https` URL. A relative
//! link that leaves the repository (`../shared/DESIGN.md`) works in one checkout and
//! nowhere else, so it fails; so does an `http://` URL, linked or bare in the text. Code
//! blocks and code spans are not links and are not checked.
//!
//! The benchmarks page's figures are checked against the runs' `summary.json` files by
//! `crates/bench/tests/results_page.rs`, beside the list of benchmarks.
//!
//! Run: `cargo test -p granule-cli --test links`.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

fn repo() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize().expect("the repository root")
}

/// `README.md` and every `.md` file under `docs/`, as paths from the repository root.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::from("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).expect("a docs directory") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p.strip_prefix(root).expect("inside").to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// The prose lines of a Markdown text: fenced code blocks blanked, code spans removed.
/// Line numbers are kept (one output line per input line).
fn prose(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        let t = line.trim_start();
        let marker = if t.starts_with("```") {
            Some("```")
        } else if t.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (fence, marker) {
            (None, Some(m)) => {
                fence = Some(m);
                out.push(String::new());
                continue;
            }
            (Some(f), Some(m)) if f == m => {
                fence = None;
                out.push(String::new());
                continue;
            }
            (Some(_), _) => {
                out.push(String::new());
                continue;
            }
            (None, None) => {}
        }
        // Drop code spans (an unclosed backtick on a line keeps the rest as text).
        let mut s = String::new();
        let mut rest = line;
        while let Some(i) = rest.find('`') {
            let ticks = rest[i..].chars().take_while(|c| *c == '`').count();
            let fence = &rest[i..i + ticks];
            match rest[i + ticks..].find(fence) {
                Some(j) => {
                    s.push_str(&rest[..i]);
                    rest = &rest[i + ticks + j + ticks..];
                }
                None => break,
            }
        }
        s.push_str(rest);
        out.push(s);
    }
    out
}

/// Every link target in a prose line: `[text](target)`, `![alt](target)`, `<scheme:...>`
/// autolinks and `[label]: target` definitions.
fn targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = line[at..].find("](") {
        let start = at + i + 2;
        let mut depth = 0usize;
        let mut end = None;
        for (k, c) in line[start..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = Some(start + k);
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let Some(end) = end else { break };
        let inner = line[start..end].trim();
        // A title after the target: `(path "title")`.
        let target = inner.split_whitespace().next().unwrap_or("");
        out.push(target.trim_matches(|c| c == '<' || c == '>').to_string());
        at = end;
    }
    let t = line.trim_start();
    if t.starts_with('[') {
        if let Some(close) = t.find("]:") {
            let target = t[close + 2..].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                out.push(target.to_string());
            }
        }
    }
    let mut at = 0;
    while let Some(i) = line[at..].find('<') {
        let start = at + i + 1;
        let Some(j) = line[start..].find('>') else {
            break;
        };
        let inner = &line[start..start + j];
        if inner.starts_with("http://") || inner.starts_with("https://") {
            out.push(inner.to_string());
        }
        at = start + j;
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (duplicates get `-1`, `-2`, ...).
fn anchors(text: &str) -> Vec<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            in_code = !in_code;
            continue;
        }
        if in_code || !t.starts_with('#') {
            continue;
        }
        let level = t.chars().take_while(|c| *c == '#').count();
        if level > 6 || !t[level..].starts_with(' ') {
            continue;
        }
        let s = slug(t[level..].trim().trim_end_matches('#'));
        let n = seen.entry(s.clone()).or_insert(0);
        out.push(if *n == 0 {
            s.clone()
        } else {
            format!("{s}-{n}")
        });
        *n += 1;
    }
    out
}

/// `path` with `.` and `..` resolved lexically; `None` when it climbs above its start.
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// What is wrong with a link to `target` from the document `doc` (a path from the
/// repository root), if anything.
fn check_link(root: &Path, doc: &Path, target: &str) -> Result<(), String> {
    if target.is_empty() {
        return Err("an empty link target".into());
    }
    if let Some((scheme, _)) = target.split_once(':') {
        if scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+')
        {
            return match scheme {
                "https" => Ok(()),
                "mailto" => Ok(()),
                "http" => Err("an http:// URL: use https".into()),
                _ => Err(format!("a link with the scheme {scheme}:")),
            };
        }
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let file = if path.is_empty() {
        doc.to_path_buf()
    } else {
        if path.starts_with('/') {
            return Err("an absolute path: link relative to the document".into());
        }
        let joined = doc.parent().unwrap_or(Path::new("")).join(path);
        normalize(&joined).ok_or_else(|| {
            format!(
                "leaves the repository (it exists in no clone): {path} from {}",
                doc.display()
            )
        })?
    };
    let abs = root.join(&file);
    if !abs.exists() {
        return Err(format!("{} does not exist", file.display()));
    }
    if let Some(anchor) = anchor {
        if file.extension().is_some_and(|x| x == "md") {
            let text = std::fs::read_to_string(&abs).map_err(|e| e.to_string())?;
            if !anchors(&text).iter().any(|a| a == anchor) {
                return Err(format!("{} has no heading #{anchor}", file.display()));
            }
        }
    }
    Ok(())
}

/// Whether the text has a bare `http://` URL other than one on this machine's loopback
/// (a generated report quotes a mount's `http://127.0.0.1:PORT/status`; those point at the
/// reader's own machine, and no https form exists).
fn has_bare_http(line: &str) -> bool {
    line.match_indices("http://").any(|(i, _)| {
        let rest = &line[i + "http://".len()..];
        !["127.0.0.1", "localhost", "[::1]"]
            .iter()
            .any(|h| rest.starts_with(h))
    })
}

/// Every bad link (and bare `http://` URL) of the documents: `file:line: target: why`.
fn bad_links(root: &Path, docs: &[PathBuf]) -> Vec<String> {
    let mut failures = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(root.join(doc)).expect("a document");
        for (i, line) in prose(&text).iter().enumerate() {
            for t in targets(line) {
                if let Err(why) = check_link(root, doc, &t) {
                    failures.push(format!("{}:{}: ({t}): {why}", doc.display(), i + 1));
                }
            }
            if has_bare_http(line) && !targets(line).iter().any(|t| t.starts_with("http://")) {
                failures.push(format!(
                    "{}:{}: a bare http:// URL in the text (use https, or put an example \
                     address in a code span)",
                    doc.display(),
                    i + 1
                ));
            }
        }
    }
    failures
}

#[test]
fn every_link_stays_in_the_repository_and_resolves() {
    let root = repo();
    let docs = documents(&root);
    let mut failures = bad_links(&root, &docs);
    for must in [
        "README.md",
        "docs/architecture.md",
        "docs/results/README.md",
        "docs/guide/README.md",
        "docs/guide/known-limits.md",
    ] {
        if !docs.iter().any(|d| d == Path::new(must)) {
            failures.push(format!("{must} is missing"));
        }
    }
    assert!(
        failures.is_empty(),
        "links that do not resolve inside the repository:\n{}",
        failures.join("\n")
    );
}

/// Every chapter of the guide is in the guide's index, and the README's map of the guide
/// names every chapter too.
#[test]
fn the_guide_index_and_the_readme_list_every_chapter() {
    let root = repo();
    let index = std::fs::read_to_string(root.join("docs/guide/README.md")).expect("index");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README");
    let mut missing = Vec::new();
    for e in std::fs::read_dir(root.join("docs/guide")).expect("docs/guide") {
        let name = e.expect("entry").file_name().to_string_lossy().into_owned();
        if !name.ends_with(".md") || name == "README.md" {
            continue;
        }
        if !index.contains(&format!("]({name}")) {
            missing.push(format!("docs/guide/README.md does not list {name}"));
        }
        if !readme.contains(&format!("](docs/guide/{name}")) {
            missing.push(format!("README.md's map of the guide does not list {name}"));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// The checker itself: what it must refuse and what it must let through.
#[test]
fn the_link_checker_refuses_links_out_of_the_repository() {
    let root = repo();
    let readme = Path::new("README.md");
    let guide = Path::new("docs/guide/concepts.md");
    let out = check_link(&root, readme, "../shared/DESIGN.md").unwrap_err();
    assert!(out.contains("leaves the repository"), "{out}");
    assert!(check_link(&root, guide, "../../../x.md").is_err());
    assert!(check_link(&root, readme, "http://example.com/").is_err());
    assert!(check_link(&root, readme, "http://127.0.0.1:8080/").is_err());
    assert!(has_bare_http("see http://example.com/ for more"));
    assert!(!has_bare_http("status at http://127.0.0.1:43647/status"));
    assert!(check_link(&root, readme, "/etc/passwd").is_err());
    assert!(check_link(&root, readme, "docs/nothing-here.md").is_err());
    assert!(check_link(&root, readme, "#no-such-heading").is_err());
    assert!(check_link(&root, readme, "https://example.com/").is_ok());
    assert!(check_link(&root, readme, "docs/guide/README.md").is_ok());
    assert!(check_link(&root, guide, "../../README.md").is_ok());
    assert!(check_link(&root, guide, "operations.md#bounds-of-the-http-doors").is_ok());
    assert!(check_link(&root, guide, "operations.md#no-such-heading").is_err());
    assert_eq!(slug("`granule status`"), "granule-status");
    assert_eq!(slug("8. Watch it run"), "8-watch-it-run");
    assert_eq!(slug("Resource limits (cgroups)"), "resource-limits-cgroups");
    assert_eq!(
        targets("see [a](x.md) and ![b](y.png \"t\") and <https://z>"),
        vec!["x.md", "y.png", "https://z"]
    );
    assert_eq!(
        prose("a `[x](nope.md)` b\n```\n[y](nope.md)\n```\n"),
        vec!["a  b", "", "", ""]
    );
}
