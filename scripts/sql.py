#!/usr/bin/env python3
"""The extension's SQL, written once in src/sql/ and composed here into the scripts that ship.

- `upgrade FROM TO`: the upgrade script from release FROM to version TO. Its hand-written part,
  sql/upgrade/outbox_pg--FROM--TO.sql, holds what cannot be replaced in place (tables, indexes,
  sequences, data, the functions and views it must drop first, the Rust functions' declarations);
  after it (or where it says `-- @replaceable`) come every function, view, trigger, comment and
  grant of the install script, taken from the same src/sql/ files the install is made of, as
  `CREATE OR REPLACE`. So a function's SQL exists once, and an upgrade cannot drift from a fresh
  install (tests/upgrade.rs compares the two; tests/sql_scripts.rs compares this output with the
  committed sql/outbox_pg--FROM--TO.sql).
- `check`: fails when a committed upgrade script into the version under development (Cargo.toml's)
  differs from what `upgrade` makes of the current files; `write` writes it.
- `sql-only [--pg-tle]`: the install for servers that cannot load the library (docs/sql-only.md),
  made of the same src/sql/ files: what needs the library (the `LANGUAGE c` functions, the Rust
  ones pgrx declares) comes from src/sql/sql_only/ in SQL and PL/pgSQL, and what only means
  something inside CREATE EXTENSION (`pg_extension_config_dump`) is left out of the plain script.
  `--pg-tle`: the same SQL as the body of a `pgtle.install_extension` call (which keeps the
  `pg_extension_config_dump` statements: pg_tle runs the body as CREATE EXTENSION does).
  `--uninstall`: the plain install's removal (its functions in schema public, then the schema).

Statements are split the way PostgreSQL's lexer splits them (comments, quoted strings and
identifiers, dollar quotes); each keeps the comment lines right above it.
Usage: python3 scripts/sql.py upgrade FROM TO | check | write | sql-only [--pg-tle | --uninstall]
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def version():
    """The version under development: Cargo.toml's package version."""
    with open(os.path.join(ROOT, "Cargo.toml")) as cargo:
        for line in cargo:
            match = re.match(r'^version\s*=\s*"([^"]+)"', line)
            if match:
                return match.group(1)
    raise SystemExit("sql.py: no version in Cargo.toml")


def install_files():
    """src/sql/ files of the install script, in src/lib.rs's order (test helpers left out: they
    are in the test build only)."""
    with open(os.path.join(ROOT, "src", "lib.rs")) as lib:
        text = lib.read()
    files = []
    for match in re.finditer(r'^extension_sql_file!\("([^"]+)",\s*name\s*=\s*"([^"]+)"', text, re.M):
        path, name = match.groups()
        if name != "test_helpers":
            files.append(os.path.join(ROOT, "src", path))
    if not files:
        raise SystemExit("sql.py: src/lib.rs names no extension_sql_file!")
    return files


def statements(text):
    """Splits SQL text into statements, each with the comments and blank lines before it."""
    out, start, i, n = [], 0, 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end + 1
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "'":
            escapes = i > 0 and text[i - 1] in "eE" and (i < 2 or not (text[i - 2].isalnum() or text[i - 2] == "_"))
            i += 1
            while i < n:
                if escapes and text[i] == "\\":
                    i += 2
                elif text[i] == "'":
                    if text.startswith("''", i):
                        i += 2
                    else:
                        i += 1
                        break
                else:
                    i += 1
        elif c == '"':
            end = text.find('"', i + 1)
            while end >= 0 and text.startswith('""', end):
                end = text.find('"', end + 2)
            i = n if end < 0 else end + 1
        elif c == "$":
            match = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$", text[i:])
            if match and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
                tag = match.group(0)
                end = text.find(tag, i + len(tag))
                i = n if end < 0 else end + len(tag)
            else:
                i += 1
        elif c == ";":
            out.append(text[start : i + 1])
            start = i = i + 1
        else:
            i += 1
    rest = text[start:]
    if rest.strip() and strip_comments(rest).strip():
        raise SystemExit(f"sql.py: a statement without its ';': {rest.strip()[:80]!r}")
    return out


def strip_comments(statement):
    """The statement without its leading comments and blank lines."""
    lines = statement.split("\n")
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("--")):
        lines.pop(0)
    return "\n".join(lines)


def leading_comments(statement):
    """The comment lines right above the statement (blank lines before them dropped)."""
    lines = statement.split("\n")
    head = []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("--"):
            break
        head.append(line)
    while head and not head[0].strip():
        head.pop(0)
    return "\n".join(head)


CREATE = re.compile(r"^CREATE\s+(OR\s+REPLACE\s+)?(FUNCTION|PROCEDURE|VIEW|TRIGGER)\b", re.I)
VIEW_NAME = re.compile(r"^CREATE\s+(?:OR\s+REPLACE\s+)?VIEW\s+([\w@.\"]+)", re.I)
GRANT_ON = re.compile(r"^(?:GRANT|REVOKE)\b.*?\bON\s+(?:(FUNCTION|PROCEDURE|SCHEMA|SEQUENCE|TABLE)\s+)?([\w@.\"]+)", re.I | re.S)


def replaceable(statement, views):
    """The statement as an upgrade runs it to replace in place (functions, views, triggers as
    `CREATE OR REPLACE`; their comments (a view's columns' too) and grants, and grants on schemas,
    as they are), or None
    when it is the hand-written part's to carry: tables, indexes, sequences, roles, data, DO
    blocks, and the comments and grants of tables and sequences, which belong with them. `views`:
    the names of the install's views."""
    body = strip_comments(statement)
    match = CREATE.match(body)
    if match:
        if not match.group(1):
            body = body[: match.start(2)].rstrip() + " OR REPLACE " + body[match.start(2) :]
        return body
    comment = re.match(r"^COMMENT\s+ON\s+(FUNCTION|PROCEDURE|VIEW|TRIGGER|SCHEMA)\b", body, re.I)
    if comment:
        return body
    column = re.match(r"^COMMENT\s+ON\s+COLUMN\s+([\w@\"]+\.[\w@\"]+)\.", body, re.I)
    if column and column.group(1) in views:
        return body
    grant = GRANT_ON.match(body)
    if grant:
        kind, name = (grant.group(1) or "TABLE").upper(), grant.group(2)
        if kind in ("FUNCTION", "PROCEDURE", "SCHEMA") or (kind == "TABLE" and name in views):
            return body
    return None


def upgrade(from_version, to_version):
    hand_path = os.path.join(ROOT, "sql", "upgrade", f"outbox_pg--{from_version}--{to_version}.sql")
    if not os.path.exists(hand_path):
        raise SystemExit(f"sql.py: {os.path.relpath(hand_path, ROOT)} is missing (the hand-written part of the upgrade)")
    with open(hand_path) as hand:
        hand_text = hand.read()
    generated = [
        f"-- outbox_pg {from_version} -> {to_version}, made by `python3 scripts/sql.py write` from",
        f"-- sql/upgrade/outbox_pg--{from_version}--{to_version}.sql (what cannot be replaced in place) and the",
        "-- functions, views, triggers, comments and grants of src/sql/ (replaced in place). Do not edit:",
        "-- edit those files and run the script again (sql/README.md).",
        "",
    ]
    replaced = []
    files = {}
    for path in install_files():
        with open(path) as f:
            files[path] = statements(f.read())
    views = {m.group(1) for sts in files.values() for m in (VIEW_NAME.match(strip_comments(st)) for st in sts) if m}
    for path, sts in files.items():
        parts = [s for s in (replaceable(st, views) for st in sts) if s]
        if parts:
            replaced.append(f"-- {os.path.relpath(path, ROOT)}")
            replaced.extend(part + "\n" for part in parts)
    marker = "-- @replaceable\n"
    if marker in hand_text:
        before, after = hand_text.split(marker, 1)
    else:
        before, after = hand_text, ""
    out = "\n".join(generated) + before.rstrip("\n") + "\n\n"
    out += "-- " + "-" * 97 + "\n-- Replaced in place: every function, view, trigger, comment and grant of src/sql/.\n"
    out += "-- " + "-" * 97 + "\n" + "\n".join(replaced)
    if after.strip():
        out += "\n" + after.lstrip("\n")
    return out


def upgrade_target():
    """The committed upgrade into the version under development: (from, to, path)."""
    to_version = version()
    with open(os.path.join(ROOT, "sql", "releases")) as releases:
        released = [line.split()[0] for line in releases if line.strip() and not line.startswith("#")]
    previous = [v for v in released if v != to_version]
    if not previous:
        raise SystemExit("sql.py: sql/releases lists no release before " + to_version)
    from_version = previous[-1]
    return from_version, to_version, os.path.join(ROOT, "sql", f"outbox_pg--{from_version}--{to_version}.sql")


SQL_ONLY_DIR = os.path.join(ROOT, "src", "sql", "sql_only")
FUNCTION_NAME = re.compile(r"^CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+([\w@.\"]+)\s*\(", re.I)
# Functions of these languages need the library or a superuser (LANGUAGE internal).
C_LANGUAGE = re.compile(r"\bLANGUAGE\s+(c|internal)\b", re.I)
CONFIG_DUMP = re.compile(r"^SELECT\s+pg_catalog\.pg_extension_config_dump\s*\(", re.I)
# The schema outbox_enqueue and outbox_mark_processed live in (CREATE EXTENSION's @extschema@).
SQL_ONLY_SCHEMA = "public"
# The C and internal functions of the install that src/sql/sql_only/ replaces in place (the others
# are the Rust functions pgrx declares, which src/sql/ only comments and grants).
REPLACED = {"@extschema@.outbox_enqueue", "outbox._log_pending", "outbox._raw_size"}


def sql_only_statements(pg_tle):
    """The SQL-only install as (source file, statement) pairs: the install's files in src/lib.rs's
    order, where each `LANGUAGE c` or `internal` function is replaced by the src/sql/sql_only/ function of the
    same name, and the other src/sql/sql_only/ statements (the Rust functions' replacements and
    their helpers) come right after the bootstrap file, before anything that could call them."""
    replacements, extra = {}, []
    for name in sorted(os.listdir(SQL_ONLY_DIR)):
        if not name.endswith(".sql"):
            continue
        path = os.path.join(SQL_ONLY_DIR, name)
        with open(path) as f:
            for st in statements(f.read()):
                match = FUNCTION_NAME.match(strip_comments(st))
                if match and match.group(1) in REPLACED:
                    replacements[match.group(1)] = (path, st)
                else:
                    extra.append((path, st))
    out, used = [], set()
    for index, path in enumerate(install_files()):
        with open(path) as f:
            for st in statements(f.read()):
                body = strip_comments(st)
                match = FUNCTION_NAME.match(body)
                if match and C_LANGUAGE.search(body):
                    name = match.group(1)
                    if name not in replacements:
                        raise SystemExit(f"sql.py: {name} is a C or internal function and src/sql/sql_only/ has no replacement for it")
                    out.append(replacements[name])
                    used.add(name)
                elif CONFIG_DUMP.match(body) and not pg_tle:
                    continue
                else:
                    out.append((path, st))
        if index == 0:
            out.extend(extra)
    unused = set(replacements) - used
    if unused:
        raise SystemExit(f"sql.py: src/sql/sql_only/ replaces functions the install no longer has: {sorted(unused)}")
    return out




def sql_only_body(pg_tle=False):
    """The SQL-only install's statements as one text, @extschema@ resolved to SQL_ONLY_SCHEMA."""
    parts, last = [], None
    for path, st in sql_only_statements(pg_tle):
        if path != last:
            parts.append(f"\n-- {os.path.relpath(path, ROOT)}")
            last = path
        parts.append(st.strip("\n") + "\n")
    body = (leftover_guard() + "\n".join(parts)).replace("@extschema@", SQL_ONLY_SCHEMA)
    # outbox._version() (src/sql/sql_only/library.sql): what outside relays check the schema
    # against, where no pg_extension row records it.
    return body.replace("@OUTBOX_VERSION@", version())


PG_TLE_TAG = "$_outbox_pg_tle_$"


def sql_only(pg_tle):
    body = sql_only_body(pg_tle)
    head = [
        f"-- outbox_pg {version()}, SQL-only install (docs/sql-only.md), made by `bash scripts/sql-only.sh"
        + (" --pg-tle`" if pg_tle else "`") + " from src/sql/.",
        "-- Run it as the database owner (CREATE on the database, CREATEROLE), no superuser needed.",
    ]
    if pg_tle:
        if PG_TLE_TAG in body:
            raise SystemExit(f"sql.py: the install's SQL contains {PG_TLE_TAG}, the pg_tle body's quote")
        head.append("-- Registers it with pg_tle (a pgtle_admin member runs this), then: CREATE EXTENSION outbox_pg;")
        return ("\n".join(head) + "\n"
                + f"SELECT pgtle.install_extension(\n    'outbox_pg',\n    '{version()}',\n"
                + "    'Transactional outbox relayed to Redis Streams (SQL-only: no library)',\n"
                + f"{PG_TLE_TAG}\n{body}{PG_TLE_TAG},\n    '{{}}'::text[]\n);\n")
    head.append("-- psql -d DATABASE -f outbox_pg.sql: one transaction, stopping at the first error, which leaves nothing behind.")
    # What CREATE EXTENSION sets around its script (extension.c, execute_extension_script): function
    # bodies are checked when they run, not when created (the files create them in an order where a
    # function may name one created later), and the extension's schema is the search_path.
    setup = ("SET LOCAL check_function_bodies = off;\nSET LOCAL client_min_messages = warning;\n"
             f"SET LOCAL search_path = {SQL_ONLY_SCHEMA};\n")
    return "\n".join(head) + "\n\\set ON_ERROR_STOP on\nBEGIN;\n" + setup + "\n" + body + "\nCOMMIT;\n"


def public_functions():
    """The names of the functions the SQL-only install makes outside the schema outbox (in
    SQL_ONLY_SCHEMA: outbox_enqueue, outbox_mark_processed), which DROP SCHEMA outbox leaves."""
    names = set()
    for _, st in sql_only_statements(False):
        match = FUNCTION_NAME.match(strip_comments(st))
        if match and match.group(1).startswith("@extschema@."):
            names.add(match.group(1).split(".", 1)[1])
    return sorted(names)


def sql_array(names):
    return "ARRAY[" + ", ".join(f"'{name}'" for name in names) + "]"


def leftover_guard():
    """Refuses to install over the functions an earlier install left in SQL_ONLY_SCHEMA (after a
    DROP SCHEMA outbox CASCADE), naming the removal script, instead of failing on the first one."""
    return f"""-- Made by scripts/sql.py: an earlier install's functions outside the schema outbox.
DO $leftover$
DECLARE
    found text;
BEGIN
    SELECT pg_catalog.string_agg(p.oid::regprocedure::text, ', ') INTO found
      FROM pg_catalog.pg_proc p
     WHERE p.pronamespace = '{SQL_ONLY_SCHEMA}'::regnamespace AND p.proname = ANY ({sql_array(public_functions())});
    -- With the schema there, the install is whole: schema.sql's guard says so.
    IF found IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = 'outbox') THEN
        RAISE EXCEPTION 'outbox_pg: functions an earlier install left are in the way: %', found
            USING ERRCODE = 'duplicate_function',
                  DETAIL = 'DROP SCHEMA outbox CASCADE removes the schema but not the functions the install made in schema {SQL_ONLY_SCHEMA}.',
                  HINT = 'Remove the earlier install with the script `bash scripts/sql-only.sh --uninstall` prints, then install again.';
    END IF;
END
$leftover$;
"""


def uninstall():
    """The SQL-only install's removal: its functions in SQL_ONLY_SCHEMA (every overload), then the
    schema outbox with everything in it, in one transaction. The roles stay: they are cluster-wide
    and may serve other databases' installs."""
    return f"""-- outbox_pg {version()}, removal of the SQL-only install, made by `bash scripts/sql-only.sh --uninstall`.
-- Run it as the database owner: psql -d DATABASE -f uninstall.sql. It drops every event, every
-- counter and the failure path with the schema outbox, and what depends on them (views over
-- outbox.messages or outbox_enqueue); the roles outbox_writer, outbox_consumer and outbox_admin
-- stay (other databases may use them: DROP ROLE them when none does).
\\set ON_ERROR_STOP on
BEGIN;
DO $uninstall$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = '{SQL_ONLY_SCHEMA}'::regnamespace AND p.proname = ANY ({sql_array(public_functions())}) LOOP
        -- CASCADE, as for the schema: a view over them (any role's, a temporary one included)
        -- must not keep the install from going.
        EXECUTE pg_catalog.format('DROP FUNCTION %s CASCADE', f);
    END LOOP;
END
$uninstall$;
DROP SCHEMA IF EXISTS outbox CASCADE;
COMMIT;
"""


def main(args):
    if args[:1] == ["upgrade"] and len(args) == 3:
        sys.stdout.write(upgrade(args[1], args[2]))
    elif args == ["write"] or args == ["check"]:
        from_version, to_version, path = upgrade_target()
        made = upgrade(from_version, to_version)
        if args == ["write"]:
            with open(path, "w") as f:
                f.write(made)
            print(os.path.relpath(path, ROOT))
        else:
            committed = open(path).read() if os.path.exists(path) else ""
            if committed != made:
                sys.exit(f"sql.py: {os.path.relpath(path, ROOT)} differs from what `python3 scripts/sql.py write` makes "
                         "of src/sql/ and its hand-written part: run it and commit the result")
    elif args[:1] == ["sql-only"] and args[1:] in ([], ["--pg-tle"]):
        sys.stdout.write(sql_only(args[1:] == ["--pg-tle"]))
    elif args == ["sql-only", "--uninstall"]:
        sys.stdout.write(uninstall())
    else:
        sys.exit(__doc__.strip().split("\n")[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
