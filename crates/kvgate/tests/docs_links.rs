//! Every relative link in the README and under docs/ names a file that exists and, for a Markdown
//! page, a heading that page has: pages move and sections are renamed, and a reader following a
//! dead link learns nothing. And every page a user reads stays short enough to read in one sitting.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The pages checked: the README, docs/ and docs/notes/.
fn pages() -> Vec<PathBuf> {
    let root = repo_root();
    let mut pages = vec![root.join("README.md")];
    for dir in ["docs", "docs/notes"] {
        let mut found: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("read {dir}: {e}"))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        found.sort();
        pages.extend(found);
    }
    pages
}

/// The lines of a page outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// A heading's anchor as GitHub makes it: lower case, punctuation other than `-` and `_` dropped,
/// spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text).into_iter().filter_map(|l| l.strip_prefix('#')).map(|l| slug(l.trim_start_matches('#'))).collect()
}

/// The targets of the inline links on a line: `[text](target)`.
fn link_targets(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(&after[..end]);
        rest = &after[end..];
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_resolves_to_a_file_and_heading() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        for (n, line) in prose(&text).into_iter().enumerate() {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
                let file = if path.is_empty() { page.clone() } else { dir.join(path) };
                let shown = page.strip_prefix(repo_root()).unwrap_or(&page).display().to_string();
                let named = format!("{shown}: prose line {}: {target}", n + 1);
                if !file.exists() {
                    broken.push(format!("{named} (no such file)"));
                    continue;
                }
                if anchor.is_empty() || file.extension().is_none_or(|x| x != "md") {
                    continue;
                }
                let headings = anchors(&std::fs::read_to_string(&file).unwrap());
                if !headings.contains(anchor) {
                    broken.push(format!("{named} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_are_made_as_github_makes_them() {
    assert_eq!(slug("Several replicas: one NATS between them"), "several-replicas-one-nats-between-them");
    assert_eq!(slug("gRPC workers (SMG's worker protocol)"), "grpc-workers-smgs-worker-protocol");
    assert_eq!(slug("On real engines: `kvgate demo --engines vllm`"), "on-real-engines-kvgate-demo---engines-vllm");
    assert_eq!(link_targets("see [a](x.md#b) and [c](#d)."), ["x.md#b", "#d"]);
}

/// The longest a README or docs/ page may grow: a page past it answers more than one kind of
/// question and should be split (docs/notes/ holds dated logs, which are not read in one sitting).
const MAX_PAGE_LINES: usize = 320;

#[test]
fn every_page_a_user_reads_stays_under_the_length_limit() {
    let long: Vec<String> = pages()
        .into_iter()
        .filter(|p| !p.parent().is_some_and(|d| d.ends_with("notes")))
        .filter_map(|p| {
            let lines = std::fs::read_to_string(&p).unwrap().lines().count();
            (lines > MAX_PAGE_LINES).then(|| format!("{}: {lines} lines", p.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "pages over {MAX_PAGE_LINES} lines (split them by the question each part answers):\n{}",
        long.join("\n")
    );
}
