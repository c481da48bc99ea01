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
