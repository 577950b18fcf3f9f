//! The SQL is written once (issue 36): the committed upgrade script into the version under
//! development is what `scripts/sql.py` composes from its hand-written part
//! (`sql/upgrade/`) and the functions, views, triggers, comments and grants of `src/sql/`. A
//! function changed in `src/sql/` without `python3 scripts/sql.py write` fails here, long before
//! the upgrade test notices it. No server: a quick check.

use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn sql_py(args: &[&str]) -> std::process::Output {
    Command::new("python3")
        .arg(format!("{ROOT}/scripts/sql.py"))
        .args(args)
        .output()
        .expect("python3 runs scripts/sql.py")
}

#[test]
fn the_committed_upgrade_script_is_what_sql_py_makes_of_src_sql() {
    let out = sql_py(&["check"]);
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

#[test]
fn every_function_and_view_of_the_install_is_in_the_upgrade_once() {
    // From the last release (sql/releases) into the version under development.
    let releases = std::fs::read_to_string(format!("{ROOT}/sql/releases")).unwrap();
    let current = env!("CARGO_PKG_VERSION");
    let previous = releases
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_whitespace().next())
        .rfind(|&version| version != current)
        .expect("sql/releases lists a release before the version under development");
    let out = sql_py(&["upgrade", previous, current]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let script = String::from_utf8(out.stdout).unwrap();
    let mut created = std::collections::HashMap::<String, usize>::new();
    for line in script.lines() {
        let upper = line.to_uppercase();
        for kind in ["CREATE OR REPLACE FUNCTION ", "CREATE OR REPLACE VIEW "] {
            if let Some(rest) = upper.strip_prefix(kind) {
                let name = rest.split(['(', ' ']).next().unwrap_or_default().to_string();
                *created.entry(name).or_default() += 1;
            }
        }
    }
    for name in [
        "OUTBOX.REPLAY",
        "OUTBOX.MESSAGES",
        "OUTBOX.STATS",
        "OUTBOX._CLAIM_SHARDS",
        "OUTBOX._ADVANCE",
        "OUTBOX._READ_WINDOW",
        "OUTBOX._LAST_SEQS",
    ] {
        assert_eq!(created.get(name), Some(&1), "{name} in the generated upgrade: {created:?}");
    }
}
