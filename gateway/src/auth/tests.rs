use super::*;

fn resource(name: &str) -> ResourceName {
    ResourceName::new(name).unwrap()
}

fn file(key: &str) -> String {
    format!(
        r#"
        [[identity]]
        name = "node-a"
        keys = ["{}"]
        grants = [
          {{ resources = ["sweeper"], actions = ["read", "write"] }},
          {{ resources = ["reports.*"], actions = ["read"] }},
        ]

        [[identity]]
        name = "prometheus"
        keys = []
        grants = [{{ actions = ["metrics"] }}]
        "#,
        stored_hash(key)
    )
}

#[test]
fn keys_identify_their_identity_and_grants_decide() {
    let key = new_key();
    assert!(key.starts_with(KEY_PREFIX) && key.len() > 40);
    let identities = Identities::parse(&file(&key)).unwrap();
    assert_eq!(identities.len(), 2);
    let node_a = identities.identify(&key).expect("the key is known");
    assert_eq!(node_a.name, "node-a");
    assert!(identities.identify(&new_key()).is_none());

    assert!(node_a.may(Action::Write, Some(&resource("sweeper"))));
    assert!(node_a.may(Action::Read, Some(&resource("reports.daily"))));
    assert!(!node_a.may(Action::Write, Some(&resource("reports.daily"))));
    assert!(
        !node_a.may(Action::Write, Some(&resource("sweeper-x"))),
        "exact names are exact"
    );
    assert!(!node_a.may(Action::Advance, Some(&resource("sweeper"))));
    assert!(!node_a.may(Action::Metrics, None));
    assert!(
        !node_a.may(Action::Read, None),
        "an action on a resource needs one"
    );
}

#[test]
fn bad_files_are_refused_with_the_reason() {
    for (text, reason) in [
        ("[[identity]]\nname = \"a\"\nkeys = [\"fgk_plain\"]", "store hashes"),
        ("[[identity]]\nname = \"a\"\nkeys = [\"sha256:12\"]", "64 hex"),
        ("[[identity]]\nname = \"a\"\n[[identity]]\nname = \"a\"", "used twice"),
        (
            "[[identity]]\nname = \"a\"\ngrants = [{ resources = [\"a*b*\"], actions = [\"read\"] }]",
            "resource pattern",
        ),
        (
            "[[identity]]\nname = \"a\"\ngrants = [{ resources = [\"a\"], actions = [\"fly\"] }]",
            "unknown variant",
        ),
        ("[[identity]]\nname = \"a\"\ncolour = \"red\"", "unknown field"),
    ] {
        let error = Identities::parse(text).unwrap_err();
        assert!(error.contains(reason), "{text:?}: {error}");
    }
}

#[test]
fn bearer_headers_are_read_strictly() {
    let dir = std::env::temp_dir().join(format!("fg-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("auth.toml");
    let key = new_key();
    std::fs::write(&path, file(&key)).unwrap();
    let auth = Authenticator::load(&path).unwrap();
    let header = format!("Bearer {key}");
    assert_eq!(
        auth.authenticate(Some(header.as_bytes()), None)
            .unwrap()
            .name,
        "node-a"
    );
    let lower = format!("bearer {key}");
    assert!(auth.authenticate(Some(lower.as_bytes()), None).is_ok());
    for bad in [
        None,
        Some(key.as_bytes().to_vec()),
        Some(format!("Basic {key}").into_bytes()),
        Some(b"Bearer ".to_vec()),
        Some(format!("Bearer {key}x").into_bytes()),
    ] {
        assert_eq!(
            auth.authenticate(bad.as_deref(), None).unwrap_err(),
            Denial::Unauthenticated,
            "{bad:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The auth file with two identities known by certificate names, in a directory of
/// its own, removed at the end.
struct CertificateFile {
    dir: std::path::PathBuf,
    auth: Authenticator,
    key: String,
}

impl CertificateFile {
    fn new() -> CertificateFile {
        let dir = std::env::temp_dir().join(format!(
            "fg-auth-certs-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("auth.toml");
        let key = new_key();
        std::fs::write(
            &path,
            format!(
                r#"
                [[identity]]
                name = "node-a"
                keys = ["{}"]
                certificates = ["node-a.internal", "Node-A.Other.Internal"]
                grants = [{{ resources = ["sweeper"], actions = ["write"] }}]

                [[identity]]
                name = "node-b"
                certificates = ["node-b.internal"]
                "#,
                stored_hash(&key)
            ),
        )
        .unwrap();
        let auth = Authenticator::load(&path).unwrap();
        CertificateFile { dir, auth, key }
    }

    fn who(&self, authorization: Option<&str>, names: Option<&[&str]>) -> Option<String> {
        let certificate = names.map(|names| ClientCertificate::new(names.iter().copied()));
        self.auth
            .authenticate(authorization.map(str::as_bytes), certificate.as_ref())
            .map(|identity| identity.name.clone())
            .ok()
    }
}

impl Drop for CertificateFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn certificate_names_identify_their_identity_without_regard_to_case() {
    let file = CertificateFile::new();
    assert!(file.auth.identities().lists_certificates());
    let who = |names: &[&str]| file.who(None, Some(names));
    assert_eq!(who(&["node-a.internal"]).as_deref(), Some("node-a"));
    assert_eq!(who(&["NODE-A.internal"]).as_deref(), Some("node-a"));
    assert_eq!(who(&["node-a.other.internal"]).as_deref(), Some("node-a"));
    assert_eq!(
        who(&["unlisted.internal", "node-b.internal"]).as_deref(),
        Some("node-b"),
        "any of the certificate's names may be the listed one"
    );
    assert_eq!(
        who(&["node-a.internal", "node-a.other.internal"]).as_deref(),
        Some("node-a"),
        "two names of one identity"
    );
    assert_eq!(who(&["unlisted.internal"]), None);
    assert_eq!(who(&[]), None, "a certificate without DNS names");
    assert_eq!(
        who(&["node-a.internal", "node-b.internal"]),
        None,
        "names of two identities: neither"
    );
    assert_eq!(
        who(&["sub.node-a.internal"]),
        None,
        "names are exact, not suffixes"
    );
}

#[test]
fn a_bearer_header_decides_alone_and_without_either_nothing_authenticates() {
    let file = CertificateFile::new();
    let bearer = format!("Bearer {}", file.key);
    let node_b = Some(&["node-b.internal"][..]);
    assert_eq!(
        file.who(Some(&bearer), node_b).as_deref(),
        Some("node-a"),
        "the key wins over the certificate"
    );
    let unknown = format!("Bearer {}", new_key());
    assert_eq!(
        file.who(Some(&unknown), node_b),
        None,
        "a wrong key is not rescued by the certificate"
    );
    assert_eq!(file.who(Some("Basic x"), node_b), None);
    assert_eq!(file.who(None, node_b).as_deref(), Some("node-b"));
    assert_eq!(file.who(None, None), None);
}
