//! outbox_pg's `META.json` (the repository's root), the distribution metadata PGXN reads:
//! - valid against the PGXN meta spec v1.0.0, the version PGXN Manager accepts, checked with the
//!   `pgxn_meta` crate's validator (the spec's JSON schemas, embedded), which must also refuse a
//!   copy with a broken version (so that a validator that accepted anything would fail here);
//! - its `version` and the extension's `provides.outbox_pg.version` equal to Cargo.toml's, which
//!   the packages, the image and the control file's `default_version` (`@CARGO_VERSION@`, filled in
//!   by pgrx) carry;
//! - its PostgreSQL range the majors scripts/pg-config.sh builds for; the files it names exist.

use std::fs;
use std::path::Path;

use pgxn_meta::dist::Distribution;
use pgxn_meta::valid::Validator;
use serde_json::Value;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn read(path: &str) -> String {
    fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn meta() -> Value {
    serde_json::from_str(&read("META.json")).unwrap_or_else(|e| panic!("META.json is not JSON: {e}"))
}

/// The `version = "..."` of the `[package]` table of the root Cargo.toml.
fn cargo_version() -> String {
    let manifest = read("Cargo.toml");
    let package = manifest.split("\n[").next().unwrap_or_default();
    package
        .lines()
        .find_map(|line| line.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_else(|| panic!("no version in Cargo.toml's [package]"))
        .to_string()
}

#[test]
fn meta_json_is_valid_against_the_pgxn_meta_spec() {
    let meta = meta();
    let spec = Validator::new().validate(&meta).unwrap_or_else(|e| panic!("META.json is not valid PGXN metadata: {e}"));
    assert_eq!(spec, 1, "META.json follows meta-spec 1.0.0, the version PGXN accepts");
    let dist = Distribution::try_from(meta.clone()).unwrap_or_else(|e| panic!("META.json does not load: {e}"));
    assert_eq!(dist.name(), "outbox_pg");

    // The validator is not a rubber stamp: PGXN versions are semantic versions.
    let mut broken = meta;
    broken["version"] = Value::from("0.3");
    assert!(Validator::new().validate(&broken).is_err(), "a META.json with version 0.3 passed validation");
}

#[test]
fn meta_json_versions_are_the_release_version() {
    let meta = meta();
    let version = cargo_version();
    assert_eq!(meta["version"], version.as_str(), "META.json's version against Cargo.toml's");
    assert_eq!(meta["provides"]["outbox_pg"]["version"], version.as_str(), "the extension's version in META.json");
    let control = read("outbox_pg.control");
    let default_version = control
        .lines()
        .find_map(|line| line.strip_prefix("default_version = '"))
        .and_then(|rest| rest.strip_suffix('\''))
        .unwrap_or_else(|| panic!("no default_version in outbox_pg.control:\n{control}"));
    assert!(
        default_version == "@CARGO_VERSION@" || default_version == version,
        "outbox_pg.control's default_version {default_version:?} is neither pgrx's @CARGO_VERSION@ nor {version}"
    );
    // The upgrade path a package of this version ships must end at it.
    assert!(
        read("sql/releases").lines().any(|line| line.starts_with(&format!("{version} ")))
            || Path::new(ROOT)
                .join("sql")
                .read_dir()
                .unwrap()
                .any(|entry| { entry.unwrap().file_name().to_string_lossy().ends_with(&format!("--{version}.sql")) }),
        "no upgrade script into {version} in sql/ and no release {version} in sql/releases"
    );
}

#[test]
fn meta_json_names_the_supported_majors_and_existing_files() {
    let meta = meta();
    // scripts/pg-config.sh's `15 | 16 | 17 | 18)`: the majors everything builds for.
    let script = read("scripts/pg-config.sh");
    let majors: Vec<u32> = script
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with("15 |") || line.starts_with("15)"))
        .unwrap_or_else(|| panic!("no case of the supported majors in scripts/pg-config.sh"))
        .trim_end_matches(|c: char| c != ')')
        .trim_end_matches(')')
        .split('|')
        .map(|major| major.trim().parse().unwrap())
        .collect();
    let (low, high) = (majors.iter().min().unwrap(), majors.iter().max().unwrap());
    let range = format!(">= {low}.0.0, < {}.0.0", high + 1);
    for phase in ["build", "runtime"] {
        assert_eq!(meta["prereqs"][phase]["requires"]["PostgreSQL"], range.as_str(), "prereqs.{phase}");
    }
    for key in ["file", "docfile"] {
        let path = meta["provides"]["outbox_pg"][key].as_str().unwrap();
        assert!(Path::new(ROOT).join(path).is_file(), "provides.outbox_pg.{key}: {path} does not exist");
    }
}
