//! An `--auth-file` for a test's gateway, removed when dropped.

use std::path::PathBuf;

use fencegate_gateway::auth::stored_hash;

/// An auth file of `(name, key, grants in TOML)` entries, removed at the end.
pub struct AuthFile(PathBuf);

impl AuthFile {
    pub fn new(identities: &[(&str, &str, &str)]) -> AuthFile {
        let path = std::env::temp_dir().join(format!(
            "fencegate-auth-file-{}-{:08x}.toml",
            std::process::id(),
            rand::random::<u32>()
        ));
        let mut text = String::new();
        for (name, key, grants) in identities {
            text.push_str(&format!(
                "[[identity]]\nname = {name:?}\nkeys = [{:?}]\ngrants = [{grants}]\n\n",
                stored_hash(key)
            ));
        }
        std::fs::write(&path, text).expect("the auth file is written");
        AuthFile(path)
    }

    pub fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for AuthFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
