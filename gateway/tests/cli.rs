//! The command line, through the built binary: help that explains every flag, and
//! settings that cannot work refused before anything starts.
//!
//! (Being an integration test of this package also makes `cargo test` build the
//! `fencegate` binary that the end-to-end tests in `tests/` run.)

use std::process::Command;

fn fencegate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(args)
        .env_clear()
        .output()
        .expect("the binary runs")
}

#[test]
fn help_names_every_flag_and_its_environment_variable() {
    let output = fencegate(&["--help"]);
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for (flag, env) in [
        ("--listen", "FENCEGATE_LISTEN"),
        ("--database-url", "DATABASE_URL"),
        ("--data-dir", "FENCEGATE_DATA_DIR"),
        ("--pool-size", "FENCEGATE_POOL_SIZE"),
        ("--write-lanes", "FENCEGATE_WRITE_LANES"),
        ("--group-commit-max", "FENCEGATE_GROUP_COMMIT_MAX"),
        ("--threads", "FENCEGATE_THREADS"),
        ("--max-body", "FENCEGATE_MAX_BODY"),
        ("--cache-size", "FENCEGATE_CACHE_SIZE"),
        ("--metrics-resource-cap", "FENCEGATE_METRICS_RESOURCE_CAP"),
        ("--backend-timeout", "FENCEGATE_BACKEND_TIMEOUT"),
        ("--log-format", "FENCEGATE_LOG_FORMAT"),
        ("--stale-log-limit", "FENCEGATE_STALE_LOG_LIMIT"),
        ("--sql", "FENCEGATE_SQL"),
        ("--sql-database-url", "FENCEGATE_SQL_DATABASE_URL"),
        ("--sql-pool-size", "FENCEGATE_SQL_POOL_SIZE"),
        (
            "--sql-max-statement-size",
            "FENCEGATE_SQL_MAX_STATEMENT_SIZE",
        ),
        ("--tls-cert", "FENCEGATE_TLS_CERT"),
        ("--tls-key", "FENCEGATE_TLS_KEY"),
        ("--tls-client-ca", "FENCEGATE_TLS_CLIENT_CA"),
    ] {
        assert!(
            help.contains(flag),
            "--help does not mention {flag}:\n{help}"
        );
        assert!(help.contains(env), "--help does not mention {env}:\n{help}");
    }
    for command in ["serve", "protect", "unprotect", "check"] {
        assert!(
            help.contains(command),
            "--help does not list the {command} command"
        );
    }
}

#[test]
fn the_table_commands_explain_themselves() {
    let output = fencegate(&["protect", "--help"]);
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for needed in [
        "<TABLE>",
        "--resource",
        "--database-url",
        "DATABASE_URL",
        "partitions",
    ] {
        assert!(
            help.contains(needed),
            "protect --help lacks {needed}:\n{help}"
        );
    }
    let output = fencegate(&["check"]);
    assert!(!output.status.success(), "check without a database URL");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--database-url"));
}

#[test]
fn settings_that_cannot_work_are_refused_with_the_flag_named() {
    for (args, flag) in [
        (&["--pool-size", "0"][..], "--pool-size"),
        (&["--max-body", "1MB"][..], "--max-body"),
        (&["--backend-timeout", "soon"][..], "--backend-timeout"),
        (&["--group-commit-max", "0"][..], "--group-commit-max"),
        (&["--write-lanes", "0"][..], "--write-lanes"),
        (
            &["--database-url", "postgres://127.0.0.1:1/x", "--sql"][..],
            "--sql-database-url",
        ),
        (&["--sql-database-url", "postgres://x"][..], "--sql"),
        (&["--write-lock-timeout", "0s"][..], "--write-lock-timeout"),
    ] {
        let output = fencegate(args);
        assert!(!output.status.success(), "{args:?} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(flag),
            "{args:?}: the error does not name {flag}: {stderr}"
        );
    }
}

#[test]
fn a_busy_address_is_a_clear_start_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = std::env::temp_dir().join(format!("fencegate-cli-{}", std::process::id()));
    let output = fencegate(&["--listen", &addr, "--data-dir", dir.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("could not listen on {addr}")),
        "{stderr}"
    );
}

fn help(flag: &str) -> String {
    let output = fencegate(&[flag]);
    assert!(output.status.success(), "{flag} failed");
    String::from_utf8(output.stdout).unwrap()
}

/// The flags a help text lists (`--listen`, `--help`), in order: the first long flag
/// of each line indented as a flag is (deeper lines are help text).
fn flags(help: &str) -> Vec<&str> {
    help.lines()
        .filter(|line| {
            let indent = line.len() - line.trim_start().len();
            indent <= 6 && line.trim_start().starts_with('-')
        })
        .map(|line| {
            let from = line.find("--").expect("a long flag");
            let name = &line[from..];
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(name.len());
            &name[..end]
        })
        .collect()
}

#[test]
fn short_help_is_one_line_per_flag_under_headings() {
    let short = help("-h");
    let long = help("--help");
    let listed = flags(&long);
    assert!(listed.len() > 70, "{listed:?}");
    assert_eq!(flags(&short), listed, "-h and --help list other flags");
    for flag in &listed {
        let lines: Vec<&str> = short
            .lines()
            .filter(|line| flags(line).first() == Some(flag))
            .collect();
        assert_eq!(lines.len(), 1, "{flag} in -h: {lines:?}");
        // The summary is on the flag's own line, after the flag and its value.
        let words = lines[0].split("  ").filter(|part| !part.trim().is_empty());
        assert!(words.count() >= 2, "{flag} has no summary in -h: {lines:?}");
    }
    for line in short.lines() {
        assert!(line.len() <= 160, "a long line in -h: {line}");
    }
    assert!(
        short.lines().count() <= 145,
        "-h has {} lines:\n{short}",
        short.lines().count()
    );
    for heading in fencegate_gateway::config::heading::ALL {
        let line = format!("{heading}:");
        assert!(short.lines().any(|l| l == line), "-h lacks {line}");
        assert!(long.lines().any(|l| l == line), "--help lacks {line}");
    }
}

#[test]
fn long_help_keeps_every_flags_details() {
    use clap::CommandFactory;
    let short = help("-h");
    let long = help("--help");
    let cli = fencegate_gateway::config::Cli::command();
    let mut detailed = 0;
    for arg in cli.get_arguments().filter(|arg| !arg.is_hide_set()) {
        let Some(text) = arg.get_long_help() else {
            continue;
        };
        let text = text.to_string();
        let (_summary, details) = text.split_once("\n\n").unwrap();
        for paragraph in details.split("\n\n") {
            assert!(long.contains(paragraph), "--help lacks: {paragraph}");
            assert!(!short.contains(paragraph), "-h has: {paragraph}");
        }
        detailed += 1;
    }
    assert!(detailed > 60, "only {detailed} flags have details");
    for sentence in [
        "Use it for one start, then drop it: once the new store exists, a start with it refuses.",
        "Needs the gateway's login to be a member of pg_signal_backend.",
        "Behind a proxy that hides client addresses without authentication, every client is one peer: raise it to 100.",
    ] {
        assert!(long.contains(sentence), "--help lacks: {sentence}");
        assert!(!short.contains(sentence), "-h has: {sentence}");
    }
}

#[test]
fn the_grant_commands_ask_for_the_schema_owner() {
    for command in ["grant", "revoke", "grants"] {
        let output = fencegate(&[command, "--help"]);
        assert!(output.status.success());
        let help = String::from_utf8(output.stdout).unwrap();
        assert!(!help.contains("owns the tables"), "{command}:\n{help}");
        assert!(
            help.contains("owner of schema `fencegate` (the gateway's login) or of a superuser"),
            "{command}:\n{help}"
        );
    }
}

/// A development shell often has RUST_BACKTRACE=1; a bad setting or a database that
/// cannot be reached must still read as one message, with the same exit status.
#[test]
fn configuration_and_start_errors_print_the_message_alone_whatever_rust_backtrace_says() {
    let unreachable = "postgres://nobody@127.0.0.1:1/x";
    for (args, says, status) in [
        (
            &["--write-lanes", "0"][..],
            "error: invalid configuration: --write-lanes must be at least 1",
            1,
        ),
        (
            &["--listen", "127.0.0.1:0", "--database-url", unreachable][..],
            "error: could not connect with --database-url",
            1,
        ),
        (
            &["grants", "--database-url", unreachable][..],
            "error: could not connect to the database",
            1,
        ),
        (&["--listen", "nonsense"][..], "error: invalid value", 2),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(args)
            .env_clear()
            .env("RUST_BACKTRACE", "1")
            .env("RUST_LIB_BACKTRACE", "1")
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(status), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(
            !stderr.to_lowercase().contains("backtrace"),
            "{args:?}: {stderr}"
        );
        // No frame lines (`  3: fencegate::serve`, `at ./gateway/src/main.rs:41:5`).
        for line in stderr.lines().map(str::trim_start) {
            let frame = line
                .split_once(": ")
                .is_some_and(|(index, _)| index.parse::<u32>().is_ok());
            assert!(!frame && !line.starts_with("at "), "{args:?}: {stderr}");
        }
    }
}
