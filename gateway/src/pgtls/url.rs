//! Taking the TLS parameters out of a connection string, in either of its forms, and
//! leaving the rest as written for tokio-postgres.

use percent_encoding::percent_decode_str;

use super::PgUrlError;

/// The TLS parameters of a URL, and `target_session_attrs`, as written (decoded); the
/// last of each counts.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Params {
    pub(super) sslmode: Option<String>,
    pub(super) sslrootcert: Option<String>,
    pub(super) sslcert: Option<String>,
    pub(super) sslkey: Option<String>,
    /// Not TLS, but taken here too: tokio-postgres knows `any` and `read-write`, and
    /// the gateway also takes libpq's `primary` (see `super::parse`).
    pub(super) target_session_attrs: Option<String>,
}

impl Params {
    /// Keeps `value` if `key` is one of the TLS parameters; false otherwise.
    fn take(&mut self, key: &str, value: String) -> bool {
        let slot = match key {
            "sslmode" => &mut self.sslmode,
            "sslrootcert" => &mut self.sslrootcert,
            "sslcert" => &mut self.sslcert,
            "sslkey" => &mut self.sslkey,
            "target_session_attrs" => &mut self.target_session_attrs,
            _ => return false,
        };
        *slot = Some(value);
        true
    }
}

/// Splits `url` into the URL without its TLS parameters, and those parameters. The
/// forms are told apart as tokio-postgres does: by the `postgres://` or
/// `postgresql://` prefix.
pub(super) fn split(url: &str) -> Result<(String, Params), PgUrlError> {
    let scheme = ["postgresql://", "postgres://"]
        .into_iter()
        .find(|scheme| url.starts_with(scheme));
    match scheme {
        Some(scheme) => Ok(split_uri(url, scheme.len())),
        None => split_keywords(url),
    }
}

/// The URI form: parameters in the query, `&`-separated and percent-encoded. The query
/// starts at the first `?` after the user info (which may hold an encoded `?`).
fn split_uri(url: &str, scheme_len: usize) -> (String, Params) {
    let after_scheme = &url[scheme_len..];
    let authority = after_scheme.find('@').map_or(0, |at| at + 1);
    let Some(question) = after_scheme[authority..].find('?') else {
        return (url.to_owned(), Params::default());
    };
    let query_start = scheme_len + authority + question;
    let mut params = Params::default();
    let mut kept = Vec::new();
    for pair in url[query_start + 1..].split('&') {
        let taken = pair.split_once('=').is_some_and(|(key, value)| {
            let decode = |text| percent_decode_str(text).decode_utf8().ok();
            match (decode(key), decode(value)) {
                (Some(key), Some(value)) => params.take(&key, value.into_owned()),
                _ => false,
            }
        });
        if !taken {
            kept.push(pair);
        }
    }
    let mut rest = url[..query_start].to_owned();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    (rest, params)
}

/// The key=value form: `key = value` pairs separated by whitespace; a value is quoted
/// with `'` when it holds spaces, and `\` escapes the next character. The pairs taken
/// are cut out of the text; the rest is left as written.
fn split_keywords(url: &str) -> Result<(String, Params), PgUrlError> {
    let mut params = Params::default();
    let mut rest = String::with_capacity(url.len());
    let mut copied = 0;
    let mut chars = url.char_indices().peekable();
    let position = |chars: &mut std::iter::Peekable<std::str::CharIndices>| {
        chars.peek().map_or(url.len(), |&(i, _)| i)
    };
    let skip_spaces = |chars: &mut std::iter::Peekable<std::str::CharIndices>| {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
    };
    loop {
        skip_spaces(&mut chars);
        let start = position(&mut chars);
        while chars
            .next_if(|(_, c)| !c.is_whitespace() && *c != '=')
            .is_some()
        {}
        let key = &url[start..position(&mut chars)];
        if key.is_empty() {
            // The end, or text tokio-postgres stops at too.
            break;
        }
        skip_spaces(&mut chars);
        if chars.next_if(|(_, c)| *c == '=').is_none() {
            return Err(PgUrlError::Parse(format!(
                "invalid connection string: expected `=` after parameter `{key}`"
            )));
        }
        skip_spaces(&mut chars);
        let mut value = String::new();
        if chars.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match chars.next() {
                    Some((_, '\'')) => break,
                    Some((_, '\\')) => value.extend(chars.next().map(|(_, c)| c)),
                    Some((_, c)) => value.push(c),
                    None => {
                        return Err(PgUrlError::Parse(format!(
                            "invalid connection string: unterminated quoted value of `{key}`"
                        )))
                    }
                }
            }
        } else {
            while let Some((_, c)) = chars.next_if(|(_, c)| !c.is_whitespace()) {
                match c {
                    '\\' => value.extend(chars.next().map(|(_, c)| c)),
                    c => value.push(c),
                }
            }
        }
        let end = position(&mut chars);
        if params.take(key, value) {
            rest.push_str(&url[copied..start]);
            copied = end;
        }
    }
    rest.push_str(&url[copied..]);
    Ok((rest, params))
}
