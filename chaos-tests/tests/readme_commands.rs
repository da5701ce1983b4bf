//! The command lines of the README and the user guide work as typed in a fresh shell: every `make TARGET`
//! they name (in a code block or inline) is a target of the Makefile (`make -n` resolves it); none spells
//! a `cargo` command (that needs the libtorch environment sourced and builds into ./target — the Makefile
//! has a target for each); and every `troupe ...` line of a shell code block parses: `troupe`'s command
//! line, and for `troupe chaos` the chaos harness's, with a shipped scenario. A renamed flag, subcommand,
//! make target or scenario fails here. (It lives in troupe-chaos, which sees both command lines.)

use std::path::Path;
use std::process::Command;

use clap::Parser;

const DOCS: [&str; 2] = ["README.md", "docs/guide.md"];

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// One command as a document spells it: where, and its words (brackets around optional flags dropped).
#[derive(Debug)]
struct Line {
    at: String,
    words: Vec<String>,
    in_shell_block: bool,
}

/// Every command of a Markdown text: each line of its ```sh blocks with its comment cut off, and each
/// inline code span outside code blocks; split at ` && ` and ` | `. Leading `VAR=value` words are dropped.
fn commands(doc: &str) -> Vec<Line> {
    let text = std::fs::read_to_string(repo().join(doc)).unwrap();
    let mut out = Vec::new();
    let mut push = |at: String, command: &str, in_shell_block: bool| {
        for part in command.split(" && ").flat_map(|c| c.split(" | ")) {
            // Shell words: a quoted argument ("The ") is one word.
            let split = shlex::split(part).unwrap_or_else(|| part.split_whitespace().map(String::from).collect());
            let words: Vec<String> = split
                .iter()
                .skip_while(|w| w.contains('=') && !w.starts_with('-'))
                .map(|w| w.trim_start_matches('[').trim_end_matches(']').to_string())
                .collect();
            if !words.is_empty() {
                out.push(Line { at: at.clone(), words, in_shell_block });
            }
        }
    };
    let mut fence: Option<&str> = None;
    let mut prose = String::new();
    let mut prose_lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if let Some(lang) = line.trim_start().strip_prefix("```") {
            fence = if fence.is_some() { None } else { Some(lang.trim()) };
            continue;
        }
        match fence {
            Some("sh") => {
                let command = line.find(" #").map_or(line, |c| &line[..c]);
                if !command.trim_start().starts_with('#') {
                    push(format!("{doc}:{}", i + 1), command, true);
                }
            }
            Some(_) => {}
            None => {
                prose.push_str(line);
                prose.push(' ');
                prose_lines.push((prose.len(), i + 1));
            }
        }
    }
    // Inline spans may wrap onto the next line: cut them out of the prose as a whole.
    let mut offset = 0;
    for (k, piece) in prose.split('`').enumerate() {
        if k % 2 == 1 {
            let line = prose_lines.iter().find(|(end, _)| *end > offset).map_or(0, |(_, n)| *n);
            push(format!("{doc}:{line}"), piece, false);
        }
        offset += piece.len() + 1;
    }
    out
}

fn is_troupe(word: &str) -> bool {
    word == "troupe" || word.ends_with("/troupe")
}

/// Why `line` would not work as typed, if it would not.
fn problem(line: &Line) -> Option<String> {
    let (program, args) = line.words.split_first().unwrap();
    match program.as_str() {
        "make" => {
            let (vars, targets): (Vec<&String>, Vec<&String>) = args.iter().partition(|w| w.contains('='));
            let out = Command::new("make")
                .args(["-n", "--no-print-directory", "-C"])
                .arg(repo())
                .args(&targets)
                .args(&vars)
                .output()
                .expect("make runs");
            (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).into_owned())
        }
        "cargo" if !args.is_empty() => {
            Some("a cargo command needs the libtorch environment sourced: spell it as a make target".into())
        }
        p if is_troupe(p) && line.in_shell_block && !args.iter().any(|w| w.contains("...")) => {
            if let Err(e) = troupe_actors::cli::Cli::try_parse_from(&line.words) {
                return Some(e.to_string());
            }
            if args.first().map(String::as_str) != Some("chaos") {
                return None;
            }
            match troupe_chaos::cli::Cli::try_parse_from(&line.words[1..]) {
                Err(e) => Some(e.to_string()),
                Ok(troupe_chaos::cli::Cli { command: troupe_chaos::cli::Command::Run { scenario, .. } })
                    if !troupe_chaos::harness::SHIPPED.iter().any(|(name, _)| *name == scenario) =>
                {
                    Some(format!("no shipped scenario {scenario:?}"))
                }
                Ok(_) => None,
            }
        }
        _ => None,
    }
}

#[test]
fn every_command_line_in_the_readme_and_the_guide_works_as_typed() {
    let mut checked = Vec::new();
    let mut problems = Vec::new();
    for doc in DOCS {
        let lines = commands(doc);
        let troupe = lines.iter().filter(|l| is_troupe(&l.words[0]) && l.in_shell_block).count();
        let make = lines.iter().filter(|l| l.words[0] == "make").count();
        assert!(troupe >= 10 && make >= 2, "{doc}: found only {troupe} troupe and {make} make command lines");
        checked.push(format!("{doc}: {troupe} troupe, {make} make"));
        for line in &lines {
            if let Some(why) = problem(line) {
                problems.push(format!("{} `{}`: {why}", line.at, line.words.join(" ")));
            }
        }
    }
    assert!(problems.is_empty(), "command lines that do not work as typed ({checked:?}):\n{}", problems.join("\n"));
}

#[test]
fn the_check_catches_a_wrong_flag_target_scenario_or_cargo_command() {
    let line = |words: &str, in_shell_block| Line {
        at: "test".into(),
        words: words.split_whitespace().map(String::from).collect(),
        in_shell_block,
    };
    for bad in [
        "target/release/troupe train --stepz 200",
        "troupe checkpoint lst ckpt",
        "troupe chaos run --scenario kill-worker --sed 7",
        "troupe chaos run --scenario kill-everything",
        "make no-such-target",
        "cargo run --release -p troupe-examples --example job_api",
    ] {
        assert!(problem(&line(bad, true)).is_some(), "{bad:?} passed");
    }
    for good in ["troupe chaos run --scenario kill-worker --seed 7", "make demo DEMO_STEPS=30", "troupe COMMAND --help"]
    {
        let in_block = !good.contains("COMMAND");
        assert_eq!(problem(&line(good, in_block)), None, "{good:?}");
    }
}
