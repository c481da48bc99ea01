use super::values::parse_size;
use super::*;

fn parse(args: &[&str]) -> Result<Config, clap::Error> {
    Cli::try_parse_from(std::iter::once("fencegate").chain(args.iter().copied())).map(|cli| {
        match cli.into_command() {
            Command::Serve(config) => *config,
            other => panic!("not serve: {other:?}"),
        }
    })
}

#[test]
fn serve_is_the_default_command() {
    let implicit = parse(&["--database-url", "postgres://x", "--pool-size", "3"]).unwrap();
    let explicit = parse(&[
        "serve",
        "--database-url",
        "postgres://x",
        "--pool-size",
        "3",
    ])
    .unwrap();
    assert_eq!(implicit.store.pool_size, 3);
    assert_eq!(explicit.store.pool_size, 3);
    assert_eq!(implicit.http.listen, DEFAULT_LISTEN.parse().unwrap());
}

#[test]
fn sizes_and_durations() {
    assert_eq!(parse_size("1MiB"), Ok(1 << 20));
    assert_eq!(parse_size("512KiB"), Ok(512 << 10));
    assert_eq!(parse_size("100"), Ok(100));
    assert!(parse_size("1MB").is_err());
    assert!(parse_size("lots").is_err());
    let config = parse(&["--database-url", "x", "--backend-timeout", "250ms"]).unwrap();
    assert_eq!(config.store.backend_timeout, Duration::from_millis(250));
}

#[test]
fn validation_names_the_flag() {
    let err = parse(&["--group-commit-max", "0"])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--group-commit-max"), "{err}");
    let err = parse(&["--database-url", "x", "--pool-size", "0"])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--pool-size"), "{err}");
    assert!(parse(&["--database-url", "x"]).unwrap().validate().is_ok());
}

#[test]
fn sql_settings() {
    let sql = |extra: &[&str]| {
        let mut args = vec!["--database-url", "x", "--sql", "--sql-database-url", "y"];
        args.extend_from_slice(extra);
        parse(&args).unwrap().validate().map_err(|e| e.to_string())
    };
    assert!(sql(&[]).is_ok());
    let config = parse(&["--database-url", "x", "--sql", "--sql-database-url", "y"]).unwrap();
    assert_eq!(config.sql.sql_max_statements, DEFAULT_SQL_MAX_STATEMENTS);
    assert_eq!(config.sql.sql_statement_timeout, Duration::from_secs(2));
    assert!(sql(&["--sql-role", "writer", "--sql-allow-ddl"]).is_ok());
    for (extra, flag) in [
        (&["--sql-max-statements", "0"][..], "--sql-max-statements"),
        (&["--sql-max-rows", "0"], "--sql-max-rows"),
        (&["--sql-role", ""], "--sql-role"),
        (&["--sql-pool-size", "0"], "--sql-pool-size"),
        (
            &["--sql-max-statement-size", "0"],
            "--sql-max-statement-size",
        ),
        (
            &["--sql-statement-timeout", "10s"],
            "--sql-statement-timeout",
        ),
        (
            &[
                "--sql-max-response",
                "8MiB",
                "--max-response-memory",
                "4MiB",
            ],
            "--max-response-memory",
        ),
    ] {
        let err = sql(extra).unwrap_err();
        assert!(err.contains(flag), "{extra:?}: {err}");
    }
    let err = parse(&["--database-url", "x", "--sql-role", "writer"])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("need --sql"), "{err}");
    let err = parse(&["--sql"])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--database-url"), "{err}");
    let err = parse(&["--database-url", "x", "--sql"])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--sql-database-url"), "{err}");
}

#[test]
fn admin_commands() {
    let cli = Cli::try_parse_from([
        "fencegate",
        "protect",
        "app.orders",
        "--resource",
        "orders",
        "--database-url",
        "postgres://x",
    ])
    .unwrap();
    match cli.command {
        Some(Command::Admin(AdminCommand::Protect(args))) => {
            assert_eq!(
                (args.table.as_str(), args.resource.as_str()),
                ("app.orders", "orders")
            );
            assert_eq!(args.database.database_url, "postgres://x");
        }
        other => panic!("{other:?}"),
    }
    assert!(Cli::try_parse_from(["fencegate", "protect", "t", "--database-url", "x"]).is_err());
    assert!(Cli::try_parse_from(["fencegate", "check", "--database-url", "x"]).is_ok());
}

#[test]
fn tls_files_come_in_pairs_and_the_client_ca_needs_them() {
    let config = parse(&["--tls-cert", "c.pem", "--tls-key", "k.pem"]).unwrap();
    assert_eq!(
        (config.tls.tls_cert.unwrap(), config.tls.tls_key.unwrap()),
        ("c.pem".into(), "k.pem".into())
    );
    let config = parse(&[
        "--tls-cert",
        "c.pem",
        "--tls-key",
        "k.pem",
        "--tls-client-ca",
        "ca.pem",
    ])
    .unwrap();
    assert_eq!(config.tls.tls_client_ca, Some("ca.pem".into()));
    assert!(config.validate().is_ok());
    for args in [
        &["--tls-cert", "c.pem"][..],
        &["--tls-key", "k.pem"],
        &["--tls-client-ca", "ca.pem"],
        &["--tls-client-ca", "ca.pem", "--tls-key", "k.pem"],
    ] {
        let err = parse(args).unwrap_err().to_string();
        assert!(err.contains("required"), "{args:?}: {err}");
    }
}

#[test]
fn threads_default_to_one_on_small_machines_and_one_per_core_above() {
    let auto = parse(&[]).unwrap();
    assert_eq!(auto.http.threads, 0);
    assert_eq!(auto.serving_threads(1), 1);
    assert_eq!(auto.serving_threads(2), 1);
    assert_eq!(auto.serving_threads(3), 3);
    assert_eq!(auto.serving_threads(16), 16);
    let chosen = parse(&["--threads", "2"]).unwrap();
    assert_eq!(chosen.serving_threads(2), 2);
    assert_eq!(chosen.serving_threads(16), 2);
    assert_eq!(parse(&["--threads", "1"]).unwrap().serving_threads(16), 1);
}

#[test]
fn door_tls_is_required_with_a_certificate_unless_turned_off() {
    let url = ["--database-url", "postgres://x"];
    let with_cert = [url.as_slice(), &["--pg-tls-cert", "c", "--pg-tls-key", "k"]].concat();
    assert!(parse(&with_cert).unwrap().pg_requires_tls());
    let off = [with_cert.as_slice(), &["--pg-require-tls=false"]].concat();
    assert!(!parse(&off).unwrap().pg_requires_tls());
    let bare = [with_cert.as_slice(), &["--pg-require-tls"]].concat();
    assert!(parse(&bare).unwrap().pg_requires_tls());
    assert!(!parse(&url).unwrap().pg_requires_tls());
    let no_cert = [url.as_slice(), &["--pg-require-tls"]].concat();
    let error = parse(&no_cert).unwrap().validate().unwrap_err();
    assert!(error.to_string().contains("--pg-tls-cert"), "{error}");
}

#[test]
fn a_cleartext_door_beyond_loopback_must_be_asked_for() {
    let wide = [
        "--database-url",
        "postgres://x",
        "--pg-listen",
        "0.0.0.0:7432",
    ];
    let error = parse(&wide).unwrap().validate().unwrap_err();
    assert!(
        error.to_string().contains("--pg-insecure-cleartext"),
        "{error}"
    );
    let insecure = [wide.as_slice(), &["--pg-insecure-cleartext"]].concat();
    assert!(parse(&insecure).unwrap().validate().is_ok());
    let tls = [
        wide.as_slice(),
        &["--pg-tls-cert", "c", "--pg-tls-key", "k"],
    ]
    .concat();
    assert!(parse(&tls).unwrap().validate().is_ok());
    for local in ["127.0.0.2:7432", "[::1]:7432", "off"] {
        let args = ["--database-url", "postgres://x", "--pg-listen", local];
        assert!(parse(&args).unwrap().validate().is_ok(), "{local}");
    }
    // Without the Postgres backend there is no door to guard.
    assert!(parse(&["--pg-listen", "0.0.0.0:7432"])
        .unwrap()
        .validate()
        .is_ok());
}

#[test]
fn door_allow_pairs_take_wildcards() {
    let config = parse(&[
        "--pg-allow",
        "orders/app_writer",
        "--pg-allow",
        "*/reporter",
    ])
    .unwrap();
    let [exact, any_db] = &config.door.pg_allow[..] else {
        panic!("{:?}", config.door.pg_allow)
    };
    assert!(exact.admits("orders", "app_writer"));
    assert!(!exact.admits("orders", "reporter"));
    assert!(!exact.admits("billing", "app_writer"));
    assert!(any_db.admits("billing", "reporter"));
    assert!(parse(&["--pg-allow", "orders"]).is_err());
    assert!(parse(&["--pg-allow", "/app"]).is_err());
    assert_eq!(
        parse(&[]).unwrap().pg_max_connections(),
        DEFAULT_PG_MAX_CONNECTIONS
    );
}

#[test]
fn replication_flags_need_postgres_and_a_patroni_url_is_http() {
    let invalid = |args: &[&str]| parse(args).unwrap().validate().unwrap_err().to_string();
    assert!(invalid(&["--require-synchronous-replication"]).contains("--database-url"));
    assert!(invalid(&["--patroni-url", "http://db-1:8008"]).contains("--database-url"));
    for url in [
        "db-1:8008",
        "https://db-1:8008",
        "http://",
        "http://db-1:8008,db-2:8008",
    ] {
        let error = invalid(&["--database-url", "postgres://x", "--patroni-url", url]);
        assert!(error.contains("--patroni-url"), "{url}: {error}");
    }
    let several = parse(&[
        "--database-url",
        "postgres://x",
        "--patroni-url",
        "http://db-1:8008,http://db-2:8008,http://db-3:8008",
    ])
    .unwrap();
    assert!(several.validate().is_ok());
    assert_eq!(
        several.replication.patroni_url,
        ["http://db-1:8008", "http://db-2:8008", "http://db-3:8008"]
    );
    let config = parse(&[
        "--database-url",
        "postgres://x",
        "--require-synchronous-replication",
        "--patroni-url",
        "http://db-1:8008",
    ])
    .unwrap();
    assert!(config.validate().is_ok());
    assert!(config.replication.require_synchronous_replication);
    assert!(
        !parse(&["--database-url", "x"])
            .unwrap()
            .replication
            .require_synchronous_replication
    );
}

#[test]
fn etcd_and_zookeeper_bindings_need_their_sources() {
    let etcd = parse(&["--database-url", "x", "--issued-by", "etcd:billing-*"]).unwrap();
    let error = etcd.validate().unwrap_err().to_string();
    assert!(error.contains("--etcd-endpoints"), "{error}");
    let zookeeper = parse(&["--database-url", "x", "--issued-by", "zookeeper:ledger"]).unwrap();
    let error = zookeeper.validate().unwrap_err().to_string();
    assert!(error.contains("--zookeeper-connect"), "{error}");
    let both = parse(&[
        "--database-url",
        "x",
        "--issued-by",
        "etcd:billing-*,zookeeper:ledger",
        "--etcd-endpoints",
        "10.0.0.5:2379,10.0.0.6:2379",
        "--zookeeper-connect",
        "10.0.0.7:2181",
    ])
    .unwrap();
    assert!(both.validate().is_ok());
    assert_eq!(both.issuers.etcd_endpoints.len(), 2);
    assert_eq!(both.issuers.etcd_prefix, DEFAULT_ETCD_PREFIX);
    assert_eq!(both.issuers.zookeeper_prefix, DEFAULT_ZOOKEEPER_PREFIX);
}

/// `command` and every command below it, each with its path (`fencegate grant`).
fn commands(command: &clap::Command, path: String) -> Vec<(String, clap::Command)> {
    let mut all = vec![(path.clone(), command.clone())];
    for sub in command.get_subcommands() {
        all.extend(commands(sub, format!("{path} {}", sub.get_name())));
    }
    all
}

/// `-h` shows `help`, `--help` shows `long_help`: a one-line summary, then (for flags
/// with more to say) the summary again, a blank line and the details.
#[test]
fn every_flag_has_a_one_line_summary_and_its_details_for_long_help() {
    use clap::CommandFactory;
    for (path, command) in commands(&Cli::command(), "fencegate".into()) {
        for arg in command.get_arguments().filter(|arg| !arg.is_hide_set()) {
            let name = format!("{path} {}", arg.get_id());
            let summary = arg
                .get_help()
                .unwrap_or_else(|| panic!("{name} has no help"))
                .to_string();
            assert!(
                !summary.contains('\n') && summary.len() <= 80,
                "{name}: the summary is not one short line: {summary:?}"
            );
            if let Some(long) = arg.get_long_help() {
                let long = long.to_string();
                let (first, details) = long
                    .split_once("\n\n")
                    .unwrap_or_else(|| panic!("{name}: long help without details: {long:?}"));
                assert_eq!(first.trim_end_matches('.'), summary, "{name}");
                assert!(!details.trim().is_empty(), "{name}");
            }
        }
        for sub in command.get_subcommands() {
            let name = format!("{path} {}", sub.get_name());
            let about = sub
                .get_about()
                .unwrap_or_else(|| panic!("{name} has no about"))
                .to_string();
            assert!(
                !about.contains('\n') && about.len() <= 70,
                "{name}: the about is not one short line: {about:?}"
            );
            if let Some(long) = sub.get_long_about() {
                assert!(long.to_string().starts_with(&about), "{name}");
            }
        }
    }
}

/// Each heading holds one run of flags, in the order of [`heading::ALL`], and every
/// flag of `serve` is under one of them.
#[test]
fn serve_flags_are_grouped_under_the_headings() {
    use clap::CommandFactory;
    let cli = Cli::command();
    let mut seen: Vec<&str> = Vec::new();
    for arg in cli.get_arguments().filter(|arg| !arg.is_hide_set()) {
        let Some(found) = arg.get_help_heading() else {
            panic!("--{} has no heading", arg.get_id())
        };
        assert!(heading::ALL.contains(&found), "{found}");
        if seen.last() != Some(&found) {
            assert!(!seen.contains(&found), "heading {found} is split");
            seen.push(found);
        }
    }
    assert_eq!(seen, heading::ALL);
}

/// `grant`, `revoke` and `grants` change or read the schema's own grants, which only
/// its owner or a superuser may; owning the fenced tables is not enough.
#[test]
fn the_grant_commands_ask_for_the_schema_owner() {
    use clap::CommandFactory;
    let cli = Cli::command();
    for name in ["grant", "revoke", "grants"] {
        let command = cli.find_subcommand(name).unwrap();
        let url = command
            .get_arguments()
            .find(|arg| arg.get_id() == "database_url")
            .unwrap();
        let text = format!(
            "{} {}",
            url.get_help().unwrap(),
            url.get_long_help().unwrap()
        );
        assert!(!text.contains("owns the tables"), "{name}: {text}");
        assert!(
            text.contains("owner of schema `fencegate`") && text.contains("superuser"),
            "{name}: {text}"
        );
    }
    let protect = cli.find_subcommand("protect").unwrap();
    let url = protect
        .get_arguments()
        .find(|arg| arg.get_id() == "database_url")
        .unwrap();
    let summary = url.get_help().unwrap().to_string();
    assert!(summary.contains("owns the tables"), "{summary}");
}
