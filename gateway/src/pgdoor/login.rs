//! Authentication, relayed: the server asks, the client answers, the door passes both
//! on — and withdraws SCRAM channel binding, and puts its own cancel key in place of
//! the server's.
//!
//! Withdrawing channel binding has a limit: a client over TLS that supports it, offered
//! plain SCRAM, says so in its first message (gs2 flag `y`), and a server that itself
//! runs TLS — the door's upstream with `sslmode` other than `disable` — then refuses
//! the login as a downgrade. The door refuses it first, saying what to change
//! (`channel_binding=disable` in the client).
//!
//! With `target_session_attrs=read-write`, the server must be the primary: one that
//! reports `in_hot_standby=on` or `default_transaction_read_only=on` before its first
//! ReadyForQuery does not get the session (see [`NOT_PRIMARY`]).

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};

use super::cancel::IssuedKey;
use super::relay::{error_code, forward, refuse, NOT_PRIMARY, NOT_PRIMARY_SQLSTATE};
use super::wire::{self, auth, backend, frontend, ProtocolError, WireError};
use super::Door;

pub(super) enum Login {
    /// Authenticated; the session's cancel key (held until the session ends, with the
    /// upstream key it stands for) and the first transaction status.
    Ready {
        key: Option<(IssuedKey, wire::CancelKey)>,
        status: u8,
    },
    /// The server refused the session with an error, relayed to the client (or the
    /// door did, for what it cannot relay): its SQLSTATE, if there was one.
    Refused { sqlstate: Option<[u8; 5]> },
    /// The server is not the primary; the client was told so ([`NOT_PRIMARY`]).
    NotPrimary,
}

/// Both ends of a session, each side buffered.
pub(super) struct Ends<'a, CR, CW, UR, UW> {
    pub(super) client_read: &'a mut BufReader<CR>,
    pub(super) client_write: &'a mut BufWriter<CW>,
    pub(super) upstream_read: &'a mut BufReader<UR>,
    pub(super) upstream_write: &'a mut BufWriter<UW>,
    /// The upstream connection is TLS: the server supports SCRAM channel binding.
    pub(super) upstream_tls: bool,
    /// The index of the server's host among the URL's.
    pub(super) upstream_host: usize,
}

/// Relays authentication between the client and the server until the server's first
/// ReadyForQuery, or its error.
pub(super) async fn authenticate<CR, CW, UR, UW>(
    door: &Door,
    ends: &mut Ends<'_, CR, CW, UR, UW>,
) -> Result<Login, WireError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UR: AsyncRead + Unpin,
    UW: AsyncWrite + Unpin,
{
    let mut key = None;
    loop {
        let Some(header) = wire::read_header(
            ends.upstream_read,
            wire::MAX_INSPECTED_MESSAGE,
            "server message",
        )
        .await?
        else {
            return Ok(Login::Refused { sqlstate: None });
        };
        let body = wire::read_body(ends.upstream_read, header).await?;
        match header.tag {
            backend::AUTHENTICATION => {
                let code = wire::auth_code(&body).ok_or(ProtocolError::Malformed(
                    "authentication request from the server",
                ))?;
                match code {
                    auth::OK | auth::SASL_FINAL => {
                        forward(ends.client_write, header, &body).await?
                    }
                    auth::CLEARTEXT_PASSWORD | auth::MD5_PASSWORD | auth::SASL_CONTINUE => {
                        forward(ends.client_write, header, &body).await?;
                        relay_response(ends).await?;
                    }
                    auth::SASL => {
                        let offered = wire::without_channel_binding(&body).unwrap_or(body);
                        forward(ends.client_write, header, &offered).await?;
                        let (header, response) = read_response(ends).await?;
                        if ends.upstream_tls && gs2_flag(&response) == Some(b'y') {
                            door.metrics().pg_auth_failure();
                            refuse(ends.client_write, "28000", CHANNEL_BINDING_REFUSED).await?;
                            return Ok(Login::Refused {
                                sqlstate: Some(*b"28000"),
                            });
                        }
                        forward(ends.upstream_write, header, &response).await?;
                        ends.upstream_write.flush().await?;
                    }
                    other => {
                        door.metrics().pg_auth_failure();
                        let text = format!(
                            "authentication method {other} (GSSAPI, SSPI or Kerberos) cannot be relayed by \
                             fencegate's Postgres door; use scram-sha-256, md5, password or trust for \
                             the gateway's address in pg_hba.conf"
                        );
                        refuse(ends.client_write, "28000", &text).await?;
                        return Ok(Login::Refused {
                            sqlstate: Some(*b"28000"),
                        });
                    }
                }
            }
            backend::BACKEND_KEY_DATA => {
                let upstream = wire::CancelKey::parse(&body)
                    .ok_or(ProtocolError::Malformed("BackendKeyData from the server"))?;
                let (ours, issued) = door.keys.issue(upstream.clone(), ends.upstream_host);
                key = Some((issued, upstream));
                ends.client_write
                    .write_all(&ours.backend_key_data())
                    .await?;
            }
            backend::ERROR_RESPONSE => {
                let sqlstate = error_code(&body).and_then(|code| <[u8; 5]>::try_from(code).ok());
                if sqlstate.is_some_and(|code| code.starts_with(b"28")) {
                    door.metrics().pg_auth_failure();
                }
                forward(ends.client_write, header, &body).await?;
                ends.client_write.flush().await?;
                return Ok(Login::Refused { sqlstate });
            }
            backend::READY_FOR_QUERY => {
                forward(ends.client_write, header, &body).await?;
                ends.client_write.flush().await?;
                let status = body.first().copied().unwrap_or(b'I');
                return Ok(Login::Ready { key, status });
            }
            backend::PARAMETER_STATUS
                if door.upstream.primary_only() && wire::reports_read_only(&body) =>
            {
                door.not_primary(ends.upstream_host, "login");
                refuse(ends.client_write, NOT_PRIMARY_SQLSTATE, NOT_PRIMARY).await?;
                return Ok(Login::NotPrimary);
            }
            // ParameterStatus, NoticeResponse, NegotiateProtocolVersion.
            _ => forward(ends.client_write, header, &body).await?,
        }
    }
}

/// Why a login that would fail as a channel-binding downgrade is refused.
const CHANNEL_BINDING_REFUSED: &str =
    "fencegate's Postgres door cannot relay SCRAM channel binding: your client, connected \
     over TLS, supports it, and the database, which the door reaches over TLS too, would \
     refuse the login as a downgrade. Set channel_binding=disable in the client's \
     connection settings";

/// The gs2 flag of a SASLInitialResponse body (mechanism name, then the client's first
/// message): `n` no channel binding, `y` supported by the client but not offered, `p`
/// in use.
fn gs2_flag(body: &[u8]) -> Option<u8> {
    let end = body.iter().position(|b| *b == 0)?;
    // The name's NUL, then the length of the data.
    body.get(end + 5).copied()
}

/// Waits for the client's answer to an authentication request and passes it on.
async fn relay_response<CR, CW, UR, UW>(
    ends: &mut Ends<'_, CR, CW, UR, UW>,
) -> Result<(), WireError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
    UW: AsyncWrite + Unpin,
{
    let (header, body) = read_response(ends).await?;
    forward(ends.upstream_write, header, &body).await?;
    ends.upstream_write.flush().await?;
    Ok(())
}

/// Waits for the client's answer to an authentication request.
async fn read_response<CR, CW, UR, UW>(
    ends: &mut Ends<'_, CR, CW, UR, UW>,
) -> Result<(wire::Header, bytes::Bytes), WireError>
where
    CR: AsyncRead + Unpin,
    CW: AsyncWrite + Unpin,
{
    ends.client_write.flush().await?;
    let header = wire::read_header(
        ends.client_read,
        wire::MAX_AUTH_MESSAGE,
        "authentication message",
    )
    .await?
    .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
    if header.tag != frontend::PASSWORD {
        return Err(ProtocolError::UnexpectedType(header.tag).into());
    }
    let body = wire::read_body(ends.client_read, header).await?;
    Ok((header, body))
}

#[cfg(test)]
mod tests {
    use super::gs2_flag;

    #[test]
    fn the_gs2_flag_follows_the_mechanism_and_length() {
        let mut body = b"SCRAM-SHA-256\0".to_vec();
        let first = b"y,,n=,r=abc";
        body.extend_from_slice(&(first.len() as i32).to_be_bytes());
        body.extend_from_slice(first);
        assert_eq!(gs2_flag(&body), Some(b'y'));
        assert_eq!(gs2_flag(b"SCRAM-SHA-256\0\0\0\0"), None);
        assert_eq!(gs2_flag(b"no terminator"), None);
    }
}
