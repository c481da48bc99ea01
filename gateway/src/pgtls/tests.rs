use super::*;

fn params(sslmode: Option<&str>, sslrootcert: Option<&str>) -> Params {
    Params {
        sslmode: sslmode.map(str::to_owned),
        sslrootcert: sslrootcert.map(str::to_owned),
        ..Params::default()
    }
}

#[test]
fn uri_form_loses_only_the_tls_parameters() {
    let (rest, taken) = split(
        "postgres://u:p%3Fw@db.example:5433/app?sslmode=verify-full&application_name=x\
         &sslrootcert=%2Fetc%2Fca%20certs.pem&connect_timeout=5",
    )
    .unwrap();
    assert_eq!(
        rest,
        "postgres://u:p%3Fw@db.example:5433/app?application_name=x&connect_timeout=5"
    );
    assert_eq!(
        taken,
        params(Some("verify-full"), Some("/etc/ca certs.pem"))
    );

    let (rest, taken) =
        split("postgresql://db.example/app?sslmode=require&sslcert=c.pem&sslkey=k.pem").unwrap();
    assert_eq!(rest, "postgresql://db.example/app");
    assert_eq!(taken.sslmode.as_deref(), Some("require"));
    assert_eq!(taken.sslcert.as_deref(), Some("c.pem"));
    assert_eq!(taken.sslkey.as_deref(), Some("k.pem"));

    let (rest, taken) = split("postgres://u@db.example/app").unwrap();
    assert_eq!(rest, "postgres://u@db.example/app");
    assert_eq!(taken, Params::default());
}

#[test]
fn the_query_starts_after_the_user_info() {
    // A `?` in the password, unencoded, is the password's (as tokio-postgres reads it).
    let (rest, taken) = split("postgres://u:p?w@h/db?sslmode=disable").unwrap();
    assert_eq!(rest, "postgres://u:p?w@h/db");
    assert_eq!(taken.sslmode.as_deref(), Some("disable"));
}

#[test]
fn the_last_of_a_repeated_parameter_counts() {
    let (_, taken) = split("postgres://h/db?sslmode=disable&sslmode=require").unwrap();
    assert_eq!(taken.sslmode.as_deref(), Some("require"));
    let (_, taken) = split("host=h sslmode=disable sslmode=verify-ca").unwrap();
    assert_eq!(taken.sslmode.as_deref(), Some("verify-ca"));
}

#[test]
fn keyword_form_loses_only_the_tls_parameters() {
    let url = "host=db.example sslmode = 'verify-ca'  sslrootcert='/a b/ca.pem' \
               password='it\\'s secret' dbname=app sslcert=/c\\ d.pem sslkey=k.pem";
    let (rest, taken) = split(url).unwrap();
    assert_eq!(taken.sslmode.as_deref(), Some("verify-ca"));
    assert_eq!(taken.sslrootcert.as_deref(), Some("/a b/ca.pem"));
    assert_eq!(taken.sslcert.as_deref(), Some("/c d.pem"));
    assert_eq!(taken.sslkey.as_deref(), Some("k.pem"));
    // The rest is left as written, and tokio-postgres reads it.
    assert!(rest.contains("password='it\\'s secret'"), "{rest}");
    let config: tokio_postgres::Config = rest.parse().unwrap();
    assert_eq!(config.get_password(), Some(&b"it's secret"[..]));
    assert_eq!(config.get_dbname(), Some("app"));
}

#[test]
fn malformed_keyword_strings_are_refused_without_their_values() {
    for url in [
        "host=h password='s3cret",
        "host=h password s3cret",
        "host=h sslrootcert='/tmp/unterminated",
    ] {
        let error = split(url).unwrap_err().to_string();
        assert!(error.contains("invalid connection string"), "{error}");
        assert!(!error.contains("s3cret"), "{error}");
    }
}

#[test]
fn sslmode_and_sslrootcert_decide_what_is_checked() {
    use SslMode::*;
    let file = Some(Roots::File("/ca.pem".into()));
    let cases = [
        (None, None, Prefer, None, false),
        (Some("disable"), Some("/ca.pem"), Disable, None, false),
        (Some("allow"), None, Allow, None, false),
        (Some("prefer"), Some("/ca.pem"), Prefer, file.clone(), false),
        (Some("require"), None, Require, None, false),
        // libpq checks the chain whenever a root certificate is there.
        (
            Some("require"),
            Some("/ca.pem"),
            Require,
            file.clone(),
            false,
        ),
        (
            Some("verify-ca"),
            Some("/ca.pem"),
            VerifyCa,
            file.clone(),
            false,
        ),
        (Some("verify-full"), Some("/ca.pem"), VerifyFull, file, true),
        (None, Some("system"), VerifyFull, Some(Roots::System), true),
        (
            Some("verify-full"),
            Some("system"),
            VerifyFull,
            Some(Roots::System),
            true,
        ),
    ];
    for (sslmode, root, mode, roots, check_name) in cases {
        let settings = Settings::from_params(&params(sslmode, root))
            .unwrap_or_else(|e| panic!("{sslmode:?} {root:?}: {e}"));
        assert_eq!(
            settings,
            Settings {
                mode,
                roots,
                check_name,
                client_cert: None
            },
            "{sslmode:?} {root:?}"
        );
    }
}

#[test]
fn inconsistent_settings_are_refused() {
    let refused = |sslmode, root| {
        Settings::from_params(&params(sslmode, root))
            .unwrap_err()
            .to_string()
    };
    assert!(refused(Some("verify-full"), None).contains("sslmode=verify-full needs sslrootcert"));
    assert!(refused(Some("verify-ca"), None).contains("sslmode=verify-ca needs sslrootcert"));
    assert!(refused(Some("require"), Some("system")).contains("needs sslmode=verify-full"));
    assert!(refused(Some("verify-ca"), Some("system")).contains("needs sslmode=verify-full"));
    assert!(refused(Some("strict"), None).contains("sslmode \"strict\" is not one of"));
    let half = Params {
        sslcert: Some("c.pem".into()),
        ..Params::default()
    };
    assert!(matches!(
        Settings::from_params(&half),
        Err(PgUrlError::HalfClientCert)
    ));
}

#[test]
fn parse_sets_what_tokio_postgres_negotiates() {
    for (url, negotiation) in [
        ("postgres://u:pw@h/db", Negotiation::Prefer),
        ("postgres://u:pw@h/db?sslmode=allow", Negotiation::Prefer),
        ("postgres://u:pw@h/db?sslmode=disable", Negotiation::Disable),
        ("host=h user=u sslmode=require", Negotiation::Require),
        // TLS is never tried over a Unix socket.
        ("host=/run/postgresql sslmode=require", Negotiation::Disable),
        (
            "host=/run/postgresql hostaddr=127.0.0.1 sslmode=require",
            Negotiation::Require,
        ),
    ] {
        let parsed = parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(parsed.config.get_ssl_mode(), negotiation, "{url}");
        assert_eq!(parsed.tls.negotiation(), negotiation, "{url}");
    }
    let parsed = parse("postgres://u:pw@h/db?sslmode=require&application_name=a").unwrap();
    assert_eq!(parsed.config.get_application_name(), Some("a"));
    assert_eq!(
        parsed.tls.describe(None),
        "over TLS (sslmode=require: certificate not verified)"
    );
    let parsed = parse("postgres://u:pw@h/db").unwrap();
    assert_eq!(
        parsed.tls.describe(Some(false)),
        "without TLS (sslmode=prefer: the server offers none)"
    );
}

#[test]
fn errors_name_the_problem_but_not_the_password() {
    for (url, expected) in [
        ("postgres://u:s3cret@h/db?sslmode=on", "sslmode \"on\""),
        (
            "postgres://u:s3cret@h/db?sslcrl=x",
            "unknown option `sslcrl`",
        ),
        (
            "postgres://u:s3cret@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            "could not read sslrootcert /nonexistent/ca.pem",
        ),
        (
            "user=u password=s3cret sslmode=verify-ca",
            "sslmode=verify-ca needs sslrootcert",
        ),
    ] {
        let error = match parse(url) {
            Ok(_) => panic!("{url} was accepted"),
            Err(error) => error.to_string(),
        };
        assert!(error.contains(expected), "{url}: {error}");
        assert!(!error.contains("s3cret"), "{url}: {error}");
    }
}

#[test]
fn a_root_file_without_certificates_is_refused() {
    let path = std::env::temp_dir().join(format!("fencegate-pgtls-{}.pem", std::process::id()));
    std::fs::write(&path, "not a certificate\n").unwrap();
    let url = format!(
        "postgres://h/db?sslmode=verify-ca&sslrootcert={}",
        path.display()
    );
    let error = parse(&url).err().map(|e| e.to_string());
    let _ = std::fs::remove_file(&path);
    let error = error.expect("refused");
    assert!(error.contains("holds no PEM certificate"), "{error}");
}

#[test]
fn system_roots_mean_verify_full() {
    // The machine's CA certificates are read: the tests need a CA bundle installed.
    let parsed = parse("postgres://u@db.example/app?sslrootcert=system")
        .unwrap_or_else(|e| panic!("the system's CA certificates: {e}"));
    assert_eq!(parsed.tls.mode(), SslMode::VerifyFull);
    assert_eq!(
        parsed.tls.describe(None),
        "over TLS (sslmode=verify-full: certificate and host name verified)"
    );
}

#[test]
fn target_session_attrs_take_libpqs_primary_and_refuse_standbys() {
    use tokio_postgres::config::TargetSessionAttrs;
    for (url, expected) in [
        ("postgres://u@h1,h2/db", TargetSessionAttrs::Any),
        (
            "postgres://u@h1,h2/db?target_session_attrs=any",
            TargetSessionAttrs::Any,
        ),
        (
            "postgres://u@h1,h2/db?target_session_attrs=read-write",
            TargetSessionAttrs::ReadWrite,
        ),
        (
            "postgres://u@h1:5432,h2:5433/db?target_session_attrs=primary&sslmode=disable",
            TargetSessionAttrs::ReadWrite,
        ),
        (
            "host=h1,h2 user=u target_session_attrs=primary",
            TargetSessionAttrs::ReadWrite,
        ),
    ] {
        let parsed = parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(parsed.config.get_target_session_attrs(), expected, "{url}");
        assert_eq!(parsed.config.get_hosts().len(), 2, "{url}");
    }
    for attrs in ["standby", "read-only", "prefer-standby", "bogus"] {
        let error = parse(&format!(
            "postgres://u@h1,h2/db?target_session_attrs={attrs}"
        ))
        .err()
        .unwrap_or_else(|| panic!("{attrs} was taken"))
        .to_string();
        assert!(
            error.contains(attrs) && error.contains("read-write"),
            "{error}"
        );
    }
}
